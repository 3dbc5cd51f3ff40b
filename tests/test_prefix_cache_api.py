"""The prefix cache seen from outside: `LLM` reuses prefixes from call to call (chat turns, repeated
prompts) with the tokens it gives without the cache, also at TP=2; the server reports
`usage.prompt_tokens_details.cached_tokens` (streamed usage too) and Prometheus counters; the flags turn it
off. Tiny random target (its linear layers as Q4_1 blocks) + draft + 97-token character tokenizer."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

from blockspec import LLM, SamplingParams
from blockspec.engine.prefix_cache import common_prefix
from blockspec.models.config import ModelConfig
from tests.test_server import KEY, counter
from tests.test_server_hardening import start
from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

SYSTEM = "You answer in one short line, always, whatever you are asked. " * 2
TURNS = ["What is a prefix cache?", "Say it again, shorter.", "And once more."]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("prefix-api")
    # intermediate 128: Q4_1's 32-weight blocks split evenly over two ranks
    target = write_tiny_tokenizer(write_tiny_target(root / "target", "llama", intermediate_size=128))
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target), block_size=4)
    return {"target": str(target), "draft": str(draft)}


def make_llm(folders, **settings) -> LLM:
    return LLM(**{**dict(model_path=folders["target"], draft_model_path=folders["draft"], device="cpu",
                         quantization="q4_1", max_model_len=384,
                         adaptive_speculation=False), **settings})


def chat_turns(llm: LLM, params: SamplingParams, algorithm: str | None = None) -> list:
    """Three chat turns, each sent with the previous answers; the outputs."""
    messages, outs = [{"role": "system", "content": SYSTEM}], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        out = llm.chat(messages, params, speculative_algorithm=algorithm)[0]
        messages.append({"role": "assistant", "content": out.text})
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def reference(folders) -> LLM:
    return make_llm(folders, prefix_caching=False)


PARAMS = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.9, seed=5)]


@pytest.mark.parametrize("params", PARAMS)
def test_llm_reuses_prefixes_across_calls(folders, reference, params):
    llm = make_llm(folders, speculative_tree_budget=6)
    for algorithm in ("DFLASH", "NONE"):
        want = chat_turns(reference, params, algorithm)
        assert all(o.cached_tokens == 0 for o in want)
        got = chat_turns(llm, params, algorithm)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for before, after in zip(got, got[1:]):  # the previous turn, as far as the template re-renders it
            shared = common_prefix(after.prompt_token_ids, before.prompt_token_ids + before.token_ids[:-1],
                                   after.num_prompt_tokens - 1)
            assert before.num_prompt_tokens <= shared <= after.cached_tokens < after.num_prompt_tokens
    again = llm.generate([TURNS[0]] * 2, params)  # the second copies what the first computes
    assert [o.cached_tokens for o in again] == [0, len(again[0].prompt_token_ids) - 1]
    assert again[0].token_ids == again[1].token_ids
    llm.clear_prefix_cache()
    assert not llm.runner.prefix_cache.entries and llm.runner.slots_available == llm.runner.pool.num_slots


def test_tp2_hits_give_the_tokens_of_tp1_without_the_cache(folders):
    # fp32 activations: the ranks' partial sums only reorder rounding, which these tokens do not feel;
    # int8 activations can turn such a last-bit difference into a different rounding of a whole block
    one = make_llm(folders, prefix_caching=False, cpu_activations="fp32")
    want = {(p.temperature, a): [o.token_ids for o in chat_turns(one, p, a)]
            for p in PARAMS for a in ("DFLASH", "NONE")}
    two = make_llm(folders, tp_size=2, speculative_tree_budget=6, cpu_activations="fp32")
    try:
        for params in PARAMS:
            for algorithm in ("DFLASH", "NONE"):
                got = chat_turns(two, params, algorithm)
                assert [o.token_ids for o in got] == want[params.temperature, algorithm]
                assert got[1].cached_tokens > got[0].num_prompt_tokens
        two.clear_prefix_cache()
        assert [o.token_ids for o in chat_turns(two, PARAMS[0])] == want[0.0, "DFLASH"]
    finally:
        two.close()


def test_tp2_with_int8_activations_stays_lossless_on_cache_hits(folders):
    two = make_llm(folders, tp_size=2, speculative_tree_budget=6)
    try:
        assert two.activations == "int8"
        for params in PARAMS:
            plain = chat_turns(two, params, "NONE")
            dflash = chat_turns(two, params, "DFLASH")
            assert [o.token_ids for o in dflash] == [o.token_ids for o in plain]
            assert all(o.cached_tokens > before.num_prompt_tokens for before, o in zip(dflash, dflash[1:]))
            two.clear_prefix_cache()
    finally:
        two.close()


@pytest.fixture(scope="module")
def server(folders):
    from blockspec.server.app import create_app

    app = create_app(make_llm(folders, max_num_seqs=4), api_key=KEY)
    srv, thread, url = start(app)
    yield {"app": app, "url": url}
    srv.should_exit = True
    thread.join(timeout=30)


def test_usage_reports_cached_tokens(server, reference):
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "system", "content": SYSTEM + "Usage."}, {"role": "user", "content": TURNS[0]}]
    one = client.chat.completions.create(model="target", messages=messages, max_tokens=16, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens < one.usage.prompt_tokens
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]}]
    two = client.chat.completions.create(model="target", messages=messages, max_tokens=16, temperature=0)
    assert one.usage.prompt_tokens <= two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens
    assert two.choices[0].message.content == reference.chat(messages, SamplingParams(max_tokens=16))[0].text
    messages += [{"role": "assistant", "content": two.choices[0].message.content},
                 {"role": "user", "content": TURNS[2]}]
    chunks = list(client.chat.completions.create(model="target", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert two.usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    same = [client.completions.create(model="target", prompt="The same prompt, twice.", max_tokens=4,
                                      temperature=0) for _ in range(2)]
    assert same[1].usage.prompt_tokens_details.cached_tokens == same[1].usage.prompt_tokens - 1
    assert same[0].choices[0].text == same[1].choices[0].text

    text = httpx.get(server["url"] + "/metrics").text
    for name in ("blockspec_prefix_cache_hit_tokens_total ", "blockspec_prefix_cache_miss_tokens_total ",
                 "blockspec_prefix_cache_hit_rate ", "blockspec_prefix_cache_evictions_total ",
                 "blockspec_prefix_cache_bytes ", "blockspec_prefix_cache_entries "):
        assert name in text, name
    assert "# TYPE blockspec_prefix_cache_hit_tokens_total counter" in text
    assert ('blockspec_engine_info{device="cpu",quantization="q4_1",cpu_activations="int8",'
            'draft_quantization="q8_0",speculative_accept="match"} 1') in text
    hits = counter(server, "blockspec_prefix_cache_hit_tokens_total")
    assert hits >= two.usage.prompt_tokens_details.cached_tokens + usage.prompt_tokens_details.cached_tokens
    assert 0 < counter(server, "blockspec_prefix_cache_hit_rate") < 1
    assert counter(server, "blockspec_prefix_cache_bytes") > 0


def test_the_flags_turn_it_off(folders):
    from blockspec.cli import build_parser
    from blockspec.config import EngineConfig

    for flag in ("--disable-prefix-caching", "--disable-radix-cache"):
        args = build_parser().parse_args(["serve", flag])
        assert EngineConfig.from_args(args, device="cpu").prefix_caching is False
    assert EngineConfig.from_args(build_parser().parse_args(["serve"]), device="cpu").prefix_caching
    llm = make_llm(folders, prefix_caching=False)
    outs = [llm.generate("Twice over.", SamplingParams(max_tokens=4))[0] for _ in range(2)]
    assert [o.cached_tokens for o in outs] == [0, 0] and not llm.runner.prefix_cache.entries


def test_bench_serving_measures_the_cache(folders, tmp_path):
    import json

    from blockspec.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"Question {i}: what is {i} plus {i}?", "Why?"]}) + "\n"
                            for i in range(3)))
    common = ["--dataset", str(data), "--num-prompts", "3", "--max-new-tokens", "6", "--model-path",
              folders["target"], "--draft-model-path", folders["draft"], "--device", "cpu", "--quantization",
              "q4_1", "--prefill-tokens-per-step", "16", "--no-adaptive-speculation"]
    out = tmp_path / "multi.json"
    assert main(["bench-serving", "--multi-turn", "--json", str(out), *common]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "multi-turn" and report["num_conversations"] == 3
    assert report["outputs_match"] == 1.0 and report["turn2_tau_cached"] >= 1
    for row in report["per_conversation"]:
        assert 0 < row["cached_tokens"] < row["turn2_prompt_tokens"] and row["outputs_match"]
    out = tmp_path / "shared.json"
    assert main(["bench-serving", "--shared-prefix", "40", "--concurrency", "1,2", "--json", str(out),
                 *common]) == 0
    report = json.loads(out.read_text())
    assert report["shared_prompt_tokens"] >= 40 and len(report["rows"]) == 4
    for row in report["rows"]:
        assert (row["hit_rate"] > 0) == row["prefix_caching"] and row["outputs_match"] == 1.0
    assert main(["bench-serving", "--multi-turn", "--shared-prefix", "8", *common]) == 2


SOAK_SECONDS = float(os.environ.get("BLOCKSPEC_PREFIX_SOAK_SECONDS", "10"))
SOAK_BUDGET = 240  # KV tokens for entries and running requests together: the cache is always under pressure
STEMS = ["Shared stem one: " + "abcdefgh" * 5, "Another shared stem, two: " + "xyz" * 9, "Third " + "q" * 30]


def soak_prompts() -> list[str]:
    """Prompts that share stems (cut at several points, own tails), and a few unique ones."""
    prompts = [stem[:cut] + tail for stem in STEMS for cut in (12, len(stem)) for tail in ("!", " and more?")]
    return prompts + [f"Unique prompt {i}: " + "mn"[i % 2] * (3 + 4 * i) for i in range(4)]


def soak_client(url: str, seed: int, deadline: float, want: dict, results: dict) -> None:
    import random

    rng = random.Random(seed)
    prompts = soak_prompts()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
        while time.time() < deadline:
            i, kind = rng.randrange(len(prompts)), rng.random()
            body = {"prompt": prompts[i], "max_tokens": 10 + i % 7, "temperature": 0}
            if kind < 0.3:
                body.update(temperature=0.8, seed=i)
            if kind < 0.8:
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                out = r.json()
                key = (i, body["temperature"])
                results["done"].append((out["choices"][0]["text"], want[key]))
                results["cached"] += out["usage"]["prompt_tokens_details"]["cached_tokens"]
            else:  # a stream the client drops after a few events: the request is aborted
                with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                  "max_tokens": 60}) as r:
                    for n, _ in enumerate(r.iter_lines()):
                        if n >= rng.randint(1, 3):
                            break
                results["aborted"] += 1


def test_soak_under_cache_pressure(folders, reference):
    """Clients mix hits (shared stems, repeats) and misses, greedy and sampled, and drop streams, against
    a KV budget that keeps evicting: every answer is the request's answer alone, and at the end no slot,
    row or entry is held beyond the budget."""
    from concurrent.futures import ThreadPoolExecutor

    from blockspec.server.app import create_app
    from tests.test_server_soak import rss_mb

    prompts = soak_prompts()
    want = {}
    for i, prompt in enumerate(prompts):
        for temperature in (0.0, 0.8):
            params = SamplingParams(max_tokens=10 + i % 7, temperature=temperature, seed=i)
            want[i, temperature] = reference.generate(prompt, params)[0].text
    app = create_app(make_llm(folders, max_num_seqs=4, max_total_tokens=SOAK_BUDGET), api_key=KEY)
    srv, thread, url = start(app)
    results = {"done": [], "aborted": 0, "cached": 0}
    try:
        warm = time.time() + min(5.0, SOAK_SECONDS / 3)
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(soak_client, url, s, time.time() + SOAK_SECONDS, want, results)
                       for s in range(6)]
            time.sleep(max(0.0, warm - time.time()))
            after_warm_up = rss_mb()
            for f in futures:
                f.result()
        engine = app.state.engine
        deadline = time.time() + 10
        while engine.num_requests and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        health = httpx.get(url + "/health").json()
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    assert all(got == expected for got, expected in results["done"]) and results["aborted"]
    assert health["num_running_requests"] == health["num_waiting_requests"] == health["kv_tokens_used"] == 0
    assert health["kv_slots_free"] == health["kv_slots_total"]
    runner = app.state.llm.runner
    cache = runner.prefix_cache
    assert runner.pool.num_free + len(cache.entries) == runner.pool.num_slots
    assert cache.tokens <= SOAK_BUDGET and all(e.ready == len(e.tokens) for e in cache.entries.values())
    assert results["cached"] > 0 and cache.evictions > 0 and health["prefix_cache_hit_tokens_total"] > 0
    assert rss_mb() - after_warm_up < 100, (after_warm_up, rss_mb())
    print(f"soak {SOAK_SECONDS:.0f} s: {len(results['done'])} answered, {results['aborted']} aborted, "
          f"hit rate {cache.hit_rate:.2f}, {cache.evictions} evictions, {len(cache.entries)} entries "
          f"({cache.tokens} tokens) left, RSS {after_warm_up:.0f} -> {rss_mb():.0f} MB")


def test_hits_on_the_gpu_stand_in(folders):
    """The cache's copies, swaps and fed-back features keep to the device (tests/fake_gpu.py); dense fp32
    weights there, as on a GPU."""
    from tests.fake_gpu import FAKE_GPU, fake_gpu

    params = SamplingParams(max_tokens=20, temperature=0.9, seed=5)
    cpu = make_llm(folders, quantization="none", prefix_caching=False)
    want = [o.token_ids for o in chat_turns(cpu, params)]
    with fake_gpu():
        gpu = make_llm(folders, device=FAKE_GPU, quantization="none")
        got = chat_turns(gpu, params)
        again = chat_turns(gpu, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in again] == want
    assert got[1].cached_tokens > got[0].num_prompt_tokens and again[0].cached_tokens > 0
