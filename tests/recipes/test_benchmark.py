"""`recipes/benchmark.py` and `elastic_zoo.benchmark`: its configs, its tables from known runs, and the real command line on tiny fake data."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elastic_zoo.benchmark.methods import Method, benchmark_problems, methods_of, run_config
from elastic_zoo.benchmark.paired import paired_report
from elastic_zoo.benchmark.plots import accuracy_figure, plot_selections
from elastic_zoo.benchmark.provenance import CodeProvenance, code_provenance
from elastic_zoo.benchmark.report import markdown_report, table_rows, time_to_accuracy
from elastic_zoo.models import tiny_cnn
from elastic_zoo.module import ImageClassifier
from lightning_elastic.inspection import MAP_STATES, selection_map
from lightning_elastic.records import Decision, Mask, SelectionRecord
from tests.integration.tiny import synthetic_profile
from tests.recipes.recipe_fakes import CONF, REPO, compose_config, fake_fashion_mnist
from tests.recipes.test_cli import config_error_lines, run_recipe

CODE = CodeProvenance(Path("/src/lightning_elastic"), "a" * 40, dirty=False)
PRESETS = sorted(path.stem for path in (CONF / "benchmark").glob("*.yaml"))
CSV_COLUMNS = [
    "method", "seed", "metric", "wall_s", "speedup_vs_full", "train_speedup_vs_full", "asked_speedup", "callback_fit_speedup",
    "full_estimate_vs_full_run", "overhead_share", "excess_share", "train_s", "validation_s", "validation_vs_full", "steps", "mean_step_ms", "best_acc",
    "final_acc", "test_acc", "val_images", "test_images", "time_to_target_s", "peak_memory_mb", "energy_wh", "energy_source", "cpu_share", "trained_tensors",
    "total_tensors", "offline_s", "profile_s", "probe_s", "select_s", "log_s", "freeze_s", "full_step_ms", "selected_step_ms",
    "step_fraction", "step_vs_full_run", "predicted_step_ms", "selections", "changed_selections", "mean_tensors_changed",
]  # fmt: skip


@pytest.mark.parametrize("preset", [None, *PRESETS])
def test_every_preset_composes_into_runs_that_differ_only_in_method_and_seed(
    preset: str | None, tmp_path: Path
) -> None:
    cfg = compose_config([] if preset is None else [f"benchmark={preset}"], tmp_path, name="benchmark")
    assert benchmark_problems(cfg) == []
    methods = methods_of(cfg)
    assert [m.kind for m in methods][: len(cfg.benchmark.baselines)] == list(cfg.benchmark.baselines)
    last = [m for m in methods if m.kind == "elastic"][-1]
    full = run_config(cfg, methods[0], 7)
    elastic = run_config(cfg, last, 7)
    assert full["seed"] == elastic["seed"] == full["dataset"]["seed"] == 7
    assert full["elastic"]["_target_"] is None and elastic["elastic"]["speedup"] == last.speedup
    # every elastic run profiles into a folder of its own (empty: a first run), inside its measured wall clock
    assert elastic["elastic"]["cache_dir"] == str(tmp_path / "profiles" / f"{last.profile_folder}_seed_7")
    assert (full["logger"]["name"], full["logger"]["version"]) == (methods[0].name, "seed_7")
    assert full["paths"]["output_dir"] == str(tmp_path)
    same = {k for k in full if full[k] == elastic[k]}
    assert same == set(full) - {"elastic", "method", "logger"}


def test_the_default_run_is_the_published_setting(tmp_path: Path) -> None:
    cfg = compose_config([], tmp_path, name="benchmark")
    assert [m.name for m in methods_of(cfg)] == [
        "full", "head_only", "bitfit", "static_last_k", "backbone_finetuning", "linear_freeze",
        "elastic_1.5x", "elastic_2x", "elastic_3x",
    ]  # fmt: skip
    assert cfg.model.head == "model._fc.*" and cfg.dataset.image_size == 96 and len(cfg.benchmark.seeds) >= 5


def test_benchmark_settings_are_checked_together(tmp_path: Path) -> None:
    cfg = compose_config(
        ["benchmark.seeds=[1,1]", "benchmark.baselines=[full,lora]", "benchmark.elastic_speedups=[0.5]",
         "benchmark.accuracy_fraction=2", "benchmark.freeze_start=-0.1", "benchmark.metric=f1"],
        tmp_path,
        name="benchmark",
    )  # fmt: skip
    assert benchmark_problems(cfg) == [
        "benchmark: `seeds` must be a non-empty list of distinct ints. Found: [1, 1]",
        "benchmark: `baselines` must be distinct names among ('full', 'head_only', 'bitfit', 'static_last_k', "
        "'backbone_finetuning', 'linear_freeze'). Found: ['full', 'lora']",
        "benchmark: `elastic_speedups` must be distinct numbers > 1. Found: [0.5]",
        "benchmark: `freeze_start` must be a number in [0, 1). Found: -0.1",
        "benchmark: `accuracy_fraction` must be a number in (0, 1]. Found: 2",
        "benchmark: `metric` must be one of ('acc', 'balanced_acc'). Found: 'f1'",
    ]


def _run(method: str, kind: str, seed: int, wall: float, accuracies: list[float], **extra: Any) -> dict[str, Any]:
    curve = [{"epoch": e, "seconds": wall * (e + 1) / len(accuracies), "value": a} for e, a in enumerate(accuracies)]
    return {
        "method": method, "kind": kind, "seed": seed, "wall_seconds": wall, "validation_seconds": 1.0, "steps": 10,
        "mean_step_seconds": wall / 20, "curve": curve, "best_accuracy": max(accuracies),
        "final_accuracy": accuracies[-1], "test_accuracy": accuracies[-1], "val_images": 400, "test_images": 1000,
        "peak_memory_mb": 100.0,
        "energy_joules": 3600.0, "energy_source": "estimate", "cpu_share": 0.9, "trained_tensors": 2.0, "total_tensors": 4,
        "offline_seconds": 0.0, **extra,
    }  # fmt: skip


# An elastic run's own figures, for the tables
ELASTIC = {
    "elastic": {"profile_seconds": 3.0, "probe_seconds": 2.0, "probe_excess_seconds": 1.0, "select_seconds": 0.01,
                "log_seconds": 0.25, "full_step_seconds": 0.4, "full_fit_seconds": 45.0,
                "selected_step_seconds": 0.2, "measured_speedup": 2.0, "selections": 3.0},
    "freeze_seconds": 0.002, "mask_changes": [0, 2], "speedup": 2.0,
}  # fmt: skip


def test_tables_compare_each_run_with_full_fine_tuning_of_the_same_seed(tmp_path: Path) -> None:
    runs = [
        _run("full", "full", 0, 100.0, [0.5, 0.8, 0.9]),
        _run("elastic_2x", "elastic", 0, 50.0, [0.6, 0.895, 0.89], **ELASTIC),
        _run("head_only", "head_only", 0, 20.0, [0.5, 0.6, 0.6]),
        _run("full", "full", 1, 120.0, [0.7, 0.7, 0.7]),
        _run("elastic_2x", "elastic", 1, 60.0, [0.6, 0.6, 0.7], **ELASTIC),
        _run("head_only", "head_only", 1, 30.0, [0.5, 0.5, 0.7]),
    ]
    rows = table_rows(runs, 0.99)
    assert list(rows[0]) == CSV_COLUMNS
    by = {(r["method"], r["seed"]): r for r in rows}
    assert by["elastic_2x", 0]["speedup_vs_full"] == 2.0 and by["head_only", 1]["speedup_vs_full"] == 4.0
    # 99% of full's best (0.9) is 0.891: reached at the second of three validations, at 2/3 of the 50 s.
    assert by["elastic_2x", 0]["time_to_target_s"] == pytest.approx(100 / 3)
    assert math.isnan(by["head_only", 0]["time_to_target_s"]) and by["head_only", 1]["time_to_target_s"] == 30.0
    assert by["elastic_2x", 0]["step_fraction"] == 0.5 and by["elastic_2x", 0]["changed_selections"] == 1
    assert by["elastic_2x", 1]["step_vs_full_run"] == pytest.approx(0.2 / 6.0)  # full's mean step: 120 s / 20
    # the fit's account of full fine-tuning's 10 steps (45 s) against what they took: 10 x 5 s, 10 x 6 s
    assert by["elastic_2x", 0]["full_estimate_vs_full_run"] == pytest.approx(0.9)
    assert by["elastic_2x", 1]["full_estimate_vs_full_run"] == pytest.approx(0.75)
    assert math.isnan(by["head_only", 0]["full_estimate_vs_full_run"])
    assert by["elastic_2x", 0]["energy_wh"] == 1.0
    # the contract's figure leaves validation (1 s in every run) out: (100 - 1) / (50 - 1)
    assert by["elastic_2x", 0]["train_speedup_vs_full"] == pytest.approx(99 / 49)
    assert by["elastic_2x", 0]["overhead_share"] == pytest.approx((3.0 + 2.0 + 0.01 + 0.25 + 0.002) / 49)
    assert by["elastic_2x", 0]["excess_share"] == pytest.approx((3.0 + 1.0 + 0.01 + 0.25 + 0.002) / 49)
    cfg = compose_config(["benchmark.seeds=[0,1]"], tmp_path, name="benchmark")
    report = markdown_report(cfg, rows, 60.0, CODE)
    row = "| elastic_2x | 50 ± 0% | 55.0 ± 7.1 | 2.00 ± 0.00 | 2.02 ± 0.00 | 2750 ± 354 | 79.8 ± 13.8 | 79.5 ± 13.4 | 79.5 ± 13.4 "
    assert row + "| 46.7 ± 18.9 | 100 ± 0 | 1.000 ± 0.000 |" in report
    assert "| 30.0 (1/2) |" in report  # only the second seed of head_only reaches its target: counted apart
    # the own figures: profile, probe steps, selection, the writes to the loggers, freezing (seconds a run)
    # own time: 5.262 s of 49 and 59 s of training, 10.74% and 8.92%
    assert "| 3.0 ± 0.0 | 2.0 ± 0.0 | 0.010 ± 0.000 | 0.25 ± 0.00 | 0.002 ± 0.000 | 9.8 ± 1.3% |" in report
    assert "- code: lightning_elastic from /src/lightning_elastic, commit aaaaaaaaaaa\n" in report
    assert "- evaluation: 400 validation images (one image = 0.25 points), 1,000 test images" in report
    assert "- end-to-end wall clock >= 1.80x faster than full fine-tuning: 2.00x, met" in report
    assert "- elastic_2x: asked 2x, got 2.02 ± 0.00x: met" in report
    assert "- final accuracy within 1 point of full fine-tuning: 79.5% vs 80.0% (-0.5), met" in report
    assert "- final accuracy above head_only (step 1250 ms vs 2750 ms): 79.5% vs 65.0%, met" in report
    assert "- selected step <= 0.55 of the full step measured in the same run: 0.500, met (against the full " in report
    # no steady full step in any elastic run (every probe step a warm-up step): said so, not "nan, missed"
    unmeasured = [dict(r, step_fraction=math.nan) if r["method"] == "elastic_2x" else r for r in rows]
    report = markdown_report(cfg, unmeasured, 60.0, CODE)
    assert "same run: not checked (no run measured a steady full step) (against the full fine-tuning run's" in report
    # the targets are in proportion to the reference run's speedup: at 1.5x, 0.9 x 1.5 and 1.1 / 1.5
    at_15 = [dict(r, method="elastic_1.5x") if r["method"] == "elastic_2x" else r for r in rows]
    cfg_15 = compose_config(["benchmark.seeds=[0,1]", "benchmark.reference_speedup=1.5"], tmp_path, name="benchmark")
    report = markdown_report(cfg_15, at_15, 60.0, CODE)
    assert "- end-to-end wall clock >= 1.35x faster than full fine-tuning: 2.00x, met" in report
    assert "- selected step <= 0.73 of the full step measured in the same run: 0.500, met" in report


def test_the_contract_is_shown_also_scaled_by_the_host_speed_that_validation_witnesses(tmp_path: Path) -> None:
    # seed 0's elastic run validated in 1.5 s where its full run took 1 s (a slower host): 100 s / 75 s of training,
    # 1.33x, is 2x at the full run's speed; seed 1's host did not move (1 s each): 80 s / 40 s, 2x either way
    runs = [
        _run("full", "full", 0, 101.0, [0.5, 0.9]),
        _run("elastic_2x", "elastic", 0, 76.5, [0.6, 0.89], **{**ELASTIC, "validation_seconds": 1.5}),
        _run("full", "full", 1, 81.0, [0.7, 0.7]),
        _run("elastic_2x", "elastic", 1, 41.0, [0.6, 0.7], **ELASTIC),
    ]
    rows = table_rows(runs, 0.99)
    assert [r["validation_vs_full"] for r in rows] == [1.0, 1.5, 1.0, 1.0]
    cfg = compose_config(["benchmark.seeds=[0,1]"], tmp_path, name="benchmark")
    assert (
        "- elastic_2x: asked 2x, got 1.67 ± 0.47x: **missed**; scaled by the host's speed (each run's validation time "
        "against its full run's, the same work: 1.50, 1.00) 2.00 ± 0.00x\n"
        # the fits' accounts of full fine-tuning's 10 steps (45 s) against the full runs' 10 x 5.05 s and 10 x 4.05 s
        "- elastic_2x: its account of full fine-tuning's time against the full runs': 0.89, 1.11 (1.00 ± 0.16)\n"
    ) in markdown_report(cfg, rows, 60.0, CODE)
    # no validation in the full runs: no witness, the figure alone
    unvalidated = [dict(r, validation_vs_full=math.nan) for r in rows]
    assert "- elastic_2x: asked 2x, got 1.67 ± 0.47x: **missed**\n" in markdown_report(cfg, unvalidated, 60.0, CODE)


def test_full_fine_tuning_run_again_is_the_last_run_of_each_seed_and_the_contract_is_against_both(
    tmp_path: Path,
) -> None:
    cfg = compose_config(["benchmark=short_fit"], tmp_path, name="benchmark")
    assert [m.name for m in methods_of(cfg)] == ["full", "elastic_2x", "elastic_3x", "elastic_2x_cached", "full_again"]
    assert methods_of(cfg)[-1] == Method("full_again", "full")
    runs = [
        _run("full", "full", 0, 101.0, [0.5, 0.8, 0.9]),
        _run("elastic_2x", "elastic", 0, 51.0, [0.6, 0.895, 0.89], **ELASTIC),
        _run("full_again", "full", 0, 121.0, [0.5, 0.8, 0.95]),  # not so on a CPU: tells which run is the reference
        _run("full", "full", 1, 81.0, [0.7, 0.7, 0.7]),
        _run("elastic_2x", "elastic", 1, 41.0, [0.6, 0.6, 0.7], **ELASTIC),
        _run("full_again", "full", 1, 81.0, [0.7, 0.7, 0.7]),
    ]
    by = {(r["method"], r["seed"]): r for r in table_rows(runs, 0.99)}
    # training parts (validation 1 s in every run): seed 0's full runs 100 and 120 s, their mean 110 s
    assert by["elastic_2x", 0]["train_speedup_vs_full"] == pytest.approx(110 / 50)
    assert by["elastic_2x", 0]["speedup_vs_full"] == pytest.approx(111 / 51)
    assert by["elastic_2x", 0]["step_vs_full_run"] == pytest.approx(0.2 / (111 / 20))  # mean of 101/20 and 121/20
    assert by["full_again", 0]["train_speedup_vs_full"] == pytest.approx(110 / 120)
    assert by["elastic_2x", 1]["train_speedup_vs_full"] == pytest.approx(80 / 40)
    # accuracy is measured against the first full run: 99% of its best 0.9 is reached at the second validation
    assert by["elastic_2x", 0]["time_to_target_s"] == pytest.approx(51 * 2 / 3)
    report = markdown_report(cfg, list(by.values()), 60.0, CODE)
    assert "against the first run's, seed 0: 1.20, seed 1: 1.00 (1.10 ± 0.14): the machine's own drift" in report
    assert "one full run only" not in report
    # a seed whose second full run did not run is named; without any second full run, no drift line at all
    partial = [r for r in by.values() if (r["method"], r["seed"]) != ("full_again", 1)]
    report = markdown_report(cfg, partial, 60.0, CODE)
    assert "seed 0: 1.20 (1.20): the machine" in report and "one full run only (the other failed" in report
    plain = [r for r in by.values() if r["method"] != "full_again"]
    assert "the machine's own drift" not in markdown_report(cfg, plain, 60.0, CODE)
    # the drift is said even when the targets are not checked (no reference elastic run)
    no_reference = [r for r in by.values() if r["method"] != "elastic_2x"]
    report = markdown_report(cfg, no_reference, 60.0, CODE)
    assert "Targets: not checked" in report and "seed 0: 1.20, seed 1: 1.00" in report
    # the paired tables leave the second full run out: it is full's accuracy at another speed of the machine
    paired = paired_report(runs)
    assert "| full |" in paired and "full_again" not in paired


def test_full_again_needs_full_fine_tuning_among_the_baselines(tmp_path: Path) -> None:
    cfg = compose_config(["benchmark.baselines=[static_last_k]", "benchmark.full_again=true"], tmp_path, "benchmark")
    assert benchmark_problems(cfg) == [
        "benchmark: `full_again` true needs `full` among `baselines` (it runs full fine-tuning again after each "
        "seed's other runs). Found: baselines ['static_last_k']"
    ]
    cfg = compose_config(["benchmark.full_again=yes"], tmp_path, "benchmark")
    assert benchmark_problems(cfg) == ["benchmark: `full_again` must be true or false. Found: 'yes'"]


def _recorded(
    method: str, kind: str, wall: float, acc: list[float], balanced: list[float], tested: tuple[float, float], **extra: Any
) -> dict[str, Any]:
    """A run of seed 0 as runs.json holds it now: both metrics at every validation and at the test."""
    run = _run(method, kind, 0, wall, acc, **extra)
    for key in ("best_accuracy", "final_accuracy", "test_accuracy"):
        del run[key]
    run["curve"] = [
        {"epoch": e, "seconds": wall * (e + 1) / len(acc), "values": {"val/acc": a, "val/balanced_acc": b}}
        for e, (a, b) in enumerate(zip(acc, balanced, strict=True))
    ]
    run["test"] = {"test/acc": tested[0], "test/balanced_acc": tested[1]}
    return run


BOTH = [
    _recorded("full", "full", 100.0, [0.6, 0.8], [0.5, 0.7], (0.81, 0.66)),
    _recorded("elastic_2x", "elastic", 50.0, [0.7, 0.8], [0.65, 0.6], (0.74, 0.62), **ELASTIC),
]


def test_tables_read_out_the_chosen_metric_of_runs_that_recorded_both(tmp_path: Path) -> None:
    plain = {r["method"]: r for r in table_rows(BOTH, 0.99)}
    balanced = {r["method"]: r for r in table_rows(BOTH, 0.99, "balanced_acc")}
    assert [(r["metric"], r["best_acc"], r["final_acc"], r["test_acc"]) for r in plain.values()] == [
        ("acc", 0.8, 0.8, 0.81), ("acc", 0.8, 0.8, 0.74)
    ]  # fmt: skip
    assert [(r["metric"], r["best_acc"], r["final_acc"], r["test_acc"]) for r in balanced.values()] == [
        ("balanced_acc", 0.7, 0.7, 0.66), ("balanced_acc", 0.65, 0.6, 0.62)
    ]  # fmt: skip
    # 99% of full's best: 0.792 plain, reached by elastic at its second validation (50 s); 0.693 balanced, never
    assert plain["elastic_2x"]["time_to_target_s"] == 50.0 and math.isnan(balanced["elastic_2x"]["time_to_target_s"])
    cfg = compose_config(["benchmark.seeds=[0]", "benchmark.metric=balanced_acc"], tmp_path, name="benchmark")
    report = markdown_report(cfg, list(balanced.values()), 60.0, CODE)
    assert "| best balanced_acc (%) | final balanced_acc (%) | test balanced_acc (%) |" in report
    assert "| 2.00 | 2.02 | 2500 | 65.0 | 60.0 | 62.0 | n/a |" in report
    assert "balanced_acc: balanced accuracy (the mean over classes of each class's recall" in report
    assert "- final balanced accuracy within 1 point of full fine-tuning: 60.0% vs 70.0% (-10.0), **missed**" in report
    figure = accuracy_figure(BOTH, 0.99, "balanced_acc")
    [axes] = figure.axes
    assert axes.get_ylabel() == "best validation balanced accuracy so far (%)\nmean ± sd over seeds"
    full_line = next(line for line in axes.get_lines() if line.get_label() == "full")
    assert max(full_line.get_ydata()) == pytest.approx(70.0)  # full's best balanced accuracy, not its 80% plain


def test_runs_recorded_before_balanced_accuracy_read_out_as_plain_accuracy_only() -> None:
    old = [_run("full", "full", 0, 100.0, [0.5, 0.8])]
    assert table_rows(old, 0.99)[0]["best_acc"] == 0.8
    with pytest.raises(ValueError, match=r"`metric` 'balanced_acc' needs runs that recorded it; full seed 0 was "):
        table_rows(old, 0.99, "balanced_acc")
    with pytest.raises(ValueError, match=r"`metric` must be one of \('acc', 'balanced_acc'\). Found: 'f1'"):
        table_rows(BOTH, 0.99, "f1")  # type: ignore[arg-type]


def test_the_selections_plot_shows_each_elastic_runs_own_selection_map_unscaled(tmp_path: Path) -> None:
    names = [f"model.blocks.{k // 2}.t{k}" for k in range(6)]
    decision = Decision(Mask.of([k >= 2 for k in range(6)]), (0.0,) * 6, 0.1, 0.2)
    maps = {}
    for name, selections in (("elastic_2x", 1), ("elastic_3x", 3)):
        image = selection_map([SelectionRecord(s, s, decision, 0.3) for s in range(selections)], names, [4] * 6,
                              [False] * 5 + [True], [False] * 6)  # fmt: skip
        Image.fromarray(image).save(tmp_path / f"{name}.png")
        maps[name] = image
    history = [{"mask": "001111"}]
    runs = [
        _run("full", "full", 0, 100.0, [0.5]),
        *(_run(n, "elastic", 0, 50.0, [0.5], history=history, selection_map=str(tmp_path / f"{n}.png")) for n in maps),
        _run("elastic_2x", "elastic", 1, 50.0, [0.5], history=history, selection_map=str(tmp_path / "missing.png")),
    ]  # the second seed's maps are not drawn
    plot_selections(runs, tmp_path / "selection_maps.png")
    plot = np.asarray(Image.open(tmp_path / "selection_maps.png").convert("RGB"))
    assert plot.shape[1] >= sum(m.shape[1] for m in maps.values()) and plot.shape[0] >= max(m.shape[0] for m in maps.values())
    legend = MAP_STATES[3][1]  # the pinned head's colour, in every map's cells and legend
    assert (plot == np.array(legend, dtype=np.uint8)).all(axis=2).sum() >= sum((m == legend).all(axis=2).sum() for m in maps.values()) * 0.9


def test_time_to_accuracy_is_the_first_validation_that_reaches_the_target() -> None:
    curve = [{"seconds": 1.0, "value": 0.2}, {"seconds": 2.0, "value": 0.9}, {"seconds": 3.0, "value": 0.95}]
    assert time_to_accuracy(curve, 0.9) == 2.0
    assert math.isnan(time_to_accuracy(curve, 0.96))


STAND_IN = """
import multiprocessing, os, pathlib, sys, time
from elastic_zoo.benchmark.measure import die_with_parent

