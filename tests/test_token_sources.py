"""Where each token came from: recorded by the engine where tokens are committed, sent by the server only
to requests that ask (`return_token_sources`), and the live view (`GET /stats`). Tiny random target and
draft; greedy, so every figure is compared exactly with the engine's own."""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path

import httpx
import pytest

from blockspec.llm import LLM
from blockspec.models.config import ModelConfig
from blockspec.sampling_params import SamplingParams
from tests.live_server import start_server
from tests.tiny import ScriptedGovernor, write_tiny_draft, write_tiny_target, write_tiny_tokenizer

PROMPTS = ["Once upon a time", "abcabcabcabc", "the the the the", "Hello there, friend!"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    target = write_tiny_tokenizer(write_tiny_target(root / "target", "llama"))
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target), block_size=4)
    return {"target": target, "draft": draft}


def make_llm(folders, **settings) -> LLM:
    settings = {"adaptive_speculation": False, **settings}
    return LLM(model_path=str(folders["target"]), draft_model_path=str(folders["draft"]), device="cpu",
               max_num_seqs=4, **settings)


def steps_of(sources: list[tuple[str, int]]) -> list[list[str]]:
    """The sources of each step's tokens, step by step (steps must run 0, 1, 2, ... without a gap)."""
    groups = [(step, [source for source, _ in group]) for step, group in groupby(sources, key=lambda x: x[1])]
    assert [step for step, _ in groups] == list(range(len(groups)))
    return [group for _, group in groups]


def test_draft_only_sources_follow_the_accept_lengths(folders):
    llm = make_llm(folders, prompt_lookup_ngram=0)
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=40)):
        steps = steps_of(out.token_sources)
        assert len(out.token_sources) == len(out.token_ids) and steps[0] == ["target"]
        assert len(steps) - 1 == len(out.accept_lengths)  # one DFlash verify step each
        for i, (group, committed) in enumerate(zip(steps[1:], out.accept_lengths)):
            last = i == len(steps) - 2
            assert len(group) == committed or (last and len(group) < committed)  # the last may be cut
            if not last or len(group) == committed:
                assert group == ["draft"] * (committed - 1) + ["target"]


def test_lookup_and_plain_steps_are_told_apart(folders):
    llm = make_llm(folders, prompt_lookup_ngram=2)
    llm.decoders["DFLASH"].governor = ScriptedGovernor([True, False, True, True, False])
    plain = make_llm(folders, speculative_algorithm="NONE")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48))
    for out, ref in zip(outs, plain.generate(PROMPTS, SamplingParams(max_tokens=48))):
        assert out.token_ids == ref.token_ids  # recording sources changes nothing
        steps = steps_of(out.token_sources)
        assert len(steps) - 1 == out.stats.num_steps
        for group in steps[:-1]:
            assert group[-1] == "target" and len(set(group[:-1])) <= 1  # one proposer per step
        lookup_steps = [g for g in steps[1:] if "lookup" in g]
        assert len(lookup_steps) <= len(out.stats.lookup_accept_lengths)
        assert sum(g.count("lookup") for g in steps) <= sum(n - 1 for n in out.stats.lookup_accept_lengths)
        assert ref.token_sources == [("target", i) for i in range(len(ref.token_ids))]
    assert any(source == "lookup" for out in outs for source, _ in out.token_sources)
    assert any(source == "draft" for out in outs for source, _ in out.token_sources)


# ---- the server -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(folders):
    with start_server(make_llm(folders)) as srv:
        yield srv


@pytest.fixture(scope="module")
def ref(folders) -> LLM:
    return make_llm(folders)


