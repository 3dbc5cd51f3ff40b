"""Merged steps: a row's prompt-lookup copy and the draft's candidates verified as one tree. The merged
tree's shape and what each proposer alone would have kept, greedy decoding == plain decoding (chains and
trees; Llama, Qwen3 and a block-held target; several block sizes), each accepted token's proposer, and
the sampled distribution with its negative control (seeds: tests/test_seeds.py; the governor:
tests/test_governor.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blockspec.speculative.decoder as decoder_module
from blockspec.config import EngineConfig
from blockspec.engine.sampler import draw, filtered_probs, uniform
from blockspec.engine.sequence import Sequence
from blockspec.errors import BlockspecError, cli_flags
from blockspec.models.loader import load_draft
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.merge import MergedTree
from blockspec.speculative.proposal import Proposal
from blockspec.speculative.tree import Tree, build_tree
from tests.test_dflash_lossless import worst_deviation
from tests.tiny import ScriptedGovernor, TinyEngine, tiny_target_with_draft

LOGP = torch.tensor([[-0.1, -1.0, -3.0], [-0.2, -0.5, -4.0], [-2.0, -2.1, -2.2]])
IDS = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])


def test_trees_join_where_they_share_a_prefix():
    draft = build_tree(LOGP, IDS, 6, "best-first")  # 10 (20, 21), 11 (20, 21)
    tree, placed = draft.union(Tree.chain([10, 21, 33, 40]))
    assert tree.tokens == draft.tokens + (33, 40) and tree.parents == draft.parents + (3, 7)
    assert placed == (1, 3, 7, 8) and tree.logprobs == ()  # a copy carries no log-probabilities
    tree, placed = draft.union(Tree.chain([11, 21]))  # the draft holds the whole copy
    assert (tree.tokens, tree.parents, placed) == (draft.tokens, draft.parents, (4, 6))
    tree, placed = draft.union(draft)
    assert tree == draft and placed == tuple(range(1, 7))
    merged = MergedTree.of(draft, [12, 20])  # the copy first, the draft's nodes after it
    assert merged.tree.tokens == (12, 20, 10, 20, 21, 11, 20, 21)
    assert merged.tree.parents == (0, 1, 0, 3, 3, 0, 6, 6) and merged.drafted == frozenset(range(3, 9))
    merged = MergedTree.of(draft, [10, 21, 33])
    assert merged.tree.parents == (0, 1, 2, 1, 0, 5, 5) and merged.drafted == {1, 2, 4, 5, 6, 7}
    assert merged.sources([1, 2, 3]) == ["draft", "draft", "lookup"] and merged.alone([1, 2, 3]) == (3, 4)
    assert merged.alone([5, 6]) == (3, 1) and merged.alone([1, 4]) == (3, 2) and merged.alone([]) == (1, 1)


def greedy_walk(tree: Tree, target) -> list[int]:
    """The nodes a greedy walk accepts when the target's token after a prefix is target(prefix)."""
    node, path, prefix = 0, [], ()
    while (child := tree.children[node].get(target(prefix))) is not None:
        prefix += (target(prefix),)
        node, path = child, path + [child]
    return path


@settings(max_examples=80, deadline=None)
@given(depth=st.integers(1, 4), k=st.integers(1, 3), budget=st.integers(1, 12), seed=st.integers(0, 10**6),
       copy=st.lists(st.integers(0, 5), max_size=6), rule=st.sampled_from(["best-first", "spine-first"]))
