"""Lossless DFlash: greedy output == plain greedy output, sampled output has the target distribution.

BLOCKSPEC_TEST_DEVICE=cuda runs the engine-level checks on a GPU (fp32; the int8 head is CPU-only);
BLOCKSPEC_TEST_DEVICE=fake on the CPU stand-in that enforces CUDA's device rules (tests/fake_gpu.py)."""

import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.engine.sampler import filtered_probs
from blockspec.engine.sequence import Sequence
from blockspec.layers.int8_head import Int8ArgmaxHead
from blockspec.models.config import ModelConfig
from blockspec.models.dflash2 import dflash2_from
from blockspec.models.dflash2_config import Dflash2Config
from blockspec.models.loader import load_draft, load_target
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.proposal import Proposal
from blockspec.train.features import causal_batch
from tests.tiny import (ScriptedGovernor, TinyEngine, examples, tiny_target_with_draft,
                        write_tiny_draft, write_tiny_target)

BLOCK_SIZES = (2, 4, 8, 16)
DRAFT_VOCAB = torch.cat([torch.arange(0, 12), torch.arange(12, 97, 3)])  # the tiny target has 97 ids
DEVICE_NAME = os.environ.get("BLOCKSPEC_TEST_DEVICE", "cpu")
if DEVICE_NAME == "fake":
    from tests.fake_gpu import FAKE_GPU as DEVICE, fake_gpu

    @pytest.fixture(autouse=True, scope="module")
    def _on_the_stand_in():
        with fake_gpu():
            yield
else:
    DEVICE = torch.device(DEVICE_NAME)


# A target holding its weights as Q4_1 blocks (CPU only): the block kernel in every pass.
FAMILIES = ["llama", "qwen3"] + (["llama-q4_1"] if DEVICE.type == "cpu" else [])


@pytest.fixture(scope="module", params=FAMILIES)
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    target, cfg, draft_folder = tiny_target_with_draft(folder, request.param, DEVICE, draft_block_size=16)
    engines = {}
    for size in BLOCK_SIZES:
        draft = load_draft(draft_folder, cfg, torch.float32, DEVICE, cli_block_size=size)
        engines[size] = TinyEngine(target, draft, size, num_slots=4, max_len=160)
    return engines


def generate(engine, prompts, params, stops, use_draft):
    return engine.run([Sequence(p, params, frozenset(stops)) for p in prompts], use_draft)


def use_int8_head(engine, on: bool) -> None:
    head = engine.runner.target.lm_head
    head.int8 = Int8ArgmaxHead(head.weight) if on and head.quant is None else None


prompt_st = st.lists(st.integers(0, 96), min_size=1, max_size=60)


@settings(max_examples=examples(10), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(prompt_st, min_size=1, max_size=5),
    size=st.sampled_from(BLOCK_SIZES),
    max_tokens=st.integers(1, 60),
    stops=st.lists(st.integers(0, 96), max_size=3),
    int8_head=st.booleans(),
    draft_vocab=st.booleans(),
    script=st.one_of(st.none(), st.lists(st.booleans(), min_size=1, max_size=12)),
    lookup=st.tuples(st.sampled_from([0, 1, 2, 3]), st.sampled_from([2, 4, 7])),
    merge=st.sampled_from(["auto", "always", "never"]),
)
def test_greedy_dflash_equals_plain(models, prompts, size, max_tokens, stops, int8_head, draft_vocab, script,
                                    lookup, merge):
    engine = models[size]
    # adaptive speculation's mix of DFlash and plain steps (which leave the draft a backlog to catch up on)
    engine.dflash.governor = None if script is None else ScriptedGovernor(script)
    # prompt-lookup steps (min n-gram, width) in between, which leave the draft a backlog too
    engine.speculation.lookup_ngram, engine.speculation.lookup_width = lookup
    engine.speculation.merge = merge  # copies merged into the draft's chain as one tree (auto: by script)
    engine.set_block_size(size)  # the engines share one target: lay its weights out for this block size
    # both LM-head paths on any CPU: plain fp32, and the int8 one (CPU only)
    use_int8_head(engine, int8_head and DEVICE.type == "cpu")
    draft = engine.runner.draft
    draft.vocab = DRAFT_VOCAB.to(DEVICE) if draft_vocab else None  # proposals from a subset of the tokens
    params = SamplingParams(max_tokens=max_tokens)
    plain = generate(engine, prompts, params, stops, use_draft=False)
    spec = generate(engine, prompts, params, stops, use_draft=True)
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert s.finish_reason == p.finish_reason
        assert all(1 <= a <= size for a in s.stats.accept_lengths)
        assert all(1 <= a <= engine.speculation.lookup_width for a in s.stats.lookup_accept_lengths)
        assert len(s.output_ids) <= sum(s.stats.accept_lengths) + sum(s.stats.lookup_accept_lengths) + \
            sum(s.stats.merged_accept_lengths) + s.stats.plain_steps + 1
    assert engine.runner.pool.num_free == engine.runner.pool.num_slots  # every slot came back
    draft.vocab, engine.dflash.governor, engine.speculation.lookup_ngram = None, None, 0
    engine.speculation.merge = "auto"