def run(parent, asks, ready):
    if asks:
        die_with_parent(parent)
    pathlib.Path(ready).touch()
    time.sleep(120)

if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    ready = [f"{sys.argv[1]}/ready_{asks}" for asks in (True, False)]
    runs = [spawn.Process(target=run, args=(os.getpid(), asks, r)) for asks, r in zip((True, False), ready)]
    for process in runs:
        process.start()
    while not all(os.path.exists(r) for r in ready):  # both runs have asked (or not)
        time.sleep(0.1)
    print(*(process.pid for process in runs), flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_run_ends_with_the_benchmark_process_that_started_it(tmp_path: Path) -> None:
    # A stand-in for the benchmark: two spawned runs, only the first asks to end with it; the benchmark is killed.
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    benchmark = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    assert benchmark.stdout is not None
    asked, other = (int(pid) for pid in benchmark.stdout.readline().split())
    assert _alive(asked) and _alive(other)
    benchmark.kill()
    benchmark.wait()
    try:
        for _ in range(300):
            if not _alive(asked):
                break
            time.sleep(0.1)
        assert not _alive(asked)  # ended with its benchmark ...
        assert _alive(other)  # ... where a run that did not ask goes on
    finally:
        for pid in (asked, other):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_stopped_benchmark_ends_its_run_and_reports_the_runs_that_finished(tmp_path: Path) -> None:
    """SIGTERM once the first run has finished: the run under way ends, and results.md reports the finished ones."""
    fake_fashion_mnist(tmp_path / "fmnist", train=240, test=48)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable, "recipes/benchmark.py", "benchmark=tiny", "dataset=fashion_mnist",
        f"dataset.root={tmp_path / 'fmnist'}", "benchmark.baselines=[full,head_only,bitfit]",
        "benchmark.elastic_speedups=[]", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    benchmark = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert benchmark.stdout is not None
    for line in benchmark.stdout:
        if line.startswith("[benchmark] full seed 0:"):
            break
    benchmark.send_signal(signal.SIGTERM)  # during the second run (head only)
    out, err = benchmark.communicate(timeout=120)
    assert benchmark.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM; results.md holds the runs that finished" in err
    runs = json.loads((tmp_path / "run" / "runs.json").read_text())
    assert [r["method"] for r in runs] == ["full"]
    report = (tmp_path / "run" / "results.md").read_text()
    assert "- **stopped by SIGTERM after 1 of 3 runs**: the tables hold the runs that finished\n" in report
    assert "| full |" in report and "| head_only |" not in report and report in out
    assert not (tmp_path / "run" / "runs" / "head_only_seed_0.json").exists()  # its run ended unfinished


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True)