def sse(response: httpx.Response) -> list[dict]:
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def post(server, route: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{server['url']}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


CHAT = {"messages": [{"role": "user", "content": "abcabcabc abcabc"}], "max_tokens": 30, "temperature": 0}


def test_stream_carries_each_tokens_source_only_when_asked(server, ref):
    want = ref.chat(CHAT["messages"], SamplingParams(max_tokens=30))[0]
    asked = sse(post(server, "chat/completions", {**CHAT, "stream": True, "return_token_sources": True,
                                                  "stream_options": {"include_usage": True}}))
    plain = sse(post(server, "chat/completions", {**CHAT, "stream": True,
                                                  "stream_options": {"include_usage": True}}))
    pieces, text = [], ""
    for chunk in asked:
        for c in chunk["choices"]:
            delta = c["delta"].get("content", "")
            got = c.get("token_sources")
            if delta:
                assert got and "".join(p["text"] for p in got) == delta  # a chunk's pieces are its text
            pieces += got or []
            text += delta
    assert text == want.text
    assert [(p["source"], p["step"]) for p in pieces] == want.token_sources
    assert len(pieces) == asked[-1]["usage"]["completion_tokens"] == len(want.token_ids)
    # Without the field: the same text, and no chunk has a key it did not have before this feature.
    assert "".join(c["delta"].get("content", "") for ch in plain for c in ch["choices"]) == want.text
    for chunk in plain:
        assert set(chunk) <= {"id", "object", "created", "model", "choices", "blockspec", "usage"}
        for c in chunk["choices"]:
            assert set(c) == {"index", "delta", "logprobs", "finish_reason"}
    assert "token_sources" not in json.dumps(plain)


def test_non_streaming_and_completions(server, ref):
    body = post(server, "chat/completions", {**CHAT, "return_token_sources": True}).json()
    message, sources = body["choices"][0]["message"], body["choices"][0]["token_sources"]
    assert "".join(p["text"] for p in sources) == message["content"]
    assert len(sources) == body["usage"]["completion_tokens"]
    assert "token_sources" not in post(server, "chat/completions", CHAT).json()["choices"][0]
    comp = post(server, "completions", {"prompt": "the the the", "max_tokens": 20, "temperature": 0,
                                        "return_token_sources": True}).json()["choices"][0]
    want = ref.generate("the the the", SamplingParams(max_tokens=20))[0]
    assert [(p["source"], p["step"]) for p in comp["token_sources"]] == want.token_sources
    assert "".join(p["text"] for p in comp["token_sources"]) == comp["text"] == want.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_pieces_like_the_text(server, ref, stream):
    full = ref.generate("Once upon a time", SamplingParams(max_tokens=30))[0].text
    stop = full[7:10]  # ends the text early, mid-token perhaps
    body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "stop": [stop],
            "stream": stream}
    base = post(server, "completions", body)
    asked = post(server, "completions", {**body, "return_token_sources": True})
    if stream:
        want = "".join(c["text"] for ch in sse(base) for c in ch["choices"])
        chunks = [c for ch in sse(asked) for c in ch["choices"]]
        text = "".join(c["text"] for c in chunks)
        pieces = [p for c in chunks for p in c.get("token_sources", [])]
        for c in chunks:
            assert "".join(p["text"] for p in c.get("token_sources", [])) == c["text"]
    else:
        want = base.json()["choices"][0]["text"]
        text = asked.json()["choices"][0]["text"]
        pieces = asked.json()["choices"][0]["token_sources"]
    assert text == want == full[: full.index(stop)]
    assert "".join(p["text"] for p in pieces) == text


def test_bad_field_is_a_400_that_names_it(server):
    r = httpx.post(f"{server['url']}/v1/chat/completions", json={**CHAT, "return_token_sources": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_sources"


def test_live_view_counts_tokens_and_steps(server):
    before = httpx.get(f"{server['url']}/stats").json()
    body = post(server, "chat/completions", CHAT).json()
    after = httpx.get(f"{server['url']}/stats").json()
    assert after["time"] > before["time"] and after["speculative_algorithm"] == "DFLASH"
    made = sum(after["tokens_total"].values()) - sum(before["tokens_total"].values())
    assert made == body["usage"]["completion_tokens"]
    steps = sum(after["steps_total"].values()) - sum(before["steps_total"].values())
    ext = body["blockspec"]
    assert steps == (ext["num_verify_steps"] + ext["num_lookup_steps"] + ext["num_merged_steps"]
                     + ext["num_plain_steps"])
    rows = after["verify_rows_total"] - before["verify_rows_total"]
    assert rows == ext["num_verify_steps"]
    assert after["verify_tokens_total"] - before["verify_tokens_total"] == sum(ext["accept_lengths"])
    assert after["plan"]["kind"] in ("dflash", "lookup", "mixed", "merged", "plain")
    assert after["running_requests"] == 0 and after["kv_tokens_budget"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_sources_with_n_logprobs_and_a_stop_string(server, ref, stream):
    """Every choice of n carries its own pieces beside its logprobs; a stop string keeps a piece (with no
    text past the stop) for every token the output keeps, so there is one per completion token."""
    full = ref.generate("Once upon a time", SamplingParams(max_tokens=30))[0]
    stop = full.text[7:10]
    want = ref.generate("Once upon a time", SamplingParams(max_tokens=30, stop=[stop]))[0]
    body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "stop": [stop], "n": 2,
            "logprobs": 1, "return_token_sources": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    r = post(server, "completions", body)
    texts, pieces, logprobs = ["", ""], [[], []], [[], []]
    if stream:
        chunks = sse(r)
        usage = chunks[-1]["usage"]
        for c in (c for ch in chunks for c in ch["choices"]):
            assert "".join(p["text"] for p in c.get("token_sources", [])) == c["text"]
            texts[c["index"]] += c["text"]
            pieces[c["index"]] += c.get("token_sources", [])
            logprobs[c["index"]] += (c["logprobs"] or {}).get("tokens", [])
    else:
        usage = r.json()["usage"]
        for c in r.json()["choices"]:
            texts[c["index"]], pieces[c["index"]] = c["text"], c["token_sources"]
            logprobs[c["index"]] = c["logprobs"]["tokens"]
    for i in range(2):
        assert texts[i] == want.text == full.text[: full.text.index(stop)]
        assert "".join(p["text"] for p in pieces[i]) == texts[i]
        assert [(p["source"], p["step"]) for p in pieces[i]] == want.token_sources
        assert len(pieces[i]) == len(logprobs[i]) == len(want.token_ids)
    assert usage["completion_tokens"] == 2 * len(want.token_ids)
