"""Acceptance: how many candidate tokens the target keeps, and its own token that follows (the bonus).

Greedy and sampled acceptance are lossless. A row verified [pending, d1 .. d_n]; target output i scores
position i+1. Sampled requests follow the engine's rule: "match" (below) or "rejection" (rejection.py:
speculative sampling, a sampled draft's tokens judged against the distribution they were drawn from; the
target's distribution again, but not plain decoding's exact tokens).

Under "match", sampled requests use "sample, then match": at each verified position the target's own token
is drawn from its (temperature / top-k / top-p) distribution with that position's keyed uniform
(sampler.draw); a candidate is kept while it equals the drawn token, and the first drawn token that
differs (or the one after the last candidate) is the bonus. Every committed token is thus exactly
the token plain sampled decoding draws at that position with the same seed, so the output has the
target distribution for any proposer, and a candidate is kept with probability p(candidate), as in
classic speculative sampling with a deterministic draft.

A tree (tree.py) is judged the same way, walking down from the root: the target's token at a node
(its argmax, or its keyed draw at that node's depth) selects the child holding that token, and the first
node without one ends the walk with that token as the bonus. Siblings hold distinct tokens, so every
committed token is again exactly plain decoding's, whatever the tree.

Presence and frequency penalties change each position's logits by the counts of the tokens before it: a
verified position's are the output so far plus the candidates before it in its row (or its ancestors in a
tree), exactly what a plain step there would count, since the position is judged only if those were kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockspec.engine.runner import guarded
from blockspec.engine.sampler import draw, filtered_probs, penalized
from blockspec.engine.sequence import Sequence
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.proposal import AcceptRule, Drawn
from blockspec.speculative.rejection import judge, rejection_chain, stages
from blockspec.speculative.tree import Tree

# A row's accepted nodes, its bonus, and for a request that needs logits the target's logits at the root and
# each accepted node ([len(nodes) + 1, V]: they chose the committed tokens), else None.
Outcome = tuple[list[int], int, torch.Tensor | None]


def accept(seq: Sequence, host_candidates: torch.Tensor, target: torch.Tensor, rule: AcceptRule = "match",
           drawn: dict[int, Drawn] | None = None) -> tuple[int, int]:
    """(accepted count, bonus) for one row's n candidates (on the CPU) and the target's n + 1 outputs there
    (greedy token ids, or fp32 logits for a request that `needs_logits`). `drawn`: the candidates that were
    sampled (node i + 1 for candidate i) and their distributions, for the rejection rule."""
    if not seq.needs_logits:
        return greedy_accept(host_candidates, target)
    rows = penalized(target, seq.params, seq.output_ids, host_candidates.tolist())
    if seq.params.greedy:
        return greedy_accept(host_candidates, rows.argmax(dim=-1).cpu())
    if rule == "rejection":
        return rejection_chain(host_candidates.tolist(), drawn or {}, filtered_probs(rows, seq.params),
                               seq.seed, seq.next_position)
    return sampled_accept(host_candidates, rows, seq.params, seq.seed, seq.next_position)


def greedy_accept(drafts: torch.Tensor, choice: torch.Tensor) -> tuple[int, int]:
    """drafts [B-1], choice [B] (the target's argmax per position): the longest prefix where
    draft == choice, and the target's choice at the first mismatch (or after the last draft) as the bonus."""
    if drafts.numel() == 0:  # a plain step
        return 0, int(choice[0])
    accepted = int((drafts == choice[:-1]).int().cumprod(0).sum())
    return accepted, int(choice[accepted])


def sampled_accept(drafts: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams, seed: int,
                   position: int) -> tuple[int, int]:
    """drafts [n] (CPU), target_logits [n + 1, V]; `position`: the absolute position of the token that
    target output 0 scores. Sample, then match (see the module docstring)."""
    drawn = draw(filtered_probs(target_logits, params), seed, position)
    accepted = 0
    for proposed, token in zip(drafts.tolist(), drawn):
        if proposed != token:
            break
        accepted += 1
    return accepted, drawn[accepted]


def accept_trees(seqs: list[Sequence], trees: list[Tree],
                 outputs: Callable[[list[tuple[int, int]]], list[torch.Tensor]], rule: AcceptRule = "match",
                 drawn: list[dict[int, Drawn]] | None = None) -> list[Outcome | None]:
    """Per row, (its accepted nodes, root to leaf, the bonus, the logits that chose them), or None where the
    row failed
    (`runner.guarded`). `outputs(wanted)` gives the target's outputs (greedy token ids, or fp32 logits [V]
    for a sampled request) at (row, node) pairs. They are asked for only where the walks go, as an LM head
    over every node of a large tree costs more than the rest of the step: each round, for every row still
    walking at a node without its output, that node and the draft's most probable descent from it (one
    round where the target follows the draft). `rule`, `drawn` (per row, its sampled nodes): as `accept`."""
    drawn = drawn or [{} for _ in trees]
    known: list[dict[int, torch.Tensor]] = [{} for _ in trees]
    walks: dict[int, tuple[int, list[int]]] = {row: (0, []) for row in range(len(trees))}  # (node, path)
    results: list[Outcome | None] = [None] * len(trees)
    while walks:
        wanted = [(row, node) for row, (at, _) in walks.items() for node in trees[row].line(at)
                  if node not in known[row]]
        for (row, node), out in zip(wanted, outputs(wanted)):
            known[row][node] = out
        for row, (at, path) in list(walks.items()):
            step = guarded(seqs[row], lambda: walk(seqs[row], trees[row], at, path, known[row],
                                                   drawn[row] if rule == "rejection" else None))
            if step is None or step[2] is not None:  # failed, or ended with its bonus
                if step is not None:
                    logits = (torch.stack([known[row][node] for node in [0, *step[1]]])
                              if seqs[row].needs_logits else None)
                    results[row] = (step[1], step[2], logits)
                del walks[row]
            else:
                walks[row] = step[:2]
    return results


def walk(seq: Sequence, tree: Tree, node: int, path: list[int], known: dict[int, torch.Tensor],
         drawn: dict[int, Drawn] | None = None) -> tuple[int, list[int], int | None]:
    """Walk on from `node` while the target's outputs are known: (where it stopped, the path so far, and the
    bonus if it ended). `drawn` given: by the rejection rule, with these sampled nodes."""
    while node in known:
        child, token = descend(seq, tree, node, known[node], len(path), drawn)
        if child is None:
            return node, path, token
        path = path + [child]
        node = child
    return node, path, None


def descend(seq: Sequence, tree: Tree, node: int, output: torch.Tensor, depth: int,
            drawn: dict[int, Drawn] | None = None) -> tuple[int | None, int]:
    """(the child holding the target's token at a node of this depth, or None, and that token): the
    target's greedy choice, or its keyed draw at that position, or (`drawn` given) the child the
    rejection rule keeps and else its draw from the residual."""
    if not seq.needs_logits:
        token = int(output)
    else:
        ancestors = tree.path_tokens(node)
        row = penalized(output.unsqueeze(0), seq.params, seq.output_ids + ancestors, [])
        if seq.params.greedy:
            token = int(row[0].argmax())
        elif drawn is not None:
            judged = stages(tree.children[node], tree.tokens, drawn)
            kept, token = judge(filtered_probs(row, seq.params)[0], [stage for _, stage in judged], seq.seed,
                                seq.next_position + depth)
            return (None if kept is None else judged[kept][0]), token
        else:
            token = draw(filtered_probs(row, seq.params), seq.seed, seq.next_position + depth)[0]
    return tree.children[node].get(token), token
