"""Adaptive speculation: run a DFlash step only when it is expected to beat a plain decode step.

A DFlash step commits tau tokens per row (tau: the mean accept length, bonus included) but costs more
than a plain step, by a factor that depends on the hardware, the block size and the batch size (on a
2-core CPU ~1.35x at B=2; on a GPU at batch 1 it should be barely more than 1x, not measured yet). So the
governor measures both: the wall time of each kind of step, per (block size, batch size), and each
sequence's recent tau (a slow moving average: single accept lengths are noisy, and chasing them
speculates on lucky streaks that do not last; a new sequence starts from the average over all sequences).
A kind of step costs the median of its last `window` times: one stalled step (another process on the core,
a page fault) would otherwise lift an average for long, and an inflated plain-step cost keeps the governor
speculating where plain steps are faster, with no plain steps left to correct it.
It speculates when mean tau x plain-step time > DFlash-step time, i.e. when DFlash is expected to commit
more tokens per second. Neither estimate is trusted forever: after `probe_spec_every` plain steps in a
row it speculates once (the text may have become predictable again), and after `probe_plain_every` DFlash
steps in a row it decodes plainly once (the plain cost may have changed).

Output is unaffected: a plain step is exactly the baseline, and it still captures the target's features
for the draft (kept on the sequence and injected in one pass before its next DFlash step), so speculation
can resume at any step. Only speed changes.

Prompt lookup (lookup.py) steps are timed too, under their width: a step where every row has a context
match verifies the copies if `lookup_pays` (the all-row lookup tau x plain-step time > the wide step's
time); when only some rows have one, `mix` weighs a step at the lookup width (those rows verify their copy,
at the all-row lookup tau) against a DFlash step at block size B for every row. The governor only
estimates; `plan.py` turns its answers into a step plan, and it learns from each finished step through
`record`.

Where candidate trees are set (tree.py), a drafted step is a chain or a tree, each with its own cost and
tau: `shape` picks the one expected to commit tokens faster (each is tried first, and the one not chosen
is probed again after `probe_plain_every` drafted steps), and `speculate` weighs it against a plain step.

A merged step (merge.py: the copied rows verify their copy and their draft's candidates as one tree) has
its own cost, per drafted shape and batch size, and its own tau per sequence; `merge` weighs it against
the copies alone (a lookup or mixed step), a drafted step and a plain step. A merged step also says what
the copy alone and the draft's candidates alone would have committed (exactly: `MergedTree.alone`), which
moves the lookup tau and the shape's tau as if those steps had run: while merged steps win, only the
others' costs go stale, so after `probe_plain_every` merged steps in a row the next copy step is left to
the other rules once, and a merged step not taken for `probe_plain_every` steps is tried again.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from blockspec.engine.sequence import Sequence
from blockspec.speculative.plan import DraftShape, StepPlan

MERGED = "merged"  # with a shape: the key of merged steps' costs and taus


@dataclass
class SpecGovernor:
    window: int = 9  # recent times per kind of step whose median is its cost
    tau_alpha: float = 0.1  # weight of the newest accept length in the tau moving averages (noisier)
    probe_spec_every: int = 16
    probe_plain_every: int = 64
    # (shape, batch) for drafted steps, (width, batch) for plain and lookup steps -> recent seconds per step
    _times: dict[tuple, deque] = field(default_factory=dict)
    _tau: dict[DraftShape, float] = field(default_factory=dict)  # over all sequences (new ones start here)
    _streak: tuple[bool, int] = (True, 0)  # (kind of the last steps, how many in a row)
    _drafted: int = 0  # drafted steps so far
    _last_drafted: dict[DraftShape, int] = field(default_factory=dict)  # shape -> when it last ran
    _lookup_tau: float | None = None  # accept length of a prompt-lookup row, over all rows and sequences
    _steps: int = 0  # steps recorded so far
    _last_merged: int = 0  # the step count after the latest merged step
    _merged_run: int = 0  # merged steps in a row

    def __post_init__(self) -> None:
        if not 0 < self.tau_alpha <= 1 or min(self.window, self.probe_spec_every, self.probe_plain_every) < 1:
            raise ValueError(f"SpecGovernor: tau_alpha={self.tau_alpha} must be in (0, 1] and window="
                             f"{self.window} and the probe intervals ({self.probe_spec_every}, "
                             f"{self.probe_plain_every}) >= 1.")

    def seconds(self, key: tuple) -> float | None:
        """The cost of a kind of step (see `_times`): the median of its recent times; None if never run."""
        times = self._times.get(key)
        return statistics.median(times) if times else None

    def _time(self, key: tuple, seconds: float) -> None:
        self._times.setdefault(key, deque(maxlen=self.window)).append(seconds)

    @staticmethod
    def _average(old: float | None, new: float, alpha: float) -> float:
        return new if old is None else old + alpha * (new - old)

    def expected_tau(self, seq: Sequence, shape: DraftShape | tuple) -> float | None:
        """Its estimate for a drafted shape, or a merged one ((MERGED, shape)); a new sequence's: the
        average over all sequences."""
        return seq.tau_estimates.get(shape, self._tau.get(shape))

    def shape(self, seqs: list[Sequence], shapes: tuple[DraftShape, ...]) -> DraftShape:
        """The drafted step (chain or tree) expected to commit tokens fastest for this batch: one not run yet
        at this batch size, or not for `probe_plain_every` drafted steps, first."""
        rates = {}
        for shape in shapes:
            seconds = self.seconds((shape, len(seqs)))
            taus = [self.expected_tau(s, shape) for s in seqs]
            stale = self._drafted - self._last_drafted.get(shape, -1 << 30) >= self.probe_plain_every
            if seconds is None or None in taus or stale:
                return shape
            rates[shape] = sum(taus) / seconds
        return max(shapes, key=rates.get)

    def speculate(self, seqs: list[Sequence], shape: DraftShape) -> bool:
        """Whether the next step for this batch should be a drafted step of this shape."""
        spec = self.seconds((shape, len(seqs)))
        plain = self.seconds((1, len(seqs)))
        taus = [self.expected_tau(s, shape) for s in seqs]
        if spec is None or None in taus:
            return True  # not measured yet at this block size / batch size, or a sequence never tried
        if plain is None:
            return False
        kind, run = self._streak
        if run >= (self.probe_plain_every if kind else self.probe_spec_every):
            return not kind
        return sum(taus) / len(taus) * plain > spec

    def lookup_pays(self, seqs: list[Sequence], width: int) -> bool:
        """Whether a step verifying every row's copy (`width` rows per sequence) is expected to commit
        tokens faster than a plain step: measured first, and probed again after `probe_spec_every` plain
        steps in a row (the text may have turned repetitive)."""
        wide, plain = self.seconds((width, len(seqs))), self.seconds((1, len(seqs)))
        if wide is None or plain is None or self._lookup_tau is None:
            return True
        kind, run = self._streak
        return (not kind and run >= self.probe_spec_every) or self._lookup_tau * plain > wide

    def mix(self, seqs: list[Sequence], copied: list[bool], shape: DraftShape, width: int) -> bool:
        """Whether a step verifying the copied rows' lookups (`width` rows per sequence, the other rows'
        drafted candidates padded to it) is expected to commit tokens faster than a drafted step of this
        shape for all rows. Measures the wide step first where it has no estimate."""
        wide = self.seconds((max(width, shape.width), len(seqs)))
        narrow = self.seconds((shape, len(seqs)))
        taus = [self.expected_tau(s, shape) for s in seqs]
        if wide is None or narrow is None or self._lookup_tau is None or None in taus:
            return True
        mixed = sum(self._lookup_tau if c else tau for c, tau in zip(copied, taus))
        return mixed / wide >= sum(taus) / narrow

    def merge(self, seqs: list[Sequence], copied: list[bool], shape: DraftShape, width: int) -> bool:
        """Whether a merged step (the copied rows' copies, `width` rows with the pending token, merged into
        their candidates of this shape; the other rows their candidates alone) is expected to commit tokens
        faster than the copies alone (a lookup step, or mixed where some rows have none), a drafted step
        for all rows and a plain step, those measured. Measured itself first, then the copies alone."""
        n = len(seqs)
        merged = self.seconds(((MERGED, shape), n))
        taus = [self.expected_tau(s, (MERGED, shape) if c else shape) for s, c in zip(seqs, copied)]
        drafted = [self.expected_tau(s, shape) for s in seqs]
        copy_only = self.seconds((width if all(copied) else max(width, shape.width), n))
        copy_taus = [self._lookup_tau if c else tau for c, tau in zip(copied, drafted)]
        if merged is None or None in taus or self._steps - self._last_merged >= self.probe_plain_every:
            return True
        if copy_only is None or None in copy_taus or self._merged_run >= self.probe_plain_every:
            return False  # the copies alone are measured next, and probed again after a merged streak
        rivals = [sum(copy_taus) / copy_only]
        if self.seconds((shape, n)) is not None and None not in drafted:
            rivals.append(sum(drafted) / self.seconds((shape, n)))
        if self.seconds((1, n)) is not None:
            rivals.append(n / self.seconds((1, n)))
        return sum(taus) / merged >= max(rivals)

    def record(self, plan: StepPlan, seqs: list[Sequence], seconds: float,
               alone: dict[int, tuple[int, int]] | None = None) -> None:
        """Fold in a finished step: its wall time, under its kind and width, and the rows' accept lengths;
        `alone`: per merged row, what its draft's candidates alone and its copy alone would have committed."""
        self._steps += 1
        self._merged_run = self._merged_run + 1 if plan.kind == "merged" else 0
        if plan.kind == "merged":
            self._time(((MERGED, plan.shape), len(seqs)), seconds)
            self._streak, self._last_merged = (True, 1), self._steps
            for row, (seq, source) in enumerate(zip(seqs, plan.sources)):
                if source == "draft":
                    self.fold_tau(seq, plan.shape)
                elif row in (alone or {}):
                    self.fold_tau(seq, (MERGED, plan.shape), seq.stats.merged_accept_lengths[-1])
                    drafted, copied = alone[row]
                    self.fold_tau(seq, plan.shape, drafted)
                    self._lookup_tau = self._average(self._lookup_tau, copied, self.tau_alpha)
            return
        if plan.kind in ("lookup", "mixed"):
            self._time((plan.width, len(seqs)), seconds)
            self._streak = (True, 1)  # a plain streak ends
            for seq, source in zip(seqs, plan.sources):
                if source == "lookup":
                    tau = seq.stats.lookup_accept_lengths[-1]
                    self._lookup_tau = self._average(self._lookup_tau, tau, self.tau_alpha)
                else:
                    self.fold_tau(seq, plan.shape)
            return
        speculated = plan.kind == "dflash"
        self._time((plan.shape if speculated else 1, len(seqs)), seconds)
        kind, run = self._streak
        self._streak = (speculated, run + 1 if kind == speculated else 1)
        if speculated:
            self._drafted += 1
            self._last_drafted[plan.shape] = self._drafted
            for seq in seqs:
                self.fold_tau(seq, plan.shape)

    def fold_tau(self, seq: Sequence, shape: DraftShape | tuple, tau: int | None = None) -> None:
        """Fold an accept length (default: the sequence's last drafted one) into its tau estimate for this
        shape and the all-sequence one. Its first step moves it from the all-sequence prior, not to its one
        noisy sample: one unlucky first block would otherwise keep it plain until probes slowly pull it
        back."""
        tau = seq.stats.accept_lengths[-1] if tau is None else tau
        seq.tau_estimates[shape] = self._average(self.expected_tau(seq, shape), tau, self.tau_alpha)
        self._tau[shape] = self._average(self._tau.get(shape), tau, self.tau_alpha)
