"""The chat page as a person meets it: time from opening the page to the first streamed token, and what the
page transfers, in Debian's Chromium (Playwright) against `blockspec serve` on the embedded model.

Usage: python scripts/chat_page_timing.py [--runs 5] [--port 8765] [--max-tokens 32]
Each run opens the page in a fresh browser context (empty cache), waits until it is ready (the model's
name shown), sends a prompt at once (Enter), and reads the browser's own clock (performance.now(), from
the navigation's start) at three moments: page ready, request sent, first token on screen. The page's
transfer is the browser's own count (Resource Timing transferSize: compressed bytes with headers) of the
page's files and its first API reads, before any message. Prints one JSON object (medians and every run).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import httpx

CHROMIUM = "/usr/bin/chromium"  # Debian's (apt-get install chromium); the same flags as the page's tests
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

FIRST_TOKEN = """() => new Promise((done) => {
  const seen = () => document.querySelector('.msg.assistant .tok, .msg.assistant .body p');
  if (seen()) return done(performance.now());
  new MutationObserver((_, obs) => { if (seen()) { obs.disconnect(); done(performance.now()); } })
    .observe(document.body, {subtree: true, childList: true, characterData: true});
})"""
PROMPT = "Write a Python function that checks whether a number is prime."


def serve(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "blockspec", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not start")


def cpu_name() -> str:
    for line in open("/proc/cpuinfo") if platform.system() == "Linux" else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def one_run(browser, url: str, max_tokens: int) -> dict:
    context = browser.new_context()
    page = context.new_page()
    page.add_init_script(f"localStorage.setItem('blockspec.settings.v1', "
                         f"JSON.stringify({{max_tokens: {max_tokens}, temperature: 0}}))")
    page.goto(url)
    page.wait_for_function("() => document.querySelector('#model .chip') !== null")
    ready = page.evaluate("() => performance.now()")
    transfer: dict[str, int] = {}
    entries = page.evaluate("""() => [...performance.getEntriesByType('navigation'),
        ...performance.getEntriesByType('resource')].map(e => [new URL(e.name).pathname, e.transferSize])""")
    for path, size in entries:
        transfer[path] = transfer.get(path, 0) + size
    page.fill("#input", PROMPT)
    page.press("#input", "Enter")
    sent = page.evaluate("() => performance.now()")
    first = page.evaluate(FIRST_TOKEN)
    page.wait_for_selector("#send:not([hidden])", timeout=120_000)
    context.close()
    return {"ready_ms": round(ready, 1), "sent_ms": round(sent, 1), "first_token_ms": round(first, 1),
            "send_to_first_token_ms": round(first - sent, 1), "transfer_bytes": transfer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    proc = serve(args.port)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            url = f"http://127.0.0.1:{args.port}/"
            one_run(browser, url, args.max_tokens)  # warm-up: the engine's first request
            runs = [one_run(browser, url, args.max_tokens) for _ in range(args.runs)]
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    files = runs[0]["transfer_bytes"]
    median = {key: statistics.median(r[key] for r in runs)
              for key in ("ready_ms", "first_token_ms", "send_to_first_token_ms")}
    print(json.dumps({"median": median, "page_transfer_bytes": sum(files.values()), "files": files,
                      "runs": runs, "chromium": CHROMIUM, "machine": cpu_name()}, indent=1))


if __name__ == "__main__":
    main()
