"""Probe windows, sized before training: how long, before which selections, and the warm-up steps around them.

A probe window trains every candidate tensor for a few ordinary steps, so that their importance is measured and its
steps time the full step `T` of the wall-clock plan (`planner.WallClockPlan`). `plan_schedule` gives the fit its
`Schedule`: with `probe_steps="auto"` windows and the first profile together cost a small share of the fit
(`auto_probe_plan`, and `after_profile` once the profile's cost is known), the first window long enough to time steady
steps after the process's warm-up steps when the fit can pay for it. In a process that did
not time its profile (a cached one), that first window runs on while it is still warming up (`cold_window_runs_on`),
and in one that did, while its samples lie apart (a slow step among them, WARM_SPREAD); `FirstWindow` keeps what that
first window knows of the process's warm-up until the first selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from lightning_elastic.schedule import IntervalUnit, Schedule

if TYPE_CHECKING:  # the profiling package imports this module
    from lightning_elastic.profiling.profile import TimingMethod

# The first optimizer steps a process runs are slower than the rest (first touch of memory, the allocator's and the
# kernels' caches): charged to the fit, never samples of step time. Measured in fresh processes, every tensor trained:
# Lite0 on ELPV, steps 1-3 took 0.76-0.89 s against 0.62-0.66 s after; MiniLM on e-mails, step 1 took 1.01 s against
# 0.62 s plain-timed, and a first selected step at step 2 1.37 s against 0.26 s for the next three.
WARMUP_STEPS = 4
# ... except in a process whose measured profile was timed here: its passes warmed it up, and only the fit's first
# step (the profile's first pass) is slow. Lite0 on Fashion-MNIST at 2x, 5 seeds: steps 2-6 took 0.45-0.56 s after
# the measured profile, against a median step of 0.46-0.50 s of the full runs (whose first step took 0.62-0.70 s).
PROFILED_WARMUP_STEPS = 1
# ... and in a process whose analytic profile was timed here, this many: its op-counting pass and plain timings (two
# forward passes and a full step) after the fit's first step leave one more step slow. First runs at 2x of Lite0 on
# ELPV (150 and 228 steps) and MiniLM on e-mails, 11 processes (2026-11-27): step 1 took 1.02-1.14x the mean of steps
# 2-3, which took 0.88-1.11x step 4 (1.00 on the mean), the first step the 4 warm-up steps of WARMUP_STEPS sampled.
ANALYTIC_WARMUP_STEPS = 2
# A cold process (below) that knows its warm step (`FirstWindow.warm_step`) plans this many: it tells a step still
# warming up by 20% from a steady one by that step, and runs on past those (`cold_window_runs_on`), but not a step a
# few percent slow. MiniLM on e-mails, 5 seeds: steps 2-5 fell 3-8% (0.52, 0.50, 0.49, 0.48 s), and with one warm-up
# step the cached runs' `T` (steps 2-3) came out 2-9% above the same seed's first run's (steps 5-6), the fits 1.88x.
KNOWN_WARMUP_STEPS = 2
# Auto probe windows: their steps, counted whole as the summary counts them, and the fit's first profile take at most
# this share of the planned fit (`total_steps / speedup` full steps): the callback's own-time target. Until 2026-11-27
# the windows' *extra* cost (a probe step's `T` less the `T / s` of the selected step it replaces) was held to 3%,
# which at 2x is 6% of the fit counted whole, with the profile on top: Fashion-MNIST's 400-step fits spent 7.5%
# (docs/results.md). More windows are not better: 4% of extra cost gave a 228-step fit at 2x a second window, 7
# samples of `T` instead of 3, and left a cached run's `T` 17% above the full run's step ...
OWN_SHARE = 0.05
# ... in windows of this many steps (shorter only when the fit is too short for one) ...
PROBE_WINDOW = 4
# ... but the first window runs past the process's warm-up steps to measure FIRST_STEADY_STEPS steady full steps,
# whenever that costs at most FIRST_WINDOW_SHARE of the planned fit. Without them `T` is the profile's pass, which came
# out 0.68-1.07 of the full runs' step over 12 MiniLM runs (the fit lands off its speedup by as much), for 2-4 full
# steps more. (`first_window()` reads WARMUP_STEPS when called: a test that patches it here patches every reader.)
FIRST_STEADY_STEPS, FIRST_WINDOW_SHARE = 2, 0.10
# A process that did not time its profile (it came from the cache, the user or a checkpoint) can still be warming
# up after WARMUP_STEPS: MiniLM on e-mails, a cached run's steps 5-6 took 0.86 s, 1.45x the profile's full
# step (0.59 s), and a plain full fit's 0.77-0.80 s against 0.59-0.65 s from step 7 on; `T` came out 36% high and the
# fit missed its speedup. So its first window runs on, a step at a time and at most COLD_STEPS steps, until
# COLD_SAMPLES of its steady steps came within COLD_CEILING of a warm step (the steady step a fit with the profile
# remembered, `TimingProfile.t_step`, else the profile's pass); `T` is then those steps (all of them when none came
# within: the device is slower than when profiled). With a remembered step the window plans KNOWN_WARMUP_STEPS
# and may run on by the warm-up steps it did not plan as well, as far as the longest window before: Lite0 on ELPV at
# 96 px, cached runs' steps 2-5 took 0.48-0.55 s against the 0.47 s remembered (a full run's first step 0.62 s, its
# next 0.41-0.55 s), and a 150-step fit's 6-step window was 8% of it.
COLD_CEILING, COLD_SAMPLES, COLD_STEPS = 1.2, 2, 3
# A process that timed its profile can still have a slow step among its first window's samples: MiniLM on e-mails
# runs 2-3 steps about 40% slow somewhere in its first 6 (full runs too), and after the analytic profile the first
# sample (step 2) took 1.16-1.20x the second in 3 of 5 first runs at 2x, whose `T` came out 1.02-1.12 of the full
# runs' step and whose fits ran 1.86-1.97x (docs/results.md). Two steady steps of one process lie within a few percent
# of each other (ELPV, Fashion-MNIST: 1.00-1.09). So a warm window whose samples are not within WARM_SPREAD of their
# fastest runs on, at most WARM_STEPS steps, until COLD_SAMPLES of them are; the slower ones join the warm-up steps.
WARM_SPREAD, WARM_STEPS = 1.1, 2


def first_window() -> int:
    """Optimizer steps of the first probe window that measures `T`: the process's warm-up steps, then steady ones.

    Example:
        >>> first_window()
        6
    """
    return WARMUP_STEPS + FIRST_STEADY_STEPS


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
    `PROBE_WINDOW` steps (fewer when even one would exceed the share, or fill the `period` between two selections),
    as many as the share allows, spread evenly over the selections. The first window is `first_window()` steps long
    when its extra cost (a probe step's `T` less the `T / s` of the selected step it replaces, `first * (s - 1) / N`
    of the plan) is at most `FIRST_WINDOW_SHARE` and it leaves the first selection at least as many steps to train,
    before the next selection and the fit's end; it runs even where the share is spent (it times `T`, which the
    contract needs), and its steps come out of the share. Where the first window is all warm-up steps (a fit too
    short, or with selections too close, for a longer one), a second window opens however small the share, so that
    a steady full step is timed at all: without one, a time model 30% off leaves the fit 30% off its speedup. A fit
    whose epoch length is unknown probes before every selection; if its length is unknown too, its first window is
    `first_window()` long.

    Example:
        >>> auto_probe_plan(total_steps=600, selections=10, speedup=2.0)  # 15 steps: 6, then two windows of 4
        ProbePlan(steps=4, every=4, first=6)
        >>> auto_probe_plan(total_steps=600, selections=10, speedup=2.0, spent=7)  # a measured profile took 7
        ProbePlan(steps=4, every=10, first=6)
        >>> auto_probe_plan(total_steps=90, selections=2, speedup=3.0)  # 6 steps: 13%; a later step times `T`
        ProbePlan(steps=1, every=1, first=1)
    """
    window = first_window()
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
    if max(first, steps) <= WARMUP_STEPS:  # no steady step in the first window: a second one times `T`
        windows = max(windows, 2)
    return ProbePlan(steps=steps, every=max(1, math.ceil(selections / windows)), first=max(first, steps))


