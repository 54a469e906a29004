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

Before training, `plan_schedule` sizes the probe windows (or says why they do not fit) and `reach` says which
speedup the fit can reach at all.

Pure arithmetic with no clock of its own: the callback feeds it measured seconds, tests feed it known ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.schedule import IntervalUnit, Schedule
from lightning_elastic.time_model import StepTimeModel

# The weight of the latest interval's measured / predicted ratio in the correction (the first one counts fully).
CORRECTION_RATE = 0.5
# A ratio outside these bounds says the measurement, not the time model, is wrong (e.g. a step paused by the OS).
CORRECTION_BOUNDS = (0.25, 4.0)
# A probe step that took more than this many times the window's median was paused (by the OS, another process, a
# garbage collection): with 3 or 4 steps a window, one such step would move `T` by a third. Not a sample of `T`.
PAUSED = 2.0
# The first optimizer steps a process runs are slower than the rest (first touch of memory, the allocator's and the
# kernels' caches): charged to the fit, never samples of step time. Measured in fresh processes, every tensor trained:
# Lite0 on ELPV, steps 1-3 took 0.76-0.89 s against 0.62-0.66 s after; MiniLM on e-mails, step 1 took 1.01 s against
# 0.62 s plain-timed, and a first selected step at step 2 1.37 s against 0.26 s for the next three.
WARMUP_STEPS = 4
# Auto probe windows: their extra cost stays within this share of the planned fit (3%; 4% gave a 228-step fit at 2x
# a second window, 7 samples of `T` instead of 3, for 3.6 s of probes instead of 1.8 s, 6.2% of a cached fit's
# training time instead of 2.5%, and left a cached run's `T` 17% above the full run's step: docs/results.md) ...
PROBE_SHARE = 0.03
# ... in windows of this many steps (shorter only when the fit is too short for one) ...
PROBE_WINDOW = 4
# ... but the first window runs past the process's warm-up steps to measure 2 steady full steps, whenever that costs
# at most FIRST_WINDOW_SHARE of the planned fit. Without them `T` is the profile's pass, which came out 0.68-1.07 of
# the full runs' step over 12 MiniLM runs (the fit lands off its speedup by as much), for 2-4 full steps more.
FIRST_WINDOW, FIRST_WINDOW_SHARE = WARMUP_STEPS + 2, 0.10


@dataclass(frozen=True)
class ProbePlan:
    """How long probe windows are, and before which selections they open.

    Attributes:
        steps: optimizer steps of one probe window.
        every: a window precedes the first selection and every `every`-th after it; the selections in between
            use the importance that the selected tensors' own updates measured.
        first: optimizer steps of the first window.
    """

    steps: int
    every: int
    first: int


def auto_probe_plan(
    total_steps: int | None, selections: int | None, speedup: float, period: float = math.inf
) -> ProbePlan:
    """Probe windows whose extra cost stays within `PROBE_SHARE` of the planned fit, the first measuring `T`.

    A probe step costs a full step `T` where a selected step costs about `T / s`, so `P` probe steps in a fit of
    `N` steps add `P * (1 - 1 / s) * T` to a plan of `N * T / s`: a share of `P * (s - 1) / N`. Windows of
    `PROBE_WINDOW` steps (fewer when even one would exceed the share, or fill the `period` between two selections),
    as many as the share allows, spread evenly over the selections. The first window is `FIRST_WINDOW` steps long
    when that costs at most `FIRST_WINDOW_SHARE` and leaves the first selection half a period to train (its steps
    come out of the share). A fit of unknown length probes before every selection.

    Example:
        >>> auto_probe_plan(total_steps=600, selections=10, speedup=2.0)
        ProbePlan(steps=4, every=3, first=6)
        >>> auto_probe_plan(total_steps=90, selections=2, speedup=3.0)  # 6 steps would be 13% of the fit
        ProbePlan(steps=1, every=2, first=1)
    """
    longest = PROBE_WINDOW if math.isinf(period) else min(PROBE_WINDOW, int(period) - 1)
    if total_steps is None or selections is None:
        return ProbePlan(steps=longest, every=1, first=FIRST_WINDOW if period > 2 * FIRST_WINDOW else longest)
    scale = total_steps / max(speedup - 1.0, 1e-9)  # probe steps per unit of share
    allowed = PROBE_SHARE * scale
    steps = max(1, min(longest, math.floor(allowed)))
    affordable = FIRST_WINDOW_SHARE * scale >= FIRST_WINDOW and period > 2 * FIRST_WINDOW
    first = FIRST_WINDOW if affordable else steps
    windows = 1 + math.floor(max(0.0, allowed - max(first, steps)) / steps)
    return ProbePlan(steps=steps, every=max(1, math.ceil(selections / windows)), first=max(first, steps))


