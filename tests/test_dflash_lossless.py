"""Lossless DFlash: greedy output == plain greedy output, sampled output has the target distribution."""

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.config import ModelConfig
from blockspec.engine.engine import run_to_completion
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.models.loader import load_draft, load_target
from blockspec.sampling_params import SamplingParams
from tests.tiny import write_tiny_draft, write_tiny_target

BLOCK_SIZES = (2, 4, 8, 16)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_target(folder / "target", request.param)
    cfg = ModelConfig.from_folder(folder / "target")
    write_tiny_draft(folder / "draft", cfg, block_size=16)
    target = load_target(folder / "target", torch.float32, CPU)
    runners = {}
    for size in BLOCK_SIZES:
        draft = load_draft(folder / "draft", cfg, torch.float32, CPU, cli_block_size=size)
        runners[size] = ModelRunner(target, draft, size, draft.config.mask_token_id, num_slots=4, max_len=160)
    return runners


def generate(runner, prompts, params, stops, use_draft):
    seqs = [Sequence(p, params, frozenset(stops)) for p in prompts]
    run_to_completion(runner, seqs, use_draft)
    return seqs


prompt_st = st.lists(st.integers(0, 96), min_size=1, max_size=60)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(prompt_st, min_size=1, max_size=5),
    size=st.sampled_from(BLOCK_SIZES),
    max_tokens=st.integers(1, 60),
    stops=st.lists(st.integers(0, 96), max_size=3),
)
def test_greedy_dflash_equals_plain(models, prompts, size, max_tokens, stops):
    runner = models[size]
    params = SamplingParams(max_tokens=max_tokens)
    plain = generate(runner, prompts, params, stops, use_draft=False)
    spec = generate(runner, prompts, params, stops, use_draft=True)
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert s.finish_reason == p.finish_reason
        assert all(1 <= a <= size for a in s.accept_lengths)
    assert runner.pool.num_free == runner.pool.num_slots  # every slot came back


@pytest.mark.parametrize("size", BLOCK_SIZES)
def test_mask_token_as_real_output_survives(models, size):
    """The mask id is an ordinary token in the output: nothing is filtered by value."""
    runner = models[size]
    plain = generate(runner, [[1, 2, 3]], SamplingParams(max_tokens=40), [], use_draft=False)[0]
    runner.mask_token_id = plain.output_ids[3]
    try:
        spec = generate(runner, [[1, 2, 3]], SamplingParams(max_tokens=40), [], use_draft=True)[0]
    finally:
        runner.mask_token_id = 5
    assert spec.output_ids == plain.output_ids


@pytest.mark.parametrize("size", BLOCK_SIZES)
def test_oracle_draft_is_fully_accepted(models, size):
    """A draft that proposes the target's own greedy continuation gives tau == B on every full step:
    this checks acceptance and commit bookkeeping, not just losslessness."""
    runner = models[size]
    prompt, params = [7, 8, 9, 10], SamplingParams(max_tokens=50)
    reference = generate(runner, [prompt], params, [], use_draft=False)[0].output_ids

    def oracle(seqs, block, batch):
        rows = []
        for seq in seqs:
            done = len(seq.output_ids)
            future = reference[done : done + size - 1]
            rows.append(future + [0] * (size - 1 - len(future)))
        return torch.tensor(rows)

    runner.draft_tokens = oracle
    try:
        seq = generate(runner, [prompt], params, [], use_draft=True)[0]
    finally:
        del runner.draft_tokens
    assert seq.output_ids == reference
    full_steps = (params.max_tokens - 1) // size
    assert seq.accept_lengths[:full_steps] == [size] * full_steps


def first_tokens(runner, params, use_draft, n_samples, n_tokens=3):
    seqs = [Sequence([4, 9, 16], SamplingParams(**params, seed=i), frozenset()) for i in range(n_samples)]
    run_to_completion(runner, seqs, use_draft)
    return Counter(tuple(s.output_ids[:n_tokens]) for s in seqs)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=8, top_p=0.9)],
)
def test_sampled_dflash_has_target_distribution(models, params):
    """Total variation between DFlash and plain sampling of the first 3 tokens stays within what two
    independent samples of the same distribution show (a 2% bias in any token would exceed it)."""
    runner = models[4]
    common = dict(params, max_tokens=3)
    n = 1500
    plain = first_tokens(runner, common, False, n)
    spec = first_tokens(runner, common, True, n)
    # compare the marginals of each of the first 3 positions and the joint of the first 2
    for key in (lambda t: t[0], lambda t: t[1], lambda t: t[2], lambda t: t[:2]):
        a, b = Counter(), Counter()
        for seq, count in plain.items():
            a[key(seq)] += count
        for seq, count in spec.items():
            b[key(seq)] += count
        tv = 0.5 * sum(abs(a[k] - b[k]) for k in set(a) | set(b)) / n
        support = len(set(a) | set(b))
        assert tv < 0.04 + 0.6 * (support / n) ** 0.5, (tv, support)
