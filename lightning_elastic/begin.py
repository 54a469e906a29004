"""The fit begins (step 2 of the method, `plan`), once its profile is known: its session and wall-clock plan, the
reach check, a checkpoint's account restored, the start message.

`begin_fit` is that sequence; `check_reach` sizes the auto windows to what profiling left and refuses a speedup out of
the fit's reach (`reach.Reach`), before its first update.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_elastic import reporting, resume, windows
from lightning_elastic.arguments import Settings
from lightning_elastic.distributed import install_selective_allreduce
from lightning_elastic.planner import WallClockPlan
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.reach import Reach, largest_reachable, reach, reach_shortening
from lightning_elastic.schedule import Schedule
from lightning_elastic.session import FitSession
from lightning_elastic.startup import step_profile
from lightning_elastic.time_model import StepTimeModel
from lightning_elastic.warmup import FirstWindow
from lightning_elastic.windows import ScheduleRefusal, plan_schedule


def begin_fit(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    prof: TimingProfile,
    settings: Settings,
    planned: tuple[Schedule, int | None, int],
    restored: dict[str, Any] | None,
    profile_seconds: float,
    timed: bool,
) -> FitSession:
    """The fit's session with `prof` and its wall-clock plan, before its first update; refuse what is out of reach.

    `planned`: the schedule as planned before profiling, the fit's optimizer steps (None: unknown) and the step it
    counts from. `restored`: a checkpoint's state of the callback, or None. Its own seconds are charged with
    `profile_seconds` after a checkpoint's account is restored, which would otherwise drop them: a resumed fit pays for
    its own start. A process that did not time the profile (`timed` False: a cached, given or restored one) is cold,
    and its first window may run on (`warmup.FirstWindow`).
    """
    started = settings.clock()
    schedule, total_steps, origin = planned
    step = step_profile(trainer, prof)  # an optimizer step runs the pass on every micro-batch
    plan = WallClockPlan(settings.speedup, total_steps, full_step=step.t_full)
    fit = FitSession.start(pl_module, step, schedule, plan, settings, origin)
    fit.warmup.profiled(timed, prof.method)
    fit.schedule, limit = check_reach(trainer, fit, profile_seconds, settings.calibrate)  # refuses what is out of reach
    resume.restore(fit, restored)
    fit.allreduce = install_selective_allreduce(trainer.strategy)
    run_on = fit.warmup.run_on_limit(fit.schedule.first_steps) if fit.in_first_window else 0  # none once resumed
    own = limit.own_share(settings.speedup) if fit.in_first_window else None  # a resumed fit's is spent
    reporting.announce(trainer, prof, settings.speedup, total_steps, fit.schedule, run_on, own, timed)
    fit.charge_start(profile_seconds + settings.clock() - started)
    return fit


def check_reach(
    trainer: L.Trainer, fit: FitSession, profile_seconds: float, calibrate: bool
) -> tuple[Schedule, Reach]:
    """The schedule `fit` runs (`fit.schedule`, as planned before profiling, planned again here: `_reach_at`) and what
    it reaches with it after `profile_seconds` of profiling (per step without `calibrate`), before its first update;
    refuse a speedup out of it (`Reach.check`, which raises), or warn of one on its edge. `fit` is left as it was.

    Auto windows are sized to the speedup asked, so a refusal names the largest speedup that a later fit asking for
    it reaches (`reach.largest_reachable`, with no profiling to pay, as `Reach.reachable` counts), not what the
    windows of the speedup refused would reach. That later fit reads the profile: a cold process, whose first window
    warms up for the steps of one (`warmup.FirstWindow`), more than a first run's (whose profiling passes warmed it
    up), and knows no steady step a refused fit did not measure. Planned with this fit's warm-up instead, a first run
    refused with "at most 3.21" was refused again at 3.21 on the cached run, with "at most 3.11" (its first window 6
    steps, not 3). So a first run that its profiling puts out of reach is measured against that cached fit too: it is
    refused when the cached fit is out of reach as well, and otherwise warned with the cached fit's figure (planned
    with its own warm-up, a first run was told "without it 3.25x" where a cached fit reached 3.11). A first run that
    trains remembers its steady step in the cache (`profiling.cache.remember_step`), so the fit its warning names
    warms up as a cold process that knows it; what that step adds to the floor (`StepTimeModel.calibrated`) is not
    known before this fit's first update, so the figure is the raw profile's. Like `Reach.reachable`, it leaves out
    the cached fit's check pass (0.3 s on Lite0).
    """
    speedup, auto = fit.plan.speedup, fit.settings.probe_steps == "auto"
    runs, limit = _reach_at(fit, speedup, fit.schedule, profile_seconds, calibrate, fit.warmup.warmup_steps)
    said = limit
    if limit.this_fit < speedup and auto and limit.total_steps is not None:
        later = FirstWindow(cold=True, warm_step=fit.profile.t_step).warmup_steps  # a cached fit's, after a refusal
        if not fit.warmup.cold:  # a first run names the cached fit's reach, not its own without profiling: that fit,
            # if this one trains, knows the steady step this one remembers in the cache
            trained = FirstWindow(cold=True, warm_step=fit.profile.t_full).warmup_steps
            said = replace(limit, reachable=_reach_at(fit, speedup, fit.schedule, 0.0, calibrate, trained)[1].reachable)

        def reach_at(asked: float) -> Reach | None:
            planned = plan_schedule(runs.interval, runs.unit, "auto", asked, runs.steps_per_epoch, limit.total_steps)
            if isinstance(planned, ScheduleRefusal):
                return None
            return _reach_at(fit, asked, planned, 0.0, calibrate, later)[1]

        if said.reachable < speedup:
            said = largest_reachable(reach_at, said)
    smoke = bool(getattr(trainer, "fast_dev_run", False))  # set by the Trainer; not in its type stubs
    if (warning := said.check(speedup, smoke)) is not None:  # raises if out of reach even when cached
        rank_zero_warn(warning)
    return runs, limit  # what the schedule that runs reaches (a smoke run goes on past a refusal)


def _reach_at(
    fit: FitSession, speedup: float, schedule: Schedule, profile_seconds: float, calibrate: bool, warmup_steps: int
) -> tuple[Schedule, Reach]:
    """The schedule `fit` runs when planned at `speedup` from `schedule` (as planned before profiling), in a process
    that warms up for `warmup_steps` (`warmup.FirstWindow.warmup_steps`), and what it reaches. Auto windows after the
    first get what the profiling left of the own-time share (`windows.after_profile`; a resumed fit's restored profile
    cost it nothing: windows as cached); a first window longer than the others (to time `T`, see
    `windows.auto_probe_plan`) is cut back to their length when it alone would put `speedup` out of this fit's reach
    (`reach_shortening`). The floor is the profile's pass; where a fit with the profile remembered its steady full step
    (`TimingProfile.t_step`, a cached profile's) and that step's update (`t_update`), the profile calibrated to them
    as the fit's selections calibrate it (`StepTimeModel.calibrated`): a pass timed slow has its backward scaled down
    to the step, the update is shared out by elements, and what else the step took beyond the pass (the loop) is paid
    whole by every step, the cheapest selection too. Charged whole to every step, the update put the cheapest
    selection of MiniLM's 90-step fit at 53% of a full step (a remembered step of 709 ms, 177 ms beyond the pass, most
    of it Adam's update of every tensor) and refused at 2x, "at most 1.83", a cached fit whose first run had reached
    2x (2026-12-07 15:47). A first run knows neither before its first update."""
    settings, prof = fit.settings, fit.profile
    total = fit.plan.total_steps if calibrate else None
    if settings.probe_steps == "auto":
        spent = profile_seconds / max(prof.t_full, 1e-12)  # in full steps
        schedule = windows.after_profile(schedule, speedup, spent, warmup_steps)
    model = StepTimeModel.from_profile(prof)
    if prof.t_step > 0:  # a fit remembered its steady step: the profile calibrated to it, as the fit's own steps will
        model = StepTimeModel.calibrated(prof, prof.t_step, prof.t_update)
    schedule, limit = reach_shortening(
        schedule,
        speedup,
        lambda planned: reach(model, fit.required, fit.forbidden, planned, total, profile_seconds, model.full),
        warmup_steps,
    )
    cache_on, fixed, measured = settings.cache_dir is not False, settings.probe_steps != "auto", not fit.warmup.cold
    limit = replace(limit, cache_on=cache_on, pinned=any(fit.required), fixed_windows=fixed, measured=measured)
    return schedule, limit
