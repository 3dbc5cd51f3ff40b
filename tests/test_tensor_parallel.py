"""Tensor parallelism on the CPU: gloo, 2 ranks. The vocabulary-parallel head's choices equal a full argmax
(ties included), a sharded target decodes as the whole one does, DFlash stays lossless, ranks whose clocks
disagree still decide alike, the server answers at TP=2 and fails fast when a rank dies; the errors."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.multiprocessing as mp

from blockspec import LLM, SamplingParams
from blockspec.config import EngineConfig
from blockspec.distributed import TPGroup, best_rank_choice, free_address, join, leave
from blockspec.errors import BlockspecError, ModelLoadError
from blockspec.layers.embedding import Embedding, LMHead
from blockspec.layers.int8_head import Int8ArgmaxHead
from blockspec.layers.linear import Linear
from blockspec.layers.quant import quant_type
from blockspec.models.config import ModelConfig
from blockspec.models.parallel import check_tp, head_split
from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

PROMPTS = [[3, 10, 20, 30, 40], [3, 50, 51, 52], [7, 8, 9]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for family in ("llama", "qwen3"):
        target = write_tiny_tokenizer(write_tiny_target(root / family, family))
        out[family] = target
        out[f"{family}-draft"] = write_tiny_draft(root / f"{family}-draft", ModelConfig.from_folder(target),
                                                  block_size=8)
    return out


# ---- the vocabulary-parallel head on two gloo ranks ----------------------------------------------------
def _heads_on_two_ranks(rank: int, address: str) -> None:
    torch.set_num_threads(1)
    group = join(2, torch.device("cpu"), "gloo", rank, address)
    try:
        _check_heads(group, rank)
    finally:
        leave()


@torch.inference_mode()
def _check_heads(group: TPGroup, rank: int) -> None:
    for vocab in (97, 96):  # 97: the last rank's shard is padded
        # Small integers: every logit is exact in fp32, so equal rows tie exactly.
        g = torch.Generator().manual_seed(vocab)
        weight = torch.randint(-3, 4, (vocab, 16), generator=g).float()
        weight[60] = weight[10]  # a tie across the shards
        weight[49] = weight[48]  # a tie on the shard boundary (97: 0..48 | 49..96)
        weight[47] = weight[48]
        weight[7] = weight[5]  # a tie inside a shard
        h = torch.randint(-3, 4, (64, 16), generator=g).float()
        h[:4] = weight[[10, 48, 5, 60]]  # rows whose best logits are those ties
        full = h @ weight.t()
        embed = Embedding(vocab, 16)
        embed.shard_vocab(group)
        head = LMHead(16, vocab, embed)
        head.shard_vocab(group)
        start, stop = embed.vocab_range
        embed.load("embed_tokens.weight", weight[start:stop])
        assert torch.equal(head.greedy(h), full.argmax(dim=-1))
        assert torch.equal(head.propose(h), full.argmax(dim=-1))
        head.int8 = Int8ArgmaxHead(head.weight)  # the CPU's exact int8 greedy form, on each shard
        assert torch.equal(head.greedy(h), full.argmax(dim=-1))
        head.int8 = None  # (its proposal scores are approximate: the exact ties below need fp32's)
        assert torch.equal(head.logits(h), full)
        logprobs, top = head.ranked(h, 3)  # a tree's top-k: each rank's k best and log-sum-exp, gathered
        want = full.log_softmax(dim=-1).topk(3, dim=-1).values
        assert torch.allclose(logprobs, want, atol=1e-5)
        assert torch.equal(full.gather(-1, top), full.topk(3, dim=-1).values)  # tied ids in either order
        ids = torch.tensor([0, 5, 7, 10, 47, 48, 49, 60, 90])
        assert torch.equal(embed(ids), weight[ids])
        subset = torch.tensor([5, 7, 48, 49, 60]) if vocab == 97 else torch.tensor([1, 2, 3])  # rank 1: none
        assert torch.equal(head.propose(h, subset), subset[full[:, subset].argmax(dim=-1)])
        values = torch.tensor([1.0, 2.0, 2.0]) if rank == 0 else torch.tensor([1.0, 1.0, 2.0])
        ids = torch.tensor([3, 4, 5]) + 50 * rank
        assert best_rank_choice(group, values, ids).tolist() == [3, 4, 5]  # ties: the lowest rank
    for sent in ([("step", 1)], list(range(3000))):  # within one broadcast, and past its head
        assert group.broadcast_object(sent if rank == 0 else None) == sent


def test_best_rank_choice_equals_a_full_argmax_with_ties():
    mp.start_processes(_heads_on_two_ranks, args=(free_address(),), nprocs=2, start_method="spawn")


# ---- a sharded engine decodes as the whole one does --------------------------------------------------
def _outputs(llm, params, algorithm=None):
    return [o.token_ids for o in llm.generate(PROMPTS, params, speculative_algorithm=algorithm)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_equals_tp1_and_dflash_stays_lossless(tiny, family):
    settings = dict(model_path=str(tiny[family]), draft_model_path=str(tiny[f"{family}-draft"]),
                    device="cpu", adaptive_speculation=False, prompt_lookup_ngram=0, max_model_len=128,
                    max_total_tokens=48,  # a KV budget the three requests outgrow: preemption too
                    speculative_tree_budget=6)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    one = LLM(**settings)
    want, want_sampled = _outputs(one, greedy, "NONE"), _outputs(one, sampled, "NONE")
    two = LLM(tp_size=2, **settings)
    try:
        assert two.target.layers[0].self_attn.qkv_proj.parallel == "column"
        scheduler = two.scheduler("NONE")
        for prompt in PROMPTS:
            scheduler.add(two.sequence(prompt, greedy))
        while scheduler.has_work:
            scheduler.step()
        assert scheduler.num_preemptions > 0
        assert _outputs(two, greedy, "NONE") == want
        assert _outputs(two, sampled, "NONE") == want_sampled
        two.set_tree_budget(0)  # chains first (the slabs were sized for the tree below)
        for block_size in (2, 4, 8):
            two.set_block_size(block_size)
            assert _outputs(two, greedy) == want
            if block_size == 4:  # sampled: "sample, then match", whatever the block size (test_seeds.py)
                assert _outputs(two, sampled) == want_sampled
        two.set_tree_budget(6)  # trees from each rank's top-k, gathered (at block size 8)
        assert _outputs(two, greedy) == want and _outputs(two, sampled) == want_sampled
    finally:
        two.close()


def _launched_rank(rank: int, address: str, settings: dict) -> None:
    """One rank as torchrun starts it. Rank 1 idles 0.3 s after its governor plans a plain step, outside its
    own timing, so rank 0, waiting for it inside its first collective, measures plain steps 0.3 s slower:
    a governor learning from its own clock would then draft on rank 0 while rank 1 (whose random draft
    rarely pays) steps plainly, and the ranks' passes would no longer match."""
    host, port = address.removeprefix("tcp://").split(":")
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR=host, MASTER_PORT=port)
    if rank == 1:
        from blockspec.speculative.decoder import Decoder

        plan = Decoder.plan

        def late_plan(self, seqs):
            chosen = plan(self, seqs)
            if chosen.kind == "plain" and self.governor is not None:
                time.sleep(0.3)
            return chosen

        Decoder.plan = late_plan
    llm = LLM(tp_size=2, **settings)  # rank 1 serves rank 0 in here, then exits
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = _outputs(llm, params, "NONE")
    assert _outputs(llm, params) == plain
    llm.close()


