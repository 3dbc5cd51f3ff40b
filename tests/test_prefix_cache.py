"""Exact prefix caching (engine/prefix_cache.py, prefix_reuse.py): a request's tokens with a cache hit are
its tokens without one, greedy and sampled with a seed, with DFlash, prompt lookup, trees and plain steps;
hits that end mid-block, a prefix whose owner is still prefilling or decoding, a prompt that is a strict
prefix of a cached one, eviction under pressure; every slot, row and entry comes back; the LLM keeps
prefixes from call to call.

Exactness rests on the CPU kernels being batch- and chunk-invariant: a token's K/V rows are the same bits
whether a long prefill chunk or a decode step computed them. The target holds its weights as Q4_1 blocks
(the block kernel's sums are fixed whatever the row count), as the embedded model does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.engine.prefix_cache import common_prefix
from blockspec.engine.scheduler import Scheduler, run_to_completion
from blockspec.engine.sequence import Sequence
from blockspec.models.loader import load_draft
from blockspec.sampling_params import SamplingParams
from tests.tiny import ScriptedGovernor, TinyEngine, examples, tiny_target_with_draft

CPU = torch.device("cpu")
BLOCK = 4
STEM = [3, 10, 20, 30, 40, 50, 60, 70, 80, 90, 11, 21, 31, 41, 51, 61, 71, 81, 91, 12, 22, 32, 42, 52, 62,
        72, 82, 92, 13, 23, 33, 43, 53, 63, 73, 83, 93]  # 37 tokens: hits end at every offset in a block
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
EXACTNESS = [(True, GREEDY), (True, SAMPLED), (False, GREEDY), (False, SAMPLED)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefix")
    target, cfg, draft_folder = tiny_target_with_draft(folder, "llama-q4_1", CPU, draft_block_size=BLOCK)
    return target, load_draft(draft_folder, cfg, torch.float32, CPU)


def make(models, slots: int = 4, **kwargs) -> TinyEngine:
    return TinyEngine(*models, BLOCK, num_slots=slots, max_len=256, prefix_caching=True, **kwargs)


def run(engine: TinyEngine, prompts: list[list[int]], params: SamplingParams, use_draft: bool = True,
        cache: bool = True, **kwargs) -> list[Sequence]:
    seqs = [Sequence(list(p), params, frozenset()) for p in prompts]
    run_to_completion(engine.scheduler(use_draft, prefix_caching=cache, **kwargs), seqs)
    return seqs


def uncached(engine: TinyEngine, prompt: list[int], params: SamplingParams, use_draft: bool) -> list[int]:
    """The request's tokens with no prefix reused (on the same engine: its entries stay untouched)."""
    return run(engine, [prompt], params, use_draft, cache=False)[0].output_ids


def target_rows(engine: TinyEngine, slot: int, n: int) -> torch.Tensor:
    cache = engine.runner.target_cache
    return torch.cat([cache.k[:, slot, :, :n].flatten(), cache.v[:, slot, :, :n].flatten()])


def assert_consistent(engine: TinyEngine, budget: int | None = None) -> None:
    """No request holds anything; every slot is free or an entry's, once; entries within the budget."""
    runner, cache = engine.runner, engine.runner.prefix_cache
    assert runner.pool.num_free + len(cache.entries) == runner.pool.num_slots
    assert not set(cache.entries) & set(runner.pool._free)
    for slot, entry in cache.entries.items():
        assert entry.slot == slot and entry.ready == len(entry.tokens)
        assert entry.draft_ready + len(entry.features) in (entry.ready, len(entry.features))
    if budget is not None:
        assert cache.tokens <= budget


def test_common_prefix():
    a = list(range(200))
    assert common_prefix(a, a, 500) == 200 and common_prefix(a, a, 130) == 130
    assert common_prefix(a, a[:64] + [-1], 500) == 64 and common_prefix(a, a[:70] + [-1], 500) == 70
    assert common_prefix([], a, 5) == 0 and common_prefix([1], [2], 5) == 0


