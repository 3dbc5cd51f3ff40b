"""A bounded soak on 127.0.0.1: 16 concurrent clients mix greedy and sampled streams, plain requests,
aborted streams, poisoned requests (a fault injected into one request's sampling, a vanishing
temperature) and malformed ones for SOAK_SECONDS. At the end no slot or KV token is held, resident
memory is stable, and every good greedy request's output equals its output alone."""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import blockspec.speculative.accept as accept_module
from blockspec.sampling_params import SamplingParams
from tests.test_server import BUDGET, KEY, folders, make_llm  # noqa: F401 - folders is a fixture
from tests.test_server_hardening import start

SOAK_SECONDS = float(os.environ.get("BLOCKSPEC_SOAK_SECONDS", "30"))
CLIENTS = 16
PROMPTS = [f"Soak {i}: {'xyzw'[i % 4] * (1 + 3 * i)}" for i in range(8)]
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MALFORMED = [b"{nope", b'{"prompt": "\\ud800"}', b"[" * 5000 + b"]" * 5000,
             b'{"prompt": "hi", "seed": 1e400}', b'{"prompt": "hi", "max_tokens": -1}',
             b'{"messages": [{"role": "wizard", "content": "x"}]}']


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def stream(http, body, abort_after: int | None = None) -> tuple[str, list[str]]:
    text, lines = "", []
    with http.stream("POST", "/v1/completions", content=json.dumps({**body, "stream": True})) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if line[6:] != "[DONE]" and json.loads(line[6:]).get("choices"):
                text += json.loads(line[6:])["choices"][0]["text"]
            if abort_after is not None and len(lines) >= abort_after:
                break  # closing the response aborts the request
    return text, lines


def client(url: str, seed: int, deadline: float, want: list[str], results: dict) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        while time.time() < deadline:
            kind, i = rng.random(), rng.randrange(len(PROMPTS))
            body = {"prompt": PROMPTS[i], "max_tokens": 12 + 3 * i, "temperature": 0}
            if kind < 0.35:
                text, lines = stream(http, body)
                results["greedy"].append((text, want[i], lines[-1]))
            elif kind < 0.5:
                r = http.post("/v1/completions", content=json.dumps(body))
                results["greedy"].append((r.json()["choices"][0]["text"], want[i], "[DONE]"))
            elif kind < 0.65:
                stream(http, {**body, "max_tokens": 60}, abort_after=rng.randint(1, 4))
                results["aborted"] += 1
            elif kind < 0.75:
                _, lines = stream(http, {**body, "temperature": 1.0, "seed": 666})  # the poisoned seed
                assert "error" in json.loads(lines[-2]) and lines[-1] == "[DONE]"
                results["poisoned"] += 1
            elif kind < 0.85:
                r = http.post("/v1/completions", content=json.dumps({**body, "temperature": 1e-40,
                                                                     "max_tokens": 4}))
                assert r.status_code == 200, r.text
            else:
                r = http.post("/v1/completions", content=rng.choice(MALFORMED))
                assert r.status_code == 400, r.text
                results["malformed"] += 1


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads resident memory from /proc")
def test_soak(folders, monkeypatch):  # noqa: F811
    from blockspec.server.app import create_app

    real = accept_module.sampled_accept

    def poisoned(drafts, logits, params, seed, position):
        if seed == 666 and position > 12:
            raise FloatingPointError("injected fault")
        return real(drafts, logits, params, seed, position)

    monkeypatch.setattr(accept_module, "sampled_accept", poisoned)
    want = [o.text for o in make_llm(folders).generate(
        PROMPTS, [SamplingParams(max_tokens=12 + 3 * i) for i in range(len(PROMPTS))])]
    app = create_app(make_llm(folders, max_total_tokens=BUDGET), api_key=KEY)
    srv, thread, url = start(app)
    results = {"greedy": [], "aborted": 0, "poisoned": 0, "malformed": 0}
    try:
        warm = time.time() + SOAK_SECONDS / 3
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(client, url, s, time.time() + SOAK_SECONDS, want, results)
                       for s in range(CLIENTS)]
            time.sleep(max(0.0, warm - time.time()))
            after_warm_up = rss_mb()
            for f in futures:
                f.result()
        engine = app.state.engine
        deadline = time.time() + 10
        while engine.num_requests and time.time() < deadline:  # aborts land between steps
            time.sleep(0.05)
        time.sleep(0.3)
        health = httpx.get(url + "/health").json()
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    assert health["kv_slots_free"] == health["kv_slots_total"] and health["kv_tokens_used"] == 0
    assert health["num_running_requests"] == health["num_waiting_requests"] == 0
    assert results["greedy"] and results["aborted"] and results["poisoned"] and results["malformed"]
    assert all(got == expected and end == "[DONE]" for got, expected, end in results["greedy"])
    assert rss_mb() - after_warm_up < 150, (after_warm_up, rss_mb())
