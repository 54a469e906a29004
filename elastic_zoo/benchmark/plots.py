"""The benchmark's plots (accuracy against wall-clock time, the selection maps) and its TensorBoard summary."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from elastic_zoo.benchmark.paired import by_method_and_seed, common_times, curve_band, training_end
from elastic_zoo.benchmark.readout import LABELS, Metric, read_out

MAP_DPI = 100  # the maps are drawn at one image pixel per figure pixel: their text stays sharp


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the machines that run benchmarks
    import matplotlib.pyplot as plt

    return plt


def accuracy_figure(runs: Sequence[dict[str, Any]], fraction: float, metric: Metric = "acc") -> Any:
    """Best validation `metric` so far against training seconds (validation left out) for every method.

    A line is the mean over seeds, the band one sample standard deviation; a curve starts once every seed has
    validated, and a finished run keeps its best accuracy to the right edge (a dot marks the method's mean end).
    Dotted vertical lines mark the common times of the equal-wall-clock table. `runs` as recorded; `metric`:
    "acc" or "balanced_acc" (see `readout`).
    """
    runs = read_out(runs, metric)
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    grouped = by_method_and_seed(runs)
    last = max(training_end(r) for r in runs)
    grid = [last * i / 400 for i in range(401)]
    for name, by_seed in grouped.items():
        group = list(by_seed.values())
        end = statistics.fmean(training_end(r) for r in group)
        band = curve_band(group, sorted({*grid, end}))
        if not band:
            continue
        seconds, means, spreads = (list(column) for column in zip(*band, strict=True))
        style = "-" if name.startswith("elastic") else "--" if group[0]["kind"] == "full" else ":"
        (line,) = axes.plot(seconds, [100 * m for m in means], style, drawstyle="steps-post", label=name)
        if end in seconds:
            axes.plot([end], [100 * means[seconds.index(end)]], "o", color=line.get_color(), markersize=4)
        low = [100 * (m - s) for m, s in zip(means, spreads, strict=True)]
        high = [100 * (m + s) for m, s in zip(means, spreads, strict=True)]
        axes.fill_between(seconds, low, high, step="post", color=line.get_color(), alpha=0.12, linewidth=0)
    for times in common_times(grouped).values():
        axes.axvline(statistics.fmean(times.values()), color="grey", linestyle=":", linewidth=0.6)
    full_best = [r["best_accuracy"] for r in runs if r["method"] == "full"]  # the first full run's, as the tables
    if full_best:
        axes.axhline(
            100 * fraction * statistics.fmean(full_best),
            color="grey",
            linewidth=0.8,
            label=f"{fraction:.0%} of full's best",
        )
    axes.set_xlabel("training seconds into the fit (profiling and probes included, validation left out)")
    axes.set_ylabel(f"best validation {LABELS[metric]} so far (%)\nmean ± sd over seeds")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_accuracy(runs: Sequence[dict[str, Any]], fraction: float, path: Path, metric: Metric = "acc") -> None:
    figure = accuracy_figure(runs, fraction, metric)
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)


def selections_figure(runs: Sequence[dict[str, Any]]) -> Any | None:
    """The selection maps of the elastic runs of the first seed, side by side; None without any.

    Each map is the callback's own (`lightning_elastic.inspection.selection_map`), saved by its run: tensors by
    module in model order, one column per selection, the states in its legend.
    """
    first_seed = runs[0]["seed"] if runs else None
    elastic = [r for r in runs if r.get("selection_map") and r["seed"] == first_seed]
    if not elastic:
        return None
    images = [np.asarray(Image.open(r["selection_map"]).convert("RGB")) for r in elastic]
    plt = _pyplot()
    width = sum(image.shape[1] for image in images) / MAP_DPI + 0.3 * len(images)
    height = max(image.shape[0] for image in images) / MAP_DPI + 0.8
    figure, axes = plt.subplots(
        1,
        len(images),
        figsize=(width, height),
        squeeze=False,
        gridspec_kw={"width_ratios": [image.shape[1] for image in images]},
    )
    for axis, r, image in zip(axes[0], elastic, images, strict=True):
        axis.imshow(image, interpolation="nearest")
        axis.set_axis_off()
        share = statistics.fmean(h["mask"].count("1") / len(h["mask"]) for h in r["history"])
        axis.set_title(f"{r['method']}: {share:.0%} of tensors trained, mean over selections", fontsize=9)
    figure.suptitle(f"Selections of the elastic runs, seed {first_seed}", fontsize=10)
    figure.tight_layout()
    return figure


def plot_selections(runs: Sequence[dict[str, Any]], path: Path) -> None:
    figure = selections_figure(runs)
    if figure is not None:
        figure.savefig(path, dpi=MAP_DPI)
        _pyplot().close(figure)


def log_tensorboard(
    runs: Sequence[dict[str, Any]], report: str, fraction: float, output_dir: Path, metric: Metric = "acc"
) -> None:
    """The table, the plots and every run's `metric` against whole seconds into its fit, under `summary/`."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(output_dir / "tensorboard" / "summary"))
    try:
        writer.add_text("benchmark/results", report)
        writer.add_figure("benchmark/accuracy_vs_time", accuracy_figure(runs, fraction, metric))
        figure = selections_figure(runs)
        if figure is not None:
            writer.add_figure("benchmark/selections", figure)
        name = LABELS[metric].replace(" ", "_")
        for r in read_out(runs, metric):
            for point in r["curve"]:
                tag = f"{name}_vs_seconds/{r['method']}/seed_{r['seed']}"
                writer.add_scalar(tag, point["value"], round(point["seconds"]))
    finally:
        writer.close()