def after_profile(schedule: Schedule, speedup: float, spent: float, warmup_steps: int = WARMUP_STEPS) -> Schedule:
    """An auto schedule's windows once the fit's first profile is paid: its `spent` full steps come out of `OWN_SHARE`
    (`auto_probe_plan`). The first window (it may be under way) keeps its length, but for a process that warms up for
    fewer than `WARMUP_STEPS` (`FirstWindow.warmup_steps`: it timed a measured profile, or knows its warm step): its
    long first window warms up for those `warmup_steps` only, and the steps it saves go to the later windows. A fit of
    unknown length or epoch length keeps its schedule: it probes before every selection.

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
    if warmup_steps < WARMUP_STEPS and schedule.first_probe_steps == first_window():
        first = warmup_steps + FIRST_STEADY_STEPS
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


def cold_window_runs_on(
    samples: list[float],
    reference: float,
    ran_on: int,
    room: float,
    most: int = COLD_STEPS,
    ceiling: float = COLD_CEILING,
) -> bool:
    """Whether the first window of a process that did not time its profile runs on one step more (see COLD_STEPS);
    with `ceiling` WARM_SPREAD and its fastest sample as `reference`, a window of one that did (`FirstWindow.runs_on`).

    Args:
        samples: seconds of the window's steady full steps so far (after the warm-up steps).
        reference: a warm process's full step (`FirstWindow.reference`: the remembered `t_step`, else the pass).
        ran_on: steps the window already ran on past its length.
        room: optimizer steps from now until the schedule changes the trainable set anyway.
        most: steps it may run on at most (`FirstWindow.run_on_limit`).
        ceiling: how far above `reference` a steady step may lie.

    Example:
        >>> cold_window_runs_on([0.86, 0.86], reference=0.59, ran_on=0, room=40)  # still warming up
        True
        >>> cold_window_runs_on([0.86, 0.86, 0.60, 0.62], reference=0.59, ran_on=2, room=38)
        False
        >>> cold_window_runs_on([0.86, 0.86], reference=0.59, ran_on=0, room=6)  # too near the next change
        False
    """
    steady = len(_within_ceiling(samples, reference, ceiling))
    return bool(samples) and steady < COLD_SAMPLES and ran_on < most and room > first_window()


def steady_samples(samples: list[float], reference: float, ceiling: float = COLD_CEILING) -> list[float]:
    """The samples of `T` of a first window that ran on (`cold_window_runs_on`): those within `ceiling` of a
    warm process's full step, or all of them when none is (the device is slower than when it was profiled).

    Example:
        >>> steady_samples([0.86, 0.86, 0.60, 0.62], reference=0.59)
        [0.6, 0.62]
        >>> steady_samples([0.77, 0.78, 0.76], reference=0.59)
        [0.77, 0.78, 0.76]
    """
    return _within_ceiling(samples, reference, ceiling) or list(samples)


def _within_ceiling(samples: list[float], reference: float, ceiling: float) -> list[float]:
    """The samples within `ceiling` of a warm process's full step: a warm process's steps."""
    return [s for s in samples if s <= ceiling * reference]


@dataclass
class FirstWindow:
    """What the fit's first probe window knows of the process's warm-up, until the first selection.

    Attributes:
        cold: the process did not time its profile (a cached, given or restored one): it may still be warming up
            after `WARMUP_STEPS`, so the window runs on while it is (`runs_on`). A warm one runs on while its
            samples lie apart (WARM_SPREAD).
        timed: the time model of the profile this process timed (None: it timed none): the passes of a measured
            one warm it up for all but `PROFILED_WARMUP_STEPS`, those of an analytic one for all but
            `ANALYTIC_WARMUP_STEPS` (`warmup_steps`).
        warm_step: a warm process's full step, as a fit with this profile measured it (`TimingProfile.t_step`; 0:
            not known).
        ran_on: steps the window ran on past its length.
        updates: optimizer updates of its warm-up steps after the process's first (`prior_update`).
        full_seconds, full_steps: the seconds and count of the process's warm-up steps that trained every tensor
            (the first window's), whose slowness the same fit without the callback pays too (`excess`).

    Example:
        >>> window = FirstWindow(cold=True, warm_step=0.59)
        >>> window.runs_on([0.86, 0.86], pass_step=0.67, room=40)
        True
        >>> window.take_samples([0.86, 0.60, 0.62], pass_step=0.67)
        [0.6, 0.62]
        >>> FirstWindow(updates=[0.18, 0.07]).prior_update(measured=False)
        0.07
    """

    cold: bool = False
    timed: TimingMethod | None = None
    warm_step: float = 0.0
    ran_on: int = 0
    updates: list[float] = field(default_factory=list)
    full_seconds: float = 0.0
    full_steps: int = 0

    @property
    def warmup_steps(self) -> int:
        """The process's first steps that are charged to the fit but are no samples of its steady step time: one in a
        process that timed a measured profile, ANALYTIC_WARMUP_STEPS in one that timed an analytic profile,
        KNOWN_WARMUP_STEPS in a cold one that knows its `warm_step` (it leaves out the steps still warming up by it,
        `take_samples`), else WARMUP_STEPS.

        Example:
            >>> [FirstWindow(timed=timed).warmup_steps for timed in ("measured", "flops", None)]
            [1, 2, 4]
        """
        if self.timed is not None:
            return PROFILED_WARMUP_STEPS if self.timed == "measured" else ANALYTIC_WARMUP_STEPS
        return KNOWN_WARMUP_STEPS if self.cold and self.warm_step > 0 else WARMUP_STEPS

    def profiled(self, timed: bool, method: TimingMethod) -> None:
        """Note how the fit's profile came: `timed` by this process with the time model `method`, or not (cold)."""
        self.cold, self.timed = not timed, method if timed else None

    def run_on_limit(self, first_steps: int) -> int:
        """Steps a first window of `first_steps` may run on: COLD_STEPS and the warm-up steps it did not plan in a
        cold process (its longest window is as long as with WARMUP_STEPS), WARM_STEPS in a warm one that times
        COLD_SAMPLES steps, none in a window of warm-up steps only (no steady step tells whether the process warmed
        up) nor in a warm window of fewer samples (a fit too short for more: `runs_on`).

        Example:
            >>> FirstWindow(cold=True).run_on_limit(6), FirstWindow(cold=True, warm_step=0.6).run_on_limit(4)
            (3, 5)
            >>> FirstWindow(cold=True).run_on_limit(4), FirstWindow(timed="measured").run_on_limit(2)
            (0, 0)
            >>> FirstWindow(timed="measured").run_on_limit(3), FirstWindow(timed="flops").run_on_limit(4)
            (2, 2)
        """
        samples = first_steps - self.warmup_steps
        return self._most_run_on if samples >= (1 if self.cold else COLD_SAMPLES) else 0

    @property
    def _most_run_on(self) -> int:
        """A cold process: COLD_STEPS and the warm-up steps its window did not plan; a warm one: WARM_STEPS."""
        return COLD_STEPS + WARMUP_STEPS - self.warmup_steps if self.cold else WARM_STEPS

    def excess(self, full_step: float) -> float:
        """Seconds the process's warm-up full steps took beyond `full_step` each: what the same fit without the
        callback spends on its own warm-up, which the plan adds to its reference (`WallClockPlan.warmup`). Measured
        without the callback, MiniLM's steps 1-6 took 0.77-1.01 s against 0.59-0.65 s after.

        Example:
            >>> round(FirstWindow(full_seconds=3.5, full_steps=4).excess(0.6), 6)
            1.1
        """
        return max(0.0, self.full_seconds - self.full_steps * full_step)

    def reference(self, pass_step: float) -> float:
        """The full step a cold window holds its steps against (COLD_CEILING): `warm_step`, else the profile's
        `pass_step` (which leaves the update out and varies between profiles: MiniLM 0.46-0.67 s for 0.57-0.60 s
        steady steps)."""
        return self.warm_step or pass_step

    def standard(self, samples: list[float], pass_step: float) -> tuple[float, float]:
        """What the window's steady steps are held against, and how far above it they may lie: a cold process's warm
        full step (`reference`) and COLD_CEILING, a warm process's fastest sample and WARM_SPREAD.

        Example:
            >>> FirstWindow(cold=True, warm_step=0.59).standard([0.86, 0.60], pass_step=0.67)
            (0.59, 1.2)
            >>> FirstWindow(timed="flops").standard([0.52, 0.44], pass_step=0.67)
            (0.44, 1.1)
        """
        if self.cold:
            return self.reference(pass_step), COLD_CEILING
        return min(samples, default=0.0), WARM_SPREAD

    def runs_on(self, samples: list[float], pass_step: float, room: float) -> bool:
        """Whether this process's window runs on one step more (`cold_window_runs_on`, held to `standard`): a cold one
        while it warms up, a warm one while fewer than COLD_SAMPLES of its samples lie within WARM_SPREAD of the
        fastest (never with fewer samples than that: its fit planned no more).

        Example:
            >>> FirstWindow(timed="flops").runs_on([0.52, 0.44], pass_step=0.67, room=40)
            True
            >>> FirstWindow(timed="flops").runs_on([0.52, 0.44, 0.45], pass_step=0.67, room=40)
            False
        """
        if not self.cold and len(samples) < COLD_SAMPLES:
            return False
        reference, ceiling = self.standard(samples, pass_step)
        return cold_window_runs_on(samples, reference, self.ran_on, room, self._most_run_on, ceiling)

    def take_samples(self, samples: list[float], pass_step: float) -> list[float]:
        """The window's samples of `T`, as it closes: `steady_samples` held to `standard`; the steps left out were
        still warming up, or paused: they join the warm-up steps that full fine-tuning pays as well (`excess`).

        Example:
            >>> window = FirstWindow(timed="flops")
            >>> window.take_samples([0.52, 0.44, 0.45], pass_step=0.67), window.full_steps
            ([0.44, 0.45], 1)
        """
        kept = steady_samples(samples, *self.standard(samples, pass_step))
        warming = [s for s in samples if s not in kept]
        self.full_seconds += math.fsum(warming)
        self.full_steps += len(warming)
        return kept

    def prior_update(self, measured: bool) -> float:
        """Until a steady full step is `measured`, the optimizer update that `T` (the profile's pass, which lacks it)
        is planned with: the fastest of `updates`. MiniLM's passes came out 0.52-0.57 s against a 0.60 s step;
        planned on the pass alone, 3 of 5 fits at 2x whose window was all warm-up steps trained 2-5 tensors. A 2-step
        window has one update to go by, which can be twice the steady one (0.13-0.25 s against 0.07-0.13 s in four
        MiniLM first runs, docs/results.md 23:06). 0 once `T` is measured."""
        return min(self.updates) if self.updates and not measured else 0.0
