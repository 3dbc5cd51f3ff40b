"""Debian's Chromium driven by Playwright for Python, for the chat page's tests: never a browser download.

On a machine without the browser or the driver the tests fail (they do not skip) with the way to
install them. Screenshots go to test-artifacts/chat-page/ (gitignored; $BLOCKSPEC_ARTIFACTS overrides).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("BLOCKSPEC_CHROMIUM", "/usr/bin/chromium")
# No first-run UI, no background traffic (this machine's network is closed: Chromium's own connections
# would fail, many at a time), no GPU; Playwright adds a fresh temporary user-data-dir per launch.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("BLOCKSPEC_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))
INSTALL = ("`make test` installs both; by hand: `apt-get install chromium` (Debian's package) and "
           "`pip install playwright==1.65.2` (the test extra). Never run `playwright install`: the tests "
           "use the system Chromium (BLOCKSPEC_CHROMIUM names another binary).")


def launch(playwright):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"The chat page tests need Chromium at {CHROMIUM}, which is missing. {INSTALL}",
                    pytrace=False)
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError:
        pytest.fail(f"The chat page tests need Playwright for Python, which is not installed. {INSTALL}",
                    pytrace=False)
    return start()


def screenshot(page, name: str) -> Path:
    path = ARTIFACTS / "chat-page" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    return path


def sse_stream(pieces: list[dict], *, tau: float | None = None) -> str:
    """A /v1/chat/completions stream as the server sends it with return_token_sources: one chunk per
    piece list entry ({"text", "source", "step"}), a final chunk with the blockspec extension, usage, DONE."""
    def event(payload: dict) -> str:
        return "data: " + json.dumps(payload) + "\n\n"

    base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "test"}
    out = [event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})]
    for piece in pieces:
        out.append(event({**base, "choices": [{"index": 0, "delta": {"content": piece["text"]},
                                                "logprobs": None, "finish_reason": None,
                                                "token_sources": [piece]}]}))
    ext = {"speculative_algorithm": "DFLASH", "block_size": 4, "mean_accept_length": tau or 0.0,
           "num_verify_steps": 1 if tau else 0}
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    out.append(event({**base, "choices": [last], "blockspec": ext}))
    out.append(event({**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces),
                                                        "total_tokens": 5 + len(pieces)}}))
    return "".join(out) + "data: [DONE]\n\n"


def parse_sse(body: str) -> list[dict]:
    events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"]


def token_sources(body: str) -> list[dict]:
    """Every token_sources entry of a stream, in order."""
    return [p for chunk in parse_sse(body) for c in chunk["choices"] for p in c.get("token_sources", [])]


# The rendered reply's token spans: (token index, source class, step, text), in document order.
SPANS_JS = """(selector) => [...document.querySelectorAll(selector + ' .tok')].map((s) => [
    Number(s.dataset.t), [...s.classList].find((c) => c.startsWith('src-')).slice(4), Number(s.dataset.s),
    s.textContent])"""
