"""Tree verification: tree construction, the tree attention mask, greedy tree decoding == plain decoding,
the sampled distribution, and the governor's choice between chain and tree."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.config import EngineConfig
from blockspec.engine.sampler import draw, filtered_probs, uniform
from blockspec.engine.sequence import Sequence
from blockspec.errors import BlockspecError
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.models.loader import load_draft
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.governor import SpecGovernor
from blockspec.speculative.plan import DraftShape, StepPlan
from blockspec.speculative.tree import Tree, build_tree
from tests.test_dflash_lossless import worst_deviation
from tests.tiny import ScriptedGovernor, TinyEngine, tiny_target_with_draft

# A hand-made ranking: 3 positions, each position's 3 best tokens, best first.
LOGP = torch.tensor([[-0.1, -1.0, -3.0], [-0.2, -0.5, -4.0], [-2.0, -2.1, -2.2]])
IDS = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])


def test_best_first_takes_the_most_probable_prefixes():
    # scores: 10 -0.1 | 10,20 -0.3 | 10,21 -0.6 | 11 -1.0 | 11,20 -1.2 | 11,21 -1.5 | 10,20,30 -2.3 ...
    tree = build_tree(LOGP, IDS, 6, "best-first")
    assert tree.tokens == (10, 20, 21, 11, 20, 21) and tree.parents == (0, 1, 1, 0, 4, 4)
    assert tree.logprobs == pytest.approx((-0.1, -0.2, -0.5, -1.0, -0.2, -0.5))
    assert tree.depths() == [0, 1, 2, 2, 1, 2, 2]


def test_spine_first_takes_the_chain_then_the_most_probable_others():
    tree = build_tree(LOGP, IDS, 6, "spine-first")
    assert tree.tokens == (10, 20, 30, 21, 11, 20) and tree.parents == (0, 1, 2, 1, 0, 5)
    short = build_tree(LOGP, IDS, 2, "spine-first")  # a short chain
    assert (short.tokens, short.parents) == (Tree.chain([10, 20]).tokens, Tree.chain([10, 20]).parents)


def test_a_tree_holds_fewer_nodes_only_when_the_ranking_has_fewer_prefixes():
    assert build_tree(LOGP[:1], IDS[:1], 10, "best-first").tokens == (10, 11, 12)
    assert build_tree(LOGP[:2, :2], IDS[:2, :2], 10, "spine-first").size == 6  # 2 + 2 * 2


def prefixes(logp: list[list[float]]) -> dict[tuple[int, ...], float]:
    """Every prefix of ranks and its score, by brute force."""
    out = {}
    for d in range(1, len(logp) + 1):
        for ranks in itertools.product(range(len(logp[0])), repeat=d):
            out[ranks] = sum(logp[i][r] for i, r in enumerate(ranks))
    return out


def rank_paths(tree: Tree, ids: torch.Tensor) -> list[tuple[int, ...]]:
    """Each node's prefix, as ranks per position."""
    paths = [()]
    for token, parent in zip(tree.tokens, tree.parents):
        position = len(paths[parent])
        paths.append(paths[parent] + (ids[position].tolist().index(token),))
    return paths[1:]


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, 4), k=st.integers(1, 4), budget=st.integers(1, 40), seed=st.integers(0, 10**6),
       rule=st.sampled_from(["best-first", "spine-first"]))
def test_trees_are_ancestor_closed_within_budget_and_best(depth, k, budget, seed, rule):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(depth, k, generator=g).mul(5).sort(dim=-1).values  # log-probabilities: <= 0
    ids = torch.stack([torch.randperm(100, generator=g)[:k] for _ in range(depth)])
    tree = build_tree(logp, ids, budget, rule)
    every = prefixes(logp.tolist())
    paths = rank_paths(tree, ids)
    assert tree.size == min(budget, len(every)) and len(set(paths)) == tree.size
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # ancestor-closed
    assert all(parent < node for node, parent in enumerate(tree.parents, start=1))
    spine = [tuple([0] * d) for d in range(1, min(depth, budget) + 1)]
    kept = [p for p in paths if rule == "best-first" or p not in spine]
    rest = sorted(every.values(), reverse=True) if rule == "best-first" else sorted(
        (s for p, s in every.items() if p not in spine), reverse=True)
    assert sorted((every[p] for p in kept), reverse=True) == pytest.approx(rest[: len(kept)])
    if rule == "spine-first":
        assert paths[: len(spine)] == spine


def test_tree_attention_mask_and_positions():
    cache = KVCache(1, 1, 16, 1, 8, torch.float32, "cpu")
    # root; 1 under root; 2 and 3 under 1; 4 under root; 5 padding
    batch = ForwardBatch.tree(cache, [0], [3], torch.zeros(1, 6, dtype=torch.long), [(0, 1, 1, 0)])
    assert batch.positions.tolist() == [[3, 4, 5, 5, 4, 4]]
    context = [True] * 3
    expected = [context + [1, 0, 0, 0, 0, 0], context + [1, 1, 0, 0, 0, 0], context + [1, 1, 1, 0, 0, 0],
                context + [1, 1, 0, 1, 0, 0], context + [1, 0, 0, 0, 1, 0], context + [0, 0, 0, 0, 0, 1]]
    assert batch.visible().int().tolist() == [[[int(v) for v in row] for row in expected]]


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-q4_1"])
def engine(request, tmp_path_factory):
    cpu = torch.device("cpu")
    folder = tmp_path_factory.mktemp(request.param)
    target, cfg, draft_folder = tiny_target_with_draft(folder, request.param, cpu, draft_block_size=8)
    draft = load_draft(draft_folder, cfg, torch.float32, cpu)
    return TinyEngine(target, draft, 8, num_slots=4, max_len=160, tree=(24, 4, "best-first"))


