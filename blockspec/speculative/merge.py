"""Merged steps: a row's prompt-lookup copy and its DFlash candidates verified together, as one tree.

Where the context repeats, a copy from it is right far more often than the draft; elsewhere the draft is.
A row that has both need not choose: the copy becomes one more branch of the draft's candidates (its
chain, or its tree of top choices), merged with them where the two share a prefix (siblings never share a
token), and the target verifies the whole tree in one pass. Acceptance walks it as any tree (accept.py),
so the committed tokens are exactly the target's, and the step keeps whichever branch the target agrees
with.

One merged step also tells what either proposer alone would have kept: the walk through the merged tree
is the walk through either part until it leaves that part (the target's token at a node is the same
whichever tree holds it), so the draft's candidates alone keep the accepted nodes up to the first that
only the copy holds, and the copy alone the accepted nodes while they lie on its branch. The governor
learns all three acceptance rates from each merged step.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.speculative.tree import Tree


@dataclass(frozen=True)
class MergedTree:
    tree: Tree  # the draft's candidates (nodes 1..drafted), then the copy's tokens they lack
    drafted: int  # the draft's node count
    branch: tuple[int, ...]  # the copy's nodes, one per copied token, root side first

    @classmethod
    def of(cls, draft: Tree, copy: list[int]) -> MergedTree:
        tree, branch = draft.with_branch(copy)
        return cls(tree, draft.size, branch)

    def sources(self, path: list[int]) -> list[str]:
        """Each accepted node's proposer: "lookup" where only the copy held its token, else "draft" (a token
        both proposed is the draft's: it would have been kept without the copy)."""
        return ["draft" if node <= self.drafted else "lookup" for node in path]

    def alone(self, path: list[int]) -> tuple[int, int]:
        """The tokens this step would have committed (the target's own included) verifying the draft's
        candidates alone, and the copy alone, given the merged tree's accepted nodes `path`."""
        drafted = next((i for i, node in enumerate(path) if node > self.drafted), len(path))
        copied = next((i for i, (node, own) in enumerate(zip(path, self.branch)) if node != own),
                      min(len(path), len(self.branch)))
        return drafted + 1, copied + 1