def test_the_report_names_the_commit_of_the_library_measured_and_its_uncommitted_changes(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    for path in ("lightning_elastic/__init__.py", "elastic_zoo/models.py", "README.md"):
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / path).write_text("x = 1\n")
    _git(tmp_path, "init", "-q", str(checkout))
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    library = checkout / "lightning_elastic"
    assert code_provenance(library) == CodeProvenance(library.resolve(), head.strip(), dirty=False)
    (checkout / "README.md").write_text("prose\n")  # not measured code: still clean
    assert not code_provenance(library).dirty
    (checkout / "elastic_zoo" / "models.py").write_text("x = 2\n")
    assert code_provenance(library).dirty
    assert code_provenance(library).line() == f"code: lightning_elastic from {library.resolve()}, commit {head[:11]} with uncommitted changes"
    assert code_provenance(library).mismatch(checkout) is None
    other = tmp_path / "worktree"
    assert code_provenance(library).mismatch(other) == (
        f"benchmark: the library measured is {library.resolve()}, not this checkout's {other.resolve()}/lightning_elastic: "
        f"the figures are that code's. To measure this checkout, run with PYTHONPATH={other.resolve()}"
    )
    # A copy outside git (an installed package), or ignored inside a checkout: no commit is claimed for it.
    (checkout / ".gitignore").write_text("site/\n")
    copy = checkout / "site" / "lightning_elastic"
    copy.mkdir(parents=True)
    (copy / "__init__.py").write_text("x = 1\n")
    assert code_provenance(copy) == CodeProvenance(copy.resolve(), "", dirty=False)
    assert code_provenance(copy).line() == f"code: lightning_elastic from {copy.resolve()} (not in a git checkout)"


