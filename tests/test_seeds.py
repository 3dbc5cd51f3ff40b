"""Keyed draws: a seeded request gives the same tokens whatever the schedule, sampled DFlash equals sampled
plain decoding token for token, sampling is finite for every accepted temperature, and a fault in one
request fails it alone."""

from __future__ import annotations

import pytest
import torch

import blockspec.speculative.accept as accept_module
from blockspec.engine.sampler import draw, filtered_probs, uniform
from blockspec.engine.sequence import Sequence
from blockspec.models.config import ModelConfig
from blockspec.models.loader import load_draft, load_target
from blockspec.sampling_params import SamplingParams
from tests.tiny import ScriptedGovernor, TinyEngine, write_tiny_draft, write_tiny_target

PROMPTS = [[5, 6, 7, 8] * 4, [3, 41, 17, 88, 2], [9, 9, 1]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seeds")
    write_tiny_target(folder / "target", "llama")
    cfg = ModelConfig.from_folder(folder / "target")
    write_tiny_draft(folder / "draft", cfg, block_size=8)
    target = load_target(folder / "target", torch.float32, torch.device("cpu"))
    draft = load_draft(folder / "draft", cfg, torch.float32, torch.device("cpu"))
    return TinyEngine(target, draft, 8, num_slots=4, max_len=128)


def run(engine, prompts, params, use_draft=True, size=8, script=None, lookup=(0, 0), merge="auto", tree=0):
    spec = engine.speculation
    engine.set_block_size(size)
    engine.dflash.governor = None if script is None else ScriptedGovernor(script)
    spec.lookup_ngram, spec.lookup_width = lookup
    spec.merge, spec.tree_budget = merge, tree
    try:
        seqs = engine.run([Sequence(p, params[i], frozenset()) for i, p in enumerate(prompts)], use_draft)
    finally:
        engine.dflash.governor, spec.lookup_ngram, spec.merge, spec.tree_budget = None, 0, "auto", 0
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.5, 0, 0.5)])
def test_a_seed_gives_the_same_tokens_whatever_the_schedule(engine, temperature, top_k, top_p):
    params = [SamplingParams(max_tokens=30, temperature=temperature, top_k=top_k, top_p=top_p, seed=s)
              for s in (7, 8, 9)]
    plain = run(engine, PROMPTS, params, use_draft=False)
    schedules = [dict(), dict(size=2), dict(size=4, script=[True, False, False]),
                 dict(script=[False, True]), dict(lookup=(1, 6)), dict(size=2, lookup=(2, 5), script=[True]),
                 dict(lookup=(1, 6), merge="always"), dict(size=4, lookup=(1, 5), merge="always", tree=8),
                 dict(size=2, lookup=(2, 5), tree=4, script=[True, False, True])]
    for schedule in schedules:
        assert run(engine, PROMPTS, params, **schedule) == plain, schedule
    alone = [run(engine, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]  # no batch neighbours
    assert alone == plain
    other = run(engine, PROMPTS, [SamplingParams(max_tokens=30, temperature=temperature, seed=s)
                                  for s in (1, 2, 3)], use_draft=False)
    assert other != plain  # the seed matters


def test_the_keyed_uniforms_look_independent():
    u = torch.tensor([[uniform(seed, pos) for pos in range(4)] for seed in range(4000)], dtype=torch.float64)
    assert (u >= 0).all() and (u < 1).all()
    assert abs(float(u.mean()) - 0.5) < 0.01
    corr = torch.corrcoef(u.T)
    assert (corr - torch.eye(4)).abs().max() < 0.05


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324, 1e-6, 1.0, 1e6])
def test_every_accepted_temperature_samples_a_finite_distribution(temperature):
    logits = torch.tensor([[3.0, 2.0, -1e30, 0.5], [1.0, 1.0, 1.0, 1.0]])
    for top_k, top_p in ((0, 1.0), (2, 0.5), (0, 1e-300)):
        probs = filtered_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
        tokens = draw(probs, seed=3, first_position=10)
        assert all(probs[i, t] > 0 for i, t in enumerate(tokens))
    if temperature < 1e-30:  # the limit is greedy
        assert filtered_probs(logits, SamplingParams(temperature=temperature))[0].tolist() == [1, 0, 0, 0]


def test_a_fault_in_one_request_fails_it_alone(engine, monkeypatch):
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.8, seed=1),
              SamplingParams(max_tokens=20, temperature=0.9, seed=2)]
    want = run(engine, PROMPTS, params)
    real = accept_module.sampled_accept

    def poisoned(drafts, logits, params, seed, position):
        if seed == 2 and position > 8:
            return real(drafts, logits * float("nan"), params, seed, position)
        return real(drafts, logits, params, seed, position)

    monkeypatch.setattr(accept_module, "sampled_accept", poisoned)
    engine.set_block_size(8)
    seqs = engine.run([Sequence(p, params[i], frozenset()) for i, p in enumerate(PROMPTS)], True)
    assert [s.output_ids for s in seqs[:2]] == want[:2]
    assert seqs[2].finish_reason == "error" and "not finite" in seqs[2].error
    assert engine.runner.pool.num_free == engine.runner.pool.num_slots
