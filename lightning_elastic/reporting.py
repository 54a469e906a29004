"""Where the callback's figures go: every logger's metrics, TensorBoard's text and images, messages.

The figures themselves come from typed records (`records.SelectionRecord`) and the plan (`planner.WallClockPlan`);
this module only formats and writes them, on rank zero for TensorBoard and through every logger for metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_elastic import windows
from lightning_elastic.distributed import SelectiveAllReduce
from lightning_elastic.inspection import module_rows, profile_table
from lightning_elastic.planner import FORECAST_STEPS, WallClockPlan
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.reach import at_most
from lightning_elastic.records import Decision, Mask, SelectionRecord, StepTerms
from lightning_elastic.schedule import Schedule
from lightning_elastic.summary import MET_WITHIN

TEXT_NAMES = 24  # trained tensors named one by one in a selection's text; beyond, modules are named ...
TEXT_MODULES = 8  # ... at most this many


def log_metrics(trainer: L.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Finite `metrics` to every logger of `trainer`, at global step `step` (default: the current one)."""
    clean = {k: v for k, v in metrics.items() if math.isfinite(v)}
    for logger in trainer.loggers:
        logger.log_metrics(clean, step=trainer.global_step if step is None else step)


def tensorboard_writers(trainer: L.Trainer) -> list[Any]:
    """The SummaryWriters of the TensorBoard loggers, on rank zero only."""
    if trainer.global_rank != 0:
        return []
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def contract_metrics(plan: WallClockPlan) -> dict[str, float]:
    """The wall-clock contract's state: seconds planned for the steps done, seconds spent, the correction and the
    device's pace (`pace.pace_of`)."""
    return {
        "elastic/planned_seconds": plan.planned(plan.steps_done),
        "elastic/spent_seconds": plan.spent,
        "elastic/fit_speedup": plan.speedup_so_far,
        "elastic/time_model_correction": plan.correction,
        "elastic/pace": plan.pace,
    }


def start_message(
    profile: TimingProfile,
    speedup: float,
    total_steps: int | None,
    schedule: Schedule,
    run_on: int = 0,
    own_share: float | None = None,
    timed: bool = True,
) -> str:
    r"""What the fit starts with: the profile's figures (`timed` in this run, or read: cached, given, restored), the
    target and the schedule, the steps its first window may `run_on` while the process warms up
    (`warmup.FirstWindow.run_on_limit`), and elastic's own time as planned (`reach.Reach.own_share`; None: not
    known), said when it is over `windows.OWN_SHARE` as the summary rounds it.

    Example:
        >>> p = TimingProfile(names=("a",), t_dw=(0.002,), t_dy=(0.0,), t_fw=0.004, t_full=0.007,
        ...     device="cpu", fingerprint="f", unused=(), method="measured", numel=(9,))
        >>> print(start_message(p, 2.0, 120, Schedule(1, "epoch", 3)).replace("; ", "\n"))
        ElasticTensorSelection: 1 tensor profiled on cpu (full forward+backward 7.0 ms, forward 4.0 ms)
        target speedup 2 for the fit's 120 optimizer steps
        3 probe steps before the first selection, then 3 before every selection (one every 1 epoch(s))
    """
    steps = "steps (length unknown: planned per interval)" if total_steps is None else f"{total_steps} optimizer steps"
    more = f" (up to {run_on} more while this process warms up)" if run_on else ""
    own = ""
    if own_share is not None and own_share > windows.OWN_SHARE + 0.005:  # over 5% as the summary rounds it
        own = (
            f"; profiling and probe steps (full training steps that measure importance and the full step's time), "
            f"elastic's own time, are planned at {own_share:.0%} of this fit, above the {windows.OWN_SHARE:.0%} it "
            f"keeps to in longer fits with automatic `probe_steps`: they count toward the {speedup:g}x, so the "
            "selected steps have less time"
        )
    profiled = "profiled" if timed else "profiled earlier (a profile read, not timed in this run)"
    return (
        f"ElasticTensorSelection: {_count(len(profile.names), 'tensor')} {profiled} on {profile.device} (full "
        f"forward+backward {profile.t_full * 1e3:.1f} ms, forward {profile.t_fw * 1e3:.1f} ms); target speedup "
        f"{speedup:g} for the fit's {steps}; {_count(schedule.first_steps, 'probe step')} before the first selection"
        f"{more}, {_later(schedule)}{own}"
    )