def test_a_bad_benchmark_value_on_the_command_line_ends_it_with_its_message_before_any_run(tmp_path: Path) -> None:
    """A misspelt baseline and a speedup below 1: exit status 2 and no traceback, one line per setting naming it,
    what is allowed and what was given; and nothing started (no progress line, no run folder, no results)."""
    result = run_recipe(
        "benchmark.py",
        "benchmark=tiny",
        "benchmark.baselines=[full,head_onyl]",
        "benchmark.elastic_speedups=[0.5]",
        f"paths.data_dir={tmp_path / 'data'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert config_error_lines(result) == [
        "The configuration has 2 problems; nothing was run:",
        "  - benchmark: `baselines` must be distinct names among ('full', 'head_only', 'bitfit', 'static_last_k', "
        "'backbone_finetuning', 'linear_freeze'). Found: ['full', 'head_onyl']",
        "  - benchmark: `elastic_speedups` must be distinct numbers > 1. Found: [0.5]",
        "docs/errors.md says what to do about each.",
    ]
    assert "[benchmark]" not in result.stdout  # not even the code line printed once the config is checked
    run = tmp_path / "run"
    assert not any((run / name).exists() for name in ("runs", "results.md", "results.csv", "runs.json", "profiles"))


def test_a_bad_benchmark_value_and_missing_data_are_said_at_once(tmp_path: Path) -> None:
    """The data, model and callback are checked even when the benchmark's own settings are wrong: both problems in
    one message. Before, the data's problem came only once the misspelt baseline was mended."""
    result = run_recipe(
        "benchmark.py",
        "benchmark=tiny",
        "dataset=fashion_mnist",
        f"dataset.root={tmp_path / 'nowhere'}",
        "benchmark.baselines=[full,head_onyl]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    lines = config_error_lines(result)
    assert lines[0] == "The configuration has 2 problems; nothing was run:"
    assert lines[1].startswith("  - benchmark: `baselines` must be distinct names among")
    assert lines[2].startswith(f"  - dataset: Fashion-MNIST is not in {tmp_path / 'nowhere'}:")


def test_method_names_say_the_speedup() -> None:
    cfg = OmegaConf.create({"benchmark": {"baselines": [], "elastic_speedups": [1.5, 3]}})
    assert methods_of(cfg) == [Method("elastic_1.5x", "elastic", 1.5), Method("elastic_3x", "elastic", 3.0)]


@pytest.mark.slow
@pytest.mark.slow
def test_a_speedup_refused_before_training_is_reported_with_its_reachable_figure_and_fails_no_benchmark(
    tmp_path: Path,
) -> None:
    """A refusal is the callback's answer to a speedup out of reach: listed with the reachable figure, apart from
    failures, and the benchmark ends well. Before, it was a "failed run" and the benchmark exited 1."""
    fake_fashion_mnist(tmp_path / "fmnist", train=240, test=48)
    module = ImageClassifier(tiny_cnn(num_classes=10), num_classes=10)
    (tmp_path / "profile.json").write_text(json.dumps(synthetic_profile(module).to_dict()))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable, "recipes/benchmark.py", "benchmark=tiny", "dataset=fashion_mnist",
        f"dataset.root={tmp_path / 'fmnist'}", f"+elastic.profile={tmp_path / 'profile.json'}",
        "benchmark.baselines=[full]", "benchmark.elastic_speedups=[1.2,50]", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "run" / "results.md").read_text()
    runs = {r["method"]: r for r in json.loads((tmp_path / "run" / "runs.json").read_text())}
    reachable = runs["elastic_50x"]["refused_at_most"]
    assert 1.2 < reachable < 50 and "error" not in runs["elastic_1.2x"]
    assert f"## Refused before training (a speedup out of reach)\n\n- elastic_50x, seed 0: at most {reachable:.2f}x: " \
        f"SpeedupOutOfReach: `speedup` must be at most {reachable:.2f} " in report
    assert "## Failed runs" not in report


