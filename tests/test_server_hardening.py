"""The server against an outside user's mistakes and its own faults: a poisoned request fails alone, bodies
are limited at the door, client mistakes are 4xx (a property test over the request schemas finds no
500), the OpenAI surface (/v1/models/{id}, model_not_found, roles, x-request-id, CORS, the API key from
a file or the environment), and graceful shutdown (streams end with an error event and [DONE])."""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockspec.speculative.accept as accept_module
from blockspec.errors import BlockspecError
from blockspec.server.cli import api_key
from tests.test_server import KEY, folders, free_port, make_llm  # noqa: F401 - folders is a fixture

ORIGIN = "http://app.example"
LIMIT = 64 * 1024
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def start(app, grace: float = 5.0):
    from blockspec.server.shutdown import GracefulServer
    import uvicorn

    port = free_port()
    srv = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                         app.state.engine, grace)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started
    return srv, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(folders):  # noqa: F811
    from blockspec.server.app import create_app

    app = create_app(make_llm(folders), api_key=KEY, max_request_bytes=LIMIT, cors_origins=[ORIGIN])
    srv, thread, url = start(app)
    yield {"app": app, "url": url}
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server["url"], headers=AUTH, timeout=60) as client:
        yield client


def post(http, route: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(f"/v1/{route}", content=content)


def stream_text(http, body) -> tuple[str, list[str]]:
    """A streamed completion: its text and the raw data lines."""
    lines, text = [], ""
    with http.stream("POST", "/v1/completions", content=json.dumps({**body, "stream": True})) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line[6:] != "[DONE]" and "choices" in json.loads(line[6:]):
                    text += json.loads(line[6:])["choices"][0]["text"]
    return text, lines


def test_tiny_temperatures_and_a_faulty_request_fail_nothing_else(http, monkeypatch):
    long = {"prompt": "Keep going", "max_tokens": 120, "temperature": 0}
    alone = post(http, "completions", long).json()["choices"][0]["text"]
    real = accept_module.sampled_accept

    def faulty(drafts, logits, params, seed, position):
        if seed == 666:
            raise RuntimeError("injected fault")
        return real(drafts, logits, params, seed, position)

    monkeypatch.setattr(accept_module, "sampled_accept", faulty)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_text, http, long) for _ in range(2)]
        time.sleep(0.05)
        for t in (1e-40, 5e-324, 1e-7):
            r = post(http, "completions", {"prompt": "Hello", "max_tokens": 3, "temperature": t})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        bad = post(http, "completions", {"prompt": "Hi", "max_tokens": 30, "temperature": 1, "seed": 666})
        assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
        text, lines = stream_text(http, {"prompt": "Hi", "max_tokens": 30, "temperature": 1, "seed": 666})
        assert "error" in json.loads(lines[-2]) and lines[-1] == "[DONE]"
        assert [s.result()[0] for s in streams] == [alone, alone]
    for _ in range(100):  # the engine publishes its state right after it posts the last answers
        health = http.get("/health").json()
        if health["kv_slots_free"] == health["kv_slots_total"]:
            break
        time.sleep(0.02)
    assert health["kv_slots_free"] == health["kv_slots_total"]