@pytest.mark.parametrize("int8_head", [False, True])
def test_draft_vocab_bounds_the_proposals(models, int8_head):
    if int8_head and DEVICE.type != "cpu":
        pytest.skip("the int8 head is CPU-only")
    engine = models[4]
    engine.set_block_size(4)
    use_int8_head(engine, int8_head)
    proposer = engine.dflash.draft
    proposed, propose = [], proposer.propose
    proposer.propose = lambda *a: proposed.append(propose(*a)) or proposed[-1]
    engine.runner.draft.vocab = DRAFT_VOCAB.to(DEVICE)
    try:
        plain = generate(engine, [[1, 2, 3]], SamplingParams(max_tokens=40), [], use_draft=False)[0]
        spec = generate(engine, [[1, 2, 3]], SamplingParams(max_tokens=40), [], use_draft=True)[0]
    finally:
        engine.runner.draft.vocab = None
        del proposer.propose
    assert spec.output_ids == plain.output_ids
    assert torch.isin(torch.cat([p.tokens for p in proposed]).flatten().cpu(), DRAFT_VOCAB).all()


@pytest.mark.parametrize("size", BLOCK_SIZES)
def test_mask_token_as_real_output_survives(models, size):
    """The mask id is an ordinary token in the output: nothing is filtered by value."""
    engine = models[size]
    plain = generate(engine, [[1, 2, 3]], SamplingParams(max_tokens=40), [], use_draft=False)[0]
    engine.dflash.draft.mask_token_id = engine.speculation.mask_token_id = plain.output_ids[3]
    try:
        spec = generate(engine, [[1, 2, 3]], SamplingParams(max_tokens=40), [], use_draft=True)[0]
    finally:
        engine.dflash.draft.mask_token_id = engine.speculation.mask_token_id = 5
    assert spec.output_ids == plain.output_ids


@pytest.mark.parametrize("size", BLOCK_SIZES)
def test_oracle_draft_is_fully_accepted(models, size):
    """A draft that proposes the target's own greedy continuation gives tau == B on every full step:
    this checks acceptance and commit bookkeeping, not just losslessness."""
    engine = models[size]
    prompt, params = [7, 8, 9, 10], SamplingParams(max_tokens=50)
    reference = generate(engine, [prompt], params, [], use_draft=False)[0].output_ids

    def oracle(seqs, block_size, rule="match"):
        rows = []
        for seq in seqs:
            done = len(seq.output_ids)
            future = reference[done : done + block_size - 1]
            rows.append(future + [0] * (block_size - 1 - len(future)))
        return Proposal(torch.tensor(rows, device=DEVICE))

    engine.dflash.draft.propose = oracle
    try:
        seq = generate(engine, [prompt], params, [], use_draft=True)[0]
    finally:
        del engine.dflash.draft.propose
    assert seq.output_ids == reference
    full_steps = (params.max_tokens - 1) // size
    assert seq.stats.accept_lengths[:full_steps] == [size] * full_steps


@torch.inference_mode()
def exact_next(target, prefixes: list[list[int]], params) -> torch.Tensor:
    """The target's filtered next-token distribution after each prefix (all of one length)."""
    hidden, _ = target(causal_batch(torch.tensor(prefixes, device=target.device)))
    return filtered_probs(target.logits(hidden[:, -1]), params).cpu()


