"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1, driven by the official `openai`
client and raw httpx: chat, completion, streaming, auth, errors, a 32-client load test and a
disconnect storm (no KV leaked). Tiny random target + draft + 97-token character tokenizer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from blockspec.models.config import ModelConfig
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

KEY = "test-key"
BUDGET = 256  # KV tokens: small enough that the load test preempts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    target = write_tiny_tokenizer(write_tiny_target(root / "target", "llama"))
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target), block_size=4)
    return {"target": target, "draft": draft}


def make_llm(folders, **settings) -> LLM:
    # adaptive speculation off: which steps speculate would depend on timing, and the tests compare the
    # server's accept lengths with the engine's own (the text is the same either way)
    return LLM(model_path=str(folders["target"]), draft_model_path=str(folders["draft"]), device="cpu",
               max_num_seqs=8, adaptive_speculation=False, **settings)


@pytest.fixture(scope="module")
def server(folders):
    import uvicorn

    from blockspec.server.app import create_app

    app = create_app(make_llm(folders, max_total_tokens=BUDGET), api_key=KEY)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield {"app": app, "url": f"http://127.0.0.1:{port}", "port": port}
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def ref(folders) -> LLM:
    """A second engine on the same weights: what each request produces alone."""
    return make_llm(folders)


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def health(server) -> dict:
    r = httpx.get(server["url"] + "/health")
    assert r.status_code == 200
    return r.json()


