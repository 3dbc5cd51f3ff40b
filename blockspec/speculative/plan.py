"""What a decode step will do, decided before anything runs: the speculative settings, and each step's
`StepPlan` (which rows verify what), chosen by `choose_plan` with the governor's estimates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from blockspec.config import EngineConfig
from blockspec.engine.sequence import Sequence
from blockspec.errors import BlockspecError
from blockspec.models.draft_config import DraftConfig
from blockspec.speculative.proposal import AcceptRule
from blockspec.speculative.tree import TreeRule

Source = Literal["plain", "draft", "lookup", "merged"]
MergeRule = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class DraftShape:
    """What a drafted row verifies: its block's chain (tree_budget 0) or a tree of tree_budget nodes."""

    block_size: int
    tree_budget: int = 0

    @property
    def width(self) -> int:
        """Tokens a drafted row verifies, its pending one included."""
        return self.tree_budget + 1 if self.tree_budget else self.block_size


@dataclass
class Speculation:
    """A decoder's speculative settings, resolved (the block size from the draft unless overridden)."""

    block_size: int  # the DFlash block: the pending token + block_size - 1 drafted ones
    mask_token_id: int
    lookup_ngram: int = 0  # prompt lookup: the shortest context match proposed from (0: off)
    lookup_width: int = 0  # prompt lookup: tokens verified per step, the pending one included
    tree_budget: int = 0  # candidate trees of this many nodes from the draft's ranking (0: its chain only)
    tree_topk: int = 4  # a tree's tokens per block position, at most
    tree_rule: TreeRule = "best-first"
    # a row with a copy verifies it merged into its draft's candidates as one tree (merge.py): as the
    # governor decides (auto; without one: never), on every such step (always), or never
    merge: MergeRule = "auto"
    accept: AcceptRule = "match"  # how sampled requests judge candidates (accept.py)

    @classmethod
    def from_config(cls, cfg: EngineConfig, draft: DraftConfig, vocab: int) -> Speculation:
        """The settings for a draft (its block size and mask token) with `vocab` proposable tokens."""
        if cfg.speculative_tree_budget and cfg.speculative_tree_topk > vocab:
            raise BlockspecError(f"speculative_tree_topk={cfg.speculative_tree_topk} exceeds the draft's "
                                 f"{vocab} proposable tokens; lower --speculative-tree-topk.")
        merge = cfg.prompt_lookup_merge if cfg.adaptive_speculation else cfg.prompt_lookup_merge.replace(
            "auto", "never")  # auto is the governor's choice: without one, copies alone
        return cls(draft.block_size, draft.mask_token_id, cfg.prompt_lookup_ngram,
                   cfg.prompt_lookup_block_size or max(4, draft.block_size), cfg.speculative_tree_budget,
                   cfg.speculative_tree_topk, cfg.speculative_tree_rule, merge, cfg.speculative_accept)

    @property
    def shapes(self) -> tuple[DraftShape, ...]:
        """The drafted steps there are to choose from, smallest first: the chain and, where a tree budget N
        is set, trees of N nodes and of N / 2 and N / 4 (those >= 2)."""
        n = self.tree_budget
        budgets = {b for b in (n // 4, n // 2) if b >= 2} | ({n} if n else set())
        return tuple(DraftShape(self.block_size, b) for b in [0, *sorted(budgets)])

    @property
    def merged_width(self) -> int:
        """The widest merged step's rows per sequence (0: none are taken): the widest drafted shape's
        candidates and a whole copy beside them, the pending token once."""
        merging = self.lookup_ngram and self.merge != "never"
        return max(shape.width for shape in self.shapes) + self.lookup_width - 1 if merging else 0

    @property
    def step_width(self) -> int:
        """The most rows one decode step writes past a sequence's cache length (its scratch rows)."""
        lookup = self.lookup_width if self.lookup_ngram else 0
        return max(max(shape.width for shape in self.shapes), lookup, self.merged_width)


@dataclass(frozen=True)
class StepPlan:
    """One decode step: every row verifies at most `width` tokens, its pending token plus candidates from
    its source ("plain": none; "draft": the DFlash draft's block_size - 1, or a tree of the draft's top
    choices by `shape`; "lookup": its `copies` entry; "merged": its draft's candidates and its copy as one
    tree), in one target pass; acceptance looks at the first `judged[row]` of them (a drafted row's
    candidates in a wider mixed step are padded). `capture`: the step keeps the target's features for the
    draft."""

    width: int
    sources: tuple[Source, ...]
    copies: tuple[tuple[int, ...], ...]  # per row: its prompt-lookup copy (empty unless "lookup", "merged")
    judged: tuple[int, ...]
    capture: bool
    shape: DraftShape | None = None  # what drafted rows verify (None: no row drafts)

    @classmethod
    def plain(cls, rows: int, capture: bool) -> StepPlan:
        return cls(1, ("plain",) * rows, ((),) * rows, (0,) * rows, capture)

    @classmethod
    def dflash(cls, rows: int, shape: DraftShape) -> StepPlan:
        return cls(shape.width, ("draft",) * rows, ((),) * rows, (shape.width - 1,) * rows, True, shape)

    @classmethod
    def lookup(cls, copies: list[list[int]], speculation: Speculation,
               shape: DraftShape | None = None) -> StepPlan:
        """Rows with a copy verify it, the others (if any) their draft's candidates (`shape`, the chain
        unless given), in one pass wide enough for both."""
        shape = shape or speculation.shapes[0]
        drafted = not all(copies)
        width = max(speculation.lookup_width, shape.width) if drafted else speculation.lookup_width
        sources = tuple("lookup" if c else "draft" for c in copies)
        judged = tuple(len(c) if c else shape.width - 1 for c in copies)
        return cls(width, sources, tuple(tuple(c) for c in copies), judged, True, shape if drafted else None)

    @classmethod
    def merged(cls, copies: list[list[int]], speculation: Speculation, shape: DraftShape) -> StepPlan:
        """Rows with a copy verify it merged into their draft's candidates (`shape`) as one tree
        (merge.py), the others their draft's candidates alone; as wide as a row's candidates and a whole
        copy beside them (the merged trees are usually narrower: the step runs as wide as its widest)."""
        sources = tuple("merged" if c else "draft" for c in copies)
        judged = tuple(shape.width - 1 + len(c) for c in copies)
        return cls(shape.width + speculation.lookup_width - 1, sources, tuple(tuple(c) for c in copies),
                   judged, True, shape)

    @property
    def kind(self) -> Literal["plain", "dflash", "lookup", "mixed", "merged"]:
        kinds = set(self.sources)
        if kinds == {"plain"}:
            return "plain"
        if "merged" in kinds:
            return "merged"
        return "dflash" if kinds == {"draft"} else "lookup" if kinds == {"lookup"} else "mixed"

    @property
    def drafts(self) -> bool:
        """Whether the draft runs this step (it then takes the verified rows' features at once)."""
        return "draft" in self.sources or "merged" in self.sources

    @property
    def trees(self) -> bool:
        """Whether rows verify trees (the step then runs with tree attention): drafted trees, or copies
        merged into the draft's candidates."""
        return self.shape is not None and (self.shape.tree_budget > 0 or "merged" in self.sources)


def choose_plan(seqs: list[Sequence], copies: list[list[int]], speculation: Speculation,
                governor) -> StepPlan:
    """Where some row's context has a match: a merged step (those rows' copies and draft candidates as one
    tree each) if the settings say always, or auto and the governor expects it to beat the others. Else
    prompt lookup where every row has a match (a copy is right far more often than the draft) and the
    governor expects it to beat a plain step; when only some rows have one, a mixed step if the governor
    expects it to beat a drafted step for all; otherwise a drafted step (its chain or its tree, whichever
    the governor expects to commit tokens faster) or, where the governor expects speculating not to pay, a
    plain one (which keeps the target's features, so the draft can catch up later). governor None: always
    speculate, with the tree if one is set, merging only if the settings say always."""
    shapes = speculation.shapes
    shape = shapes[-1] if governor is None or len(shapes) == 1 else governor.shape(seqs, shapes)
    copied = [bool(c) for c in copies]
    if any(copied) and (speculation.merge == "always" or (
            speculation.merge == "auto" and governor is not None
            and governor.merge(seqs, copied, shape, speculation.lookup_width))):
        return StepPlan.merged(copies, speculation, shape)
    if all(copied) and (governor is None or governor.lookup_pays(seqs, speculation.lookup_width)):
        return StepPlan.lookup(copies, speculation, shape)
    if any(copied) and not all(copied) and (governor is None
                                            or governor.mix(seqs, copied, shape, speculation.lookup_width)):
        return StepPlan.lookup(copies, speculation, shape)
    if governor is None or governor.speculate(seqs, shape):
        return StepPlan.dflash(len(seqs), shape)
    return StepPlan.plain(len(seqs), capture=True)
