"""The wall-clock contract: a fit with `speedup=s` takes `1 / s` of the time of the same fit without the callback.

What counts is the training part of the fit: every training step (probe windows included; each step is measured
from the end of the one before, so data loading and the loop count too), plus profiling, selecting and applying
a selection. Validation is the same with and without the callback and is left out.

`WallClockPlan` keeps the account. A fit of `N` optimizer steps may take `N * T / s` seconds, `T` the seconds of a
full step (measured in probe windows, which train every tensor; the profile's estimate before). At each selection
the plan gives the steps until the horizon (the end of the fit, or of the next interval when the fit's length is
unknown) what is left: probe steps ahead are charged at `T` each, the selected steps share the rest. Measured
selected steps feed back twice: they are spent (so any error is made up for later), and the ratio of measured to
predicted seconds corrects the time model's next predictions (so the error is not made again).

Pure arithmetic with no clock of its own: the callback feeds it measured seconds, tests feed it known ones.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# The weight of the latest interval's measured / predicted ratio in the correction (the first one counts fully).
CORRECTION_RATE = 0.5
# A ratio outside these bounds says the measurement, not the time model, is wrong (e.g. a step paused by the OS).
CORRECTION_BOUNDS = (0.25, 4.0)
# Auto probe windows: their extra cost stays within this share of the planned fit ...
PROBE_SHARE = 0.03
# ... in windows of this many steps (shorter only when the fit is too short for one).
PROBE_WINDOW = 4


@dataclass(frozen=True)
class ProbePlan:
    """How long probe windows are, and before which selections they open.

    Attributes:
        steps: optimizer steps of one probe window.
        every: a window precedes the first selection and every `every`-th after it; the selections in between
            use the importance that the selected tensors' own updates measured.
    """

    steps: int
    every: int = 1


def auto_probe_plan(total_steps: int | None, selections: int | None, speedup: float) -> ProbePlan:
    """Probe windows whose extra cost stays within `PROBE_SHARE` of the planned fit.

    A probe step costs a full step `T` where a selected step costs about `T / s`, so `P` probe steps in a fit of
    `N` steps add `P * (1 - 1 / s) * T` to a plan of `N * T / s`: a share of `P * (s - 1) / N`. Windows of
    `PROBE_WINDOW` steps (fewer when even one would exceed the share), as many as the share allows, spread evenly
    over the selections. A fit of unknown length probes before every selection.

    Example:
        >>> auto_probe_plan(total_steps=600, selections=10, speedup=2.0)
        ProbePlan(steps=4, every=3)
        >>> auto_probe_plan(total_steps=100, selections=5, speedup=2.0)
        ProbePlan(steps=3, every=5)
    """
    if total_steps is None or selections is None:
        return ProbePlan(steps=PROBE_WINDOW)
    allowed = PROBE_SHARE * total_steps / max(speedup - 1.0, 1e-9)
    steps = max(1, min(PROBE_WINDOW, math.floor(allowed)))
    windows = max(1, math.floor(allowed / steps))
    return ProbePlan(steps=steps, every=max(1, math.ceil(selections / windows)))


def reachable_speedup(total_steps: int, probe_steps: int, sunk_steps: float, floor: float) -> float:
    """The largest whole-fit speedup: every probe step at full cost, every other step at the cheapest selection.

    Args:
        total_steps: optimizer steps of the fit `N`.
        probe_steps: how many of them lie in probe windows.
        sunk_steps: seconds already spent (profiling), in full steps.
        floor: the cheapest selected step, as a fraction of a full step.

    Example:
        >>> reachable_speedup(total_steps=100, probe_steps=10, sunk_steps=5.0, floor=0.3)
        2.380952380952381
    """
    return total_steps / (sunk_steps + probe_steps + (total_steps - probe_steps) * floor)


@dataclass
class WallClockPlan:
    """The account of the wall-clock contract.

    Args:
        speedup: the asked speedup `s`.
        total_steps: optimizer steps of the whole fit, or None when unknown (then each interval keeps the contract,
            with what was over- or under-spent before carried forward).
        full_step: seconds of a full training step `T` (an estimate until probe steps are measured).

    Example:
        >>> plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=1.0)
        >>> plan.spend(10.0, steps=10)  # ten probe steps at full cost
        >>> plan.target(step=10, horizon=100, probe_steps_ahead=0)  # 50 s planned, 40 s left for 90 steps
        0.4444444444444444
        >>> plan.observe_selected_steps(measured=0.5, predicted=0.4)  # the model predicts 20% too little ...
        >>> plan.target(step=10, horizon=100, probe_steps_ahead=0)  # ... so it is asked for 20% less
        0.3555555555555555
    """

    speedup: float
    total_steps: int | None
    full_step: float
    spent: float = 0.0
    steps_done: int = 0
    correction: float = 1.0
    corrections: int = 0
    full_samples: int = 0
    overhead: float = 0.0

    def planned(self, steps: int | None = None) -> float:
        """Seconds the contract allows for `steps` optimizer steps (default: the whole fit, else the steps done)."""
        if steps is None:
            steps = self.total_steps if self.total_steps is not None else self.steps_done
        return steps * self.full_step / self.speedup

    def spend(self, seconds: float, steps: int = 0) -> None:
        """Charge `seconds` of training time, of which `steps` optimizer steps."""
        self.spent += seconds
        self.steps_done += steps

    def spend_overhead(self, seconds: float) -> None:
        """Charge the method's own work outside steps (profiling, selecting, applying a selection)."""
        self.spent += seconds
        self.overhead += seconds

    def observe_full_steps(self, seconds: list[float]) -> None:
        """Probe steps train every tensor, so they measure `T`: the mean over every probe step so far."""
        if not seconds:
            return
        previous = self.full_step * self.full_samples
        self.full_samples += len(seconds)
        self.full_step = (previous + math.fsum(seconds)) / self.full_samples

    def observe_selected_steps(self, measured: float, predicted: float) -> None:
        """Move the correction towards an interval's measured / predicted (uncorrected) step seconds."""
        if not (measured > 0 and predicted > 0 and math.isfinite(measured) and math.isfinite(predicted)):
            return
        low, high = CORRECTION_BOUNDS
        ratio = min(max(measured / predicted, low), high)
        rate = 1.0 if self.corrections == 0 else CORRECTION_RATE
        self.correction += rate * (ratio - self.correction)
        self.corrections += 1

    def target(self, step: int, horizon: int, probe_steps_ahead: int) -> float:
        """Seconds a selected step may take, as the time model predicts it, from optimizer step `step` to `horizon`.

        What is left of the planned time up to `horizon`, less the probe steps ahead at `T` each, shared by the
        selected steps ahead, then divided by the correction (a step the model predicts at `x` measures about
        `correction * x`). Infinite when no selected step lies ahead.
        """
        selected_ahead = horizon - step - probe_steps_ahead
        if selected_ahead <= 0:
            return math.inf
        left = self.planned(horizon) - self.spent - probe_steps_ahead * self.full_step
        return left / selected_ahead / self.correction

    @property
    def speedup_so_far(self) -> float:
        """Estimated full fine-tuning seconds of the steps done, over the seconds spent on them."""
        return self.steps_done * self.full_step / self.spent if self.spent > 0 else math.nan

    def state_dict(self) -> dict[str, Any]:
        """Plain data for checkpoints."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> WallClockPlan:
        """Rebuild a plan from `state_dict` output.

        Example:
            >>> plan = WallClockPlan(speedup=2.0, total_steps=None, full_step=0.1, spent=3.0)
            >>> WallClockPlan.from_state(plan.state_dict()) == plan
            True
        """
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})
