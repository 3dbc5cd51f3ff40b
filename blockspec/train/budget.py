"""`--time-budget`: a run fitted to an amount of training time. A new run's length is known once its first
steps are timed (CALIBRATION_STEPS, or fewer when they take a tenth of the budget), and until then it warms
up over those steps; the length is refined at each evaluation of the run's first half, and a run past
BUDGET_OVERRUN of the budget stops with a checkpoint (--resume continues it)."""

from __future__ import annotations

from blockspec.train.config import TrainConfig
from blockspec.train.objective import steps_in_budget

CALIBRATION_STEPS = 20  # steps timed (at most; a linear warm-up over them) before the length is set
BUDGET_AIM, BUDGET_OVERRUN = 0.95, 1.1  # fit the run to 95% of the budget; stop with a checkpoint past 110%
UNBOUNDED_STEPS = 10**9


class TimeBudget:
    def __init__(self, cfg: TrainConfig, step: int) -> None:
        """`step`: the run's first (a resumed run keeps the schedule it was fitted to)."""
        self.cfg, self.seconds = cfg, cfg.time_budget
        self.fitting = self.seconds is not None and step == 0
        self.calibrated = not self.fitting
        self.first_step_seconds = 0.0  # the first step's time (allocation, warm-up), set by the loop

    def start(self, total: int, warmup: int) -> tuple[int, int]:
        """The schedule (total steps, warm-up steps) to begin with."""
        return (self.cfg.steps or UNBOUNDED_STEPS, CALIBRATION_STEPS) if self.fitting else (total, warmup)

    def calibrates(self, step: int, elapsed: float) -> bool:
        """Whether this step sets the run's length (it is evaluated too: evaluations count in the fit)."""
        return not self.calibrated and step >= 3 and (step >= CALIBRATION_STEPS
                                                      or elapsed >= self.seconds / 10)

    def refit(self, step: int, elapsed: float, eval_seconds: float, evals: int, total: int, calibrate: bool,
              evaluated: bool) -> tuple[int, int] | None:
        """A new schedule at the calibration step and at each evaluation of the run's first half, else
        None."""
        fit = self.fitting and (calibrate or (self.calibrated and evaluated and 2 * step < total))
        self.calibrated = self.calibrated or calibrate
        if not fit:
            return None
        fitted = steps_in_budget(step, elapsed, eval_seconds, evals, self.cfg.eval_every,
                                 BUDGET_AIM * self.seconds, self.first_step_seconds)
        total = max(step, min(self.cfg.steps or UNBOUNDED_STEPS, fitted))
        return total, max(CALIBRATION_STEPS, round(self.cfg.warmup_ratio * total))

    def overrun(self, elapsed: float) -> bool:
        return self.seconds is not None and self.calibrated and elapsed > BUDGET_OVERRUN * self.seconds
