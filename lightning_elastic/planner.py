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

Before training, `windows.plan_schedule` sizes the probe windows (or says why they do not fit) and `reach` says
which speedup the fit can reach at all.

Pure arithmetic with no clock of its own: the callback feeds it measured seconds, tests feed it known ones.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from lightning_elastic.errors import SpeedupOutOfReach
from lightning_elastic.pace import pace_of
from lightning_elastic.records import Decision, Mask
from lightning_elastic.schedule import Schedule
from lightning_elastic.time_model import StepTimeModel

# The weight of the latest interval's measured / predicted ratio in the correction (the first one counts fully).
CORRECTION_RATE = 0.5
# A ratio outside these bounds says the measurement, not the time model, is wrong (e.g. a step paused by the OS).
CORRECTION_BOUNDS = (0.25, 4.0)
# A probe step that took more than this many times the window's median was paused (by the OS, another process, a
# garbage collection): with 3 or 4 steps a window, one such step would move `T` by a third. Not a sample of `T`.
PAUSED = 2.0
# Before training, a speedup that leaves the selected steps less than this share of a full step above the cheapest
# selection is warned about: its selections train little more than the cheapest set. MiniLM's 90-step first runs at
# 2x had about 0.0-0.05 (the plan left 166-197 ms a step against a cheapest selection of 184-209 ms), trained 2-5
# tensors and reached 78-92% where static last-k, with a step 0.07 of a full step above that floor, trained 17% of
# the tensors and reached 94.9% (docs/results.md).
NARROW_ROOM = 0.05
# After a selection's first REPLAN_AFTER measured steps, a median over REPLAN_TOLERANCE off what the plan expected
# re-plans at once, at most REPLANS times in a row (`replan_due`, `terms.off_plan`).
REPLAN_AFTER, REPLAN_TOLERANCE, REPLANS = 4, 0.10, 2


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


@dataclass(frozen=True)
class Reach:
    """The largest speedup a fit reaches when every selected step is the cheapest selection (see `reach`).

    Attributes:
        floor: the cheapest selected step, as a share of a full step.
        reachable: the largest speedup, this run's profiling left out (what a later fit that reads the profile from
            the cache, the default, reaches).
        this_fit: the largest speedup of this fit, with what its profiling cost.
        scope: what the figures count, in words.
        profile_seconds: what profiling took this run.
        profile_steps: the same in full steps of the time model.
        selected_share: the share of the fit's steps that are selected steps (the others are probe steps).
        own_steps: profiling and probe steps in full steps, the callback's own time as planned (`own_share`).
        total_steps: optimizer steps of the fit (None: not known, or no plan to keep).
    """

    floor: float
    reachable: float
    this_fit: float
    scope: str
    profile_seconds: float
    profile_steps: float
    selected_share: float = 1.0
    own_steps: float = 0.0
    total_steps: int | None = None

    def own_share(self, speedup: float) -> float | None:
        """The callback's own time as planned (profiling, probe steps counted whole) against the fit planned at
        `speedup` (`total_steps / speedup` full steps); None when there is no plan of the whole fit (its length is not
        known, or `calibrate` is off).

        Example:
            >>> model = StepTimeModel(t_dw=(1.0, 1.0), t_dy=(1.0, 1.0), t_fixed=2.0)
            >>> fit = reach(model, [False] * 2, [False] * 2, Schedule(10, "step", 2, total_steps=100), 100, 12.0, 6.0)
            >>> fit.own_steps, fit.own_share(2.0)  # 2 full steps of profiling, 20 probe steps, of a 50-step plan
            (22.0, 0.44)
        """
        return None if self.total_steps is None else self.own_steps * speedup / self.total_steps

    def room(self, speedup: float) -> float:
        """What a selected step may spend above the cheapest selection at `speedup`, on average over the fit and with
        this run's profiling paid, as a share of a full step (negative: out of this fit's reach)."""
        return (1.0 / speedup - 1.0 / self.this_fit) / self.selected_share

    def leaving(self, room: float) -> float:
        """The speedup that leaves the selected steps `room` (see `room`)."""
        return 1.0 / (room * self.selected_share + 1.0 / self.this_fit)

    def check(self, speedup: float) -> str | None:
        """Refuse a `speedup` out of reach; the warning when only this run's profiling puts it out of reach.

        Raises:
            SpeedupOutOfReach: with the largest reachable speedup (`refusal`).
        """
        if (refusal := self.refusal(speedup)) is not None:
            raise SpeedupOutOfReach(refusal, reachable=float(at_most(self.reachable)))
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
        """The warning when only this run's profiling puts `speedup` out of reach, or when it leaves the selected
        steps less than NARROW_ROOM above the cheapest selection; None otherwise."""
        if self.this_fit < speedup:
            return (
                f"ElasticTensorSelection: profiling took {self.profile_seconds:.1f} s ({self.profile_steps:.1f} full "
                f"steps) of this fit's budget, so this fit reaches at most {at_most(self.this_fit)}x of the `speedup` "
                f"{speedup!r} asked; without it (a later fit on this device that reads the profile from the cache) "
                f"{at_most(self.reachable)}x."
            )
        if (room := self.room(speedup)) >= NARROW_ROOM:
            return None
        return (
            f"ElasticTensorSelection: `speedup` {speedup!r} leaves this fit's selected steps {room:.1%} of a full step "
            f"above the cheapest selection ({self.floor:.0%} of a full step: the forward pass and what every selection "
            f"trains), {self.scope} and {self.profile_seconds:.1f} s of profiling: its selections can train little "
            f"more than the cheapest set, and accuracy may fall toward training that set alone. At most "
            f"{at_most(self.leaving(NARROW_ROOM))}x leaves {NARROW_ROOM:.0%}; a longer fit, or a later fit that reads "
            "the profile from the cache (the default), leaves more."
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
        selected_share=max(total_steps - probes, 1) / max(total_steps, 1),
        own_steps=profile_seconds / full_step + probes,
        total_steps=total_steps,
    )