def _per_step(target: float) -> str:
    """A step target in words: "12.5 ms a step", or none when the plan has spent more than it had (a target below 0).

    Example:
        >>> _per_step(0.0125), _per_step(-0.0098)
        ('12.5 ms a step', 'no time for the steps ahead')
    """
    return f"{target * 1e3:.1f} ms a step" if target >= 0 else "no time for the steps ahead"


def _count(n: int, thing: str) -> str:
    """`n` things, in words: "1 tensor", "3 tensors"."""
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _later(schedule: Schedule) -> str:
    """The windows before the selections after the first, in words: none where `probe_every` skips them all.

    Example:
        >>> _later(Schedule(1, "epoch", 1, steps_per_epoch=32, probe_every=4, total_steps=128))
        'no window before the 3 selections after it (one every 1 epoch(s))'
        >>> _later(Schedule(20, "step", 1, probe_every=3))
        'then 1 before one selection in 3 (one every 20 step(s))'
    """
    later = None if schedule.selections is None else schedule.selections - 1
    every = f"(one every {schedule.interval} {schedule.unit}(s))"
    if later is not None and schedule.probe_every > later:
        return f"no window before the {_count(later, 'selection')} after it {every}"
    which = "every selection" if schedule.probe_every == 1 else f"one selection in {schedule.probe_every}"
    return f"then {schedule.probe_steps} before {which} {every}"


def announce(
    trainer: L.Trainer,
    profile: TimingProfile,
    speedup: float,
    total_steps: int | None,
    schedule: Schedule,
    run_on: int,
    own_share: float | None,
    timed: bool = True,
) -> None:
    """The start message to the console (`start_message`); the profile's table and the charts to TensorBoard."""
    rank_zero_info(start_message(profile, speedup, total_steps, schedule, run_on, own_share, timed))
    for writer in tensorboard_writers(trainer):
        writer.add_text("elastic/profile", profile_table(profile), trainer.global_step)
        writer.add_custom_scalars(CHARTS)


def interval_metrics(
    record: SelectionRecord, plan: WallClockPlan, allreduce: SelectiveAllReduce | None
) -> dict[str, float]:
    """An interval that closed: its measured against its predicted step, the contract, and DDP's all-reduce share;
    logged at the step before the next selection (the interval's last, or the last of a probe window that followed
    it), so that the next selection's figures (`selection_metrics`, at the step it comes into force) are not a second
    value of `elastic/predicted_step_ms` at one step.

    Example:
        >>> rec = SelectionRecord(0, 0, Decision(Mask.of([True]), (1.0,), 0.1, 0.1), 0.2, measured_seconds=(0.125,))
        >>> interval_metrics(rec, WallClockPlan(2.0, 10, 0.25, full_samples=3), None)["elastic/measured_speedup"]
        2.0
    """
    metrics = {
        "elastic/measured_step_ms": record.measured_step * 1e3,
        "elastic/predicted_step_ms": record.decision.predicted_seconds * 1e3,
        **contract_metrics(plan),
    }
    # measured against measured (without `calibrate` the record's T is the profile's); a step of 0 s: a clock coarser
    # than the step (`time.time` ticks every 15.6 ms on Windows)
    if plan.full_samples and record.measured_step > 0:
        metrics["elastic/measured_speedup"] = plan.full_step_now / record.measured_step
    if allreduce is not None and allreduce.last_step_full_bytes:
        metrics["elastic/allreduce_fraction"] = allreduce.last_step_bytes / allreduce.last_step_full_bytes
    return metrics


