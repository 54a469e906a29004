"""The benchmark's tables: one row per run (`results.csv`) and the markdown report, with the verdicts of
`verdicts` (the issue's targets, the wall-clock contract)."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from elastic_zoo.benchmark.cells import cell, mean_or_nan
from elastic_zoo.benchmark.provenance import CodeProvenance
from elastic_zoo.benchmark.readout import LABELS, MEANINGS, Metric, read_out
from elastic_zoo.benchmark.verdicts import contract, targets
from elastic_zoo.recipe import chosen_option


def time_to_accuracy(curve: Sequence[dict[str, float]], target: float) -> float:
    """Seconds into the fit at the first validation reaching `target`; NaN if none does.

    Example:
        >>> time_to_accuracy([{"seconds": 10.0, "value": 0.5}, {"seconds": 20.0, "value": 0.8}], 0.7)
        20.0
    """
    return next((p["seconds"] for p in curve if p["value"] >= target), math.nan)


def own_share(run: dict[str, Any], probes: str) -> float:
    """An elastic run's own time (profiling, the probe steps as its summary's figure `probes` counts them, selection,
    its logging and freezing) against the training part of the run; NaN for a run without the callback.

    Example:
        >>> run = {"elastic": {"profile_seconds": 3.0, "probe_seconds": 2.0, "probe_excess_seconds": 1.0,
        ...     "select_seconds": 0.5}, "freeze_seconds": 0.5, "wall_seconds": 21.0, "validation_seconds": 1.0}
        >>> own_share(run, "probe_seconds"), own_share(run, "probe_excess_seconds")
        (0.3, 0.25)
    """
    elastic = run.get("elastic", {})
    own = sum(elastic.get(k, math.nan) for k in ("profile_seconds", probes, "select_seconds"))
    own += elastic.get("log_seconds", 0.0)  # runs before it was counted apart: within their selected steps
    return (own + run.get("freeze_seconds", math.nan)) / (run["wall_seconds"] - run["validation_seconds"])


def table_rows(runs: Sequence[dict[str, Any]], fraction: float, metric: Metric = "acc") -> list[dict[str, Any]]:
    """One flat row per run, with the figures that compare it with full fine-tuning of the same seed (the mean of its
    full runs' times, `full_references`).

    Accuracies, and the time to reach `fraction` of full's best, are of `metric` (see `readout`).
    """
    runs = read_out(runs, metric)
    full = full_references(runs)
    rows = []
    for r in runs:
        reference = full.get(r["seed"])
        elastic = r.get("elastic", {})
        rows.append(
            {
                "method": r["method"],
                "seed": r["seed"],
                "metric": metric,
                "wall_s": r["wall_seconds"],
                "speedup_vs_full": reference["wall_seconds"] / r["wall_seconds"] if reference else math.nan,
                # The contract's figure: the training part of the fit (validation left out) against full's.
                "train_speedup_vs_full": (
                    reference["train_seconds"] / (r["wall_seconds"] - r["validation_seconds"])
                    if reference
                    else math.nan
                ),
                "asked_speedup": r.get("speedup", math.nan),
                "callback_fit_speedup": elastic.get("fit_speedup", math.nan),
                # What the fit's account holds full fine-tuning's steps to take (`T` at the device's pace), against
                # what they took in the full runs: the fit lands off its own account by as much.
                "full_estimate_vs_full_run": (
                    elastic.get("full_fit_seconds", math.nan) / (reference["mean_step_seconds"] * r["steps"])
                    if reference
                    else math.nan
                ),
                "overhead_share": own_share(r, "probe_seconds"),
                # The same with each probe step counted by what it cost beyond a selected step (`FitSummary`).
                "excess_share": own_share(r, "probe_excess_seconds"),
                "train_s": r["wall_seconds"] - r["validation_seconds"],
                "validation_s": r["validation_seconds"],
                # The same validation work as full's: its time against theirs witnesses the host's speed in this run.
                "validation_vs_full": (
                    r["validation_seconds"] / reference["validation_seconds"]
                    if reference and reference["validation_seconds"] > 0
                    else math.nan
                ),
                "steps": r["steps"],
                "mean_step_ms": r["mean_step_seconds"] * 1e3,
                "best_acc": r["best_accuracy"],
                "final_acc": r["final_accuracy"],
                "test_acc": r["test_accuracy"],
                "val_images": r["val_images"],
                "test_images": r["test_images"],
                "time_to_target_s": (
                    time_to_accuracy(r["curve"], fraction * reference["best_accuracy"]) if reference else math.nan
                ),
                "peak_memory_mb": r["peak_memory_mb"],
                "energy_wh": r["energy_joules"] / 3600.0,
                "energy_source": r["energy_source"],
                "cpu_share": r["cpu_share"],
                "trained_tensors": r["trained_tensors"],
                "total_tensors": r["total_tensors"],
                "offline_s": r["offline_seconds"],
                "profile_s": elastic.get("profile_seconds", math.nan),
                "probe_s": elastic.get("probe_seconds", math.nan),
                "select_s": elastic.get("select_seconds", math.nan),
                "log_s": elastic.get("log_seconds", math.nan),  # writing the selections to the loggers
                "freeze_s": r.get("freeze_seconds", math.nan),
                "full_step_ms": elastic.get("full_step_seconds", math.nan) * 1e3,
                "selected_step_ms": elastic.get("selected_step_seconds", math.nan) * 1e3,
                "step_fraction": 1.0 / elastic.get("measured_speedup", math.nan),
                "step_vs_full_run": (
                    elastic.get("selected_step_seconds", math.nan) / reference["mean_step_seconds"]
                    if reference
                    else math.nan
                ),
                "predicted_step_ms": mean_or_nan([h["predicted_seconds"] for h in r.get("history", [])]) * 1e3,
                "selections": elastic.get("selections", math.nan),
                "changed_selections": sum(c > 0 for c in r["mask_changes"]) if "mask_changes" in r else math.nan,
                "mean_tensors_changed": mean_or_nan(r["mask_changes"]) if r.get("mask_changes") else math.nan,
            }
        )
    return rows


def full_references(runs: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per seed, what every run of that seed is compared with: the first full fine-tuning run's accuracy and curve,
    and the mean of the seed's full fine-tuning runs' times (two with `benchmark.full_again`: one before the seed's
    other runs and one after them, so that the machine's drift between runs is measured and evened out).

    Example:
        >>> runs = [{"seed": 0, "kind": "full", "wall_seconds": w, "validation_seconds": 1.0,
        ...          "mean_step_seconds": w / 10, "best_accuracy": a} for w, a in ((41.0, 0.9), (51.0, 0.8))]
        >>> ref = full_references(runs)[0]
        >>> ref["wall_seconds"], ref["train_seconds"], ref["mean_step_seconds"], ref["best_accuracy"]
        (46.0, 45.0, 4.6, 0.9)
    """
    grouped: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        if r["kind"] == "full":
            grouped.setdefault(r["seed"], []).append(r)
    return {
        seed: {
            "best_accuracy": group[0]["best_accuracy"],
            "wall_seconds": statistics.fmean(r["wall_seconds"] for r in group),
            "train_seconds": statistics.fmean(r["wall_seconds"] - r["validation_seconds"] for r in group),
            "validation_seconds": statistics.fmean(r["validation_seconds"] for r in group),
            "mean_step_seconds": statistics.fmean(r["mean_step_seconds"] for r in group),
        }
        for seed, group in grouped.items()
    }


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _by_method(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(row["method"], []).append(row)
    return grouped


def markdown_report(
    cfg: DictConfig, rows: Sequence[dict[str, Any]], seconds: float, code: CodeProvenance, stopped: str | None = None
) -> str:
    """The results as markdown: the code measured, the comparison table, the elastic runs' own figures, the targets;
    `stopped` says why the benchmark ended before its last run (the tables then hold the runs that finished)."""
    bench = cfg.benchmark
    metric = str(bench.metric)
    grouped = _by_method(rows)
    seeds = list(bench.seeds)
    fraction = float(bench.accuracy_fraction)
    sources = sorted({r["energy_source"] for r in rows})
    energy_note = (
        f"estimated as wall time x {cfg.device.power_watts:g} W (`device.power_watts`): proportional to wall time"
        if sources == ["estimate"]
        else "measured with NVML"
    )
    lines = [
        f"# Benchmark: {chosen_option(cfg, 'model')} x {chosen_option(cfg, 'dataset')} at {_input_size(cfg)}",
        "",
        f"- {len(seeds)} seed(s) {seeds}, {cfg.trainer.max_epochs} epochs, batch {cfg.dataset.batch_size}, "
        f"{cfg.module.optimizer} lr {cfg.module.lr:g}; elastic: re-selection every {cfg.elastic.interval} "
        f"{cfg.elastic.interval_unit}(s), probe steps {cfg.elastic.probe_steps}; device {chosen_option(cfg, 'device')} "
        f"({torch.get_num_threads()} threads)",
        f"- {code.line()}",
        *([f"- **{stopped}**: the tables hold the runs that finished"] if stopped else []),
        f"- benchmark wall time {seconds / 60:.1f} min; figures are mean ± sample standard deviation over seeds",
        f"- evaluation: {_sizes(rows, 'val_images')} validation images (one image = "
        f"{100 / max(1, min(r['val_images'] for r in rows)):.2f} points), {_sizes(rows, 'test_images')} test images",
        "- wall: the whole fit (training, every validation; for elastic also profiling, probes, selections); "
        f"step: mean of every training step; {metric}: {LABELS[metric]} ({MEANINGS[metric]}) on validation "
        f"(`val/{metric}`), best and final epoch; test: the final model on the test split (`test/{metric}`)",
        f"- time to target: first validation reaching {fraction:.0%} of full fine-tuning's best (same seed); "
        f"energy: {energy_note}",
        f"- contention check: each run's CPU time over wall time x {torch.get_num_threads()} threads was "
        f"{min(r['cpu_share'] for r in rows):.0%} to {max(r['cpu_share'] for r in rows):.0%} (well below 100%: "
        "the run waited for the CPU, or for data loading and Python)",
        "",
        "| method | tensors trained | wall (s) | speedup vs full | training speedup vs full | step (ms) "
        f"| best {metric} (%) | final {metric} (%) | test {metric} (%) | time to {fraction:.0%} of full (s) "
        "| peak memory (MiB) | energy (Wh) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, group in grouped.items():

        def col(key: str, group: list[dict[str, Any]] = group) -> list[float]:
            return [float(r[key]) for r in group]

        shares = [t / n for t, n in zip(col("trained_tensors"), col("total_tensors"), strict=True)]
        tensors = f"{cell(shares, 100, 0)}%" if any(math.isfinite(s) for s in shares) else "schedule"
        lines.append(
            f"| {name} | {tensors} | {cell(col('wall_s'))} | {cell(col('speedup_vs_full'), digits=2)} "
            f"| {cell(col('train_speedup_vs_full'), digits=2)} | {cell(col('mean_step_ms'), digits=0)} "
            f"| {cell(col('best_acc'), 100)} | {cell(col('final_acc'), 100)} | {cell(col('test_acc'), 100)} "
            f"| {cell(col('time_to_target_s'))} "
            f"| {cell(col('peak_memory_mb'), digits=0)} | {cell(col('energy_wh'), digits=3)} |"
        )
    elastic = {name: group for name, group in grouped.items() if math.isfinite(group[0]["selections"])}
    if elastic:
        lines += [
            "",
            "## The elastic runs' own figures",
            "",
            "Per-step figures from the callback's `summary()`: the full step is the mean probe step (every tensor "
            "trained) and the selected step the mean of every other step, both measured in the same run; "
            "predicted: the time model's figure for the selections made; selected / full run: the selected step "
            "against the mean step of the full fine-tuning runs of the same seed. Overheads are seconds per run: "
            "profiling (once, before the first step), probe steps (real training steps with every tensor trained), "
            "selection (importance reduction and the dynamic program), loggers (writing the selections to the "
            "loggers: metrics, text, the selection map), freezing (switching `requires_grad` and BatchNorm modes). "
            "Own time: their sum against the training part of the run, probe steps counted whole, and (beyond "
            "selected) each counted by what it took beyond a selected step. Changed: re-selections whose mask "
            "differs from the one before.",
            "",
            "| method | full step (ms) | selected step (ms) | predicted (ms) | selected / full | selected / full run "
            "| profile (s) | probe steps (s) | selection (s) | loggers (s) | freezing (s) | own time / training "
            "| own time beyond selected | fit speedup (callback's estimate) | selections | changed "
            "| tensors changed per re-selection |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, group in elastic.items():

            def ecol(key: str, group: list[dict[str, Any]] = group) -> list[float]:
                return [float(r[key]) for r in group]

            lines.append(
                f"| {name} | {cell(ecol('full_step_ms'), digits=0)} | {cell(ecol('selected_step_ms'), digits=0)} "
                f"| {cell(ecol('predicted_step_ms'), digits=0)} | {cell(ecol('step_fraction'), digits=3)} "
                f"| {cell(ecol('step_vs_full_run'), digits=3)} | {cell(ecol('profile_s'))} | {cell(ecol('probe_s'))} "
                f"| {cell(ecol('select_s'), digits=3)} | {cell(ecol('log_s'), digits=2)} "
                f"| {cell(ecol('freeze_s'), digits=3)} "
                f"| {cell(ecol('overhead_share'), 100)}% | {cell(ecol('excess_share'), 100)}% "
                f"| {cell(ecol('callback_fit_speedup'), digits=2)} "
                f"| {cell(ecol('selections'), digits=0)} | {cell(ecol('changed_selections'))} "
                f"| {cell(ecol('mean_tensors_changed'))} |"
            )
    lines += ["", *contract(grouped), "", *targets(cfg, grouped), ""]
    return "\n".join(lines)


def failures(failed: Sequence[dict[str, Any]]) -> str:
    """Markdown sections listing the runs refused before training (a speedup out of reach: the callback's answer,
    with the reachable figure) and the runs that failed, each with its message; empty when there are none.

    Example:
        >>> refused = {"method": "elastic_3x", "seed": 1, "error": "SpeedupOutOfReach: ...", "refused_at_most": 2.86}
        >>> print(failures([refused]))
        <BLANKLINE>
        ## Refused before training (a speedup out of reach)
        <BLANKLINE>
        - elastic_3x, seed 1: at most 2.86x: SpeedupOutOfReach: ...
        <BLANKLINE>
    """
    refused = [r for r in failed if "refused_at_most" in r]
    broken = [r for r in failed if "refused_at_most" not in r]
    lines = []
    if refused:
        lines += ["", "## Refused before training (a speedup out of reach)", ""]
        for r in refused:
            lines.append(f"- {r['method']}, seed {r['seed']}: at most {r['refused_at_most']:.2f}x: {r['error']}")
    if broken:
        lines += ["", "## Failed runs", "", *(f"- {r['method']}, seed {r['seed']}: {r['error']}" for r in broken)]
    return "\n".join([*lines, ""]) if lines else ""


def _sizes(rows: Sequence[dict[str, Any]], key: str) -> str:
    """The number of images every run evaluated, or their range when the runs differ (a split per seed)."""
    sizes = sorted({int(r[key]) for r in rows})
    return f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,} to {sizes[-1]:,}"


def _input_size(cfg: DictConfig) -> str:
    """The size of one input: an image's side, or a text's tokens.

    Example:
        >>> from omegaconf import OmegaConf
        >>> _input_size(OmegaConf.create({"dataset": {}, "model": {"tokenizer": {"max_length": 32}}}))
        '32 tokens'
    """
    if "image_size" in cfg.dataset:
        return f"{cfg.dataset.image_size} px"
    return f"{cfg.model.tokenizer.max_length} tokens"