def test_bodies_are_limited_at_the_door(http):
    big = json.dumps({"prompt": "hi", "junk": "x" * (LIMIT + 10)}).encode()
    r = http.post("/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "hi", "junk": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    r = http.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    long = {"prompt": "z" * (LIMIT - 100), "max_tokens": 2}  # refused on a prefix, before tokenizing it all
    r = post(http, "completions", long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    small = {"prompt": "hi", "max_tokens": 2, "junk": "y" * 1000}
    assert post(http, "completions", small).status_code == 200


MISTAKES = [
    ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ("completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("completions", b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ("completions", b"[" * 30_000 + b"]" * 30_000, None),  # 100,000 deep passes a 2 MiB limit too
    ("completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("completions", {"prompt": "hi", "temperature": 10**400}, "temperature"),
    ("completions", {"prompt": "hi", "model": 5}, "model"),
]


@pytest.mark.parametrize("route,body,param", MISTAKES)
def test_client_mistakes_are_4xx_and_keep_the_connection(http, route, body, param):
    r = post(http, route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert http.get("/health").status_code == 200  # the same keep-alive client still works


def test_large_seeds_work(http):
    for seed in (2**63, 2**64 - 1, -(2**63)):
        body = {"prompt": "hi", "max_tokens": 4, "temperature": 1.0, "seed": seed}
        first, second = (post(http, "completions", body).json()["choices"][0]["text"] for _ in range(2))
        assert first == second


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
SMALL = st.integers(-2, 6)
FIELDS = {
    "model": st.just("target") | JSON, "temperature": st.floats(0, 3) | JSON,
    "top_p": st.floats(0, 1) | JSON, "top_k": SMALL | JSON, "seed": st.integers() | JSON,
    "stream": st.booleans() | JSON, "stop": st.text(max_size=3) | JSON, "n": SMALL | JSON,
    "stop_token_ids": st.lists(st.integers(-1, 200), max_size=2) | JSON, "logprobs": JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "ignore_eos": st.booleans() | JSON, "response_format": JSON, "unknown": JSON,
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]) | JSON,
                                 "content": st.text(max_size=20) | JSON})
COMPLETION = st.fixed_dictionaries({"prompt": st.text(max_size=20) | st.lists(st.integers(-1, 120),
                                                                               max_size=4) | JSON,
                                    "max_tokens": SMALL | JSON}, optional=FIELDS)
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3) | JSON,
                              "max_tokens": SMALL | JSON}, optional=FIELDS)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(COMPLETION.map(lambda b: ("completions", b)),
                      CHAT.map(lambda b: ("chat/completions", b)),
                      JSON.map(lambda b: ("completions", b))))
def test_no_request_body_gets_a_500(http, body):
    route, payload = body
    r = post(http, route, payload)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_openai_surface(server, http):
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve("target").id == "target"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    chat = client.chat.completions.create(model="target", max_tokens=3, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason == "length"
    r = http.get("/v1/models", headers={"x-request-id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    generated = post(http, "completions", {"prompt": 5}).headers["x-request-id"]
    assert generated.startswith("req-") and generated != http.get("/health").headers["x-request-id"]
    preflight = http.options("/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in http.options("/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}).headers


def test_the_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    args = lambda **kw: argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})  # noqa: E731
    monkeypatch.delenv("BLOCKSPEC_API_KEY", raising=False)
    assert api_key(args()) is None
    monkeypatch.setenv("BLOCKSPEC_API_KEY", "from-env")
    assert api_key(args()) == "from-env" and api_key(args(api_key="given")) == "given"
    (tmp_path / "key").write_text("from-file\n")
    assert api_key(args(api_key_file=str(tmp_path / "key"))) == "from-file"
    for bad in (args(api_key="a", api_key_file=str(tmp_path / "key")), args(api_key_file=str(tmp_path)),
                args(api_key="two words")):
        with pytest.raises(BlockspecError):
            api_key(bad)


def test_graceful_shutdown_answers_everyone(folders):  # noqa: F811
    from blockspec.server.app import create_app

    app = create_app(make_llm(folders), api_key=KEY)
    engine = app.state.engine
    step = engine.scheduler.step
    engine.scheduler.step = lambda: time.sleep(0.02) or step()  # requests outlive the grace period
    srv, thread, url = start(app, grace=0.5)
    long = {"prompt": "forever", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http, ThreadPoolExecutor(3) as pool:
        streamed = pool.submit(stream_text, http, long)
        plain = pool.submit(post, http, "completions", long)
        short = pool.submit(post, http, "completions", {**long, "max_tokens": 5})
        time.sleep(0.3)
        srv.handle_exit(signal.SIGTERM, None)
        time.sleep(0.1)
        assert post(http, "completions", long).status_code == 503  # no admission while draining
        assert short.result().status_code == 200  # finished within the grace period
        r = plain.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        _, lines = streamed.result()
        assert json.loads(lines[-2])["error"]["code"] == "server_shutting_down" and lines[-1] == "[DONE]"
    thread.join(timeout=30)
    assert not thread.is_alive()