def test_what_each_proposer_alone_would_have_kept(depth, k, budget, seed, copy, rule):
    """Siblings never share a token, and the merged walk tells exactly what the draft's tree alone and the
    copy alone would have committed."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(depth, k, generator=g).sort(dim=-1).values
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(depth)])
    draft = build_tree(logp, ids, budget, rule)
    merged = MergedTree.of(draft, copy)
    children = [[t for t, p in zip(merged.tree.tokens, merged.tree.parents) if p == n]
                for n in range(merged.tree.size + 1)]
    assert all(len(c) == len(set(c)) for c in children)
    assert merged.tree.path_tokens(len(copy)) == copy  # the copy's chain: nodes 1..len(copy)
    assert merged.tree.size == len(set(map(tuple, [merged.tree.path_tokens(n) for n in range(1, 1 + len(
        copy))] + [draft.path_tokens(n) for n in range(1, draft.size + 1)])))  # one node per prefix
    answers = torch.randint(0, 6, (10**3,), generator=g).tolist()

    def target(prefix):  # a deterministic "target": the token after each prefix
        return answers[hash(prefix) % len(answers)]

    path = greedy_walk(merged.tree, target)
    assert merged.alone(path) == (len(greedy_walk(draft, target)) + 1,
                                  len(greedy_walk(Tree.chain(copy), target)) + 1)
    prefixes = {tuple(draft.path_tokens(n)) for n in range(1, draft.size + 1)}
    assert merged.sources(path) == ["draft" if tuple(merged.tree.path_tokens(n)) in prefixes else "lookup"
                                    for n in path]


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-q4_1"])
def engine(request, tmp_path_factory):
    cpu = torch.device("cpu")
    folder = tmp_path_factory.mktemp(request.param)
    target, cfg, draft_folder = tiny_target_with_draft(folder, request.param, cpu, draft_block_size=8)
    draft = load_draft(draft_folder, cfg, torch.float32, cpu)
    return TinyEngine(target, draft, 8, num_slots=4, max_len=160, lookup=(1, 6), tree=(12, 4, "best-first"),
                      merge="always")


PROMPTS = [[5, 6, 7, 8] * 5, [3, 41, 17, 88, 2, 60, 29], list(range(20, 61)), [9, 9, 1, 9, 9]]


@pytest.mark.parametrize("size, budget, lookup", [(2, 0, (1, 6)), (4, 0, (2, 4)), (8, 0, (1, 6)),
                                                  (4, 6, (1, 6)), (8, 12, (2, 5))])
def test_greedy_merged_decoding_equals_plain(engine, size, budget, lookup):
    """A batch of four, the rows with a copy merging it into their draft's chain or tree, the others
    drafting alone; then with merged, lookup, drafted and plain steps mixed by a script."""
    spec = engine.speculation
    engine.set_block_size(size)
    spec.tree_budget, (spec.lookup_ngram, spec.lookup_width) = budget, lookup
    params = SamplingParams(max_tokens=40)
    plain = engine.run([Sequence(p, params, frozenset()) for p in PROMPTS], use_draft=False)
    for script in (None, [True, False, True, True]):
        spec.merge = "always" if script is None else "auto"
        engine.dflash.governor = None if script is None else ScriptedGovernor(script)
        try:
            merged = engine.run([Sequence(p, params, frozenset()) for p in PROMPTS], use_draft=True)
        finally:
            engine.dflash.governor, spec.merge = None, "always"
        for p, m in zip(plain, merged):
            assert m.output_ids == p.output_ids
            assert all(1 <= a <= max(size, spec.lookup_width) for a in m.stats.merged_accept_lengths)
            assert all(1 <= a <= size for a in m.stats.accept_lengths)
        assert sum(len(m.stats.merged_accept_lengths) for m in merged) > 0
    assert engine.runner.pool.num_free == engine.runner.pool.num_slots


def reference_steps(engine, prompt):
    """Plain decoding's output, and a proposer of its continuation ([b, n] rows: the right tokens, or
    with a shift tokens that are always wrong there)."""
    params = SamplingParams(max_tokens=41)
    reference = engine.run([Sequence(prompt, params, frozenset())], False)[0].output_ids

    def continuation(seqs, n, shift=0):
        rows = []
        for seq in seqs:
            future = reference[len(seq.output_ids): len(seq.output_ids) + n]
            rows.append([(t + shift) % 97 for t in future] + [(shift + 1) % 97] * (n - len(future)))
        return rows

    return reference[:40], continuation


@pytest.mark.parametrize("right", ["copy", "draft"])
def test_the_step_keeps_whichever_branch_the_target_agrees_with(engine, monkeypatch, right):
    """A right copy beside wrong draft candidates commits the copy, labelled "lookup"; a wrong copy beside
    right candidates commits the candidates, labelled "draft"; every full step commits its whole branch."""
    size, width = 4, 6
    engine.set_block_size(size)
    spec = engine.speculation
    spec.tree_budget, spec.lookup_ngram, spec.lookup_width = 0, 1, width
    reference, continuation = reference_steps(engine, PROMPTS[1])
    copy_shift, draft_shift = (0, 1) if right == "copy" else (1, 0)
    monkeypatch.setattr(decoder_module, "lookups",
                        lambda seqs, ngram, n: continuation(seqs, n, copy_shift))
    proposer = engine.dflash.draft
    monkeypatch.setattr(proposer, "propose",
                        lambda seqs, b, rule: Proposal(torch.tensor(continuation(seqs, b - 1, draft_shift))))
    seq = engine.run([Sequence(PROMPTS[1], SamplingParams(max_tokens=40), frozenset())], True)[0]
    assert seq.output_ids == reference
    full = width if right == "copy" else size
    assert seq.stats.merged_accept_lengths[:5] == [full] * 5
    proposed = {source for source, _ in seq.token_sources if source != "target"}
    assert proposed == {"lookup" if right == "copy" else "draft"}


def test_sampled_merged_decoding_has_the_target_distribution(tmp_path):
    """Every token has a copy: each step verifies it merged with the draft's chain."""
    assert worst_deviation(tmp_path, dict(temperature=1.0, top_k=8), lookup_ngram=1, merge="always") < 5.0


