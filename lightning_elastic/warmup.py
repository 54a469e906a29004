"""The process's warm-up: which of a fit's first steps are charged to it but are no samples of the full step `T`.

A process's first optimizer steps are slower than the rest. The fit's first probe window (`windows`) warms up for
`FirstWindow.warmup_steps` (fewer when this process's profiling passes warmed it up), then times FIRST_STEADY_STEPS
steady full steps for the wall-clock plan. A process that did not time its profile (a cached one) may still be
warming up after them: its window runs on while it is (`cold_window_runs_on`); one that did runs on while its samples
lie apart (a slow step among them, WARM_SPREAD). `FirstWindow` keeps what that first window knows until the first
selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the profiling package imports this module's readers
    from lightning_elastic.profiling.profile import TimingMethod

# The first optimizer steps a process runs are slower than the rest (first touch of memory, the allocator's and the
# kernels' caches): charged to the fit, never samples of step time. Measured in fresh processes, every tensor trained:
# Lite0 on ELPV, steps 1-3 took 0.76-0.89 s against 0.62-0.66 s after; MiniLM on e-mails, step 1 took 1.01 s against
# 0.62 s plain-timed, and a first selected step at step 2 1.37 s against 0.26 s for the next three.
WARMUP_STEPS = 4
# ... except in a process that timed its profile here (either time model): the profiling passes after the fit's first
# step warm it up, and only that step (the profile's first pass) is slow. Lite0 on Fashion-MNIST at 2x, 5 seeds: steps
# 2-6 took 0.45-0.56 s after the measured profile, against a median step of 0.46-0.50 s of the full runs (whose first
# step took 0.62-0.70 s). The analytic profile warmed up for 2 steps until 2026-12-07: after its op-counting pass and
# plain timings step 2 took 1.07x and 1.09x the mean of steps 3-4 in two of three fresh Lite0 processes (2026-12-02).
# Since the first step counts the ops (a plain forward pass alone after it), one step against two, side by side at 2x
# (docs/results.md, 2026-12-07 01:13 and 01:47): ELPV's short fit, 5 paired seeds, own time 4.1% against 5.9% (lower
# on every seed), `T` 0.99-1.06 of the full runs' step; MiniLM's 90-step fit, 4 pairs, 5.3-5.9% against 8.3-11.5%
# but on one seed whose slow samples ran the window on (WARM_SPREAD) 11.4%; the contract and accuracy tie on both.
PROFILED_WARMUP_STEPS = 1
# A cold process (below) that knows its warm step (`FirstWindow.warm_step`) plans this many: it tells a step still
# warming up by 20% from a steady one by that step, and runs on past those (`cold_window_runs_on`), but not a step a
# few percent slow. MiniLM on e-mails, 5 seeds: steps 2-5 fell 3-8% (0.52, 0.50, 0.49, 0.48 s), and with one warm-up
# step the cached runs' `T` (steps 2-3) came out 2-9% above the same seed's first run's (steps 5-6), the fits 1.88x.
KNOWN_WARMUP_STEPS = 2
# The first probe window runs past the warm-up steps to time this many steady full steps, when the fit can pay for it
# (`windows.FIRST_WINDOW_SHARE`). Without them `T` is the profile's pass, which came out 0.68-1.07 of the full runs'
# step over 12 MiniLM runs (the fit lands off its speedup by as much). (`first_window()` reads WARMUP_STEPS when
# called: a test that patches it here patches every reader.)
FIRST_STEADY_STEPS = 2
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
# runs 2-6 steps about 40% slow somewhere in its first 6 (full runs too), and after the analytic profile the first
# sample (step 2) took 1.16-1.20x the second in 3 of 5 first runs at 2x, whose `T` came out 1.01-1.12 of the full
# runs' step and whose fits ran 1.79-2.00x. So a warm window whose samples are not within WARM_SPREAD of their
# fastest runs on, at most WARM_STEPS steps, until COLD_SAMPLES of them are; the slower ones join the warm-up steps.
# MiniLM's first runs then came out 2.02 +- 0.09x against 1.93 +- 0.04x before; ELPV's two samples lay within 10% on
# every seed (no step more). Both samples inside one run of slow steps are not caught (docs/results.md, 2026-11-28).
WARM_SPREAD, WARM_STEPS = 1.1, 2


def first_window(warmup_steps: int | None = None) -> int:
    """Optimizer steps of the first probe window that measures `T`: the process's warm-up steps (`warmup_steps`, else
    WARMUP_STEPS, read when called), then FIRST_STEADY_STEPS steady ones.

    Example:
        >>> first_window(), first_window(PROFILED_WARMUP_STEPS)
        (6, 3)
    """
    return (WARMUP_STEPS if warmup_steps is None else warmup_steps) + FIRST_STEADY_STEPS


def cold_window_runs_on(
    samples: list[float], reference: float, ran_on: int, room: float, most: int = COLD_STEPS
) -> bool:
    """Whether the first window of a process that did not time its profile runs on one step more (see COLD_STEPS).

    Args:
        samples: seconds of the window's steady full steps so far (after the warm-up steps).
        reference: a warm process's full step (`FirstWindow.reference`: the remembered `t_step`, else the pass).
        ran_on: steps the window already ran on past its length.
        room: optimizer steps from now until the schedule changes the trainable set anyway.
        most: steps it may run on at most (`FirstWindow.run_on_limit`).

    Example:
        >>> cold_window_runs_on([0.86, 0.86], reference=0.59, ran_on=0, room=40)  # still warming up
        True
        >>> cold_window_runs_on([0.86, 0.86, 0.60, 0.62], reference=0.59, ran_on=2, room=38)
        False
        >>> cold_window_runs_on([0.86, 0.86], reference=0.59, ran_on=0, room=6)  # too near the next change
        False
    """
    return _runs_on(samples, COLD_CEILING * reference, ran_on, room, most)


def _runs_on(samples: list[float], limit: float, ran_on: int, room: float, most: int) -> bool:
    """Whether a first window runs on one step more: fewer than COLD_SAMPLES of its samples are steady (up to
    `limit`), it ran on fewer than `most` steps, and the schedule leaves the first selection room to train."""
    steady = len(_steady(samples, limit))
    return bool(samples) and steady < COLD_SAMPLES and ran_on < most and room > first_window()


def _steady(samples: list[float], limit: float) -> list[float]:
    """The samples up to `limit` (`FirstWindow.steady_limit`): steps of a process that warmed up."""
    return [s for s in samples if s <= limit]


@dataclass
class FirstWindow:
    """What the fit's first probe window knows of the process's warm-up, until the first selection.

    Attributes:
        cold: the process did not time its profile (a cached, given or restored one): it may still be warming up
            after `WARMUP_STEPS`, so the window runs on while it is (`runs_on`). A warm one runs on while its
            samples lie apart (WARM_SPREAD).
        timed: the time model of the profile this process timed (None: it timed none): its passes warm the process
            up for all but `PROFILED_WARMUP_STEPS` (`warmup_steps`).
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
        """The process's first steps that are charged to the fit but are no samples of its steady step time:
        PROFILED_WARMUP_STEPS in a process that timed its profile, KNOWN_WARMUP_STEPS in a cold one that knows its
        `warm_step` (it leaves out the steps still warming up by it, `take_samples`), else WARMUP_STEPS.

        Example:
            >>> [FirstWindow(timed=timed).warmup_steps for timed in ("measured", "flops", None)]
            [1, 1, 4]
        """
        if self.timed is not None:
            return PROFILED_WARMUP_STEPS
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

    def steady_limit(self, samples: list[float], pass_step: float) -> float:
        """The slowest step of the window that counts as steady: COLD_CEILING of a cold process's warm full step
        (`reference`), WARM_SPREAD of a warm process's fastest sample.

        Example:
            >>> round(FirstWindow(cold=True, warm_step=0.59).steady_limit([0.86, 0.60], pass_step=0.67), 3)
            0.708
            >>> round(FirstWindow(timed="flops").steady_limit([0.52, 0.44], pass_step=0.67), 3)
            0.484
        """
        if self.cold:
            return COLD_CEILING * self.reference(pass_step)
        return WARM_SPREAD * min(samples, default=math.inf)

    def runs_on(self, samples: list[float], pass_step: float, room: float) -> bool:
        """Whether this process's window runs on one step more (as `cold_window_runs_on`, up to `steady_limit`): a
        cold one while it warms up, a warm one while fewer than COLD_SAMPLES of its samples lie within WARM_SPREAD of
        the fastest (never with fewer samples than that: its fit planned no more).

        Example:
            >>> FirstWindow(timed="flops").runs_on([0.52, 0.44], pass_step=0.67, room=40)
            True
            >>> FirstWindow(timed="flops").runs_on([0.52, 0.44, 0.45], pass_step=0.67, room=40)
            False
        """
        if not self.cold and len(samples) < COLD_SAMPLES:
            return False
        return _runs_on(samples, self.steady_limit(samples, pass_step), self.ran_on, room, self._most_run_on)

    def take_samples(self, samples: list[float], pass_step: float) -> list[float]:
        """The window's samples of `T`, as it closes: those up to `steady_limit`, or all of them when none is (a cold
        process's device is slower than when profiled); the steps left out were still warming up, or paused: they
        join the warm-up steps that full fine-tuning pays as well (`excess`).

        Example:
            >>> window = FirstWindow(timed="flops")
            >>> window.take_samples([0.52, 0.44, 0.45], pass_step=0.67), window.full_steps
            ([0.44, 0.45], 1)
        """
        kept = _steady(samples, self.steady_limit(samples, pass_step)) or list(samples)
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
