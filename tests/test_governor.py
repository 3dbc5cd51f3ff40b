"""Adaptive speculation: the governor's choices, and the plain steps it takes keeping the draft fed."""

from __future__ import annotations

import pytest
import torch

from blockspec.engine.engine import run_to_completion
from blockspec.engine.sequence import Sequence
from blockspec.sampling_params import SamplingParams
from blockspec.spec.governor import SpecGovernor
from tests.test_scheduler import runner  # noqa: F401  (the tiny target + draft runner fixture)


def seqs(n: int) -> list[Sequence]:
    return [Sequence([1, 2], SamplingParams(max_tokens=64), frozenset()) for _ in range(n)]


def spec_step(gov: SpecGovernor, batch: list[Sequence], accepts: list[int], seconds: float, block_size: int = 4) -> None:
    for seq, a in zip(batch, accepts):
        seq.accept_lengths.append(a)
    gov.record(batch, block_size, True, seconds)


def test_measures_both_kinds_then_picks_the_faster_and_probes():
    gov, batch = SpecGovernor(alpha=1.0, tau_alpha=1.0, probe_spec_every=3, probe_plain_every=4), seqs(2)
    assert gov.speculate(batch, 4)  # nothing measured: try DFlash
    spec_step(gov, batch, [1, 1], seconds=0.15)  # tau 1 at 1.5x a plain step's cost
    assert not gov.speculate(batch, 4)  # the plain cost is unknown: try it
    gov.record(batch, 4, False, 0.10)
    assert not gov.speculate(batch, 4)  # 1 token per 0.15 s < 1 per 0.10 s
    gov.record(batch, 4, False, 0.10)
    gov.record(batch, 4, False, 0.10)
    assert gov.speculate(batch, 4)  # 3 plain steps in a row: probe DFlash once
    spec_step(gov, batch, [3, 4], seconds=0.15)  # tau 3.5: 3.5 tokens per 0.15 s beats 1 per 0.10 s
    assert gov.speculate(batch, 4)
    for _ in range(3):
        spec_step(gov, batch, [3, 4], seconds=0.15)
    assert not gov.speculate(batch, 4)  # 4 DFlash steps in a row: re-measure the plain cost once
    gov.record(batch, 4, False, 0.10)
    assert gov.speculate(batch, 4)


def test_costs_are_per_block_and_batch_size_and_new_requests_start_from_the_average():
    gov, batch = SpecGovernor(alpha=1.0, tau_alpha=1.0), seqs(1)
    spec_step(gov, batch, [1], seconds=0.2)
    gov.record(batch, 4, False, 0.1)
    assert not gov.speculate(batch, 4)
    assert gov.speculate(seqs(2), 4)  # batch size 2 never measured
    assert gov.speculate(batch, 2)  # block size 2 never measured
    newcomer = seqs(1)
    assert newcomer[0].tau_estimate is None and not gov.speculate(newcomer, 4)  # prior: tau 1 so far


def test_a_first_unlucky_block_moves_a_request_from_the_prior_not_to_its_sample():
    gov = SpecGovernor(tau_alpha=0.1)
    veteran, newcomer = seqs(1), seqs(1)
    for _ in range(30):
        spec_step(gov, veteran, [3], seconds=0.12)
    gov.record(veteran, 4, False, 0.10)
    spec_step(gov, newcomer, [1], seconds=0.12)  # accepts only the bonus on its first block
    assert newcomer[0].tau_estimate == pytest.approx(gov.expected_tau(veteran[0], 4) * 0.9 + 0.1, abs=0.05)
    assert gov.speculate(newcomer, 4)  # ~2.8 tokens per 0.12 s still beats 1 per 0.10 s