def test_sampled_merged_trees_have_the_target_distribution(tmp_path):
    assert worst_deviation(tmp_path, dict(temperature=0.9), lookup_ngram=1, merge="always",
                           tree=(6, 4, "best-first")) < 5.0


def test_distribution_check_catches_trying_the_copy_first_without_a_residual(tmp_path, monkeypatch):
    """Negative control: a naive rule for several candidates at a node, keeping the newest child (the
    copy's, where it leaves the draft's tree) with probability p(its token) and otherwise drawing from p
    itself (not from p with that token removed), gives that token too often."""
    import blockspec.speculative.accept as accept_module

    def biased(seq, tree, node, output, depth, drawn=None):
        probs = filtered_probs(output.unsqueeze(0), seq.params).cpu()
        position = seq.next_position + depth
        if tree.children[node]:
            token, child = max(tree.children[node].items(), key=lambda item: item[1])
            if uniform(seq.seed ^ 0x5EED, position) < float(probs[0, token]):
                return child, token
        token = draw(probs, seq.seed, position)[0]
        return tree.children[node].get(token), token

    monkeypatch.setattr(accept_module, "descend", biased)
    assert worst_deviation(tmp_path, dict(temperature=1.0), lookup_ngram=1, merge="always") > 5.0


def test_a_bad_merge_setting_is_refused_by_name():
    with pytest.raises(BlockspecError, match="^prompt_lookup_merge='sometimes' must be one of auto"):
        EngineConfig(prompt_lookup_merge="sometimes")
    with pytest.raises(BlockspecError, match="^--prompt-lookup-merge="), cli_flags(
            {"prompt_lookup_merge": "--prompt-lookup-merge"}):
        EngineConfig(prompt_lookup_merge="sometimes")


def test_merged_steps_bound_the_block_size_an_llm_switches_to(tmp_path):
    """The KV slabs hold a merged step's scratch rows: a block of B beside a copy of W - 1 tokens."""
    from blockspec import LLM
    from blockspec.errors import DraftConfigError
    from blockspec.models.config import ModelConfig
    from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

    target = write_tiny_tokenizer(write_tiny_target(tmp_path / "target"))
    draft = write_tiny_draft(tmp_path / "draft", ModelConfig.from_folder(target), block_size=4)
    llm = LLM(model_path=str(target), draft_model_path=str(draft), max_model_len=64,
              prompt_lookup_block_size=6)
    assert llm.runner.max_len - llm.max_model_len == 4 + 6 - 1
    with pytest.raises(DraftConfigError, match=r"block_size=5 must be an integer in \[2, 4\]"):
        llm.set_block_size(5)
    llm.set_block_size(3)
    assert llm.speculation.merged_width == 8
    apart = LLM(model_path=str(target), draft_model_path=str(draft), max_model_len=64,
                prompt_lookup_block_size=6, prompt_lookup_merge="never")
    apart.set_block_size(6)  # no merged steps: the lookup width bounds it
