"""Adaptive speculation: the governor's choices, and the plain steps it takes keeping the draft fed."""

from __future__ import annotations

import pytest
import torch

from blockspec.engine.sequence import Sequence
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.governor import SpecGovernor
from blockspec.speculative.plan import DraftShape, Speculation, StepPlan
from tests.test_scheduler import engine  # noqa: F401  (the tiny target + draft engine fixture)


def seqs(n: int) -> list[Sequence]:
    return [Sequence([1, 2], SamplingParams(max_tokens=64), frozenset()) for _ in range(n)]


def spec_step(gov: SpecGovernor, batch: list[Sequence], accepts: list[int], seconds: float,
              block_size: int = 4) -> None:
    for seq, a in zip(batch, accepts):
        seq.stats.accept_lengths.append(a)
    gov.record(StepPlan.dflash(len(batch), DraftShape(block_size)), batch, seconds)


def plain_step(gov: SpecGovernor, batch: list[Sequence], seconds: float) -> None:
    gov.record(StepPlan.plain(len(batch), capture=True), batch, seconds)


def test_measures_both_kinds_then_picks_the_faster_and_probes():
    gov, batch = SpecGovernor(window=1, tau_alpha=1.0, probe_spec_every=3, probe_plain_every=4), seqs(2)
    assert gov.speculate(batch, DraftShape(4))  # nothing measured: try DFlash
    spec_step(gov, batch, [1, 1], seconds=0.15)  # tau 1 at 1.5x a plain step's cost
    assert not gov.speculate(batch, DraftShape(4))  # the plain cost is unknown: try it
    plain_step(gov, batch, 0.10)
    assert not gov.speculate(batch, DraftShape(4))  # 1 token per 0.15 s < 1 per 0.10 s
    plain_step(gov, batch, 0.10)
    plain_step(gov, batch, 0.10)
    assert gov.speculate(batch, DraftShape(4))  # 3 plain steps in a row: probe DFlash once
    spec_step(gov, batch, [3, 4], seconds=0.15)  # tau 3.5: 3.5 tokens per 0.15 s beats 1 per 0.10 s
    assert gov.speculate(batch, DraftShape(4))
    for _ in range(3):
        spec_step(gov, batch, [3, 4], seconds=0.15)
    assert not gov.speculate(batch, DraftShape(4))  # 4 DFlash steps in a row: re-measure the plain cost once
    plain_step(gov, batch, 0.10)
    assert gov.speculate(batch, DraftShape(4))


def test_costs_are_per_block_and_batch_size_and_new_requests_start_from_the_average():
    gov, batch = SpecGovernor(window=1, tau_alpha=1.0), seqs(1)
    spec_step(gov, batch, [1], seconds=0.2)
    plain_step(gov, batch, 0.1)
    assert not gov.speculate(batch, DraftShape(4))
    assert gov.speculate(seqs(2), DraftShape(4))  # batch size 2 never measured
    assert gov.speculate(batch, DraftShape(2))  # block size 2 never measured
    newcomer = seqs(1)
    assert not newcomer[0].tau_estimates and not gov.speculate(newcomer, DraftShape(4))  # prior: tau 1 so far


def test_one_stalled_step_does_not_move_a_cost():
    gov, batch = SpecGovernor(tau_alpha=1.0, window=5), seqs(1)
    for _ in range(3):
        spec_step(gov, batch, [2], seconds=0.25)  # 2 tokens per 0.25 s
        plain_step(gov, batch, 0.10)  # 1 token per 0.10 s: faster
    plain_step(gov, batch, 3.0)  # the machine stalled once
    assert gov.seconds((1, 1)) == pytest.approx(0.10)
    assert not gov.speculate(batch, DraftShape(4))


def test_a_first_unlucky_block_moves_a_request_from_the_prior_not_to_its_sample():
    gov = SpecGovernor(tau_alpha=0.1)
    veteran, newcomer = seqs(1), seqs(1)
    for _ in range(30):
        spec_step(gov, veteran, [3], seconds=0.12)
    plain_step(gov, veteran, 0.10)
    spec_step(gov, newcomer, [1], seconds=0.12)  # accepts only the bonus on its first block
    prior = gov.expected_tau(veteran[0], DraftShape(4))
    assert newcomer[0].tau_estimates[DraftShape(4)] == pytest.approx(prior * 0.9 + 0.1, abs=0.05)
    assert gov.speculate(newcomer, DraftShape(4))  # ~2.8 tokens per 0.12 s still beats 1 per 0.10 s


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(tau_alpha=1.5), dict(tau_alpha=0.0),
                                    dict(probe_spec_every=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="SpecGovernor"):
        SpecGovernor(**kwargs)