def reach_shortening(
    schedule: Schedule, speedup: float, reach_of: Callable[[Schedule], Reach]
) -> tuple[Schedule, Reach]:
    """What `schedule` reaches (`reach_of`, e.g. `reach` with the fit's model), with a first window longer than the
    others (`windows.auto_probe_plan`'s, to time `T`) cut back to their length when it alone would put `speedup` out
    of this fit's reach: the schedule to run and what it reaches.

    Example:
        >>> model = StepTimeModel(t_dw=(1.0, 1.0), t_dy=(1.0, 1.0), t_fixed=2.0)
        >>> reach_of = lambda schedule: reach(model, [False] * 2, [False] * 2, schedule, 100, 0.0, 5.0)
        >>> long = Schedule(50, "step", 1, first_probe_steps=6)  # 7 probe steps of 100 reach 1.58x, 2 1.63x
        >>> schedule, fit = reach_shortening(long, 1.62, reach_of)
        >>> schedule.first_window_end, round(fit.this_fit, 3)
        (1, 1.634)
        >>> reach_shortening(long, 1.55, reach_of)[0] is long
        True
    """
    limit = reach_of(schedule)
    if schedule.first_probe_steps > schedule.probe_steps and limit.this_fit < speedup:
        short = replace(schedule, first_probe_steps=0)
        shorter = reach_of(short)
        if shorter.this_fit > limit.this_fit:
            return short, shorter
    return schedule, limit


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

    Example:
        >>> plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=1.0)
        >>> plan.spend(10.0, steps=10)  # ten probe steps at full cost
        >>> plan.target(step=10, horizon=100, probe_steps_ahead=0)  # 50 s planned, 40 s left for 90 steps
        0.4444444444444444
        >>> plan.observe_selected_steps(measured=0.5, predicted=0.4)  # the model predicts 20% too little ...
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
        if seconds:
            middle = sorted(seconds)[(len(seconds) - 1) // 2]
            seconds = [s for s in seconds if s <= PAUSED * middle]
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
        left = self.planned(horizon) - self.spent - probe_steps_ahead * self.full_step_now
        return left / selected_ahead / self.correction

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
