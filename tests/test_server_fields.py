"""The request fields clients send, through the official `openai` client against a real server: `n`, a list
of prompts, logprobs / top_logprobs, presence / frequency penalties, echo, /tokenize and /detokenize, real
`created` times, latency histograms and the throughput log line. Greedy outputs equal plain decoding's."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from blockspec.sampling_params import SamplingParams
from tests.test_server import KEY, client, folders, make_llm, ref, server  # noqa: F401 - fixtures

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def plain(ref):
    """What plain decoding (no draft) produces alone."""
    return lambda prompt, **kw: ref.generate(prompt, SamplingParams(**kw), speculative_algorithm="NONE")[0]


def test_n_choices_greedy_and_seeded(client, ref, plain):
    out = client.completions.create(model="target", prompt="Once upon", max_tokens=12, temperature=0, n=3)
    want = plain("Once upon", max_tokens=12)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.text == want.text for c in out.choices)
    assert out.usage.completion_tokens == 3 * len(want.token_ids)
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)  # the prompt counts once
    sampled = client.completions.create(model="target", prompt="Once upon", max_tokens=12, temperature=0.9,
                                        n=3, seed=40)
    expect = [ref.generate("Once upon", SamplingParams(max_tokens=12, temperature=0.9, seed=40 + i),
                           speculative_algorithm="NONE")[0].text for i in range(3)]
    assert [c.text for c in sampled.choices] == expect and len(set(expect)) > 1


def test_a_list_of_prompts(client, plain):
    prompts = ["abc", "hello there", "xyz"]
    out = client.completions.create(model="target", prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        assert c.text == plain(prompts[c.index // 2], max_tokens=8).text


def test_chat_logprobs_are_the_targets(client, ref, plain):
    out = client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=15, temperature=0,
                                         logprobs=True, top_logprobs=3)
    want = ref.chat(MESSAGES, SamplingParams(max_tokens=15, logprobs=3), speculative_algorithm="NONE")[0]
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == want.text
    assert len(content) == len(want.token_ids)
    assert "".join(t.token for t in content).startswith(want.text)  # a special token ends it: not in the text
    assert [t.logprob for t in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    streamed = list(client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=15,
                                                   temperature=0, logprobs=True, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in tokens] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)


def test_completion_logprobs_and_echo(client, plain):
    out = client.completions.create(model="target", prompt="Hi you", max_tokens=10, temperature=0, logprobs=2)
    want = plain("Hi you", max_tokens=10, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens).startswith(out.choices[0].text) and out.choices[0].text == want.text
    assert len(lp.tokens) == len(want.token_ids)
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    echoed = client.completions.create(model="target", prompt="Hi you", max_tokens=10, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Hi you" + want.text
    parts = list(client.completions.create(model="target", prompt="Hi you", max_tokens=10, temperature=0,
                                           echo=True, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == "Hi you" + want.text


@pytest.mark.parametrize("presence,frequency", [(0.8, 0.0), (0.0, 1.5), (2.0, 2.0), (-1.0, 0.5)])
def test_penalties_equal_plain_decoding(client, ref, plain, presence, frequency):
    kw = dict(max_tokens=30, presence_penalty=presence, frequency_penalty=frequency)
    out = client.completions.create(model="target", prompt="aaaa bbbb", temperature=0, **kw)
    want = plain("aaaa bbbb", **kw)
    spec = ref.generate("aaaa bbbb", SamplingParams(**kw))[0]
    assert out.choices[0].text == want.text == spec.text
    assert spec.token_ids == want.token_ids


def test_streamed_choices_and_usage(client, ref):
    want = ref.chat(MESSAGES, SamplingParams(max_tokens=10), speculative_algorithm="NONE")[0]
    chunks = list(client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=10,
                                                 temperature=0, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] == want.text
    assert chunks[-1].usage.completion_tokens == 2 * len(want.token_ids)
    finishes = [c for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(c.index for c in finishes) == [0, 1]


def test_tokenize_detokenize_and_created(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server["url"] + "/tokenize", json={"prompt": "hello"}, headers=headers)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) == 5
    back = httpx.post(server["url"] + "/detokenize", json={"tokens": r.json()["tokens"]}, headers=headers)
    assert back.json() == {"prompt": "hello"}
    chat = httpx.post(server["url"] + "/tokenize", json={"messages": MESSAGES}, headers=headers).json()
    assert chat["tokens"][0] == 3  # <|im_start|>
    bad = httpx.post(server["url"] + "/detokenize", json={"tokens": [1, 999]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server["url"] + "/tokenize", json={"prompt": "x"}).status_code == 401
    created = client.models.list().data[0].created
    assert abs(created - time.time()) < 3600
    out = client.completions.create(model="target", prompt="hi", max_tokens=2, temperature=0)
    assert abs(out.created - time.time()) < 60


def test_latency_histograms(server, client):
    client.completions.create(model="target", prompt="histograms", max_tokens=12, temperature=0)
    text = httpx.get(server["url"] + "/metrics").text
    for name in ("blockspec_time_to_first_token_seconds", "blockspec_inter_token_latency_seconds",
                 "blockspec_e2e_request_latency_seconds"):
        assert f"# TYPE {name} histogram" in text
        count = [line for line in text.splitlines() if line.startswith(f"{name}_count")]
        assert count and float(count[0].split()[-1]) > 0, name


def test_throughput_line_while_busy(folders, caplog):
    from blockspec.server.async_engine import AsyncEngine
    from blockspec.server.metrics import Metrics

    llm = make_llm(folders)
    engine = AsyncEngine(llm.scheduler(), llm.tokenizer, Metrics(llm.block_size), log_interval=0.01)

    def run(seq) -> list[str]:
        caplog.clear()
        engine.scheduler.add(seq)
        with caplog.at_level(logging.INFO, logger="blockspec.server"):
            while engine.scheduler.has_work:
                engine.scheduler.step()
                engine._publish()
                engine.throughput.step(1, [2], engine.snapshot, 0.011)
                time.sleep(0.011)
        return [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]

    prompt = "some prompt that the cache will hold"
    lines = run(llm.sequence(prompt, SamplingParams(max_tokens=40)))
    assert lines and "running" in lines[0] and "tau 2.00" in lines[0] and "KV" in lines[0]
    assert "prefix cache hit 0%" in lines[0]  # its prompt was admitted in the first interval, uncached
    assert all("prefix cache" not in line for line in lines[1:])  # no prompt admitted in the others
    again = llm.sequence(prompt, SamplingParams(max_tokens=40))
    lines = run(again)  # the same prompt: the finished request's entry holds it
    assert 0 < again.cached_tokens < len(again.prompt_ids)
    assert f"prefix cache hit {100 * again.cached_tokens / len(again.prompt_ids):.0f}%" in lines[0]
    assert all("prefix cache" not in line for line in lines[1:])


def test_throughput_line_prefix_cache_hit_rate_per_interval():
    from blockspec.server.throughput import ThroughputLog

    gauges = {"num_running_requests": 1, "kv_tokens_used": 10, "kv_tokens_budget": 100}
    log_ = ThroughputLog(1.0, speculative=False, snapshot={**gauges, "prefix_cache_hit_tokens_total": 50,
                                                           "prefix_cache_miss_tokens_total": 50})
    now = {**gauges, "prefix_cache_hit_tokens_total": 80, "prefix_cache_miss_tokens_total": 60}
    assert log_.line(1.0, now).endswith("| prefix cache hit 75%")  # 30 hits, 10 misses since the start
    log_.interval, log_._since = 1e-9, 0.0
    log_.step(1, [], now, 0.01)  # a line: the interval restarts from these totals
    assert "prefix cache" not in log_.line(1.0, now)  # nothing admitted since
    later = {**now, "prefix_cache_miss_tokens_total": 70}
    assert log_.line(1.0, later).endswith("| prefix cache hit 0%")


def test_throughput_line_counts_busy_time_only(caplog):
    """One request after a minute's idle: its line reports the engine's speed while it stepped, not its
    tokens averaged over the wait (which read "0.8 tok/s over 67.4 s")."""
    from blockspec.server.throughput import ThroughputLog

    log_ = ThroughputLog(5.0, speculative=False, snapshot={})
    log_._since -= 60.0  # the server has been idle for a minute
    with caplog.at_level(logging.INFO, logger="blockspec.server"):
        for _ in range(10):
            log_.step(5, [], {"num_running_requests": 1}, 0.1)
    lines = [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]
    assert len(lines) == 1 and "| 50.0 tok/s over 0.1 s busy |" in lines[0], lines