@pytest.mark.parametrize("use_draft,params", EXACTNESS)
def test_a_hit_computes_the_bits_a_miss_computes(models, use_draft, params):
    """Turn 2 of a chat with turn 1 cached: only the new tokens are prefilled, and the rows it leaves are
    the very bits an engine that never saw turn 1 computes, so the tokens are the same."""
    warm, cold = make(models), make(models)
    first = run(warm, [STEM], params, use_draft)[0]
    turn2 = STEM + first.output_ids + [14, 24, 34]
    hit = run(warm, [turn2], params, use_draft)[0]
    miss = run(cold, [turn2], params, use_draft)[0]
    assert first.cached_tokens == 0 and miss.cached_tokens == 0
    assert hit.cached_tokens == len(STEM) + len(first.output_ids) - 1  # its pending token was never fed
    assert hit.output_ids == miss.output_ids
    (kept,), (fresh,) = warm.runner.prefix_cache.entries.values(), cold.runner.prefix_cache.entries.values()
    assert kept.tokens == fresh.tokens == (turn2 + hit.output_ids)[: len(kept.tokens)]
    assert torch.equal(target_rows(warm, kept.slot, kept.ready), target_rows(cold, fresh.slot, fresh.ready))
    again = run(warm, [turn2], params, use_draft)[0]  # the same request again: all but its last token
    assert again.cached_tokens == len(turn2) - 1 and again.output_ids == miss.output_ids
    assert_consistent(warm)


@pytest.mark.parametrize("use_draft,params", EXACTNESS)
def test_partial_hits_end_anywhere(models, use_draft, params):
    """Prompts sharing k tokens of a cached context, k inside the prompt's blocks and inside the decode
    steps' blocks alike, reuse exactly k rows and give their uncached tokens."""
    engine = make(models)
    for k in (1, 2, 5, 18, 36, len(STEM) + 1, len(STEM) + 6, len(STEM) + 22):
        source = run(engine, [STEM], params, use_draft)[0]  # cached anew each time (a hit itself)
        context = STEM + source.output_ids[:-1]
        prompt = context[:k] + [(context[k] + 1) % 97 if k < len(context) else 7, 50]
        got = run(engine, [prompt], params, use_draft)[0]
        assert got.cached_tokens == k, k
        assert got.output_ids == uncached(engine, prompt, params, use_draft), k
    assert_consistent(engine)


@pytest.mark.parametrize("use_draft", [True, False])
def test_a_prefix_whose_owner_is_still_decoding(models, use_draft):
    """A request sharing a running request's prompt and part of its output copies those rows from it."""
    engine = make(models)
    scheduler = engine.scheduler(use_draft)
    owner = Sequence(STEM + [60, 61], SamplingParams(max_tokens=40, ignore_eos=True), frozenset())
    scheduler.add(owner)
    while len(owner.output_ids) < 6:
        scheduler.step()
    later = Sequence(STEM + [60, 61] + owner.output_ids[:5] + [9], GREEDY, frozenset())
    scheduler.add(later)
    scheduler.step()
    assert not owner.finished and not engine.runner.prefix_cache.entries  # nothing cached yet: a copy
    assert later.cached_tokens == len(STEM) + 7
    while scheduler.has_work:
        scheduler.step()
    assert later.output_ids == uncached(engine, later.prompt_ids, GREEDY, use_draft)
    assert owner.output_ids == uncached(engine, owner.prompt_ids, owner.params, use_draft)
    assert_consistent(engine)


@pytest.mark.parametrize("use_draft,params", EXACTNESS)
def test_requests_arriving_together_compute_their_prefix_once(models, use_draft, params):
    """Three requests with one system prompt, prefilled 16 tokens a step: the oldest computes the prompt,
    the others copy its rows as they appear and prefill only their own last token."""
    engine = make(models)
    cache = engine.runner.prefix_cache
    prompts = [STEM + [60], STEM + [70], STEM + [80]]
    seqs = run(engine, prompts, params, use_draft, prefill_tokens_per_step=16)
    assert [s.cached_tokens for s in seqs] == [0, len(STEM), len(STEM)]
    assert cache.miss_tokens == len(STEM) + 3 and cache.hit_tokens == 2 * len(STEM)
    for seq in seqs:
        assert seq.output_ids == uncached(engine, seq.prompt_ids, params, use_draft)
    assert_consistent(engine)


@pytest.mark.parametrize("use_draft", [True, False])
def test_a_waiting_request_prefills_in_the_step_its_prefix_is_done(models, use_draft):
    """Waiting never costs a request a step: when the request ahead of it finishes the shared prefix, it
    copies the rows and prefills its own part with what the step has left, in that same step."""
    engine = make(models)
    scheduler = engine.scheduler(use_draft, prefill_tokens_per_step=64)
    short, long = (Sequence(p, GREEDY, frozenset()) for p in (STEM[:20], STEM[:20] + STEM[5:35]))
    scheduler.add(short)
    scheduler.add(long)
    scheduler.step()
    assert long.cached_tokens == 20 and len(long.output_ids) >= 1  # 20 + 30 tokens would not fit alone
    while scheduler.has_work:
        scheduler.step()
    assert long.output_ids == uncached(engine, long.prompt_ids, GREEDY, use_draft)
    assert short.output_ids == uncached(engine, short.prompt_ids, GREEDY, use_draft)
    assert_consistent(engine)