def test_tiny_benchmark_runs_every_method_and_writes_sane_results(tmp_path: Path) -> None:
    fake_fashion_mnist(tmp_path / "fmnist", train=240, test=48)
    # A fixed timing profile for the static and elastic selections, used alone (no calibration with measured
    # steps): the tiny CNN's measured times are mostly noise, and the decisions are then the same in every run.
    module = ImageClassifier(tiny_cnn(num_classes=10), num_classes=10)  # Fashion-MNIST: the profile must fit the model
    (tmp_path / "profile.json").write_text(json.dumps(synthetic_profile(module).to_dict()))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable, "recipes/benchmark.py", "benchmark=tiny", "dataset=fashion_mnist",
        f"dataset.root={tmp_path / 'fmnist'}", f"+elastic.profile={tmp_path / 'profile.json'}", "+elastic.calibrate=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    with (run / "results.csv").open() as file:
        rows = list(csv.DictReader(file))
    methods = [
        "full", "head_only", "bitfit", "static_last_k", "backbone_finetuning", "linear_freeze", "elastic_1.2x",
        "elastic_1.5x",
    ]  # fmt: skip
    assert [r["method"] for r in rows] == methods and list(rows[0]) == CSV_COLUMNS
    runs = {r["method"]: r for r in json.loads((run / "runs.json").read_text())}
    head = ["model.10.weight", "model.10.bias"]
    # What each baseline really updated, compared with its parameters before and after the fit.
    assert runs["head_only"]["updated_tensors"] == head
    assert set(runs["bitfit"]["updated_tensors"]) == {
        "model.0.bias", "model.1.weight", "model.1.bias", "model.3.bias", "model.4.weight", "model.4.bias",
        "model.6.bias", *head,
    }  # fmt: skip
    assert len(runs["full"]["updated_tensors"]) == runs["full"]["total_tensors"] == 12
    static = runs["static_last_k"]
    assert static["updated_tensors"][-2:] == head and 2 <= static["trained_tensors"] < 12
    for name in ("elastic_1.2x", "elastic_1.5x"):
        history = runs[name]["history"]
        assert len(history) == 1 and all(h["mask"][-2:] == "11" for h in history)  # the head is always trained
        assert runs[name]["tensor_names"] == [n for n, _ in module.named_parameters()]
        assert runs[name]["selection_map"] == str(run / "runs" / f"{name}_seed_0_selection_map.png")
    for r in runs.values():
        steps = r["steps"] * r["mean_step_seconds"]
        assert len(r["step_seconds"]) == r["steps"] and sum(r["step_seconds"]) == pytest.approx(steps)
        assert r["steps"] == 8 and 0 < steps + r["validation_seconds"] < r["wall_seconds"]
        # benchmark.yaml holds out a quarter (60 of the 240 training images), tiny.yaml evaluates 2 batches of 16
        assert (r["val_images"], r["test_images"]) == (32, 32)
        # both metrics at every validation and at the test (the module logs them; tiny data: any value in [0, 1])
        assert all(set(p["values"]) == {"val/acc", "val/balanced_acc"} for p in r["curve"])
        assert all(0 <= v <= 1 for p in r["curve"] for v in p["values"].values())
        assert set(r["test"]) == {"test/acc", "test/balanced_acc"} and all(0 <= v <= 1 for v in r["test"].values())
        assert r["energy_source"] == "estimate"
        assert r["energy_joules"] == pytest.approx(r["wall_seconds"] * 15.0, rel=1e-3)  # device=cpu: 15 W
        assert r["peak_memory_mb"] > 50 and 0 < r["cpu_share"] <= 1.05
    assert float(rows[0]["speedup_vs_full"]) == 1.0
    report = (run / "results.md").read_text()
    assert report in result.stdout
    code = code_provenance(REPO / "lightning_elastic")  # PYTHONPATH: this checkout's code, and no warning about it
    assert f"- {code.line()}\n" in report and code.commit and "the library measured is" not in result.stderr
    assert all(f"| {m} |" in report for m in methods) and "## Targets (elastic_1.5x" in report
    assert (run / "accuracy_vs_time.png").stat().st_size > 10_000
    assert (run / "selection_maps.png").stat().st_size > 5_000
    events = EventAccumulator(str(run / "tensorboard" / "summary"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert "accuracy_vs_seconds/elastic_1.5x/seed_0" in events.Tags()["scalars"]
    per_run = EventAccumulator(str(run / "tensorboard" / "elastic_1.5x" / "seed_0"), size_guidance={"images": 0})
    per_run.Reload()
    assert len(per_run.Images("elastic/selection")) == 1 and per_run.Scalars("val/acc")


def test_a_cached_elastic_run_reads_the_profile_its_first_run_left(tmp_path: Path) -> None:
    cfg = compose_config(["benchmark=contract"], tmp_path, name="benchmark")
    methods = {m.name: m for m in methods_of(cfg)}
    first, cached = methods["elastic_2x"], methods["elastic_2x_cached"]
    assert (
        cached.cached
        and not first.cached
        and list(methods).index("elastic_2x_cached") > list(methods).index("elastic_2x")
    )
    assert run_config(cfg, first, 3)["elastic"]["cache_dir"] == run_config(cfg, cached, 3)["elastic"]["cache_dir"]
    assert (
        run_config(cfg, first, 3)["elastic"]["cache_dir"]
        != run_config(cfg, methods["elastic_3x"], 3)["elastic"]["cache_dir"]
    )
    cfg.benchmark.elastic_cached_speedups = [2.5]
    assert any("`elastic_cached_speedups` must be distinct speedups among" in p for p in benchmark_problems(cfg))
