"""Before training: the largest speedup a fit can reach at all, and what to say when the asked one is out of it.

Every selected step pays at least the cheapest selection (the forward pass and the tensors every selection trains),
and probe steps and profiling pay a full step's cost; `reach` puts these together for the fit's schedule. The
callback refuses a speedup above `Reach.reachable` by more than the summary's tolerance (`MET_WITHIN`) before training
(`SpeedupOutOfReach`, with the figure), and warns when it is out of reach by less, when only this run's profiling puts
it out of reach, or when it leaves the selected steps little room above the cheapest selection (`NARROW_ROOM`).
`reach_shortening` cuts a long first window back when it alone would put the speedup out of reach.

Pure arithmetic on the time model and the schedule: no clock, no model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from lightning_elastic.errors import SpeedupOutOfReach
from lightning_elastic.planner import WallClockPlan
from lightning_elastic.schedule import Schedule
from lightning_elastic.summary import MET_WITHIN
from lightning_elastic.time_model import StepTimeModel

# Before training, a speedup that leaves the selected steps less than this share of a full step above the cheapest
# selection is warned about: its selections train little more than the cheapest set. MiniLM's 90-step first runs at
# 2x had about 0.0-0.05 (the plan left 166-197 ms a step against a cheapest selection of 184-209 ms), trained 2-5
# tensors and reached 78-92% where static last-k, with a step 0.07 of a full step above that floor, trained 17% of
# the tensors and reached 94.9% (docs/results.md).
NARROW_ROOM = 0.05
# A speedup out of reach by less than the share the summary counts as met (`MET_WITHIN`) is warned about, not refused:
# the fit trains its cheapest selection and lands at or below the figure (a MiniLM fit told 1.94x of 2x ended at 1.92x).
# Refused at the figure itself, MiniLM's 90-step fit at 2x trained on four seeds of five and was refused on the fifth
# with "at most 1.98" (2026-12-06, docs/results.md): the same command ran or stopped by a few milliseconds of timing
# noise.


def reachable_speedup(total_steps: int, probe_steps: int, sunk_steps: float, floor: float) -> float:
    """The largest whole-fit speedup: every probe step at full cost, every other step at the cheapest selection.

    The fit's account (`WallClockPlan.reachable`) in units of a full step, before its first step.

    Args:
        total_steps: optimizer steps of the fit `N`.
        probe_steps: how many of them lie in probe windows.
        sunk_steps: seconds already spent (profiling), in full steps.
        floor: the cheapest selected step, as a fraction of a full step.

    Example:
        >>> reachable_speedup(total_steps=100, probe_steps=10, sunk_steps=5.0, floor=0.3)
        2.380952380952381
    """
    plan = WallClockPlan(speedup=1.0, total_steps=total_steps, full_step=1.0, spent=sunk_steps)
    limit = plan.reachable(0, probe_steps, floor)
    assert limit is not None  # the fit's length is known
    return limit


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
        reachable: the largest speedup, this run's profiling left out (what a later fit that reads the profile from
            the cache, the default, reaches).
        this_fit: the largest speedup of this fit, with what its profiling cost.
        scope: what the figures count, in words.
        profile_seconds: what profiling took this run.
        profile_steps: the same in full steps of the time model.
        selected_share: the share of the fit's steps that are selected steps (the others are probe steps).
        own_steps: profiling and probe steps in full steps, the callback's own time as planned (`own_share`).
        total_steps: optimizer steps of the fit (None: not known, or no plan to keep).
        cache_on: the fit keeps its profile in the cache (`cache_dir` not False), where a later fit reads it.
        pinned: the fit pins `train_always` tensors (the refusal advises fewer only then).
        fixed_windows: the user set `probe_steps` (the refusal advises fewer only then, not under "auto").
        measured: this fit measured its profile; False: it read one (cached, given or restored), and its
            `profile_seconds` are the pass that checks it against the step, which every such fit pays.
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
    cache_on: bool = True
    pinned: bool = True
    fixed_windows: bool = True
    measured: bool = True

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

    def check(self, speedup: float, smoke: bool = False) -> str | None:
        """Refuse a `speedup` out of reach; the warning when only this run's profiling puts it out of reach. In a
        `smoke` run (Lightning's `fast_dev_run`: a few steps to see that the code runs, too few for any contract) the
        refusal is a warning, and the run goes on.

        Raises:
            SpeedupOutOfReach: with the largest reachable speedup (`refusal`).
        """
        if (refusal := self.refusal(speedup)) is not None:
            if smoke:
                return f"ElasticTensorSelection: not refused under `fast_dev_run`, which runs on: {refusal}"
            raise SpeedupOutOfReach(refusal, reachable=float(at_most(self.reachable)))
        return self.warning(speedup)

    def refusal(self, speedup: float) -> str | None:
        """The `ElasticConfigError` message when `speedup` is out of reach by more than `MET_WITHIN` of it; None when it
        is not (`warning` says when it is out of reach by less)."""
        if self.reachable >= speedup * (1 - MET_WITHIN):
            return None
        none = float(at_most(self.reachable)) <= 1.0  # none above 1, the least one may ask: asking less is no help
        whole = self.floor >= 1.0 - 1e-9  # the cheapest selection is a full step: no fit, however long, is faster
        per_step = self.total_steps is None  # a limit of each step: neither windows nor the fit's length move it
        changes = [
            *(["train fewer tensors always"] * self.pinned),
            *(["use fewer `probe_steps`"] * (self.fixed_windows and not whole and not per_step)),
            *(["train this model without the callback"] if whole else [] if per_step else ["fit longer"]),
            *([] if none else ["ask less"]),
        ] or ["train this model without the callback"]
        advice = changes[0] if len(changes) == 1 else f"{', '.join(changes[:-1])}, or {changes[-1]}"
        return (
            f"`speedup` must be at most {at_most(self.reachable)} for this model on this device {self.scope}: the "
            "forward pass and the parts of a step that every selection pays (at least the `train_always` tensors, or "
            f"one tensor) take {self.floor:.0%} of a full step{', so no speedup is within reach' if none else ''}. "
            f"{advice[0].upper()}{advice[1:]}. Found: {speedup!r}"
        )

    def warning(self, speedup: float) -> str | None:
        """The warning when `speedup` is out of reach by less than `MET_WITHIN` of it, when only this run's profiling
        puts it out of reach, or when it leaves the selected steps less than NARROW_ROOM above the cheapest selection;
        None otherwise."""
        if self.reachable < speedup:  # out of reach, by less than MET_WITHIN (`refusal` refuses more)
            later = self.measured and self.this_fit < self.reachable
            return (
                f"ElasticTensorSelection: `speedup` {speedup!r} is just out of this fit's reach: with the cheapest "
                f"selection at every selected step ({self.floor:.0%} of a full step: the forward pass and what every "
                f"selection trains) it reaches at most {at_most(self.this_fit)}x {self.scope}"
                + (
                    f" (a later fit that reads the profile from the cache{self._cache_off}: {at_most(self.reachable)}x)"
                    if later
                    else ""
                )
                + f". The reach is within the {MET_WITHIN:.0%} of the asked that the summary counts as met, so the fit "
                "trains instead of being refused; it lands at or below that figure, its selections train the cheapest "
                "set, and accuracy may fall toward training that set alone. At most "
                f"{at_most(self.leaving(NARROW_ROOM))}x leaves them {NARROW_ROOM:.0%} of a full step above it; a "
                "longer fit leaves more."
            )
        if self.this_fit < speedup and not self.measured:
            return (
                f"ElasticTensorSelection: checking the profile it read against this step took "
                f"{self.profile_seconds:.1f} s ({self.profile_steps:.1f} full steps) of this fit's budget, so this fit "
                f"reaches at most {at_most(self.this_fit)}x of the `speedup` {speedup!r} asked (every fit that reads a "
                "profile pays that pass: a longer fit spreads it)."
            )
        if self.this_fit < speedup:
            return (
                f"ElasticTensorSelection: profiling took {self.profile_seconds:.1f} s ({self.profile_steps:.1f} full "
                f"steps) of this fit's budget, so this fit reaches at most {at_most(self.this_fit)}x of the `speedup` "
                f"{speedup!r} asked; without it (a later fit on this device that reads the profile from the cache"
                f"{self._cache_off}) {at_most(self.reachable)}x."
            )
        if (room := self.room(speedup)) >= NARROW_ROOM:
            return None
        return (
            f"ElasticTensorSelection: `speedup` {speedup!r} leaves this fit's selected steps {room:.1%} of a full step "
            f"above the cheapest selection ({self.floor:.0%} of a full step: the forward pass and what every selection "
            f"trains), {self.scope} and {self.profile_seconds:.1f} s of profiling: its selections can train little "
            f"more than the cheapest set, and accuracy may fall toward training that set alone. At most "
            f"{at_most(self.leaving(NARROW_ROOM))}x leaves {NARROW_ROOM:.0%}; a longer fit"
            + (
                f", or a later fit that reads the profile from the cache (the default{self._cache_off}), leaves more."
                if self.measured
                else " leaves more."
            )
        )

    @property
    def _cache_off(self) -> str:
        """What the warnings add when this fit keeps no profile for a later one to read."""
        return "" if self.cache_on else "; `cache_dir=False` in this fit keeps none: leave it unset"


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


def largest_reachable(reach_at: Callable[[float], Reach | None], limit: Reach) -> Reach:
    """What a fit reaches planned at the largest speedup, to the hundredth, that it reaches when asked for it:
    `limit` is what it reaches planned at the speedup asked (out of its reach), `reach_at(s)` what it reaches planned
    at `s` (None: no schedule at `s`). Auto windows are sized to the plan: a lower speedup plans a longer fit, whose
    own-time share pays for more probe steps, so a fit asking for `limit.reachable` may reach less than that (a
    refusal naming it was refused again when asked for it). Which speedups reach themselves is not monotone (each
    count of probe steps has its band), so the hundredths are walked down from `limit.reachable`, each step to what
    the one above it reaches; the figure returned is the hundredth found, which `at_most` shows as it is. `limit`
    when even 1.01 is out of reach.

    Example:
        >>> def reach_at(s):  # more probe steps as the speedup falls: 3x reaches 2.65x, 2.65x 2.60x, 2.6x 2.596x
        ...     return Reach(0.3, 3.0 - 1.05 / s, 3.0, "", 0.0, 0.0)
        >>> at_most(reach_at(3.0).reachable), at_most(largest_reachable(reach_at, reach_at(3.0)).reachable)
        ('2.65', '2.59')
    """
    hundredths = math.floor(limit.reachable * 100)
    while hundredths >= 101:
        at = reach_at(hundredths / 100)
        if at is not None and at.reachable >= hundredths / 100:
            return replace(at, reachable=hundredths / 100 + 1e-9)  # `at_most` shows the hundredth, which it reaches
        below = hundredths - 1 if at is None else math.floor(at.reachable * 100)
        hundredths = min(hundredths - 1, below)
    return limit


def reach_shortening(
    schedule: Schedule, speedup: float, reach_of: Callable[[Schedule], Reach], warmup_steps: int = 0
) -> tuple[Schedule, Reach]:
    """What `schedule` reaches (`reach_of`, e.g. `reach` with the fit's model), with a first window longer than the
    others (`windows.auto_probe_plan`'s, to time `T`) cut back to their length when it alone would put `speedup` out
    of this fit's reach: the schedule to run and what it reaches. A first window cut to the process's `warmup_steps`
    or fewer times no steady full step, so a later window is kept (before the last selection at the latest), as
    `windows.auto_probe_plan` keeps one: without it the plan's `T` stays the profile's pass, which leaves out the
    update and the loop (a cached 128-step fit at 2.97x counted 7.7 ms a full step against 10-14 ms measured, and
    said 0.79x of a fit that ran 1.46x).

    Example:
        >>> model = StepTimeModel(t_dw=(1.0, 1.0), t_dy=(1.0, 1.0), t_fixed=2.0)
        >>> reach_of = lambda schedule: reach(model, [False] * 2, [False] * 2, schedule, 100, 0.0, 5.0)
        >>> long = Schedule(50, "step", 1, first_probe_steps=6)  # 7 probe steps of 100 reach 1.58x, 2 1.63x
        >>> schedule, fit = reach_shortening(long, 1.62, reach_of)
        >>> schedule.first_window_end, round(fit.this_fit, 3)
        (1, 1.634)
        >>> reach_shortening(long, 1.55, reach_of)[0] is long
        True
        >>> sparse = Schedule(25, "step", 1, probe_every=4, total_steps=100, first_probe_steps=6)  # 3 later selections
        >>> reach_shortening(sparse, 1.62, reach_of, warmup_steps=2)[0].probe_every  # a window before the third
        3
    """
    limit = reach_of(schedule)
    if schedule.first_probe_steps > schedule.probe_steps and limit.this_fit < speedup:
        short = replace(schedule, first_probe_steps=0)
        later = (short.selections or 0) - 1  # selections after the first: a window before the last of them at most
        if short.first_steps <= warmup_steps and later >= 1:
            short = replace(short, probe_every=min(short.probe_every, later))
        shorter = reach_of(short)
        if shorter.this_fit > limit.this_fit:
            return short, shorter
    return schedule, limit
