"""The chat page in a real browser (Debian's Chromium, driven by Playwright): against the real server on the
embedded SmolLM2 and its DFlash draft, and, for exact or hostile replies, with /v1/chat/completions
answered by a crafted stream (Playwright's page.route: the server's stream format, token sources
included, with the text we choose). Screenshots land in test-artifacts/chat-page/."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import httpx
import pytest

from blockspec.llm import LLM
from blockspec.models.config import ModelConfig
from tests.browser import SPANS_JS, launch, screenshot, sse_stream, sync_playwright, token_sources
from tests.live_server import start_server
from tests.test_token_sources import make_llm
from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

REPLY = ".msg.assistant"


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with start_server(LLM(max_num_seqs=4)) as srv:
        yield srv


@dataclass
class Watched:
    """A page and what it did: console errors, uncaught exceptions, every request's URL."""

    page: object
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def open(self, url: str) -> None:
        self.page.goto(url)
        self.page.wait_for_function("() => document.querySelector('#model .chip') !== null")

    def send(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def wait_done(self, timeout_s: float = 120) -> None:
        self.page.wait_for_selector("#send:not([hidden])", timeout=timeout_s * 1000)


def watch(context, color_scheme: str = "light") -> Watched:
    page = context.new_page()
    page.emulate_media(color_scheme=color_scheme)
    watched = Watched(page)
    page.on("console", lambda m: m.type in ("error", "warning")
            and watched.errors.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: watched.errors.append(f"uncaught: {e}"))
    page.on("request", lambda r: watched.requests.append(r.url))
    return watched


@pytest.fixture()
def context(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 820})
    yield ctx
    ctx.close()


def reply_spans(page) -> list[list]:
    return page.evaluate(SPANS_JS, f"{REPLY}:last-of-type")


def test_page_loads_clean_and_stays_on_its_server(context, server):
    w = watch(context)
    response = w.page.goto(server["url"] + "/")
    assert response.status == 200
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    w.page.wait_for_function("() => document.querySelector('#model .chip') !== null")
    # the engine panel has read /stats
    w.page.wait_for_function("() => document.querySelector('#live-kv').textContent.includes('/')")
    assert "smollm2" in w.page.text_content("#model").lower()
    assert w.errors == []
    assert w.requests and all(u.startswith(server["url"] + "/") for u in w.requests), w.requests
    screenshot(w.page, "empty-light")


def test_a_message_streams_and_its_colours_are_the_responses_sources(context, server):
    w = watch(context)
    w.open(server["url"] + "/")
    with w.page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as answer:
        w.send("Write a Python function that returns the sum of a list, then explain it in two sentences.")
        w.page.wait_for_selector(f"{REPLY} .tok", timeout=60_000)  # the first token, while streaming
        assert w.page.is_visible("#stop")
    w.wait_done()
    pieces = token_sources(answer.value.text())
    assert pieces, "the page asked for token sources and got them"
    spans = reply_spans(w.page)
    assert spans
    for k, source, step, text in spans:  # each coloured run is a piece of its own token, in its colour
        assert source == pieces[k]["source"] and step == pieces[k]["step"] and text in pieces[k]["text"]
    wordy = [k for k, p in enumerate(pieces) if re.search(r"[A-Za-z0-9]", p["text"])]
    shown = {k for k, *_ in spans}
    assert len(shown & set(wordy)) >= 0.9 * len(wordy)  # markdown may hide a fence's language name
    figures = w.page.text_content(f"{REPLY} .figures")
    assert "TTFT" in figures and "tok/s" in figures and f"{len(pieces)} tokens" in figures
    body = json.loads(answer.value.request.post_data)
    assert body["stream"] is True and body["return_token_sources"] is True
    assert w.errors == [] and all(u.startswith(server["url"] + "/") for u in w.requests)
    screenshot(w.page, "reply-light")
    w.page.emulate_media(color_scheme="dark")
    w.page.hover(f"{REPLY} .tok >> nth=3")
    screenshot(w.page, "reply-dark-hover")


def aborted(server) -> float:
    text = httpx.get(server["url"] + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('blockspec_requests_total{finish_reason="abort"}'))