@dataclass(frozen=True)
class ScheduleRefusal:
    """Probe windows that do not fit between two selections.

    Attributes:
        message: the `ElasticConfigError` message (under `fast_dev_run`, why the callback steps aside instead).
    """

    message: str


def plan_schedule(
    interval: int,
    unit: IntervalUnit,
    probe_steps: int | Literal["auto"],
    speedup: float,
    steps_per_epoch: float | tuple[int, ...],
    total_steps: int | None,
) -> Schedule | ScheduleRefusal:
    """The fit's schedule, with probe windows sized by `auto_probe_plan` or as asked; a refusal if they do not fit.

    Example:
        >>> plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(20,), total_steps=100).first_window_end
        6
        >>> plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(20,), total_steps=100).probe_steps
        3
        >>> plan_schedule(2, "step", 2, 2.0, steps_per_epoch=(20,), total_steps=100).message[:43]
        '`probe_steps` must be fewer than the optimi'
    """
    shape = Schedule(interval, unit, 0, steps_per_epoch, 1, total_steps or math.inf)
    period = shape.period
    if probe_steps == "auto":
        selections = None if total_steps is None or math.isinf(period) else 1 + shape.selections_until(total_steps - 1)
        probes = auto_probe_plan(total_steps, selections, speedup, period)
        steps, every, first = probes.steps, probes.every, probes.first
    else:
        steps, every, first = int(probe_steps), 1, int(probe_steps)
    if period <= steps or steps < 1:
        return ScheduleRefusal(
            f"`probe_steps` must be fewer than the optimizer steps between two selections ({period:g} = "
            f"`interval` {interval} x {'steps per epoch' if unit == 'epoch' else '1 step'}). Found: {probe_steps}"
        )
    return replace(shape, probe_steps=steps, probe_every=every, first_probe_steps=first if first > steps else 0)


def late_first_window(schedule: Schedule) -> str | None:
    """The warning when the first probe window runs on past its length (None when it does not).

    Example:
        >>> late_first_window(Schedule(interval=3, unit="step", probe_steps=2))[24:100]
        '`probe_steps` 2 leave the first selection no step to train before the next w'
        >>> late_first_window(Schedule(interval=5, unit="step", probe_steps=2)) is None
        True
    """
    steps, period = schedule.first_steps, schedule.period
    if schedule.first_window_end == steps:
        return None
    return (
        f"ElasticTensorSelection: `probe_steps` {steps} leave the first selection no step to train before the next "
        f"window opens ({period:g} optimizer steps between selections), so the first window runs on until step "
        f"{schedule.first_window_end} and the first selection comes there. Fewer than {period / 2:g} `probe_steps` "
        "select earlier."
    )


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


def at_most(limit: float) -> str:
    """`limit` rounded down to two decimals: a figure shown as a ceiling is never above the true one.

    Example:
        >>> at_most(1.0549), at_most(2.0)
        ('1.05', '2.00')
    """
    return f"{math.floor(limit * 100) / 100:.2f}"


