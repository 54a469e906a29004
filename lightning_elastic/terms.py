"""What a selection decides under, alike on every rank: the plan's step terms, the decision, and whether to re-plan.

`select_now` decides (`selector.decide`) on every tensor's importance under `step_terms`: the time model (the profile
calibrated to the full step, update and loop the fit measured) and the step target (the plan's up to its horizon,
`planner.WallClockPlan.target`). `off_plan` says when the selection in force ran its first steps off that plan
(`planner.replan_due`). Every figure that a rank measured for itself is averaged over the ranks first
(`mean_over_ranks`), so that every rank decides alike and trains the same tensors.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_elastic.messages import starved_warning
from lightning_elastic.planner import REPLAN_AFTER, REPLANS, replan_due
from lightning_elastic.records import Decision, StepTerms
from lightning_elastic.selector import decide
from lightning_elastic.time_model import StepTimeModel

if TYPE_CHECKING:
    from lightning_elastic.session import FitSession


def mean_over_ranks(trainer: L.Trainer, values: Sequence[float], device: torch.device) -> list[float]:
    """`values`, each averaged over the ranks (as they are on a single process)."""
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    return [float(v) for v in trainer.strategy.reduce(local, reduce_op="mean").tolist()]


def select_now(fit: FitSession, trainer: L.Trainer) -> tuple[Decision, StepTerms]:
    """The selection due now: `selector.decide` on every tensor's importance as it stands (`FitSession.importance`)
    under the plan's `step_terms`, with the fit's pins and units; the warning when even the cheapest selection is
    over the step target (`messages.starved_warning`, when `FitSession.say_starved`)."""
    importance = fit.importance(trainer)
    terms = step_terms(fit, trainer, fit.settings.calibrate)
    required, forbidden = pins = (fit.required, fit.forbidden)
    resolution, units = fit.settings.resolution, fit.units
    decision = decide(
        terms.model, importance, terms.target, required=required, forbidden=forbidden, resolution=resolution,
        units=units,
    )
    if fit.say_starved(decision):
        rank_zero_warn(starved_warning(fit.step_of(trainer), decision, terms, fit.plan, fit.schedule, *pins))
    return decision, terms


def step_terms(fit: FitSession, trainer: L.Trainer, calibrate: bool) -> StepTerms:
    """The plan's figures and target under `calibrate` (planned even before any steady full step is measured: a
    window of warm-up steps only leaves the profile's `T`); else the profile's step over the speedup."""
    prof = fit.profile
    if not calibrate:
        return StepTerms(StepTimeModel.from_profile(prof), prof.t_full, 0.0, prof.t_full / fit.plan.speedup)
    figures = [*_local_figures(fit), _local_target(fit, fit.step_of(trainer))]
    full, optimizer, loop, target = mean_over_ranks(trainer, figures, fit.params[0].device)  # one collective
    return StepTerms(StepTimeModel.calibrated(prof, full, optimizer, loop), full, optimizer, target, loop)


def _local_figures(fit: FitSession) -> tuple[float, float, float]:
    """This rank's full step `T` (the plan's: measured in steady probe steps, else the profile's pass plus
    `prior_update`) and its optimizer update (the steady probe steps' mean, else `prior_update`), both at the
    device's pace now (`WallClockPlan.pace`), and its loop (the median of the latest measured,
    `StepClock.loop_seconds`)."""
    return fit.plan.full_step_now, steady_update(fit) * fit.plan.pace, fit.clock.loop_seconds()


def steady_update(fit: FitSession) -> float:
    """A full step's optimizer update on this rank: the mean of the last probe window's steady steps', else
    `FitSession.prior_update`."""
    probed = fit.probe_optimizer
    return math.fsum(probed) / len(probed) if probed else fit.prior_update


def _local_target(fit: FitSession, step: int) -> float:
    """This rank's plan's step target until the horizon: the fit's end when its length is known, else the next
    selection (the schedule's period, or as long as the last interval)."""
    if fit.plan.total_steps is not None:
        horizon = fit.plan.total_steps
    else:
        period = fit.schedule.period
        previous = step - fit.history[-1].step if fit.history else step
        horizon = step + (int(period) if math.isfinite(period) else max(previous, 1))
    return fit.plan.target(step, horizon, fit.schedule.probe_steps_between(step, horizon))


def off_plan(fit: FitSession, trainer: L.Trainer) -> bool:
    """Whether to re-plan now: the selection in force measured its first `REPLAN_AFTER` steps, it is not the
    `REPLANS`-th re-plan in a row, `2 * REPLAN_AFTER` steps or more are left before the schedule changes the
    trainable set anyway, and `planner.replan_due` says so of their median's measured / expected ratio (averaged
    over ranks). The median, because one slow step among four (the first after a switch took 0.36 s against 0.20 s
    for the next ones on Fashion-MNIST) moves a mean by a fifth: past the tolerance, for a selection that runs as
    planned. A re-plan may keep the mask (the target moved too little)."""
    if fit.probe_end is not None or not fit.history or len(fit.selected_steps) != REPLAN_AFTER:
        return False
    if all(r.replanned for r in fit.history[-REPLANS:]) and len(fit.history) >= REPLANS:
        return False
    if fit.schedule.steps_to_next_change(fit.step_of(trainer)) < 2 * REPLAN_AFTER:
        return False
    decision = fit.history[-1].decision
    local = statistics.median(fit.selected_steps) / fit.plan.expected(decision.predicted_seconds)
    ratio = mean_over_ranks(trainer, [local], fit.params[0].device)[0]
    return replan_due(ratio, decision, fit.forbidden)
