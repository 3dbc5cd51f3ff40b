"""Candidate trees from a DFlash2 draft's selector: a beam over its lattice, kept as a tree.

A plain DFlash draft scores each block position on its own, so its trees take each position's top-k
(tree.py). A DFlash2 draft scores edges: position i's K candidates given the token before them (the anchor
at i = 0, else one of position i-1's candidates), so a prefix (c1 .. cd) has the log-probability sum_i log
softmax(S_i(c_{i-1}, .))[c_i] under the selector, and the best continuation of one prefix is not that of
another. The tree keeps, per depth, the `width` best prefixes by that cumulative log-probability (a beam),
grown from the previous depth's beam and the walk; the walk (the chain the engine verifies without a tree:
greedy, or a sampled row's draw under "rejection") comes first, so a tree never holds less than it. Every
node's cumulative log-probability is <= its parent's, so taking nodes best first (ties: shallower first)
within `budget` keeps the tree ancestor-closed.
"""

from __future__ import annotations

import torch

from blockspec.speculative.tree import Tree

Path = tuple[int, ...]  # a node: its candidate index at each depth, root side first


def selector_tree(scores: torch.Tensor, candidates: torch.Tensor, width: int, budget: int,
                  walked: list[int] | None = None) -> Tree:
    """One row's tree of at most `budget` nodes from its lattice scores [γ, K, K] (position i's row p: the
    edges from position i-1's candidate p; position 0's rows all hold the anchor's) and candidate ids
    [γ, K] (`CandidateSelector.lattice`), `width` prefixes per depth. `walked`: the walk that comes first,
    as each depth's candidate index (a sampled walk; default: the greedy walk)."""
    logp = torch.log_softmax(scores.double(), dim=-1).tolist()  # [γ][pred][K]
    steps = len(logp)
    cumulative: dict[Path, float] = {}  # a prefix's log-probability
    own: dict[Path, float] = {}  # its last token's, given the one before

    def grow(parent: Path, base: float) -> list[Path]:
        depth, row = len(parent), parent[-1] if parent else 0
        out = []
        for c, value in enumerate(logp[depth][row]):
            path = parent + (c,)
            own[path], cumulative[path] = value, base + value
            out.append(path)
        return out

    cumulative[()] = 0.0
    spine: list[Path] = []
    tip: Path = ()  # the walk so far
    beam: list[Path] = [()]
    members: set[Path] = set()
    for depth in range(min(steps, budget)):
        parents = beam if tip in beam else beam + [tip]
        children = [child for parent in parents for child in grow(parent, cumulative[parent])]
        if walked is not None:
            tip = tip + (walked[depth],)
        else:
            tip = max((tip + (c,) for c in range(len(logp[depth][0]))), key=lambda p: (own[p], -p[-1]))
        spine.append(tip)
        beam = sorted(children, key=lambda p: (-cumulative[p], p))[:width]
        members.update(beam)
    rest = sorted(members.difference(spine), key=lambda p: (-cumulative[p], len(p), p))
    kept: dict[Path, int] = {(): 0}
    tokens, parents_out, logprobs = [], [], []
    for path in spine + rest:
        if len(tokens) == budget:
            break
        if path[:-1] not in kept:
            continue
        kept[path] = len(kept)
        tokens.append(int(candidates[len(path) - 1, path[-1]]))
        parents_out.append(kept[path[:-1]])
        logprobs.append(own[path])
    return Tree(tuple(tokens), tuple(parents_out), tuple(logprobs))
