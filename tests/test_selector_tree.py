"""Selector trees (speculative/selector_tree.py): the greedy walk first, then a beam's prefixes by their
cumulative selector log-probability, ancestor-closed within the budget; checked against enumerating every
prefix; and DFlash2 tree decoding equal to plain decoding, greedy and seeded sampled."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockspec.layers.selector import walk
from blockspec.models.loader import load_draft
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.selector_tree import selector_tree
from tests.test_dflash2 import plain_and_dflash, smollm2_dflash2, write_checkpoint  # noqa: F401 - a fixture
from tests.tiny import TinyEngine, tiny_target_with_draft

CPU = torch.device("cpu")


def lattice(steps: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(steps, k, k, generator=gen) * 2
    scores[0] = scores[0, 0]  # position 0's rows all hold the anchor's edges
    candidates = torch.stack([torch.randperm(100, generator=gen)[:k] for _ in range(steps)])
    return scores, candidates


def prefixes(scores: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every prefix (candidate indices) and its cumulative log-probability, enumerated."""
    logp = torch.log_softmax(scores.double(), dim=-1)
    steps, k = scores.shape[0], scores.shape[-1]
    out = {}
    for depth in range(1, steps + 1):
        for path in itertools.product(range(k), repeat=depth):
            out[path] = sum(float(logp[i, path[i - 1] if i else 0, c]) for i, c in enumerate(path))
    return out


def node_paths(tree, candidates: torch.Tensor) -> list[tuple[int, ...]]:
    """Each node's candidate indices from the root."""
    paths: list[tuple[int, ...]] = [()]
    for token, parent in zip(tree.tokens, tree.parents):
        depth = len(paths[parent])
        paths.append(paths[parent] + (candidates[depth].tolist().index(token),))
    return paths[1:]


@pytest.mark.parametrize("seed", range(6))
def test_the_walk_comes_first_then_the_best_prefixes(seed):
    steps, k = 4, 3
    scores, candidates = lattice(steps, k, seed)
    chain = walk(scores.unsqueeze(0), candidates.unsqueeze(0)).tokens[0].tolist()
    every = prefixes(scores)
    for budget in (1, 3, 7, 12, 40):
        tree = selector_tree(scores, candidates, width=k ** steps, budget=budget)  # the beam keeps everything
        paths = node_paths(tree, candidates)
        spine = min(steps, budget)
        assert list(tree.tokens[:spine]) == chain[:spine] and tree.parents[:spine] == tuple(range(spine))
        rest = sorted((p for p in every if p not in paths[:spine]), key=lambda p: (-every[p], len(p), p))
        assert paths[spine:] == rest[: budget - spine]
        assert len(set(paths)) == len(paths) == min(budget, len(every))
        for path, parent in zip(paths, tree.parents):  # ancestor-closed, parents first
            assert parent == 0 if len(path) == 1 else paths[parent - 1] == path[:-1]
        logp = torch.log_softmax(scores.double(), dim=-1)
        for path, value in zip(paths, tree.logprobs):
            depth = len(path) - 1
            assert value == pytest.approx(float(logp[depth, path[-2] if depth else 0, path[-1]]))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_a_beam_keeps_its_width_per_depth(width):
    steps, k = 5, 4
    scores, candidates = lattice(steps, k, 11)
    every = prefixes(scores)
    tree = selector_tree(scores, candidates, width=width, budget=100)
    paths = node_paths(tree, candidates)
    chain = walk(scores.unsqueeze(0), candidates.unsqueeze(0)).tokens[0].tolist()
    assert list(tree.tokens[:steps]) == chain
    beam, spine = [()], paths[:steps]
    want = set(spine)
    for depth in range(steps):  # the beam grows from its last depth's prefixes and the walk's
        grown = beam + ([spine[depth - 1]] if depth and spine[depth - 1] not in beam else [])
        children = [p + (c,) for p in grown for c in range(k)]
        beam = sorted(children, key=lambda p: (-every[p], p))[:width]
        want.update(beam)
    assert set(paths) == want
    if width == 1:
        assert tree.size == steps  # the beam of one is the walk


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engine(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    target, cfg, draft_folder = tiny_target_with_draft(folder, request.param, CPU, draft_block_size=8)
    write_checkpoint(folder / "d2", cfg, draft_folder)
    draft = load_draft(folder / "d2", cfg, torch.float32, CPU)
    return TinyEngine(target, draft, 5, num_slots=3, max_len=160, tree=(10, 3, "best-first"))


def test_dflash2_trees_decode_as_plain_decoding(engine):
    for _, p, s in plain_and_dflash(engine, (3, 5)):
        assert s.output_ids == p.output_ids
        assert s.stats.tree_steps > 0


def test_dflash2_trees_on_smollm2_decode_as_plain_decoding(smollm2_dflash2):
    from blockspec import LLM

    llm = LLM(draft_model_path=str(smollm2_dflash2), max_num_seqs=2, max_model_len=512, block_size=5,
              adaptive_speculation=False, prompt_lookup_ngram=0, speculative_tree_budget=10,
              speculative_tree_topk=3)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}]),
               "def quicksort(items):"]
    params = SamplingParams(max_tokens=32)
    plain = llm.generate(prompts, params, speculative_algorithm="NONE")
    for p, s in zip(plain, llm.generate(prompts, params)):
        assert s.token_ids == p.token_ids and s.stats.tree_steps == len(s.accept_lengths) > 0