PROMPTS = [[1, 2, 3], [5, 6, 7, 8] * 5, list(range(20, 61))]


@pytest.mark.parametrize("size, budget, rule", [(2, 3, "best-first"), (4, 8, "spine-first"),
                                                (4, 24, "best-first"), (8, 6, "best-first"),
                                                (8, 20, "spine-first")])
def test_greedy_tree_decoding_equals_plain(engine, size, budget, rule):
    """A batch of three, each row its own tree; with the lookup rows of a repeating prompt beside them and
    with plain, chain and tree steps mixed by a script: the output is plain decoding's, token for token."""
    spec = engine.speculation
    engine.set_block_size(size)
    spec.tree_budget, spec.tree_rule = budget, rule
    params = SamplingParams(max_tokens=40)
    plain = engine.run([Sequence(p, params, frozenset()) for p in PROMPTS], use_draft=False)
    for lookup, script in (((0, 0), None), ((2, 5), [True, True, False])):
        spec.lookup_ngram, spec.lookup_width = lookup
        engine.dflash.governor = None if script is None else ScriptedGovernor(script)
        try:
            trees = engine.run([Sequence(p, params, frozenset()) for p in PROMPTS], use_draft=True)
        finally:
            spec.lookup_ngram, engine.dflash.governor = 0, None
        for p, t in zip(plain, trees):
            assert t.output_ids == p.output_ids
            assert all(1 <= a <= size for a in t.stats.accept_lengths)
        assert sum(t.stats.tree_steps for t in trees) > 0
    assert engine.runner.pool.num_free == engine.runner.pool.num_slots


def test_sampled_tree_decoding_has_the_target_distribution(tmp_path):
    """Acceptance walks any tree alike (the rule only shapes it): one rule suffices here."""
    assert worst_deviation(tmp_path, dict(temperature=1.0, top_k=8), tree=(6, 4, "best-first")) < 5.0


def test_distribution_check_catches_the_min_p_over_q_rule_on_top_k_marginals(tmp_path, monkeypatch):
    """Negative control: accepting each child with probability min(1, p/q), q its draft marginal, and
    otherwise drawing the bonus from p, is biased (the tokens a tree holds come out too often)."""
    import blockspec.speculative.accept as accept_module

    def biased(seq, tree, node, output, depth, drawn=None):
        probs = filtered_probs(output.unsqueeze(0), seq.params).cpu()
        position = seq.next_position + depth
        for token, child in tree.children[node].items():
            ratio = float(probs[0, token]) / math.exp(tree.logprobs[child - 1])
            if uniform(seq.seed ^ 0x5EED, position * 128 + child) < min(1.0, ratio):
                return child, token
        return None, draw(probs, seq.seed, position)[0]

    monkeypatch.setattr(accept_module, "descend", biased)
    assert worst_deviation(tmp_path, dict(temperature=1.0), tree=(6, 4, "best-first")) > 5.0


def test_the_governor_takes_the_tree_only_where_it_commits_faster():
    gov = SpecGovernor(window=1, tau_alpha=1.0, probe_plain_every=3)
    batch = [Sequence([1, 2], SamplingParams(max_tokens=64), frozenset())]
    chain, tree = DraftShape(4), DraftShape(4, 8)

    def step(shape, accepted, seconds):
        batch[0].stats.accept_lengths.append(accepted)
        gov.record(StepPlan.dflash(1, shape), batch, seconds)

    assert gov.shape(batch, (chain, tree)) == chain  # nothing measured: each is tried first
    step(chain, 2, 0.10)
    assert gov.shape(batch, (chain, tree)) == tree
    step(tree, 3, 0.20)  # 3 per 0.20 s < 2 per 0.10 s
    assert gov.shape(batch, (chain, tree)) == chain
    for _ in range(3):
        step(chain, 2, 0.10)
    assert gov.shape(batch, (chain, tree)) == tree  # not run for 3 drafted steps: probed again
    step(tree, 3, 0.12)  # the tree got cheaper: 3 per 0.12 s > 2 per 0.10 s
    assert gov.shape(batch, (chain, tree)) == tree


@pytest.mark.parametrize("kwargs, flag", [(dict(speculative_tree_budget=-1), "--speculative-tree-budget"),
                                          (dict(speculative_tree_budget=65), "--speculative-tree-budget"),
                                          (dict(speculative_tree_topk=0), "--speculative-tree-topk"),
                                          (dict(speculative_tree_rule="widest"), "--speculative-tree-rule")])
def test_bad_tree_settings_are_refused_by_name(kwargs, flag):
    """By the API's field name in Python, by the flag on the command line."""
    from blockspec.errors import cli_flags

    field = next(iter(kwargs))
    with pytest.raises(BlockspecError, match=f"^{field}="):
        EngineConfig(**kwargs)
    with pytest.raises(BlockspecError, match=f"^{flag}="), cli_flags({field: flag}):
        EngineConfig(**kwargs)