@pytest.mark.parametrize("use_draft", [True, False])
def test_waiting_on_an_aborted_owner_falls_back(models, use_draft):
    engine = make(models)
    scheduler = engine.scheduler(use_draft, prefill_tokens_per_step=16)
    seqs = [Sequence(STEM + [t], GREEDY, frozenset()) for t in (60, 70, 80)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.step()
    assert seqs[0].num_cached == 16 and seqs[1].num_cached == 0
    scheduler.abort(seqs[0].seq_id)  # its 16 rows stay behind as an entry
    while scheduler.has_work:
        scheduler.step()
    assert seqs[1].cached_tokens == 16 and seqs[2].cached_tokens == len(STEM)  # the next oldest computed it
    for seq in seqs[1:]:
        assert seq.output_ids == uncached(engine, seq.prompt_ids, GREEDY, use_draft)
    assert_consistent(engine)


@pytest.mark.parametrize("slots", [4, 1])
def test_a_prompt_that_is_a_strict_prefix_of_a_cached_one(models, slots):
    """With a slot to spare, the shorter prompt copies the rows and the longer entry stays; with none, it
    takes the entry's slot over. Either way its tokens are its uncached ones."""
    engine = make(models, slots=slots)
    long = run(engine, [STEM], GREEDY)[0]
    short = run(engine, [STEM[:20]], GREEDY)[0]
    assert short.cached_tokens == 19
    kept = [e.tokens for e in engine.runner.prefix_cache.entries.values()]
    assert (STEM + long.output_ids[:-1] in kept) == (slots > 1)
    assert short.output_ids == uncached(engine, STEM[:20], GREEDY, True)
    assert_consistent(engine)


def test_a_backlog_of_draft_features_is_carried_and_fed(models):
    """A request that ends on plain steps leaves its last positions' target features unfed; the entry keeps
    them, and a hit feeds them to the draft (its rows there were garbage) before it prefills on."""
    engine = make(models, governor=ScriptedGovernor([False]))  # plain steps only: features wait
    first = run(engine, [STEM], GREEDY)[0]
    (entry,) = engine.runner.prefix_cache.entries.values()
    assert entry.draft_ready == len(STEM) and len(entry.features) == entry.ready - len(STEM) > 0
    draft = engine.runner.draft_cache
    draft.k[:, entry.slot, :, entry.draft_ready : entry.ready] = float("nan")
    engine.dflash.governor = ScriptedGovernor([True])
    turn2 = STEM + first.output_ids + [5, 6]
    hit = run(engine, [turn2], GREEDY)[0]
    assert hit.cached_tokens == entry.ready and not hit.unfed_features
    assert hit.output_ids == uncached(engine, turn2, GREEDY, False)
    (kept,) = engine.runner.prefix_cache.entries.values()  # turn 2's, in the slot it took over (or moved)
    assert kept.draft_ready == kept.ready and not draft.k[:, kept.slot, :, : kept.ready].isnan().any()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_lookup_trees_and_plain_steps_with_hits(models, params):
    engine = make(models, lookup=(2, 5), tree=(6, 4, "best-first"),
                  governor=ScriptedGovernor([True, False, True, True, False, False]))
    prompts = [STEM, STEM[:30] + [7, 7, 7, 7], STEM + [1, 2, 3] * 4]
    turns = run(engine, prompts, params)
    for seq in turns:
        follow_up = seq.prompt_ids + seq.output_ids + [44, 45]
        hit = run(engine, [follow_up], params)[0]
        assert hit.cached_tokens >= len(seq.prompt_ids) + len(seq.output_ids) - 1
        assert hit.output_ids == uncached(engine, follow_up, params, True)
        assert hit.output_ids == uncached(engine, follow_up, params, False)
    assert engine.runner.prefix_cache.hit_tokens > 0
    assert_consistent(engine)


def test_a_disabled_scheduler_reuses_and_keeps_nothing(models):
    engine = make(models)
    for _ in range(2):
        assert run(engine, [STEM], GREEDY, cache=False)[0].cached_tokens == 0
    assert not engine.runner.prefix_cache.entries and engine.runner.prefix_cache.hit_tokens == 0


def drive(scheduler: Scheduler, arrivals: list[tuple[int, Sequence]], budget: int | None) -> None:
    """Add each request at its step; after every step the rows written and cached fit the budget."""
    step, pending = 0, sorted(arrivals, key=lambda a: a[0])
    while pending or scheduler.has_work:
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        scheduler.step()
        step += 1
        if budget is not None:
            written = sum(s.num_cached for s in scheduler.running)
            assert written + scheduler.cache.tokens <= budget


def test_eviction_under_pressure(models):
    """Three slots and a small budget: entries go least recently used first and before anyone is preempted;
    every request gives its tokens alone; every slot and row comes back."""
    engine = make(models, slots=3)
    prompts = ([STEM + [i] for i in range(4)] + [STEM[:25] + [i, i] for i in range(3)]
               + [[5 + i] * (10 + 3 * i) for i in range(4)])
    params = [GREEDY if i % 2 else SAMPLED for i in range(len(prompts))]
    want = [uncached(engine, p, sp, True) for p, sp in zip(prompts, params)]
    budget = len(STEM) + 1 + 24 + BLOCK + 40
    scheduler = engine.scheduler(True, max_total_tokens=budget, prefill_tokens_per_step=24)
    seqs = [Sequence(list(p), sp, frozenset()) for p, sp in zip(prompts, params)]
    drive(scheduler, [(i // 2, s) for i, s in enumerate(seqs)], budget)
    assert [s.output_ids for s in seqs] == want
    cache = engine.runner.prefix_cache
    assert cache.evictions > 0 and cache.hit_tokens > 0 and sum(s.cached_tokens for s in seqs) > 0
    assert scheduler.tokens_in_use == 0 and not scheduler.running
    assert_consistent(engine, budget)


stem_st = st.lists(st.integers(6, 96), min_size=1, max_size=30)
request_st = st.tuples(st.integers(0, 2), st.integers(0, 30), st.lists(st.integers(6, 96), max_size=6),
                       st.integers(1, 24), st.booleans(), st.integers(0, 6))


@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stems=st.lists(stem_st, min_size=3, max_size=3), requests=st.lists(request_st, min_size=2, max_size=7),
       slack=st.integers(0, 80), chunk=st.integers(4, 40), use_draft=st.booleans())
def test_random_workloads_with_shared_prefixes_match_alone(models, stems, requests, slack, chunk,
                                                           use_draft):
    """Requests built from three shared stems (cut anywhere, own tails), arriving at random steps, greedy
    and sampled, under a random KV budget and prefill chunk, on a small engine whose cache carries over
    from example to example: each gives its uncached tokens."""
    engine = shared_engine(models)
    prompts = [stems[s][:cut] + tail or [6] for s, cut, tail, _, _, _ in requests]
    params = [SamplingParams(max_tokens=m, temperature=0.9 if sampled else 0.0, seed=i)
              for i, (_, _, _, m, sampled, _) in enumerate(requests)]
    want = [uncached(engine, p, sp, use_draft) for p, sp in zip(prompts, params)]
    biggest = max(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params)) + BLOCK
    scheduler = engine.scheduler(use_draft, max_total_tokens=biggest + slack, prefill_tokens_per_step=chunk)
    seqs = [Sequence(list(p), sp, frozenset()) for p, sp in zip(prompts, params)]
    drive(scheduler, [(r[5], s) for r, s in zip(requests, seqs)], biggest + slack)
    assert [s.output_ids for s in seqs] == want
    assert all(s.cached_tokens < len(s.prompt_ids) + len(s.output_ids) for s in seqs)  # (resumed: its own)
    assert_consistent(engine, biggest + slack)


_SHARED: dict[int, TinyEngine] = {}


def shared_engine(models) -> TinyEngine:
    if id(models) not in _SHARED:
        _SHARED[id(models)] = make(models, slots=3)
    return _SHARED[id(models)]


def test_the_embedded_model_hit_gives_the_bits_of_a_miss(smollm2_dir):
    """SmolLM2 as it ships (its GGUF's blocks, the shipped draft): turn 2 of a chat hits turn 1 and its
    answer; its tokens, and the target K/V it leaves, are those of an engine that never saw turn 1."""
    from blockspec import LLM

    warm, cold = (LLM(max_num_seqs=2, max_model_len=512) for _ in range(2))
    messages = [{"role": "user", "content": "Name three prime numbers and say why they are prime."}]
    params = SamplingParams(max_tokens=24)
    first = warm.chat(messages, params)[0]
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And two more?"}]
    hit, miss = warm.chat(messages, params)[0], cold.chat(messages, params)[0]
    assert hit.cached_tokens >= first.num_prompt_tokens and miss.cached_tokens == 0
    assert hit.token_ids == miss.token_ids
    (kept,), (fresh,) = (llm.runner.prefix_cache.entries.values() for llm in (warm, cold))
    assert kept.tokens == fresh.tokens
    assert torch.equal(target_rows(warm, kept.slot, kept.ready), target_rows(cold, fresh.slot, fresh.ready))