def test_ranks_with_different_clocks_decide_alike(tiny):
    settings = dict(model_path=str(tiny["llama"]), draft_model_path=str(tiny["llama-draft"]), device="cpu",
                    prompt_lookup_ngram=0, max_model_len=128)  # adaptive speculation on: the governor
    mp.start_processes(_launched_rank, args=(free_address(), settings), nprocs=2, start_method="spawn")


def test_a_step_that_fails_on_rank_0_stops_the_engine_instead_of_hanging(tiny, monkeypatch):
    import blockspec.speculative.decoder as decoder
    from blockspec.engine.mirror import EngineStopped

    two = LLM(tp_size=2, model_path=str(tiny["llama"]), draft_model_path=str(tiny["llama-draft"]),
              device="cpu", max_model_len=128)
    try:
        plan, calls = decoder.choose_plan, []

        def failing(*args):  # rank 0 only: rank 1 runs its own copy of the code, in its own process
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("planning failed")
            return plan(*args)

        monkeypatch.setattr(decoder, "choose_plan", failing)
        with pytest.raises(RuntimeError, match="planning failed"):
            two.generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True))
        monkeypatch.setattr(decoder, "choose_plan", plan)
        start = time.perf_counter()
        with pytest.raises(EngineStopped, match="planning failed.*Build a new LLM"):
            two.generate([PROMPTS[1]], SamplingParams(max_tokens=4))
        assert time.perf_counter() - start < 5
    finally:
        two.close()
    assert not any(p.is_alive() for p in two._processes)