def test_settings_are_sent_and_stop_stops_the_server_too(context, server):
    w = watch(context)
    w.open(server["url"] + "/")
    w.page.click("#open-settings")
    w.page.fill("#set-system", "You are a storyteller.")
    w.page.fill("#set-temperature", "0.9")
    w.page.fill("#set-top-p", "0.8")
    w.page.fill("#set-top-k", "40")
    w.page.fill("#set-max-tokens", "1500")
    w.page.fill("#set-seed", "7")
    w.page.click("#settings button.primary")
    before = aborted(server)
    with w.page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        w.send("Tell me a very long story about a lighthouse keeper.")
    body = json.loads(sent.value.post_data)
    assert body["messages"][0] == {"role": "system", "content": "You are a storyteller."}
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"], body["seed"]) == (
        0.9, 0.8, 40, 1500, 7)
    w.page.wait_for_function(f"() => document.querySelectorAll('{REPLY} .tok').length >= 8", timeout=60_000)
    w.page.click("#stop")
    w.wait_done(timeout_s=10)
    assert w.page.is_visible(f"{REPLY} .note") and "Stopped" in w.page.text_content(f"{REPLY} .note")
    shown = w.page.text_content(f"{REPLY} .body")
    deadline = time.time() + 10
    while time.time() < deadline and (aborted(server) == before
                                      or httpx.get(server["url"] + "/stats").json()["running_requests"]):
        time.sleep(0.2)
    assert aborted(server) == before + 1  # the server aborted it: nothing runs on
    assert httpx.get(server["url"] + "/stats").json()["running_requests"] == 0
    w.page.wait_for_timeout(500)
    assert w.page.text_content(f"{REPLY} .body") == shown
    assert w.errors == []


HOSTILE = """Here is some text.
<script>window.__pwned = "script"</script>
<img src="http://evil.invalid/x.png" onerror="window.__pwned='img'">
<svg onload="window.__pwned='svg'"><circle r="5"/></svg>
<iframe src="http://evil.invalid/"></iframe>
<style>body { display: none }</style>
<a href="http://evil.invalid" onclick="window.__pwned='a'">a link</a>
<form action="http://evil.invalid"><input name="q"></form>
<meta http-equiv="refresh" content="0;url=http://evil.invalid/">
<base href="http://evil.invalid/"><object data="http://evil.invalid/x"></object>
[click me](javascript:window.__pwned="link") and [data](data:text/html,<script>alert(1)</script>)
![pixel](http://evil.invalid/track.png) and **<img src=x onerror=window.__pwned="bold">**
`<b onmouseover="window.__pwned='code'">hover</b>` &lt;script&gt;alert(1)&lt;/script&gt;
| <script>window.__pwned="cell"</script> | <img src=x onerror=alert(1)> |
|---|---|
| javascript:window.__pwned="bare" | \u202eevil |

```html
</code></pre><script>window.__pwned="fence"</script>
```
"""


