"""Merged steps: a row's prompt-lookup copy and its DFlash candidates verified together, as one tree.

Where the context repeats, a copy from it is right far more often than the draft; elsewhere the draft is.
A row that has both need not choose: the draft's candidates (its chain, or its tree of top choices) join
the copy's chain as more branches, sharing its nodes where they share a prefix (siblings never share a
token), and the target verifies the whole tree in one pass. Acceptance walks it as any tree (accept.py),
so the committed tokens are exactly the target's, and the step keeps whichever branch the target agrees
with. The copy's nodes come first (1..len(copy)): the walk asks for the target's outputs along the first
children first, and the copy is the likelier branch; an accepted copy is already in place in the cache.

One merged step also tells what either proposer alone would have kept: the walk through the merged tree
is the walk through either part until it leaves that part (the target's token at a node is the same
whichever tree holds it), so the draft's candidates alone keep the accepted nodes up to the first the
draft did not propose, and the copy alone the accepted nodes while they lie on its chain. The governor
learns all three acceptance rates from each merged step (under the "rejection" rule a sibling's test
changes the residual the others meet, so there these are estimates).
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.speculative.tree import Tree


@dataclass(frozen=True)
class MergedTree:
    tree: Tree  # the copy's chain (nodes 1..copied), then the draft's candidates that it lacks
    copied: int  # the copy's length
    drafted: frozenset[int]  # the nodes the draft proposed (the copy's too where the two agree)
    placed: tuple[int, ...] = ()  # per node of the draft's tree, the node it became

    @classmethod
    def of(cls, draft: Tree, copy: list[int]) -> MergedTree:
        tree, placed = Tree.chain(copy).union(draft)
        return cls(tree, len(copy), frozenset(placed), placed)

    def sources(self, path: list[int]) -> list[str]:
        """Each accepted node's proposer: "draft" where the draft proposed its token (it would have been
        kept without the copy), else "lookup"."""
        return ["draft" if node in self.drafted else "lookup" for node in path]

    def alone(self, path: list[int]) -> tuple[int, int]:
        """The tokens this step would have committed (the target's own included) verifying the draft's
        candidates alone, and the copy alone, given the merged tree's accepted nodes `path`."""
        drafted = next((i for i, node in enumerate(path) if node not in self.drafted), len(path))
        copied = next((i for i, node in enumerate(path) if i >= self.copied or node != i + 1), len(path))
        return drafted + 1, copied + 1