def counter(server, name: str) -> float:
    text = httpx.get(server["url"] + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["target"]
    assert health(server)["status"] == "ok"


def test_chat_and_completion_match_the_engine_alone(client, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    chat = client.chat.completions.create(model="target", messages=messages, max_tokens=20, temperature=0)
    want = ref.chat(messages, SamplingParams(max_tokens=20))[0]
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == want.text
    assert chat.choices[0].finish_reason == want.finish_reason
    assert chat.usage.completion_tokens == len(want.token_ids)
    assert chat.usage.prompt_tokens == want.num_prompt_tokens
    ext = chat.blockspec
    assert ext["speculative_algorithm"] == "DFLASH" and ext["block_size"] == 4
    assert (ext["accept_lengths"] == want.accept_lengths
            and ext["num_verify_steps"] == len(want.accept_lengths))
    assert ext["num_plain_steps"] == 0

    comp = client.completions.create(model="target", prompt="Once upon a time", max_tokens=12, temperature=0)
    want = ref.generate("Once upon a time", SamplingParams(max_tokens=12))[0]
    assert comp.object == "text_completion" and comp.choices[0].text == want.text
    ids = client.completions.create(model="target", prompt=[7, 8, 9], max_tokens=5, temperature=0)
    assert ids.choices[0].text == ref.generate([[7, 8, 9]], SamplingParams(max_tokens=5))[0].text


def test_streaming_chunks_usage_and_extension(client, ref):
    messages = [{"role": "user", "content": "Stream please"}]
    chunks = list(client.chat.completions.create(model="target", messages=messages, max_tokens=25,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    want = ref.chat(messages, SamplingParams(max_tokens=25))[0]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == want.finish_reason
    assert last.blockspec["accept_lengths"] == want.accept_lengths
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)

    parts = list(client.completions.create(model="target", prompt="abc", max_tokens=9, temperature=0,
                                           stream=True))
    assert all(p.object == "text_completion" for p in parts)
    want = ref.generate("abc", SamplingParams(max_tokens=9))[0]
    assert "".join(p.choices[0].text for p in parts) == want.text
    assert parts[-1].choices[0].finish_reason == want.finish_reason and parts[-1].usage is None


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(client, ref, stream):
    full = ref.generate("stop test", SamplingParams(max_tokens=30))[0].text
    stop = full[12:14]
    kwargs = dict(model="target", prompt="stop test", max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    if stream:
        parts = list(client.completions.create(stream=True, **kwargs))
        text, reason = "".join(p.choices[0].text for p in parts), parts[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs).choices[0]
        text, reason = out.text, out.finish_reason
    assert text == full[: full.find(stop)] and reason == "stop"


def test_auth_is_enforced(server):
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server["url"] + "/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model="target", prompt="hi", max_tokens=2)
        assert info.value.status_code == 401
    r = httpx.get(server["url"] + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


BAD_REQUESTS = [
    ("completions", b"{not json", "prompt"),
    ("completions", [1, 2], None),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, 2, 500]}, "prompt"),
    ("completions", {"prompt": ["a", 5]}, "prompt"),
    ("completions", {"prompt": ["a"] * 65}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 100000}, "prompt"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "model": 5}, "model"),
    ("completions", {"prompt": "x" * 600}, "prompt"),
    # fits the context, not the KV budget
    ("completions", {"prompt": "x" * 300, "max_tokens": 100}, "prompt"),
    ("completions", {"prompt": "hi", "n": 17}, "n"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": "x"}, "frequency_penalty"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("route,body,param", BAD_REQUESTS)
def test_invalid_requests_get_openai_400(server, route, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server['url']}/v1/{route}", content=content,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None and not isinstance(body, bytes):
        assert error["param"] == param, error


def test_client_errors_and_unknown_routes(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="target", prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    r = httpx.get(server["url"] + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    assert health(server)["status"] == "ok"


def load_request(i: int) -> tuple[str, dict]:
    """Request i of the load test: chat or completion, greedy or seeded sampling, its own length."""
    params = dict(max_tokens=6 + (i * 7) % 35, temperature=0.9 if i % 5 == 4 else 0.0, seed=i)
    return f"Request {i}: {'abcdefgh'[i % 8] * (1 + i % 13)}", params


def test_32_concurrent_streams_get_exactly_their_tokens(server, ref):
    requests = [load_request(i) for i in range(32)]
    want = []
    for i, (prompt, params) in enumerate(requests):
        sp = SamplingParams(**params)
        want.append((ref.chat([{"role": "user", "content": prompt}], sp) if i % 2
                     else ref.generate(prompt, sp))[0].text)
    preempted_before = counter(server, "blockspec_preemptions_total")

    def run(i: int) -> str:
        prompt, params = requests[i]
        c = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)
        if i % 2:
            stream = c.chat.completions.create(model="target",
                                               messages=[{"role": "user", "content": prompt}],
                                               stream=True, **params)
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        return "".join(ch.choices[0].text for ch in c.completions.create(model="target", prompt=prompt,
                                                                           stream=True, **params))

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, range(32), timeout=300))
    assert got == want
    # the tiny budget forced preemption
    assert counter(server, "blockspec_preemptions_total") > preempted_before
    assert counter(server, "blockspec_plain_decode_steps_total") == 0  # adaptive speculation is off here
    # prompt lookup is on (the default): its steps are counted apart, each committing 1..W tokens
    steps, tokens = (counter(server, "blockspec_lookup_steps_total"),
                     counter(server, "blockspec_lookup_tokens_total"))
    assert steps <= tokens <= 4 * steps
    state = health(server)
    assert state["kv_tokens_used"] == 0 and state["kv_slots_free"] == state["kv_slots_total"]


def wait_idle(server, timeout: float = 20.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = health(server)
        if state["num_running_requests"] == 0 and state["num_waiting_requests"] == 0:
            return state
        time.sleep(0.1)
    return health(server)


def test_disconnect_storm_leaks_no_kv(server, monkeypatch):
    aborted = counter(server, 'blockspec_requests_total{finish_reason="abort"}')
    scheduler = server["app"].state.engine.scheduler
    step = scheduler.step

    def slow_step():  # >= 5 ms per step: no request can finish before its client leaves
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(scheduler, "step", slow_step)
    long = dict(max_tokens=200, temperature=0, ignore_eos=True)

    def open_and_drop(i: int) -> None:
        route, body = ("completions", {"prompt": f"storm {i}", **long}) if i % 2 else \
            ("chat/completions", {"messages": [{"role": "user", "content": f"storm {i}"}], **long})
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{server['url']}/v1/{route}", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        break  # leave after the first chunk: the connection closes

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(open_and_drop, range(16), timeout=120))
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{server['url']}/v1/completions", json={"prompt": "slow", **long}, timeout=0.2,
                   headers={"Authorization": f"Bearer {KEY}"})
    state = wait_idle(server)
    assert state["num_running_requests"] == 0 and state["num_waiting_requests"] == 0
    assert state["kv_tokens_used"] == 0 and state["kv_slots_free"] == state["kv_slots_total"]
    runner = server["app"].state.llm.runner  # every slot is free or a prefix-cache entry's
    assert runner.pool.num_free + len(runner.prefix_cache.entries) == runner.pool.num_slots
    assert counter(server, 'blockspec_requests_total{finish_reason="abort"}') - aborted == 17
    assert health(server)["status"] == "ok"


def test_metrics_exposition(server, client):
    client.completions.create(model="target", prompt="metrics", max_tokens=4, temperature=0)
    text = httpx.get(server["url"] + "/metrics").text
    for name in ("blockspec_requests_total{", "blockspec_generation_tokens_total ",
                 "blockspec_prompt_tokens_total ", 'blockspec_accept_length_bucket{le="4"}',
                 "blockspec_num_waiting_requests ", "blockspec_num_running_requests ",
                 "blockspec_step_latency_seconds_bucket", "blockspec_kv_tokens_used ",
                 "blockspec_preemptions_total "):
        assert name in text, name
    assert ('blockspec_engine_info{device="cpu",quantization="none",cpu_activations="none",'
            'draft_quantization="none",speculative_accept="match"} 1') in text


def test_serve_cli_errors(capsys):
    from blockspec.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    assert "pick another --port" in capsys.readouterr().err
    assert main(["serve", "--max-running-requests", "0"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    assert "--max-total-tokens" in capsys.readouterr().out


def test_serve_starts_on_the_embedded_default(smollm2_dir):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "blockspec", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        out = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=3, temperature=0)
        assert (out.usage.completion_tokens >= 1
                and out.blockspec["speculative_algorithm"] in ("DFLASH", "NONE"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