def selection_metrics(
    record: SelectionRecord,
    plan: WallClockPlan,
    numel: Sequence[int],
    select_seconds: float,
    optimizer_seconds: float,
    loop_seconds: float = 0.0,
) -> dict[str, float]:
    """A new selection: what it trains, its predicted, full and target step, what every step pays between two
    (`loop_seconds`), and the contract.

    Example:
        >>> rec = SelectionRecord(0, 0, Decision(Mask.of([True, False]), (1.0, 0.0), 0.1, 0.15), 0.2)
        >>> metrics = selection_metrics(rec, WallClockPlan(2.0, 10, 0.2), [30, 10], 0.01, 0.0)
        >>> metrics["elastic/selected_elements_fraction"], metrics["elastic/select_ms"]
        (0.75, 10.0)
    """
    mask = record.mask
    return {
        "elastic/selected_fraction": mask.count(True) / len(mask),
        "elastic/selected_elements_fraction": mask.elements(numel) / sum(numel),
        "elastic/predicted_step_ms": record.decision.predicted_seconds * 1e3,
        "elastic/full_step_ms": record.full_seconds * 1e3,
        "elastic/target_step_ms": max(record.decision.target_seconds, 0.0) * 1e3,  # 0: the plan has no time left
        "elastic/optimizer_ms": optimizer_seconds * 1e3,
        "elastic/loop_ms": loop_seconds * 1e3,
        "elastic/select_ms": select_seconds * 1e3,
        **contract_metrics(plan),
    }


def write_selection(writer: Any, record: SelectionRecord, names: Sequence[str], step: int) -> None:
    """A new selection to a TensorBoard writer: the importance, the top tensors, the text."""
    writer.add_histogram("elastic/importance", torch.tensor(record.decision.importance), step)
    for tag, value in top_importance(record, names).items():
        writer.add_scalar(tag, value, step)
    writer.add_text("elastic/selection", selection_text(record, names), step)


def write_map(trainer: L.Trainer, image: Callable[[], np.ndarray | None], step: int) -> bool:
    """The selection map (`image`, drawn once, only when there is a TensorBoard writer) to every TensorBoard writer;
    whether it was written."""
    writers = tensorboard_writers(trainer)
    drawn = image() if writers else None
    for writer in writers if drawn is not None else ():
        writer.add_image("elastic/selection", drawn, step, dataformats="HWC")
    return drawn is not None


def log_selection(
    trainer: L.Trainer,
    record: SelectionRecord,
    plan: WallClockPlan,
    profile: TimingProfile,
    seconds: tuple[float, float, float],
) -> None:
    """A selection's metrics to every logger (`seconds`: the selection's own, the optimizer step's and the loop's
    between two steps), and its text to TensorBoard (the map is drawn at its own pace: `inspection.MapPace`)."""
    metrics = selection_metrics(record, plan, profile.numel, *seconds)
    log_metrics(trainer, metrics)
    for writer in tensorboard_writers(trainer):
        write_selection(writer, record, profile.names, trainer.global_step)


def progress_metrics(probing: bool, mask: Mask | None) -> dict[str, float]:
    """The progress bar's phase and share of tensors this step trains (not sent to loggers).

    `elastic/probing` is 1 in a probe window (every tensor trains and is measured), 0 under a selection.

    Example:
        >>> progress_metrics(False, Mask.of([True, False, False, True]))
        {'elastic/probing': 0.0, 'elastic/trained': 0.5}
    """
    if probing or mask is None:
        return {"elastic/probing": 1.0, "elastic/trained": 1.0}
    return {"elastic/probing": 0.0, "elastic/trained": mask.count(True) / len(mask)}


def show_progress(
    pl_module: L.LightningModule, shown: dict[str, float], probing: bool, mask: Mask | None, first_batch: bool
) -> dict[str, float]:
    """Put `progress_metrics` on the progress bar (not the loggers) when they differ from what it has `shown`, or at an
    epoch's `first_batch` (the bar keeps what was logged last, and `log` costs 0.3 ms a call); what it shows now."""
    now = progress_metrics(probing, mask)
    if now != shown or first_batch:
        for name, value in now.items():
            pl_module.log(name, value, prog_bar=True, logger=False, batch_size=1)
    return now


