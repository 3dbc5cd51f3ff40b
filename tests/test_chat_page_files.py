"""The chat page's files as the server sends them: headers (Content-Security-Policy, gzip, ETag), nothing
that points off the server or parses HTML, small, and off with chat_page=False (`serve --no-ui`)."""

from __future__ import annotations

import re

import httpx
import pytest

from blockspec.server.ui import PAGES, STATIC
from tests.live_server import start_server
from tests.test_token_sources import make_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from blockspec.models.config import ModelConfig
    from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

    root = tmp_path_factory.mktemp("page-files")
    target = write_tiny_tokenizer(write_tiny_target(root / "target", "llama"))
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target))
    return make_llm({"target": target, "draft": draft})


def files() -> dict[str, str]:
    return {name: (STATIC / name).read_text() for name, _ in PAGES.values()}


def test_files_are_small_self_contained_and_never_parse_html():
    text = files()
    assert sum(len(t.encode()) for t in text.values()) < 200_000
    for name, body in text.items():
        urls = re.findall(r"[a-z]+://[\w.-]+[^\s\"'<>)]*", body)
        assert [u for u in urls if u != "http://www.w3.org/2000/svg"] == [], (name, urls)
        assert not re.search(r"""(?:src|href)\s*=\s*["']//|url\(\s*["']?//|fetch\(\s*["']//|@import""", body)
    for name in [n for n in text if n.endswith(".js")]:
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|"
                             r"setAttribute\('style'|DOMParser", text[name]), name
        for url in re.findall(r"fetch\('([^']*)'", text[name]):
            assert not url.startswith(("/", "http")), url  # relative: works behind any host or prefix
    html = text["index.html"]
    assert not re.search(r"<script[^>]*>[^<]+</script>|\sstyle=|\son[a-z]+=", html)  # nothing inline
    assert set(re.findall(r'(?:src|href)="([^"]+)"', html)) == {route[1:] for route in PAGES if route != "/"}


def test_served_with_security_headers_gzip_and_etag(llm):
    with start_server(llm) as srv:
        for route, (name, media_type) in PAGES.items():
            r = httpx.get(srv["url"] + route)  # httpx asks for gzip and decodes it
            assert r.status_code == 200 and r.headers["content-type"] == media_type
            assert r.headers["content-encoding"] == "gzip" and r.content == (STATIC / name).read_bytes()
            assert "default-src 'none'" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff"
            again = httpx.get(srv["url"] + route, headers={"If-None-Match": r.headers["etag"]})
            assert again.status_code == 304 and not again.content
        plain = httpx.get(srv["url"] + "/", headers={"Accept-Encoding": "identity"})
        assert "content-encoding" not in plain.headers and b"<title>blockspec chat</title>" in plain.content
        live = httpx.get(srv["url"] + "/stats").json()
        assert live["tokens_total"] == {"draft": 0, "lookup": 0, "target": 0}


def test_no_ui_turns_the_page_off_and_nothing_else(llm):
    with start_server(llm, chat_page=False) as srv:
        for route in PAGES:
            r = httpx.get(srv["url"] + route)
            assert r.status_code == 404 and "error" in r.json()
        assert httpx.get(srv["url"] + "/v1/models").status_code == 200
        assert httpx.get(srv["url"] + "/stats").status_code == 200


def test_serve_has_a_no_ui_flag():
    import argparse

    from blockspec.server.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve"]).ui is True
    assert parser.parse_args(["serve", "--no-ui"]).ui is False