def test_plain_steps_feed_the_draft_what_a_prefill_would(engine):
    """Plain steps keep their features; once the backlog is injected (in one pass, before the next
    DFlash step) the draft's context K/V equals what prefilling the longer prompt writes."""
    runner, decoder = engine.runner, engine.dflash
    prompt = [5, 9, 2, 7, 3, 8]
    a = Sequence(prompt, SamplingParams(max_tokens=8), frozenset())
    runner.admit(a)
    runner.first_tokens([a], runner.prefill([a], [prompt], capture=True))
    for _ in range(3):
        decoder.run([a], StepPlan.plain(1, capture=True))
    assert len(a.unfed_features) == 3
    decoder.draft.catch_up([a])
    assert a.unfed_features == []
    b = Sequence(prompt + a.output_ids[:3], SamplingParams(max_tokens=8), frozenset())
    runner.admit(b)
    runner.prefill([b], [b.prompt_ids], capture=True)
    n = len(prompt) + 3
    for cache in (runner.draft_cache.k, runner.draft_cache.v):
        torch.testing.assert_close(cache[:, a.slot, :, :n], cache[:, b.slot, :, :n])
    assert a.stats.plain_steps == 3 and a.stats.accept_lengths == []  # plain steps are not verify steps
    runner.release(a)
    runner.release(b)


def test_backlogs_of_different_lengths_are_fed_and_capped(engine, monkeypatch):
    runner, decoder = engine.runner, engine.dflash
    monkeypatch.setattr("blockspec.speculative.decoder.MAX_UNFED", 4)
    plain = StepPlan.plain
    a, b = (Sequence([5, 9, 2, 7], SamplingParams(max_tokens=16), frozenset()) for _ in range(2))
    for seq in (a, b):
        runner.admit(seq)
    runner.first_tokens([a, b], runner.prefill([a, b], [a.prompt_ids, b.prompt_ids], capture=True))
    decoder.run([a], plain(1, capture=True))
    for _ in range(2):
        decoder.run([a, b], plain(2, capture=True))
    assert (len(a.unfed_features), len(b.unfed_features)) == (3, 2)
    decoder.run([a, b], plain(2, capture=True))  # a reaches the cap: the whole batch is fed
    assert a.unfed_features == [] and b.unfed_features == []
    ref = Sequence(a.prompt_ids + a.output_ids[:4], SamplingParams(max_tokens=8), frozenset())
    runner.admit(ref)
    runner.prefill([ref], [ref.prompt_ids], capture=True)
    n = len(ref.prompt_ids)
    torch.testing.assert_close(runner.draft_cache.k[:, a.slot, :, :n],
                               runner.draft_cache.k[:, ref.slot, :, :n])
    decoder.run([b], plain(1, capture=True))
    runner.release(b)  # finished or preempted: the backlog goes with the slot
    assert b.unfed_features == []
    for seq in (a, ref):
        runner.release(seq)


def test_governed_generation_mixes_steps_and_matches_plain(engine):
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_tokens=60)
    plain = engine.run([Sequence(prompt, params, frozenset())], use_draft=False)[0]
    engine.dflash.governor = SpecGovernor(probe_spec_every=2, probe_plain_every=2)
    try:
        governed = engine.run([Sequence(prompt, params, frozenset())], use_draft=True)[0]
    finally:
        engine.dflash.governor = None
    assert governed.output_ids == plain.output_ids
    assert governed.stats.plain_steps > 0 and governed.stats.accept_lengths


def test_mixed_lookup_steps_are_weighed_against_dflash_steps():
    """Only some rows copying: a wider step pays off when the copied rows' lookup tau outweighs its cost."""
    gov, batch = SpecGovernor(window=1, tau_alpha=1.0), seqs(2)
    assert gov.mix(batch, [True, False], DraftShape(2), 4)  # nothing measured yet: try the wide step
    spec_step(gov, batch, [2, 2], 0.10, block_size=2)  # DFlash at B=2: 4 tokens per 0.10 s
    batch[0].stats.lookup_accept_lengths.append(4)
    batch[1].stats.accept_lengths.append(2)
    mixed = StepPlan.lookup([[7, 7, 7], []], Speculation(2, 0, lookup_ngram=2, lookup_width=4))
    assert mixed.kind == "mixed" and mixed.width == 4
    gov.record(mixed, batch, 0.11)  # 4 + 2 tokens per 0.11 s
    assert gov.mix(batch, [True, False], DraftShape(2), 4)
    gov.record(mixed, batch, 0.20)  # the wide step got slow: 6 per 0.20 s < 4 per 0.10 s
    assert not gov.mix(batch, [True, False], DraftShape(2), 4)