@dataclass(frozen=True)
class Reach:
    """The largest speedup a fit reaches when every selected step is the cheapest selection (see `reach`).

    Attributes:
        floor: the cheapest selected step, as a share of a full step.
        reachable: the largest speedup, this run's profiling left out (it is paid once: the profile is cached).
        this_fit: the largest speedup of this fit, with what its profiling cost.
        scope: what the figures count, in words.
        profile_seconds: what profiling took this run.
        profile_steps: the same in full steps of the time model.
    """

    floor: float
    reachable: float
    this_fit: float
    scope: str
    profile_seconds: float
    profile_steps: float

    def check(self, speedup: float) -> str | None:
        """Refuse a `speedup` out of reach; the warning when only this run's profiling puts it out of reach.

        Raises:
            ElasticConfigError: with the largest reachable speedup (`refusal`).
        """
        if (refusal := self.refusal(speedup)) is not None:
            raise ElasticConfigError(refusal)
        return self.warning(speedup)

    def refusal(self, speedup: float) -> str | None:
        """The `ElasticConfigError` message when `speedup` is out of reach; None when it is not."""
        if self.reachable >= speedup:
            return None
        return (
            f"`speedup` must be at most {at_most(self.reachable)} for this model on this device {self.scope}: the "
            "forward pass and the parts of a step that every selection pays (at least the `train_always` tensors, or "
            f"one tensor) take {self.floor:.0%} of a full step. Train fewer tensors always, use fewer `probe_steps`, "
            f"a longer fit, or a lower speedup. Found: {speedup!r}"
        )

    def warning(self, speedup: float) -> str | None:
        """The warning when only this run's profiling puts `speedup` out of reach; None otherwise."""
        if self.this_fit >= speedup:
            return None
        return (
            f"ElasticTensorSelection: profiling took {self.profile_seconds:.1f} s ({self.profile_steps:.0f} full "
            f"steps) of this fit's budget, so this fit reaches at most {at_most(self.this_fit)}x of the `speedup` "
            f"{speedup!r} asked. The profile is cached: later fits on this device reach {at_most(self.reachable)}x."
        )


def reach(
    model: StepTimeModel,
    required: Sequence[bool],
    forbidden: Sequence[bool],
    schedule: Schedule,
    total_steps: int | None,
    profile_seconds: float,
    full_step: float,
) -> Reach:
    """What a fit can reach: probe steps at full cost, every other step at the cheapest selection.

    Args:
        model: the time model of the profile.
        required, forbidden: the tensors every selection trains, and those none trains.
        schedule: the fit's schedule (its probe windows).
        total_steps: optimizer steps of the fit; None counts per step (fit length unknown, or no plan to keep).
        profile_seconds: what profiling took this run.
        full_step: the profile's full step, the unit of `profile_seconds` in the plan.

    Example:
        >>> model = StepTimeModel(t_dw=(1.0, 1.0), t_dy=(1.0, 1.0), t_fixed=2.0)
        >>> fit = reach(model, [False, False], [False, False], Schedule(4, "step", 1), 8, 6.0, full_step=6.0)
        >>> round(fit.floor, 2), round(fit.reachable, 2), round(fit.this_fit, 2)
        (0.6, 1.33, 1.14)
    """
    floor = model.cheapest(required, forbidden) / model.full
    profile_steps = profile_seconds / model.full
    if total_steps is None:
        return Reach(floor, 1.0 / floor, 1.0 / floor, "(per step)", profile_seconds, profile_steps)
    probes = schedule.probe_steps_between(0, total_steps)
    return Reach(
        floor=floor,
        reachable=reachable_speedup(total_steps, probes, 0.0, floor),
        this_fit=reachable_speedup(total_steps, probes, profile_seconds / full_step, floor),
        scope=f"in a fit of {total_steps} steps with {probes} probe steps at full cost",
        profile_seconds=profile_seconds,
        profile_steps=profile_steps,
    )


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
        """Probe steps train every tensor, so they measure `T`: the mean over every probe step so far, leaving out
        steps that took more than `PAUSED` times their window's median (they were paused, not slow)."""
        if seconds:
            middle = sorted(seconds)[(len(seconds) - 1) // 2]
            seconds = [s for s in seconds if s <= PAUSED * middle]
        if not seconds:
            return
        previous = self.full_step * self.full_samples
        self.full_samples += len(seconds)
        self.full_step = (previous + math.fsum(seconds)) / self.full_samples

    def expected(self, predicted: float) -> float:
        """Seconds a step that the time model predicts at `predicted` measures, as the plan has learnt it."""
        return self.correction * predicted

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
