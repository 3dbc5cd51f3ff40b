"""What a decode step will do, decided before anything runs: the speculative settings, and each step's
`StepPlan` (which rows verify what), chosen by `choose_plan` with the governor's estimates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from blockspec.engine.sequence import Sequence

Source = Literal["plain", "draft", "lookup"]


@dataclass
class Speculation:
    """A decoder's speculative settings, resolved (the block size from the draft unless overridden)."""

    block_size: int  # the DFlash block: the pending token + block_size - 1 drafted ones
    mask_token_id: int
    lookup_ngram: int = 0  # prompt lookup: the shortest context match proposed from (0: off)
    lookup_width: int = 0  # prompt lookup: tokens verified per step, the pending one included

    @property
    def step_width(self) -> int:
        """The most rows one decode step writes past a sequence's cache length (its scratch rows)."""
        return max(self.block_size, self.lookup_width if self.lookup_ngram else 0)

    @property
    def row_counts(self) -> tuple[int, ...]:
        """Rows per sequence of its verify and draft passes (for tuning the CPU weight layouts)."""
        return (self.block_size, self.lookup_width)


@dataclass(frozen=True)
class StepPlan:
    """One decode step: every row verifies `width` tokens, its pending token plus candidates from its
    source ("plain": none; "draft": the DFlash draft's block_size - 1; "lookup": its `copies` entry), in one
    target pass; acceptance looks at the first `judged[row]` of them (a drafted row's block in a wider mixed
    step is padded). `capture`: the step keeps the target's features for the draft."""

    width: int
    sources: tuple[Source, ...]
    copies: tuple[tuple[int, ...], ...]  # per row: its prompt-lookup candidates (empty unless "lookup")
    judged: tuple[int, ...]
    capture: bool

    @classmethod
    def plain(cls, rows: int, capture: bool) -> StepPlan:
        return cls(1, ("plain",) * rows, ((),) * rows, (0,) * rows, capture)

    @classmethod
    def dflash(cls, rows: int, block_size: int) -> StepPlan:
        return cls(block_size, ("draft",) * rows, ((),) * rows, (block_size - 1,) * rows, True)

    @classmethod
    def lookup(cls, copies: list[list[int]], speculation: Speculation) -> StepPlan:
        """Rows with a copy verify it, the others (if any) their draft block, in one pass wide enough for
        both."""
        size, lookup_width = speculation.block_size, speculation.lookup_width
        width = max(lookup_width, size) if not all(copies) else lookup_width
        sources = tuple("lookup" if c else "draft" for c in copies)
        judged = tuple(len(c) if c else size - 1 for c in copies)
        return cls(width, sources, tuple(tuple(c) for c in copies), judged, True)

    @property
    def kind(self) -> Literal["plain", "dflash", "lookup", "mixed"]:
        kinds = set(self.sources)
        if kinds == {"plain"}:
            return "plain"
        return "dflash" if kinds == {"draft"} else "lookup" if kinds == {"lookup"} else "mixed"

    @property
    def drafts(self) -> bool:
        """Whether the draft runs this step (it then takes the verified rows' features at once)."""
        return "draft" in self.sources


def choose_plan(seqs: list[Sequence], copies: list[list[int]], speculation: Speculation,
                governor) -> StepPlan:
    """Prompt lookup where a row's context has a match (its copy is right far more often than the draft);
    when only some rows have one, a mixed step if the governor expects it to beat a DFlash step for all;
    otherwise a DFlash step or, where the governor expects speculating not to pay, a plain one (which keeps
    the target's features, so the draft can catch up later). governor None: always speculate."""
    copied = [bool(c) for c in copies]
    block_size = speculation.block_size
    if any(copied) and (all(copied) or governor is None
                        or governor.mix(seqs, copied, block_size, speculation.lookup_width)):
        return StepPlan.lookup(copies, speculation)
    if governor is None or governor.speculate(seqs, block_size):
        return StepPlan.dflash(len(seqs), block_size)
    return StepPlan.plain(len(seqs), capture=True)