def max_z(counts: Counter, probs: dict, n: int, min_expected: float = 20.0) -> float:
    """Largest standardised deviation of observed counts from the exact probabilities, over the cells
    expected to hold >= min_expected samples: below that a count is far from normal (one extra sample in a
    cell expecting 0.2 is z = 2), and truly random samples exceed z = 5 in about half of the runs."""
    worst = 0.0
    for key, p in probs.items():
        if 0 < p < 1 and n * p >= min_expected:
            worst = max(worst, abs(counts[key] - n * p) / (n * p * (1 - p)) ** 0.5)
    unexpected = sum(c for k, c in counts.items() if probs.get(k, 0.0) == 0.0)
    assert unexpected == 0, "sampled a token the filtered target distribution excludes"
    return worst


def worst_deviation(folder, params, lookup_ngram: int = 0, quantization: str | None = None,
                    tree: tuple[int, int, str] = (0, 4, "best-first"), merge: str = "auto",
                    accept: str = "match", dflash2: bool = False) -> float:
    """Sample tokens 2 and 3 (drafted positions 1 and 2 of a block) 8000 times with DFlash and return
    the largest standardised deviation from the exact target distribution. With `lookup_ngram` the prompt
    holds every token id, so every token has a match and the steps verify prompt-lookup blocks (merge
    "always": each merged into the draft's candidates as one tree); `tree` (budget, top-k, rule): the
    steps verify candidate trees; `accept`: the sampled acceptance rule; `dflash2`: the draft as a DFlash2 one
    (identity convolutions, a random selector over its 8 best tokens per position)."""
    write_tiny_target(folder / "t", "llama", vocab_size=16, seed=3)
    cfg = ModelConfig.from_folder(folder / "t")
    write_tiny_draft(folder / "d", cfg, block_size=4, mask_token_id=15)
    target = load_target(folder / "t", torch.float32, DEVICE, quantization)
    draft = load_draft(folder / "d", cfg, torch.float32, DEVICE)
    if dflash2:
        selector = Dflash2Config(2, 16, 16, 8, cfg.vocab_size)
        draft = dflash2_from(draft, selector, torch.Generator().manual_seed(0), std=0.5)
    engine = TinyEngine(target, draft, 4, num_slots=64, max_len=32, lookup=(lookup_ngram, 4), tree=tree,
                        merge=merge, accept=accept)
    prompt = [(7 * i + 3) % 16 for i in range(16)] if lookup_ngram else [3, 1]
    sp, n = SamplingParams(max_tokens=3, **params), 8000
    seqs = [Sequence(prompt, SamplingParams(max_tokens=3, seed=i, **params), frozenset()) for i in range(n)]
    engine.run(seqs, use_draft=True)
    outputs = [tuple(s.output_ids) for s in seqs]
    if lookup_ngram:
        copies = "merged_accept_lengths" if merge == "always" else "lookup_accept_lengths"
        assert all(getattr(s.stats, copies) and not s.stats.accept_lengths for s in seqs)
    assert all(s.stats.tree_steps == (len(s.stats.accept_lengths) if tree[0] else 0) for s in seqs)

    first = exact_next(target, [prompt], sp)[0]
    t1_support = [t for t in range(16) if first[t] > 0]
    second = exact_next(target, [prompt + [t] for t in t1_support], sp)
    joint = {(t1, t2): float(first[t1] * second[i, t2])
             for i, t1 in enumerate(t1_support) for t2 in range(16)}
    worst = max_z(Counter(o[:2] for o in outputs), joint, n)
    top_prefixes = sorted(joint, key=joint.get, reverse=True)[:3]
    third = exact_next(target, [prompt + list(pre) for pre in top_prefixes], sp)
    for i, pre in enumerate(top_prefixes):
        continuations = Counter(o[2] for o in outputs if o[:2] == pre)
        m = sum(continuations.values())
        worst = max(worst, max_z(continuations, {t: float(third[i, t]) for t in range(16)}, m))
    return worst


@pytest.mark.parametrize(
    "params", [dict(temperature=1.0), dict(temperature=0.8, top_k=5),
               dict(temperature=1.2, top_k=10, top_p=0.7)]
)
def test_sampled_dflash_has_target_distribution(tmp_path, params):
    """Every cell within 5 standard deviations; a 2% absolute bias on a 10% cell is ~6 sd here."""
    assert worst_deviation(tmp_path, params) < 5.0


