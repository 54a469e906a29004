"""The wall-clock contract: a fit with `speedup=s` takes `1 / s` of the time of the same fit without the callback.

What counts is the training part of the fit: every training step (probe windows included; each step is measured
from the end of the one before, so data loading and the loop count too), plus profiling, selecting and applying
a selection. Validation is the same with and without the callback and is left out.

`WallClockPlan` keeps the account. A fit of `N` optimizer steps may take `(N * T + W) / s` seconds, `T` the seconds
of a full step (measured in probe windows, which train every tensor; the profile's estimate before) and `W` what full
fine-tuning's first, slower steps take beyond `T` (measured in the first window's warm-up steps); each step counts
at the device's pace as it ran (`pace`: a window run slowly leaves `T` high, the forward passes after it say by how
much). At each selection the plan gives the steps until the horizon (the end of the fit, or of the next interval
when the fit's length is unknown) what is left: probe steps ahead are charged at `T` each, the selected steps share
the rest. Measured selected steps feed back twice: they are spent (so any error is made up for later), and the ratio
of measured to predicted seconds corrects the time model's next predictions (so the error is not made again).

Before training, `windows.plan_schedule` sizes the probe windows (or says why they do not fit) and `reach.reach`
says which speedup the fit can reach at all.

Pure arithmetic with no clock of its own: the callback feeds it measured seconds, tests feed it known ones.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_elastic.pace import pace_of
from lightning_elastic.records import Decision, Mask

# The weight of the latest interval's measured / predicted ratio in the correction (the first one counts fully).
CORRECTION_RATE = 0.5
# A ratio outside these bounds says the measurement, not the time model, is wrong (e.g. a step paused by the OS).
CORRECTION_BOUNDS = (0.25, 4.0)
# A probe step that took more than this many times the window's median was paused (by the OS, another process, a
# garbage collection): with 3 or 4 steps a window, one such step would move `T` by a third. Not a sample of `T`.
PAUSED = 2.0
# After a selection's first REPLAN_AFTER measured steps, a median over REPLAN_TOLERANCE off what the plan expected
# re-plans at once, at most REPLANS times in a row (`replan_due`, `terms.off_plan`).
REPLAN_AFTER, REPLAN_TOLERANCE, REPLANS = 4, 0.10, 2
# What the whole fit reaches, forecast from fewer selected steps than this, is an early figure: a fit's first selected
# steps can run far slower than its later ones (ELPV at 2x, 150 steps: 1.48x forecast from 4 steps; 2.03x at the end).
FORECAST_STEPS = 16


def unpaused(seconds: Sequence[float]) -> list[float]:
    """The steps of a window or an interval that were not paused: none longer than `PAUSED` times their median (the
    lower of the middle two).

    Example:
        >>> unpaused([0.009, 0.010, 0.034, 0.072])  # two steps of a 4-step interval hit by another process
        [0.009, 0.01]
    """
    if not seconds:
        return []
    middle = sorted(seconds)[(len(seconds) - 1) // 2]
    return [s for s in seconds if s <= PAUSED * middle]


def replan_due(ratio: float, decision: Decision, forbidden: Mask) -> bool:
    """Whether a selection whose first steps took `ratio` times what the plan expected of them (the time model's
    seconds times the plan's correction) is re-planned: more than REPLAN_TOLERANCE off, and a new selection could
    differ (not the cheapest selection running slow, nor running fast a selection that every tensor, or the time
    left, did not limit).

    Example:
        >>> bound = Decision(Mask.of([True, False]), (1.0, 1.0), predicted_seconds=1.0, target_seconds=1.0)
        >>> replan_due(1.2, bound, Mask.of([False, False])), replan_due(0.8, bound, Mask.of([False, False]))
        (True, True)
        >>> replan_due(0.8, bound, Mask.of([False, True]))  # every tensor it may train already trains
        False
    """
    everything = all(m or f for m, f in zip(decision.mask, forbidden, strict=True))
    unhurried = decision.predicted_seconds < (1 - REPLAN_TOLERANCE) * decision.target_seconds  # time did not bind
    if (ratio > 1 and decision.starved) or (ratio < 1 and (everything or unhurried)):
        return False
    return abs(ratio - 1.0) > REPLAN_TOLERANCE


@dataclass
class WallClockPlan:
    """The account of the wall-clock contract.

    Args:
        speedup: the asked speedup `s`.
        total_steps: optimizer steps of the whole fit, or None when unknown (then each interval keeps the contract,
            with what was over- or under-spent before carried forward).
        full_step: seconds of a full training step `T` (an estimate until probe steps are measured).
        warmup: seconds the same fit without the callback spends on its process's warm-up beyond `T` a step (its
            first steps are slower), as this process's warm-up full steps measured it (`warmup.FirstWindow.excess`).
        pace: how fast the device runs now against the steps that measured `T` (`pace.pace_of`): a full step now
            takes `T * pace`, and each step done counts `pace` full steps in full fine-tuning's time (`paced_beyond`
            sums what the steps done counted beyond one each).
        reference_forward: the forward pass's seconds in the steps that measured `T` (0: not measured).
        selected_samples: the selected steps the correction has learnt from (`observe_selected_steps`).

    Example:
        >>> plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=1.0)
        >>> plan.spend(10.0, steps=10)  # ten probe steps at full cost
        >>> plan.target(step=10, horizon=100, probe_steps_ahead=0)  # 50 s planned, 40 s left for 90 steps
        0.4444444444444444
        >>> plan.observe_selected_steps([0.5, 0.5], predicted=0.4)  # the model predicts 20% too little ...
        >>> plan.target(step=10, horizon=100, probe_steps_ahead=0)  # ... so it is asked for 20% less
        0.3555555555555555
        >>> plan.reference_forward = 0.3  # the probe steps' forward pass, and the latest steps' at half of it:
        >>> plan.observe_pace([0.15] * 8)  # T was measured slow, so full fine-tuning's 90 steps ahead take less
        >>> round(plan.pace, 3), round(plan.full_fit(), 2)  # 10 steps at 1 s, 90 at 0.556 s
        (0.556, 60.0)
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
    warmup: float = 0.0
    pace: float = 1.0
    paced_beyond: float = 0.0
    reference_forward: float = 0.0
    selected_samples: int = 0

    def planned(self, steps: int | None = None) -> float:
        """Seconds the contract allows for the fit's first `steps` optimizer steps (default: the whole fit, else the
        steps done): what full fine-tuning would take for them (`full_fit`), over the speedup."""
        return self.full_fit(steps) / self.speedup

    def full_fit(self, steps: int | None = None) -> float:
        """Estimated seconds of full fine-tuning for the fit's first `steps` optimizer steps (default as `planned`):
        `T` a step at the pace of each step done (`paced_beyond`) and at today's for those ahead, plus its process's
        warm-up."""
        if steps is None:
            steps = self.total_steps if self.total_steps is not None else self.steps_done
        done = min(steps, self.steps_done)
        beyond = self.paced_beyond * done / self.steps_done if self.steps_done else 0.0
        return (done + beyond + (steps - done) * self.pace) * self.full_step + self.warmup

    @property
    def full_step_now(self) -> float:
        """Seconds of a full step at the device's pace now: what the time model is calibrated to."""
        return self.full_step * self.pace

    def spend(self, seconds: float, steps: int = 0) -> None:
        """Charge `seconds` of training time, of which `steps` optimizer steps (at the pace now)."""
        self.spent += seconds
        self.steps_done += steps
        self.paced_beyond += steps * (self.pace - 1.0)

    def spend_overhead(self, seconds: float) -> None:
        """Charge the method's own work outside steps (profiling, selecting, applying a selection)."""
        self.spent += seconds
        self.overhead += seconds

    def observe_full_steps(self, seconds: list[float], forwards: Sequence[float] = ()) -> None:
        """Probe steps train every tensor, so they measure `T`: the mean over every probe step so far, leaving out
        steps that took more than `PAUSED` times their window's median (paused, not slow), each at its window's pace:
        `forwards`, their forward passes (0: not timed), against the first timed window's (`reference_forward`)."""
        timed = [f for f in forwards if f > 0]
        if self.reference_forward <= 0 and timed:
            self.reference_forward = statistics.median(timed)
        scale = statistics.median(timed) / self.reference_forward if timed else 1.0
        seconds = unpaused(seconds)
        if not seconds:
            return
        previous = self.full_step * self.full_samples
        self.full_samples += len(seconds)
        self.full_step = (previous + math.fsum(seconds) / scale) / self.full_samples

    def observe_pace(self, forwards: Sequence[float]) -> None:
        """The pace from the latest steps' forward passes (`pace.pace_of`); 1 until a window's are observed."""
        self.pace = pace_of(forwards, self.reference_forward)

    def expected(self, predicted: float) -> float:
        """Seconds a step that the time model predicts at `predicted` measures, as the plan has learnt it."""
        return self.correction * predicted

    def observe_selected_steps(self, steps: Sequence[float], predicted: float) -> None:
        """Move the correction towards an interval's measured / predicted (uncorrected) step seconds: the mean of its
        steps that were not paused (`unpaused`). Paused steps are spent all the same (`spend`); taken into the
        correction, two steps of 72 and 34 ms among steps of 8-10 ms (another process) read as a time model 3.95x
        low, and every step target after them starved the selections for the rest of the fit."""
        kept = unpaused(steps)
        measured = math.fsum(kept) / len(kept) if kept else math.nan
        if not (measured > 0 and predicted > 0 and math.isfinite(measured) and math.isfinite(predicted)):
            return
        low, high = CORRECTION_BOUNDS
        ratio = min(max(measured / predicted, low), high)
        rate = 1.0 if self.corrections == 0 else CORRECTION_RATE
        self.correction += rate * (ratio - self.correction)
        self.corrections += 1
        self.selected_samples += len(kept)

    def target(self, step: int, horizon: int, probe_steps_ahead: int) -> float:
        """Seconds a selected step may take, as the time model predicts it, from optimizer step `step` to `horizon`.

        What is left of the planned time up to `horizon`, less the probe steps ahead at `T` each, shared by the
        selected steps ahead, then divided by the correction (a step the model predicts at `x` measures about
        `correction * x`). Infinite when no selected step lies ahead.
        """
        selected_ahead = horizon - step - probe_steps_ahead
        if selected_ahead <= 0:
            return math.inf
        left = self.planned(horizon) - self.spent - probe_steps_ahead * self.full_step_now
        return left / selected_ahead / self.correction

    def reachable(self, step: int, probe_steps_ahead: int, cheapest: float) -> float | None:
        """The whole fit's speedup if every selected step from optimizer step `step` to the fit's end measured
        `cheapest` seconds (the cheapest selection, as the plan expects it) and the probe steps ahead `T` at today's
        pace each; None when the fit's length is not known.

        Example:
            >>> plan = WallClockPlan(speedup=3.0, total_steps=100, full_step=1.0, spent=12.0, steps_done=10)
            >>> round(plan.reachable(10, probe_steps_ahead=2, cheapest=0.3), 3)  # 100 s in 12 + 2 + 88 x 0.3 = 40.4
            2.475
        """
        if self.total_steps is None:
            return None
        ahead = max(self.total_steps - step, 0)
        probes = min(probe_steps_ahead, ahead)
        best = self.spent + probes * self.full_step_now + (ahead - probes) * cheapest
        return self.full_fit() / best if best > 0 else math.inf

    @property
    def speedup_so_far(self) -> float:
        """Estimated full fine-tuning seconds of the steps done, over the seconds spent on them."""
        return self.full_fit(self.steps_done) / self.spent if self.spent > 0 else math.nan

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