def unprofiled_warning(names: Sequence[str]) -> str:
    """The warning when tensors the profiled batch did not use get a gradient: they train outside every selection.

    Example:
        >>> unprofiled_warning(["b.weight", "b.bias"])[:75]
        'ElasticTensorSelection: tensors that the profiled batch did not use got a g'
    """
    return (
        "ElasticTensorSelection: tensors that the profiled batch did not use got a gradient (a branch of the model "
        f"that batch did not take): {list(names)[:5]}{' ...' if len(names) > 5 else ''}. They are not in the profile, "
        "so no selection freezes them: they train whenever a batch uses them, outside the selection (the plan counts "
        "their time in the steps it measures). Freeze them with `train_never` if they should not train."
    )


def nonfinite_warning(names: Sequence[str], dropped: Sequence[int]) -> str:
    """The warning, once a fit, when some tensor steps' importance was not finite (`dropped`: their count per tensor).

    Example:
        >>> nonfinite_warning(["a", "b"], [0, 3])[:80]
        "ElasticTensorSelection: the importance of ['b'] was not finite at 3 tensor steps"
    """
    named = [n for n, d in zip(names, dropped, strict=True) if d][:5]
    return (
        f"ElasticTensorSelection: the importance of {named} was not finite at {sum(dropped)} tensor steps (a NaN or "
        "inf gradient or update): those steps are left out and each tensor keeps its last finite importance. Counted "
        "as `nonfinite_steps` in the summary; warned once a fit."
    )


def starved_warning(
    step: int,
    decision: Decision,
    terms: StepTerms,
    plan: WallClockPlan,
    schedule: Schedule,
    required: Sequence[bool],
    forbidden: Sequence[bool],
) -> str:
    """The warning when even the cheapest selection takes longer than the plan's step target (`FitSession.say_starved`
    says when): once `T` is measured, with what the whole fit reaches at that selection for every step left and the
    probe steps of `schedule` ahead (`WallClockPlan.reachable`), measured where the check before training had only
    the profile; from fewer than `FORECAST_STEPS` selected steps, said to be an early figure."""
    largest = terms.model.max_speedup(required, forbidden, terms.full)
    reachable = None
    if plan.full_samples and plan.total_steps is not None:
        ahead = schedule.probe_steps_between(step, plan.total_steps)
        reachable = plan.reachable(step, ahead, plan.expected(decision.predicted_seconds))
    if reachable is None:
        outcome = (
            "Later intervals pay it back if they can: the summary's `fit_speedup` is the outcome."
            if plan.total_steps is None
            else "Later intervals pay it back if they can; what the whole fit can reach is said once a probe window "
            "has measured the full step."
        )
    elif reachable < plan.speedup * (1 - MET_WITHIN):
        ask = "ask at most that, or fit longer" if reachable > 1 else "a `speedup` must be above 1: fit longer"
        outcome = (
            "With the cheapest selection at every step left, at the step times measured so far, this fit reaches "
            f"about {at_most(reachable)}x: the `speedup` asked is out of its reach ({ask})."
        )
    elif reachable < plan.speedup:
        outcome = (
            "With the cheapest selection at every step left, at the step times measured so far, this fit reaches "
            f"about {at_most(reachable)}x: within the {MET_WITHIN:.0%} of the asked that the summary counts as met, "
            "with nothing to spare."
        )
    else:
        outcome = (
            "Later intervals can pay it back: at the cheapest selection, at the step times measured so far, this fit "
            f"reaches about {at_most(reachable)}x."
        )
    if reachable is not None and (n := plan.selected_samples) < FORECAST_STEPS:
        basis = f"{n} selected step{'s' * (n != 1)}" if n else "the time model, before any selected step"
        outcome += (
            f" An early figure, from {basis} (a fit's first ones can run far slower than its later ones): said again "
            f"if the cheapest selection is still over the plan once {FORECAST_STEPS} selected steps are measured."
        )
    return (
        f"ElasticTensorSelection: at step {step} the plan leaves {_per_step(decision.target_seconds)} "
        f"(full step {terms.full * 1e3:.1f} ms, {plan.spent:.1f} s spent of {plan.planned():.1f} s planned); "
        f"the cheapest selection takes {decision.predicted_seconds * 1e3:.1f} ms, so this interval spends more "
        f"than its share of `speedup` {plan.speedup!r} (largest per-step speedup: {at_most(largest)}x). {outcome}"
    )