@pytest.mark.skipif(DEVICE.type != "cpu", reason="block-quantized weights run on the CPU")
def test_sampled_dflash_on_a_block_quantized_target_has_its_distribution(tmp_path):
    """Q8_0 blocks: the target distribution is the quantized model's own, and DFlash keeps it exactly."""
    assert worst_deviation(tmp_path, dict(temperature=0.9, top_k=6), quantization="q8_0") < 5.0


def test_sampled_prompt_lookup_has_target_distribution(tmp_path):
    """Prompt-lookup proposals are deterministic tokens like the draft's: the same acceptance keeps the
    target distribution."""
    assert worst_deviation(tmp_path, dict(temperature=1.0, top_k=8), lookup_ngram=1) < 5.0


def test_distribution_check_catches_a_biased_rule(tmp_path, monkeypatch):
    """Negative control: classic speculative sampling with a classic bug, resampling the bonus from p
    without removing the rejected draft token, over-produces that token and must fail the same check
    (its uniforms come from the same keyed stream as the real rule's draws)."""
    import blockspec.speculative.accept as accept_module
    from blockspec.engine.sampler import draw, uniform

    def biased(drafts, logits, params, seed, position):
        probs = filtered_probs(logits, params).cpu()
        for i, d in enumerate(drafts.tolist()):
            if uniform(seed ^ 0x5EED, position + i) >= probs[i, d]:
                return i, draw(probs[i : i + 1], seed, position + i)[0]
        n = drafts.shape[0]
        return n, draw(probs[n:], seed, position + n)[0]

    monkeypatch.setattr(accept_module, "sampled_accept", biased)
    assert worst_deviation(tmp_path, dict(temperature=1.0)) > 5.0


def test_prompt_lookup_steps_skip_the_draft(models):
    """A request whose context repeats takes prompt-lookup steps (no draft pass), accepts copies, and
    still matches plain decoding; the draft's backlog of their features is caught up before it drafts."""
    engine = models[4]
    engine.speculation.lookup_ngram, engine.speculation.lookup_width = 1, 6
    engine.set_block_size(4)
    proposer = engine.dflash.draft
    drafted, propose = [], proposer.propose
    proposer.propose = lambda *a: drafted.append(1) or propose(*a)
    try:
        prompt, params = [5, 6, 7, 8] * 6, SamplingParams(max_tokens=60)
        plain = generate(engine, [prompt], params, [], use_draft=False)[0]
        spec = generate(engine, [prompt], params, [], use_draft=True)[0]
    finally:
        del proposer.propose
        engine.speculation.lookup_ngram = 0
        engine.set_block_size(4)
    assert spec.output_ids == plain.output_ids
    stats = spec.stats
    steps = len(stats.accept_lengths) + len(stats.lookup_accept_lengths)
    assert stats.lookup_accept_lengths and len(drafted) == len(stats.accept_lengths) < steps


def test_a_batch_mixes_lookup_rows_and_drafted_rows_in_one_step(models):
    """When only some rows have a context match, one verify pass at the lookup width checks those rows'
    copies and the others' draft blocks (judged on their B-1 drafted tokens only); output still equals
    plain."""
    engine = models[2]
    engine.speculation.lookup_ngram, engine.speculation.lookup_width = 2, 5
    engine.set_block_size(2)
    decoder = engine.dflash
    kinds, run = [], decoder.run
    decoder.run = lambda seqs, plan: kinds.append(plan.kind) or run(seqs, plan)
    try:
        # a repeating context and one without repeats
        prompts = [[5, 6, 7, 8] * 6, [3, 41, 17, 88, 2, 60, 29]]
        params = SamplingParams(max_tokens=40)
        plain = generate(engine, prompts, params, [], use_draft=False)
        spec = generate(engine, prompts, params, [], use_draft=True)
    finally:
        del decoder.run
        engine.speculation.lookup_ngram = 0
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert "mixed" in kinds
    assert spec[0].stats.lookup_accept_lengths and spec[1].stats.accept_lengths
    assert all(1 <= a <= 2 for s in spec for a in s.stats.accept_lengths)
    assert all(1 <= a <= 5 for s in spec for a in s.stats.lookup_accept_lengths)
