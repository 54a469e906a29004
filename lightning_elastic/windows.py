"""Probe windows, sized before training: how long, before which selections, and the warm-up steps around them.

A probe window trains every candidate tensor for a few ordinary steps, so that their importance is measured and its
steps time the full step `T` of the wall-clock plan (`planner.WallClockPlan`). `plan_schedule` gives the fit its
`Schedule`: with `probe_steps="auto"` windows and the first profile together cost a small share of the fit
(`auto_probe_plan`, and `after_profile` once the profile's cost is known), the first window long enough to time steady
steps after the process's warm-up steps when the fit can pay for it (which steps those are, and when that window runs
on: `warmup`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from lightning_elastic import warmup
from lightning_elastic.schedule import IntervalUnit, Schedule

# Auto probe windows: their steps, counted whole as the summary counts them, and the fit's first profile take at most
# this share of the planned fit (`total_steps / speedup` full steps): the callback's own-time target. Until 2026-11-27
# the windows' *extra* cost (a probe step's `T` less the `T / s` of the selected step it replaces) was held to 3%,
# which at 2x is 6% of the fit counted whole, with the profile on top: Fashion-MNIST's 400-step fits spent 7.5%
# (docs/results.md). More windows are not better: 4% of extra cost gave a 228-step fit at 2x a second window, 7
# samples of `T` instead of 3, and left a cached run's `T` 17% above the full run's step ...
OWN_SHARE = 0.05
# ... in windows of this many steps (shorter only when the fit is too short for one) ...
PROBE_WINDOW = 4
# ... and the first window times `warmup.FIRST_STEADY_STEPS` steady full steps after the process's warm-up steps
# (`warmup.first_window()`) whenever that costs at most FIRST_WINDOW_SHARE of the planned fit: 2-4 full steps more.
FIRST_WINDOW_SHARE = 0.10


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
    total_steps: int | None, selections: int | None, speedup: float, period: float = math.inf, spent: float = 0.0
) -> ProbePlan:
    """Probe windows that, with the `spent` full steps of the fit's first profile, take at most `OWN_SHARE` of the
    planned fit, the first measuring `T`.

    The plan of a fit of `N` steps is `N / s` full steps `T`; `P` probe steps take `P` of them. Windows of
    `PROBE_WINDOW` steps (fewer when even one would exceed the share, or fill the `period` between two selections), as
    many as the share allows, spread evenly over the selections. The first window is `warmup.first_window()` steps long
    when its extra cost (a probe step's `T` less the `T / s` of the selected step it replaces, `first * (s - 1) / N` of
    the plan) is at most `FIRST_WINDOW_SHARE` and it leaves the first selection at least as many steps to train, before
    the next selection and the fit's end; it runs even where the share is spent (it times `T`, which the contract
    needs), and its steps come out of the share. Where the first window is all warm-up steps (a fit too short, or with
    selections too close, for a longer one), a second window opens however small the share, so that a steady full step
    is timed at all: without one, a time model 30% off leaves the fit 30% off its speedup. A fit whose epoch length is
    unknown probes before every selection; if its length is unknown too, its first window is `warmup.first_window()`
    long.

    Example:
        >>> auto_probe_plan(total_steps=600, selections=10, speedup=2.0)  # 15 steps: 6, then two windows of 4
        ProbePlan(steps=4, every=4, first=6)
        >>> auto_probe_plan(total_steps=600, selections=10, speedup=2.0, spent=7)  # a measured profile took 7
        ProbePlan(steps=4, every=10, first=6)
        >>> auto_probe_plan(total_steps=90, selections=2, speedup=3.0)  # 6 steps: 13%; a later step times `T`
        ProbePlan(steps=1, every=1, first=1)
    """
    window = warmup.first_window()
    longest = PROBE_WINDOW if math.isinf(period) else min(PROBE_WINDOW, int(period) - 1)
    if total_steps is None:
        return ProbePlan(steps=longest, every=1, first=window if period > 2 * window else longest)
    allowed = OWN_SHARE * total_steps / speedup - spent  # probe steps, counted whole
    steps = max(1, min(longest, math.floor(allowed)))
    room = min(period, total_steps) > 2 * window  # the first selection trains at least as long as its window
    first = window if room and FIRST_WINDOW_SHARE * total_steps / max(speedup - 1.0, 1e-9) >= window else steps
    if selections is None:  # epoch length unknown: a window before every selection
        return ProbePlan(steps=longest, every=1, first=window if first == window else longest)
    windows = 1 + math.floor(max(0.0, allowed - max(first, steps)) / steps)
    if max(first, steps) <= warmup.WARMUP_STEPS:  # no steady step in the first window: a second one times `T`
        windows = max(windows, 2)
    return ProbePlan(steps=steps, every=max(1, math.ceil(selections / windows)), first=max(first, steps))


def after_profile(
    schedule: Schedule, speedup: float, spent: float, warmup_steps: int = warmup.WARMUP_STEPS
) -> Schedule:
    """An auto schedule's windows once the fit's first profile is paid: its `spent` full steps come out of `OWN_SHARE`
    (`auto_probe_plan`). The first window (it may be under way) keeps its length, but for a process that warms up for
    fewer than `warmup.WARMUP_STEPS` (`warmup.FirstWindow.warmup_steps`: it timed a measured profile, or knows its
    warm step): its long first window warms up for those `warmup_steps` only, and the steps it saves go to the later
    windows. A fit of unknown length or epoch length keeps its schedule: it probes before every selection.

    Example:
        >>> planned = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(100,), total_steps=400)
        >>> planned.probe_every, after_profile(planned, 2.0, spent=3.0).probe_every  # 10 steps; 7 left, then 6
        (2, 4)
        >>> after_profile(planned, 2.0, spent=6.0, warmup_steps=1).first_window_end  # 6 + 3 steps of 10
        3
    """
    if (selections := schedule.selections) is None:
        return schedule
    first = schedule.first_steps
    if warmup_steps < warmup.WARMUP_STEPS and schedule.first_probe_steps == warmup.first_window():
        first = warmup.first_window(warmup_steps)
    saved = schedule.first_steps - first  # what the shorter first window leaves the later ones
    total = int(schedule.total_steps)
    probes = auto_probe_plan(total, selections, speedup, schedule.period, spent - saved)
    if not schedule.first_probe_steps:  # the first window is `probe_steps` long (and may be under way): they stay
        return replace(schedule, probe_every=probes.every)
    return replace(schedule, probe_steps=probes.steps, probe_every=probes.every, first_probe_steps=first)


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
        2
        >>> plan_schedule(2, "step", 2, 2.0, steps_per_epoch=(20,), total_steps=100).message[:43]
        '`probe_steps` must be fewer than the optimi'
    """
    shape = Schedule(interval, unit, 0, steps_per_epoch, 1, total_steps or math.inf)
    period = shape.period
    if probe_steps == "auto":
        probes = auto_probe_plan(total_steps, shape.selections, speedup, period)
        steps, every, first = probes.steps, probes.every, probes.first
    else:
        steps, every, first = int(probe_steps), 1, int(probe_steps)
    if probe_steps == "auto" and period < 2:
        return ScheduleRefusal(
            "`interval` must leave at least 2 optimizer steps between two selections, a probe step and one to train "
            f"(an `interval` of 2 or more, or longer epochs). Found: `interval` {interval} x "
            f"{'steps per epoch' if unit == 'epoch' else '1 step'} = {period:g}"
        )
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