def selection_text(record: SelectionRecord, names: Sequence[str]) -> str:
    """One re-selection in words: when, how much, what it costs against a full step, and the trained tensors.

    Up to `TEXT_NAMES` trained tensors are named one by one; more are named by module (at most `TEXT_MODULES`),
    with how many of each module's tensors train (`blocks.3.* (4)`).

    Example:
        >>> from lightning_elastic.records import Decision, Mask
        >>> names = [f"m.blocks.{k // 10}.t{k}" for k in range(40)]
        >>> rec = SelectionRecord(8, 1, Decision(Mask.of([k >= 12 for k in range(40)]), (0.0,) * 40, 0.1, 0.2), 0.3)
        >>> print(selection_text(rec, names))  # doctest: +NORMALIZE_WHITESPACE
        step 8, epoch 1: 28/40 tensors trained; predicted step 100.0 ms for a target of 200.0 ms (full step 300.0 ms).
        blocks.1.* (8), blocks.2.* (10), blocks.3.* (10)
    """
    mask, decision = record.mask, record.decision
    trained = mask.trained(names)
    if len(trained) > TEXT_NAMES:
        trained = [label for label, _, _ in module_rows(trained, max_rows=TEXT_MODULES)]
    shown = ", ".join(trained)
    target = f"{decision.target_seconds * 1e3:.1f} ms" if decision.target_seconds >= 0 else "none (no time left)"
    return (
        f"step {record.step}, epoch {record.epoch}: {mask.count(True)}/{len(mask)} tensors trained; predicted step "
        f"{decision.predicted_seconds * 1e3:.1f} ms for a target of {target} "
        f"(full step {record.full_seconds * 1e3:.1f} ms).  \n{shown}"
    )


# TensorBoard's Custom Scalars tab: the questions a user asks, each answered by one chart of the scalars above.
CHARTS: dict[str, dict[str, list[Any]]] = {
    "elastic": {
        "step time per interval: predicted vs measured (ms)": [
            "Multiline",
            ["elastic/predicted_step_ms", "elastic/measured_step_ms", "elastic/target_step_ms", "elastic/full_step_ms"],
        ],
        "wall-clock contract: planned vs spent (s)": [
            "Multiline",
            ["elastic/planned_seconds", "elastic/spent_seconds"],
        ],
        "trained share: elements vs tensors": [
            "Multiline",
            ["elastic/selected_elements_fraction", "elastic/selected_fraction"],
        ],
        "importance of the top tensors": ["Multiline", ["elastic/importance/.*"]],
    }
}
TOP_TENSORS = 5  # tensors whose importance is charted at each selection


def top_importance(record: SelectionRecord, names: Sequence[str]) -> dict[str, float]:
    """The importance of a selection's `TOP_TENSORS` most important tensors, tagged by name.

    Example:
        >>> from lightning_elastic.records import Decision, Mask
        >>> rec = SelectionRecord(0, 0, Decision(Mask.of([True, False]), (0.5, 2.0), 0.1, 0.1), 0.2)
        >>> top_importance(rec, ["a.weight", "b.weight"])
        {'elastic/importance/b.weight': 2.0, 'elastic/importance/a.weight': 0.5}
    """
    values = record.decision.importance
    order = sorted((k for k in range(len(values)) if math.isfinite(values[k])), key=lambda k: -values[k])
    return {f"elastic/importance/{names[k]}": float(values[k]) for k in order[:TOP_TENSORS]}