# ---- the embedded SmolLM2: GGUF blocks split by KV groups (3 over 2 ranks) ------------------------------
def test_smollm2_tp2_equals_tp1(smollm2_dir):
    """The test prompts of test_smollm2.py, batched (the ranks step both rows together)."""
    params = SamplingParams(max_tokens=16)
    one = LLM(max_num_seqs=2, max_model_len=512, speculative_algorithm="NONE")
    question = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci "
                                            "number."}]
    prompts = [one.tokenizer.apply_chat_template(question, add_generation_prompt=True),
               "def quicksort(items):"]
    want = [o.token_ids for o in one.generate(prompts, params)]
    del one
    two = LLM(tp_size=2, max_num_seqs=2, max_model_len=512)  # the shipped draft, its draft vocabulary
    try:
        assert [two.target.layers[0].self_attn.heads, two.runner.target_cache.k.shape[2]] in ([3, 1], [6, 2])
        for algorithm in ("NONE", "DFLASH"):
            assert [o.token_ids for o in two.generate(prompts, params, algorithm)] == want, algorithm
    finally:
        two.close()


# ---- the server at TP=2 -----------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def test_server_at_tp2_answers_and_fails_fast_when_a_rank_dies(tiny):
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_server import free_port

    port = free_port()
    folder, draft = str(tiny["llama"]), str(tiny["llama-draft"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "blockspec", "serve", "--port", str(port),
                             "--tp-size", "2", "--model-path", folder, "--draft-model-path", draft,
                             "--device", "cpu"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, proc.stdout.read()
        ref = LLM(model_path=folder, speculative_algorithm="NONE", device="cpu")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                               timeout=60)
        model = client.models.list().data[0].id
        prompts = ["abc", "Hello there", "x = 1", "zzz"]

        def complete(prompt: str) -> str:
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, prompts))
        want = [o.text for o in ref.generate(prompts, SamplingParams(max_tokens=12))]
        assert texts == want

        # Kill rank 1 mid-stream: the stream ends with an error within seconds, and the server exits.
        body = {"model": model, "prompt": "abc", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            (rank1,) = _children(proc.pid)
            os.kill(rank1, signal.SIGKILL)
            killed = time.time()
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.time() - killed < 10
        assert any("error" in json.loads(line[6:]) for line in rest if line != "data: [DONE]"), rest[-3:]
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


# ---- errors ----------------------------------------------------------------------------------------
def test_tp_errors_name_the_values_and_the_fix(tiny, monkeypatch):
    cfg = ModelConfig.from_folder(tiny["llama"])  # 4 heads, 2 KV heads, intermediate 96, vocab 97
    with pytest.raises(BlockspecError, match=r"num_key_value_heads=2.*--tp-size"):
        check_tp(cfg, 3)
    with pytest.raises(BlockspecError, match="intermediate_size=97"):
        check_tp(dataclasses.replace(cfg, intermediate_size=97), 2)
    with pytest.raises(BlockspecError, match="nccl needs CUDA"):
        EngineConfig(device="cpu", tp_size=2, tp_backend="nccl")
    with pytest.raises(BlockspecError, match="tp_size=0"):
        EngineConfig(device="cpu", tp_size=0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    from blockspec.distributed import check_devices

    with pytest.raises(BlockspecError, match="needs 2 CUDA devices.*1 are visible"):
        check_devices(2, torch.device("cuda"))
    group = TPGroup(1, 2, torch.device("cpu"))
    down = Linear(96, 64)
    down.shard_rows(group, 48, 48)
    with pytest.raises(ModelLoadError, match=r"32-weight block boundaries.*\[48, 96\)"):
        down.use_blocks(quant_type("q4_1"))
    with pytest.raises(ModelLoadError, match=r"block boundaries.*\[0, 48\)"):  # every rank fails; none hangs
        LLM(model_path=str(tiny["llama"]), speculative_algorithm="NONE", device="cpu", quantization="q4_1",
            tp_size=2)
    assert head_split(9, 3, 0, 2) == (0, 3, 0, 1) and head_split(9, 3, 1, 2) == (3, 6, 1, 2)
    assert head_split(8, 2, 3, 4) == (6, 2, 1, 1)  # KV heads replicated: ranks 2 and 3 share KV head 1