def hostile_pieces(text: str) -> list[dict]:
    """The text in 3-character tokens (so tags are split across tokens), sources and steps cycling."""
    sources = ["target", "draft", "draft", "lookup"]
    return [{"text": text[i : i + 3], "source": sources[(i // 3) % 4], "step": i // 9}
            for i in range(0, len(text), 3)]


def crafted(page, pieces: list[dict], tau: float | None = None) -> None:
    """Answer the page's next chat requests with this stream instead of the model's."""
    body = sse_stream(pieces, tau=tau)
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=body))


def test_a_hostile_reply_stays_text(context, server):
    w = watch(context)
    dialogs = []
    w.page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    w.open(server["url"] + "/")
    crafted(w.page, hostile_pieces(HOSTILE))
    w.send("Say something nasty.")
    w.wait_done()
    w.page.hover(f"{REPLY} .body p")
    w.page.hover(f"{REPLY} code >> nth=0")
    w.page.wait_for_timeout(300)
    assert w.page.evaluate("() => window.__pwned") is None and dialogs == []
    found = w.page.evaluate(f"() => [...document.querySelectorAll('{REPLY} .body *')].map(e => e.tagName)")
    assert not set(found) & {"SCRIPT", "IMG", "SVG", "IFRAME", "STYLE", "FORM", "INPUT", "META", "BASE",
                             "OBJECT", "EMBED", "LINK"}, found
    hrefs = w.page.evaluate(f"() => [...document.querySelectorAll('{REPLY} a')].map(a => a.href)")
    assert all(h.startswith(("http://", "https://", "mailto:")) for h in hrefs), hrefs
    shown = w.page.text_content(f"{REPLY} .body")
    for literal in ('<script>window.__pwned = "script"</script>', "<iframe src=", "onerror=",
                    "[click me](javascript:", "&lt;script&gt;", "</code></pre><script>"):
        assert literal in shown, literal
    assert w.page.is_visible("#input")  # the <style> did not hide the page
    assert not [u for u in w.requests if "evil" in u]
    assert w.errors == []
    screenshot(w.page, "hostile-reply")


def test_colours_hover_figures_and_the_sources_switch(context, server):
    pieces = [{"text": text, "source": source, "step": step} for text, source, step in [
        ("The", "target", 0), (" quick", "draft", 1), (" brown", "draft", 1), (" fox", "target", 1),
        (" jumps", "lookup", 2), (" over", "lookup", 2), (".", "target", 2),
        ("\n\n```py\nx = 1\n", "target", 3), ("print(x)", "draft", 4), ("\n```", "target", 4)]]
    w = watch(context)
    w.open(server["url"] + "/")
    crafted(w.page, pieces, tau=2.5)
    w.send("Anything.")
    w.wait_done()
    spans = reply_spans(w.page)
    by_token: dict[int, str] = {}
    for k, source, step, text in spans:
        assert (source, step) == (pieces[k]["source"], pieces[k]["step"])
        by_token[k] = by_token.get(k, "") + text
    assert by_token[1] == " quick" and by_token[4] == " jumps" and by_token[8] == "print(x)"
    colours = w.page.evaluate(f"""() => Object.fromEntries(['draft', 'lookup', 'target'].map(s =>
        [s, getComputedStyle(document.querySelector('{REPLY} .src-' + s)).backgroundColor]))""")
    assert colours["draft"] != colours["lookup"] and colours["target"] == "rgba(0, 0, 0, 0)"
    figures = w.page.text_content(f"{REPLY} .figures")
    assert "draft tau 2.50" in figures and "lookup 20%" in figures and "10 tokens" in figures
    assert "tok/step" in figures
    w.page.hover(f"{REPLY} .tok[data-t='5']")
    tip = w.page.text_content("#tooltip")
    assert "step 2" in tip and "copied from the context" in tip and "3 tokens: 2 lookup + 1 target" in tip
    assert w.page.eval_on_selector_all(".tok.step-hl", "n => n.map(s => Number(s.dataset.t))") == [4, 5, 6]
    screenshot(w.page, "colours-hover")
    w.page.click("#show-sources")
    assert not w.page.is_visible("#legend")
    off = w.page.evaluate(
        f"() => getComputedStyle(document.querySelector('{REPLY} .src-draft')).backgroundColor")
    assert off == "rgba(0, 0, 0, 0)"


def test_keys_conversations_copy_and_enter(context, tmp_path_factory):
    root = tmp_path_factory.mktemp("page")
    target = write_tiny_tokenizer(write_tiny_target(root / "target", "llama"))
    folders = {"target": target, "draft": write_tiny_draft(root / "draft", ModelConfig.from_folder(target))}
    with start_server(make_llm(folders), api_key="sesame") as srv:
        w = watch(context)
        w.page.goto(srv["url"] + "/")
        w.page.wait_for_selector("#keydialog[open]")
        w.page.fill("#key-input", "wrong")
        w.page.press("#key-input", "Enter")
        w.page.wait_for_selector("#key-error:not([hidden])")
        w.page.fill("#key-input", "sesame")
        w.page.press("#key-input", "Enter")
        w.page.wait_for_function("() => document.querySelector('#model .chip') !== null")
        w.page.click("#open-settings")
        w.page.fill("#set-max-tokens", "24")  # the tiny model's context is 512 tokens
        w.page.click("#settings button.primary")
        w.page.fill("#input", "first line")
        w.page.press("#input", "Shift+Enter")
        w.page.type("#input", "second line")
        assert w.page.input_value("#input") == "first line\nsecond line"  # Shift+Enter: a new line
        w.page.press("#input", "Enter")  # Enter: sends
        w.wait_done()
        assert w.page.text_content(".msg.user .bubble") == "first line\nsecond line"
        assert w.page.text_content(f"{REPLY} .body") and not w.page.is_visible(f"{REPLY} .error")
        w.page.click("#new-chat")
        crafted(w.page, [{"text": "```sh\necho copied\n```", "source": "target", "step": 0}])
        # Plain http from another machine is no secure context: no clipboard API. The copy must still work.
        w.page.evaluate("""() => {
            Object.defineProperty(Navigator.prototype, 'clipboard', {get: () => undefined});
            window.__copied = [];
            document.addEventListener('copy', () => window.__copied.push(String(window.getSelection())));
        }""")
        w.send("A code block, please.")
        w.wait_done()
        w.page.click(f"{REPLY} .copy")
        w.page.wait_for_function("() => window.__copied.length > 0")
        assert w.page.evaluate("() => window.__copied") == ["echo copied"]
        assert w.page.text_content(f"{REPLY} .copy") == "Copied"
        assert w.page.locator(".chat-item").count() == 2
        w.page.reload()  # conversations are kept in the browser
        w.page.wait_for_function("() => document.querySelector('#model .chip') !== null")
        titles = w.page.eval_on_selector_all(".chat-item .open", "n => n.map(b => b.textContent)")
        assert titles == ["A code block, please.", "first line second line"]
        w.page.click(".chat-item:nth-child(1) .delete")
        assert w.page.eval_on_selector_all(".chat-item .open", "n => n.map(b => b.textContent)") == [
            "first line second line"]
        w.page.reload()
        w.page.wait_for_function("() => document.querySelector('#model .chip') !== null")
        assert w.page.locator(".chat-item").count() == 1
        assert w.errors == [] or all("401" in e for e in w.errors), w.errors
