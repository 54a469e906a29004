"""Where the callback's figures go: every logger's metrics, TensorBoard's text and images (the words it says to the
console are in `messages`).

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

from lightning_elastic.distributed import SelectiveAllReduce
from lightning_elastic.inspection import module_rows, profile_table
from lightning_elastic.messages import start_message
from lightning_elastic.planner import WallClockPlan
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.records import Mask, SelectionRecord
from lightning_elastic.schedule import Schedule

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
        >>> from lightning_elastic.records import Decision
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
        >>> from lightning_elastic.records import Decision
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
