"""Candidate trees: where the draft's top choice at a block position misses, the target's token is often
its second or third, so a step can verify several continuations at once.

The DFlash draft scores every block position in one pass; position d's top-k tokens and their
log-probabilities are independent of the tokens chosen before it, so a prefix (t1 .. td) scores the sum
of its tokens' log-probabilities. A tree holds the `budget` best prefixes, found best-first without
enumerating the k^depth product: a prefix is expanded only when popped, into its next sibling (same
parent, next rank) and its first child (next position, rank 0). Every score is <= its parent's, so the
set is ancestor-closed. The spine-first rule takes the argmax chain first (so a tree never accepts less
than the chain it contains), then best-first for the rest.

Node 0 is the row's pending token (the root); nodes 1..n are the candidates, each after its parent.
The target verifies all of them in one pass in which a node sees the context and its ancestors only, at
position context length + depth (`ForwardBatch.tree`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

TreeRule = Literal["best-first", "spine-first"]
TREE_RULES: tuple[TreeRule, ...] = ("best-first", "spine-first")


@dataclass(frozen=True)
class Tree:
    """Node i (1..n) holds tokens[i - 1] and hangs under node parents[i - 1] < i; node 0 is the root.
    `logprobs`: the draft's log-probability of each node's token at its position (empty for a copy)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    logprobs: tuple[float, ...] = ()

    @classmethod
    def chain(cls, tokens: list[int]) -> Tree:
        return cls(tuple(tokens), tuple(range(len(tokens))))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Per node, root included: its depth (the root 0)."""
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return depth

    def path_tokens(self, node: int) -> list[int]:
        """The tokens of `node`'s ancestors below the root and its own, root side first."""
        tokens = []
        while node:
            tokens.append(self.tokens[node - 1])
            node = self.parents[node - 1]
        return tokens[::-1]

    def line(self, node: int) -> list[int]:
        """`node` and its most probable descent: its first child (the draft's best), that one's, ..."""
        out = [node]
        while self.children[out[-1]]:
            out.append(min(self.children[out[-1]].values()))
        return out

    def union(self, other: Tree) -> tuple[Tree, tuple[int, ...]]:
        """This tree with `other` merged in, root on root: each of other's nodes (parents first) becomes the
        node already holding its token under its parent's place (siblings never share a token), or a new
        one after this tree's nodes. Returns the tree and, per node of `other`, the node it became.
        Log-probabilities are kept where both trees carry them."""
        tokens, parents = list(self.tokens), list(self.parents)
        logprobs = list(self.logprobs) if self.logprobs and other.logprobs else []
        children = [dict(c) for c in self.children]
        placed = [0]
        for i, (token, parent) in enumerate(zip(other.tokens, other.parents)):
            at = placed[parent]
            node = children[at].get(token)
            if node is None:
                tokens.append(token)
                parents.append(at)
                logprobs += [other.logprobs[i]] if logprobs else []
                children.append({})
                node = children[at][token] = len(tokens)
            placed.append(node)
        return Tree(tuple(tokens), tuple(parents), tuple(logprobs)), tuple(placed[1:])

    @cached_property
    def children(self) -> list[dict[int, int]]:
        """Per node, root included: its children by token (siblings never share a token)."""
        out: list[dict[int, int]] = [{} for _ in range(self.size + 1)]
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents), start=1):
            out[parent][token] = node
        return out


def build_tree(logprobs: torch.Tensor, ids: torch.Tensor, budget: int, rule: TreeRule) -> Tree:
    """The tree of `budget` nodes (fewer only when k^depth is smaller) from one row's draft ranking:
    logprobs / ids [depth, k], each position's best first."""
    logp, ranked = logprobs.tolist(), ids.tolist()
    depth, k = len(logp), len(logp[0]) if logp else 0
    nodes: list[tuple[int, int, float]] = []  # (token, parent, log-probability)
    heap: list[tuple[float, int, int, int, int, float]] = []  # (-score, order, position, rank, parent, base)
    order = 0

    def push(position: int, rank: int, parent: int, base: float) -> None:
        nonlocal order
        if position < depth and rank < k:
            heapq.heappush(heap, (-(base + logp[position][rank]), order, position, rank, parent, base))
            order += 1

    if rule == "spine-first":
        base = 0.0
        for position in range(min(depth, budget)):
            nodes.append((ranked[position][0], position, logp[position][0]))
            push(position, 1, position, base)  # the spine node's next sibling
            base += logp[position][0]
    else:
        push(0, 0, 0, 0.0)
    while heap and len(nodes) < budget:
        negative, _, position, rank, parent, base = heapq.heappop(heap)
        nodes.append((ranked[position][rank], parent, logp[position][rank]))
        push(position, rank + 1, parent, base)
        push(position + 1, 0, len(nodes), -negative)
    return Tree(*(tuple(column) for column in zip(*nodes))) if nodes else Tree((), ())


def with_spine(logprobs: torch.Tensor, ids: torch.Tensor, spine: list[int],
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's ranking (logprobs / ids [depth, w], best first) cut to k per position, each position's
    `spine` token (which the ranking holds) moved first: built "spine-first", the tree's spine is then the
    given chain (a sampled proposal, rejection.py), its other nodes the best of the rest."""
    order = []
    for position, token in enumerate(spine):
        first = int((ids[position] == token).nonzero()[0])
        rest = [rank for rank in range(ids.shape[1]) if rank != first]
        order.append([first] + rest[: k - 1])
    index = torch.tensor(order, dtype=torch.long)
    return logprobs.gather(-1, index), ids.gather(-1, index)
