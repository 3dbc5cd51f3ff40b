"""Continuous batching: many requests together (mixed params, chunked prefill, preemption, aborts)
produce exactly what each produces alone, and every KV slot and budget token comes back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence
from blockspec.errors import RequestError
from blockspec.models.config import ModelConfig
from blockspec.models.loader import load_draft, load_target
from blockspec.sampling_params import SamplingParams
from tests.tiny import (ScriptedGovernor, TinyEngine, examples, write_tiny_draft,
                        write_tiny_target)

CPU = torch.device("cpu")
MAX_LEN = 160


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> TinyEngine:
    folder = tmp_path_factory.mktemp("sched")
    write_tiny_target(folder / "target", "llama")
    cfg = ModelConfig.from_folder(folder / "target")
    write_tiny_draft(folder / "draft", cfg, block_size=4)
    target = load_target(folder / "target", torch.float32, CPU)
    draft = load_draft(folder / "draft", cfg, torch.float32, CPU)
    return TinyEngine(target, draft, 4, num_slots=4, max_len=MAX_LEN)


REQUESTS = [  # (prompt, params, stop ids): different lengths, limits, stops, greedy and sampled rows
    ([3, 1, 4, 1, 5], SamplingParams(max_tokens=40), []),
    (list(range(10, 70)), SamplingParams(max_tokens=25), [7]),
    ([9], SamplingParams(max_tokens=1), []),
    ([2, 7, 1, 8, 2, 8] * 5, SamplingParams(max_tokens=50, temperature=0.8, seed=11), []),
    ([42, 43], SamplingParams(max_tokens=33, temperature=1.0, top_k=5, seed=3), []),
    (list(range(90, 20, -1)), SamplingParams(max_tokens=30), [11, 12]),
    ([5, 5, 5], SamplingParams(max_tokens=45, top_p=0.9, temperature=0.6, seed=5), []),
]


def fresh(requests=REQUESTS) -> list[Sequence]:
    return [Sequence(list(p), SamplingParams(**vars(sp)), frozenset(stops)) for p, sp, stops in requests]


def alone(engine: TinyEngine, use_draft: bool, requests=REQUESTS) -> list[Sequence]:
    return [engine.run([seq], use_draft)[0] for seq in fresh(requests)]


def drive(scheduler: Scheduler, seqs: list[Sequence], stream: dict[int, list[int]] | None = None) -> None:
    """Run to completion, checking after every step that each request's output only ever grows
    (what a streaming client sees is never taken back or repeated)."""
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work:
        scheduler.step()  # the rows a step wrote (commits + scratch) were reserved within the budget
        assert sum(s.num_cached for s in scheduler.running) <= scheduler.max_total_tokens
        for seq in seqs:
            if stream is not None:
                seen = stream.setdefault(seq.seq_id, [])
                assert seq.output_ids[: len(seen)] == seen
                stream[seq.seq_id] = list(seq.output_ids)


def assert_same(got: list[Sequence], want: list[Sequence]) -> None:
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids, (g.prompt_ids[:5], g.params)
        assert g.finish_reason == w.finish_reason


def assert_all_free(scheduler: Scheduler) -> None:
    assert scheduler.runner.pool.num_free == scheduler.runner.pool.num_slots
    assert scheduler.tokens_in_use == 0 and not scheduler.running and not scheduler.waiting


@pytest.mark.parametrize("use_draft", [True, False])
def test_batched_equals_alone(engine, use_draft):
    want = alone(engine, use_draft)
    scheduler = engine.scheduler(use_draft)
    got = fresh()
    drive(scheduler, got)
    assert_same(got, want)
    assert scheduler.num_preemptions == 0
    assert_all_free(scheduler)
    if use_draft:
        assert all(1 <= a <= 4 for s in got for a in s.stats.accept_lengths)


@pytest.mark.parametrize("use_draft", [True, False])
def test_running_slots_stay_compact(engine, use_draft, monkeypatch):
    """When a request leaves, the ones above it move down (KV copied once), so every decode batch is a
    contiguous slot range in order and reads its K/V as a view; outputs are unchanged. (Prefill is not
    shared here: a request still prefilling beside decoding ones holds a slot among theirs, and those
    steps gather.)"""
    want = alone(engine, use_draft)
    batches, moves = [], []
    decoder = engine.dflash if use_draft else engine.plain
    step = decoder.decode
    monkeypatch.setattr(decoder, "decode", lambda seqs: (batches.append([s.slot for s in seqs]), step(seqs)))
    move = engine.runner.target_cache.move
    monkeypatch.setattr(engine.runner.target_cache, "move", lambda *a: (moves.append(a), move(*a)))
    got = fresh()
    drive(engine.scheduler(use_draft, prefill_decode_ratio=0), got)
    assert_same(got, want)
    assert moves and len(batches) > 10
    assert all(slots == list(range(slots[0], slots[0] + len(slots))) for slots in batches)


@pytest.mark.parametrize("use_draft", [True, False])
def test_tiny_budget_preempts_and_stays_lossless(engine, use_draft):
    want = alone(engine, use_draft)
    biggest = max(len(p) + sp.max_tokens - 1 for p, sp, _ in REQUESTS) + 4
    scheduler = engine.scheduler(use_draft, max_total_tokens=biggest + 20, prefill_tokens_per_step=24)
    got, stream = fresh(), {}
    drive(scheduler, got, stream)
    assert scheduler.num_preemptions > 0
    assert_same(got, want)
    assert_all_free(scheduler)


def test_long_prompt_is_prefilled_in_chunks_alongside_decode(engine):
    requests = [([4, 4], SamplingParams(max_tokens=30), []),
                (list(range(96, 0, -1)), SamplingParams(max_tokens=20), [])]
    want = alone(engine, True, requests)
    scheduler = engine.scheduler(True, prefill_tokens_per_step=10)
    got = fresh(requests)
    for seq in got:
        scheduler.add(seq)
    scheduler.step()  # the short prompt finishes prefill and decodes; the long one is 8 tokens in
    assert len(got[0].output_ids) > 1 and got[1].num_cached == 8 and not got[1].output_ids
    drive(scheduler, [])
    assert_same(got, want)
    assert_all_free(scheduler)


def test_prefill_shares_the_step_with_decoding_rows(engine):
    """A long prompt arriving while others decode advances by its fair share per step (ratio x the
    decoding rows at the prompt's start, at least MIN_PREFILL_CHUNK), and only by the full allowance when
    nothing decodes."""
    from blockspec.engine.prefill_chunks import MIN_PREFILL_CHUNK

    requests = [([4, 4], SamplingParams(max_tokens=40), []), ([5, 6], SamplingParams(max_tokens=40), []),
                (list(range(96, 0, -1)), SamplingParams(max_tokens=10), [])]
    want = alone(engine, True, requests)
    scheduler = engine.scheduler(True, prefill_tokens_per_step=512)
    got = fresh(requests)
    scheduler.add(got[0])
    scheduler.add(got[1])
    scheduler.step()
    scheduler.add(got[2])
    scheduler.step()
    share = max(MIN_PREFILL_CHUNK, int(2.0 * 2 * scheduler.width))
    assert got[2].num_cached == share < len(got[2].prompt_ids)
    drive(scheduler, [])
    assert_same(got, want)
    assert_all_free(scheduler)


def test_abort_frees_the_slot_at_once(engine):
    runner = engine.runner
    scheduler = engine.scheduler(True)
    seqs = fresh([([1, 2, 3], SamplingParams(max_tokens=100), [])] * 6)  # 4 slots: two wait
    for seq in seqs:
        scheduler.add(seq)
    scheduler.step()
    assert runner.pool.num_free == 0 and len(scheduler.waiting) == 2
    used = scheduler.tokens_in_use
    assert scheduler.abort(seqs[1].seq_id) is seqs[1]
    assert runner.pool.num_free == 1 and scheduler.tokens_in_use < used
    assert seqs[1].finish_reason == "abort"
    assert scheduler.abort(seqs[5].seq_id) is seqs[5]  # a waiting one
    assert len(scheduler.waiting) == 1 and scheduler.abort(seqs[5].seq_id) is None
    for seq in seqs:
        scheduler.abort(seq.seq_id)
    assert_all_free(scheduler)


def test_request_that_can_never_fit_is_refused(engine):
    scheduler = engine.scheduler(True, max_total_tokens=50)
    with pytest.raises(RequestError, match="KV tokens"):
        scheduler.add(Sequence(list(range(30)), SamplingParams(max_tokens=30), frozenset()))
    with pytest.raises(RequestError, match="max_total_tokens"):
        engine.scheduler(True, max_total_tokens=0)


def test_on_step_streams_every_token_once(engine):
    seqs, seen = fresh(), {}

    def on_step(ran: list[Sequence]) -> None:
        for seq in ran:
            seen.setdefault(seq.seq_id, []).append(len(seq.output_ids))

    engine.run(seqs, True, on_step=on_step, max_total_tokens=120)
    for seq in seqs:
        lengths = seen[seq.seq_id]
        assert lengths == sorted(lengths) and lengths[-1] == len(seq.output_ids)


@pytest.mark.parametrize("variant", [1, 2, 3], ids=["portable", "avx2", "avx512"])
def test_prefilled_in_chunks_of_4_beside_another_equals_alone(engine, variant):
    """Found by the random workloads below: a sampled request prefilled 4 tokens a step beside a greedy one
    drew other tokens from index 3 than alone, while a BLAS multiplied one-row steps (GEMVs) and 2-row
    steps in other orders; the dense kernel sums every row in one order, under each instruction set."""
    from blockspec.layers.dense import available_variants, dense_variant

    if variant not in available_variants():
        pytest.skip("this CPU lacks the variant")
    reqs = [([56, 34, 71, 35, 68, 87], SamplingParams(max_tokens=7, temperature=0.9, seed=0), []),
            ([0], SamplingParams(max_tokens=4, seed=1), [])]
    with dense_variant(variant):
        want = alone(engine, False, reqs)
        got = fresh(reqs)
        drive(engine.scheduler(False, max_total_tokens=13, prefill_tokens_per_step=4), got)
    assert_same(got, want)


prompt_st = st.lists(st.integers(0, 96), min_size=1, max_size=40)
request_st = st.tuples(prompt_st, st.integers(1, 40), st.booleans(),
                       st.lists(st.integers(0, 96), max_size=2))


@settings(max_examples=examples(20), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request_st, min_size=2, max_size=6), slack=st.integers(0, 60),
       chunk=st.integers(4, 64), use_draft=st.booleans())
def test_random_workloads_match_alone(engine, requests, slack, chunk, use_draft):
    reqs = [(p, SamplingParams(max_tokens=m, temperature=0.9 if sampled else 0.0, seed=i), stops)
            for i, (p, m, sampled, stops) in enumerate(requests)]
    want = alone(engine, use_draft, reqs)
    biggest = max(len(p) + sp.max_tokens - 1 for p, sp, _ in reqs) + (4 if use_draft else 1)
    scheduler = engine.scheduler(use_draft, max_total_tokens=biggest + slack, prefill_tokens_per_step=chunk)
    got = fresh(reqs)
    drive(scheduler, got, {})
    assert_same(got, want)
    assert_all_free(scheduler)


@settings(max_examples=examples(15), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(prompt_st, st.integers(1, 40)), min_size=2, max_size=6),
       slack=st.integers(0, 60), script=st.lists(st.booleans(), min_size=1, max_size=10))
def test_random_workloads_mixing_dflash_and_plain_steps_match_plain(engine, requests, slack, script):
    """Adaptive speculation's plain steps leave each request a backlog of draft features; preemption,
    compaction and finishing must drop or carry it correctly. Greedy output equals plain decoding."""
    reqs = [(p, SamplingParams(max_tokens=m), []) for p, m in requests]
    want = alone(engine, False, reqs)
    biggest = max(len(p) + sp.max_tokens - 1 for p, sp, _ in reqs) + 4
    engine.dflash.governor = ScriptedGovernor(script)
    try:
        scheduler = engine.scheduler(True, max_total_tokens=biggest + slack, prefill_tokens_per_step=16)
        got = fresh(reqs)
        drive(scheduler, got, {})
    finally:
        engine.dflash.governor = None
    assert_same(got, want)
    assert_all_free(scheduler)
    assert all(not s.unfed_features for s in got)