def test_all_row_lookup_steps_are_kept_only_while_they_beat_plain_steps():
    gov, batch = SpecGovernor(window=1, tau_alpha=1.0, probe_spec_every=3), seqs(1)
    assert gov.lookup_pays(batch, 4)  # nothing measured yet: try it
    lookup = StepPlan.lookup([[7, 7, 7]], Speculation(2, 0, lookup_ngram=2, lookup_width=4))
    batch[0].stats.lookup_accept_lengths.append(2)
    gov.record(lookup, batch, 0.25)  # 2 tokens per 0.25 s
    plain_step(gov, batch, 0.10)  # 1 per 0.10 s: faster
    assert not gov.lookup_pays(batch, 4)
    plain_step(gov, batch, 0.10)
    plain_step(gov, batch, 0.10)
    assert gov.lookup_pays(batch, 4)  # 3 plain steps in a row: probe the copies again
    batch[0].stats.lookup_accept_lengths.append(4)
    gov.record(lookup, batch, 0.25)  # the text turned repetitive: 4 per 0.25 s (lookup tau moves to 4)
    assert gov.lookup_pays(batch, 4)


def merged_step(gov: SpecGovernor, batch: list[Sequence], committed: int, alone: tuple[int, int],
                seconds: float) -> None:
    batch[0].stats.merged_accept_lengths.append(committed)
    spec = Speculation(2, 0, lookup_ngram=2, lookup_width=4)
    gov.record(StepPlan.merged([[7, 7, 7]], spec, DraftShape(2)), batch, seconds, {0: alone})


def test_merged_steps_are_weighed_against_the_copies_alone_and_teach_all_three_taus():
    gov, batch, chain = SpecGovernor(window=1, tau_alpha=1.0, probe_plain_every=3), seqs(1), DraftShape(2)
    assert gov.merge(batch, [True], chain, 4)  # nothing measured: try it
    merged_step(gov, batch, 3, (2, 1), 0.12)  # the draft alone would have kept 2, the copy alone 1
    assert gov.expected_tau(batch[0], chain) == 2 and gov._lookup_tau == 1
    assert gov.expected_tau(batch[0], ("merged", chain)) == 3
    assert not gov.merge(batch, [True], chain, 4)  # the copies alone not measured yet: them next
    lookup = StepPlan.lookup([[7, 7, 7]], Speculation(2, 0, lookup_ngram=2, lookup_width=4))
    batch[0].stats.lookup_accept_lengths.append(1)
    gov.record(lookup, batch, 0.10)
    assert gov.merge(batch, [True], chain, 4)  # 3 per 0.12 s beats 1 per 0.10 s
    merged_step(gov, batch, 3, (2, 1), 0.12)
    merged_step(gov, batch, 3, (2, 1), 0.12)
    assert gov.merge(batch, [True], chain, 4)
    merged_step(gov, batch, 3, (2, 1), 0.12)
    assert not gov.merge(batch, [True], chain, 4)  # 3 merged steps in a row: the others' turn once
    batch[0].stats.lookup_accept_lengths.append(1)
    gov.record(lookup, batch, 0.10)
    merged_step(gov, batch, 3, (2, 1), 0.40)  # merged steps got slow: 3 per 0.40 s < 1 per 0.10 s
    assert not gov.merge(batch, [True], chain, 4)
    for _ in range(3):
        plain_step(gov, batch, 0.10)
    assert gov.merge(batch, [True], chain, 4)  # not taken for 3 steps: probed again


def test_choose_plan_merges_as_the_settings_say():
    from blockspec.speculative.plan import choose_plan
    from tests.tiny import ScriptedGovernor

    batch, copies = seqs(2), [[7, 7, 7], []]
    spec = Speculation(2, 0, lookup_ngram=2, lookup_width=4, merge="always")
    plan = choose_plan(batch, copies, spec, None)
    assert plan.kind == "merged" and plan.sources == ("merged", "draft") and plan.width == 5
    assert plan.trees and plan.drafts and spec.step_width == 5
    spec.merge = "auto"
    assert choose_plan(batch, copies, spec, None).kind == "mixed"  # no governor: copies alone
    assert choose_plan(batch, copies, spec, ScriptedGovernor([True])).kind == "merged"
    spec.merge = "never"
    assert choose_plan(batch, copies, spec, ScriptedGovernor([True])).kind == "mixed"
    assert spec.step_width == 4