@pytest.mark.parametrize("kwargs", [dict(alpha=0.0), dict(alpha=1.5), dict(tau_alpha=0.0), dict(probe_spec_every=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="SpecGovernor"):
        SpecGovernor(**kwargs)


def test_plain_steps_feed_the_draft_what_a_prefill_would(runner):
    """Plain steps keep their features; once the backlog is injected (in one pass, before the next
    DFlash step) the draft's context K/V equals what prefilling the longer prompt writes."""
    prompt = [5, 9, 2, 7, 3, 8]
    a = Sequence(prompt, SamplingParams(max_tokens=8), frozenset())
    runner.admit(a)
    runner.sample_first([a], runner.prefill_batch([a], [prompt], use_draft=True))
    for _ in range(3):
        runner.decode_step([a], feed_draft=True)
    assert len(a.unfed_features) == 3
    runner.feed_draft_backlog([a])
    assert a.unfed_features == []
    b = Sequence(prompt + a.output_ids[:3], SamplingParams(max_tokens=8), frozenset())
    runner.admit(b)
    runner.prefill_batch([b], [b.prompt_ids], use_draft=True)
    n = len(prompt) + 3
    for cache in (runner.draft_cache.k, runner.draft_cache.v):
        torch.testing.assert_close(cache[:, a.slot, :, :n], cache[:, b.slot, :, :n])
    assert a.plain_steps == 3 and a.accept_lengths == []  # plain steps are not verify steps
    runner.release(a)
    runner.release(b)


def test_backlogs_of_different_lengths_are_fed_and_capped(runner, monkeypatch):
    monkeypatch.setattr(runner, "MAX_UNFED", 4)
    a, b = (Sequence([5, 9, 2, 7], SamplingParams(max_tokens=16), frozenset()) for _ in range(2))
    for seq in (a, b):
        runner.admit(seq)
    runner.sample_first([a, b], runner.prefill_batch([a, b], [a.prompt_ids, b.prompt_ids], use_draft=True))
    runner.decode_step([a], feed_draft=True)
    for _ in range(2):
        runner.decode_step([a, b], feed_draft=True)
    assert (len(a.unfed_features), len(b.unfed_features)) == (3, 2)
    runner.decode_step([a, b], feed_draft=True)  # a reaches the cap: the whole batch is fed
    assert a.unfed_features == [] and b.unfed_features == []
    ref = Sequence(a.prompt_ids + a.output_ids[:4], SamplingParams(max_tokens=8), frozenset())
    runner.admit(ref)
    runner.prefill_batch([ref], [ref.prompt_ids], use_draft=True)
    n = len(ref.prompt_ids)
    torch.testing.assert_close(runner.draft_cache.k[:, a.slot, :, :n], runner.draft_cache.k[:, ref.slot, :, :n])
    runner.decode_step([b], feed_draft=True)
    runner.release(b)  # finished or preempted: the backlog goes with the slot
    assert b.unfed_features == []
    for seq in (a, ref):
        runner.release(seq)


def test_governed_generation_mixes_steps_and_matches_plain(runner):
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_tokens=60)
    plain = Sequence(prompt, params, frozenset())
    run_to_completion(runner, [plain], use_draft=False)
    runner.governor = SpecGovernor(probe_spec_every=2, probe_plain_every=2)
    try:
        governed = Sequence(prompt, params, frozenset())
        run_to_completion(runner, [governed], use_draft=True)
    finally:
        runner.governor = None
    assert governed.output_ids == plain.output_ids
    assert governed.plain_steps > 0 and governed.accept_lengths


def test_mixed_lookup_steps_are_weighed_against_dflash_steps():
    """Only some rows copying: a wider step pays off when the copied rows' lookup tau outweighs its cost."""
    gov, batch = SpecGovernor(alpha=1.0, tau_alpha=1.0), seqs(2)
    assert gov.mix(batch, [True, False], 2, 4)  # nothing measured yet: try the wide step
    spec_step(gov, batch, [2, 2], 0.10, block_size=2)  # DFlash at B=2: 4 tokens per 0.10 s
    batch[0].lookup_accept_lengths.append(4)
    batch[1].accept_lengths.append(2)
    gov.record_lookup(batch, [True, False], 2, 4, 0.11)  # 4 + 2 tokens per 0.11 s
    assert gov.mix(batch, [True, False], 2, 4)
    gov.record_lookup(batch, [True, False], 2, 4, 0.20)  # the wide step got slow: 6 per 0.20 s < 4 per 0.10 s
    assert not gov.mix(batch, [True, False], 2, 4)
