"""The real command lines, run as a user runs them: `python recipes/train.py ...`, `recipes/profile_model.py`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elastic_zoo.models import tiny_cnn
from elastic_zoo.module import ImageClassifier
from lightning_elastic.profiling.profile import read_profile
from lightning_elastic.summary import FitSummary
from recipes.train import format_summary
from tests.recipes.recipe_fakes import REPO


def test_no_recipe_shadows_a_standard_module() -> None:
    # `python recipes/x.py` puts recipes/ first on sys.path: a recipes/profile.py would replace the standard
    # `profile` module that cProfile, and so Lightning, imports.
    names = {path.stem for path in (REPO / "recipes").glob("*.py")}
    assert names & set(sys.stdlib_module_names) == set()
    # The same holds for `python benchmarks/x.py`.
    assert {path.stem for path in (REPO / "benchmarks").glob("*.py")} & set(sys.stdlib_module_names) == set()


def test_profile_cost_wraps_functions_the_library_still_has() -> None:
    """benchmarks/profile_cost.py times the profiler by wrapping its functions by name: a rename breaks it."""
    code = "import runpy; runpy.run_path('benchmarks/profile_cost.py', run_name='bench')['instrument']()"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def run_recipe(script: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, f"recipes/{script}", *overrides]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_train_command_fine_tunes_tests_and_prints_the_summary(tmp_path: Path) -> None:
    started = time.perf_counter()
    result = run_recipe(
        "train.py",
        "experiment=demo",  # Lite0 x ELPV, made tiny below: a small CNN, 16 x 16 images, a few batches
        "model=tiny",
        "dataset.image_size=16",
        "dataset.batch_size=64",
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=6",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.enable_checkpointing=false",
        "elastic.probe_steps=2",
        "elastic.speedup=1.25",  # the tiny model's forward pass is a large part of its step
        "device.threads=1",  # steps this small slow down with more threads on a busy machine
        f"paths.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert format_summary(summary) in result.stdout
    # the progress bar, whichever Lightning picks: tqdm's, or Rich's when `rich` is installed (the text extra brings it)
    assert "Epoch 1: 100%" in result.stdout or re.search(r"Epoch 1/1 .* (\d+)/\1 ", result.stdout)
    # a quiet console: no cloud tips, no accelerators the machine lacks, no warnings from inside Lightning
    assert "Tip:" not in result.stdout + result.stderr and "TPU available" not in result.stdout + result.stderr
    assert "LeafSpec" not in result.stderr
    # the summary table against the callback's own accounting: 12 steps, each a full step at the measured cost times
    # the device's pace as it ran (a busy machine slows some), and the warm-up full fine-tuning's first steps pay
    report = summary["elastic_report"]
    assert report["steps"] == 12 and report["selections"] == summary["selections"] == 2
    assert 0.5 * 12 <= report["paced_steps"] <= 2.0 * 12  # the pace's bounds
    full_fit = report["paced_steps"] * report["full_step_seconds"] + report["warmup_excess_seconds"]
    assert report["full_fit_seconds"] == pytest.approx(full_fit)
    assert report["fit_speedup"] == pytest.approx(report["full_fit_seconds"] / report["spent_seconds"])
    assert report["spent_seconds"] == summary["spent_seconds"] and report["fit_speedup"] == summary["fit_speedup"]
    # The callback logs its table once, at fit end (Lightning's log goes to stderr); the recipe's summary gives the
    # headline and does not repeat the table.
    headline = f"{report['fit_speedup']:.2f}x (asked 1.25x, {'met' if not report['shortfall'] else 'NOT met'})"
    assert (result.stdout + result.stderr).count("  fit speedup        ") == 1
    assert f"  elastic            fit speedup {headline}; " in result.stdout
    table = {line[:21].strip(): line[21:] for line in result.stderr.splitlines() if line.startswith("  ")}
    assert table["fit speedup"].startswith(
        f"{headline}: {report['spent_seconds']:.1f} s spent against {report['full_fit_seconds']:.1f} s"
    )
    overhead = sum(report[k] for k in ("profile_seconds", "probe_seconds", "select_seconds", "apply_seconds", "log_seconds"))
    assert table["elastic's own time"].startswith(f"{overhead:.1f} s")
    excess = FitSummary(**report).probe_excess_seconds  # derived from the record's fields, not one of them
    share = (overhead - report["probe_seconds"] + excess) / report["spent_seconds"]
    assert 0 <= excess < report["probe_seconds"]  # a probe step costs more than a selected one
    assert f"; {share:.0%} with a probe step counted by what it cost beyond" in table["elastic's own time"]
    assert table["per-step speedup"].startswith(f"{report['measured_speedup']:.2f}x")
    assert (tmp_path / "run" / "selection_map.png").stat().st_size > 2_000
    assert 0 < summary["wall_seconds"] < elapsed
    # Two epochs, a selection at the start of each: after the 2-step probe, then at the second epoch's start.
    assert summary["selections"] == 2 and summary["epochs"] == 2
    assert summary["measured_speedup"] > 0 and summary["target_speedup"] == 1.25
    assert summary["energy_wh_estimate"] == pytest.approx(summary["wall_seconds"] * 15.0 / 3600)
    assert summary["test_images"] == 393  # ELPV's test split: 15% of 2,624 images, stratified
    events = EventAccumulator(summary["tensorboard_dir"], size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert events.Scalars("test/acc")[-1].value == pytest.approx(summary["test_accuracy"])
    assert len(events.Scalars("elastic/selected_fraction")) == 2
    maps = events.Images("elastic/selection")  # a fit of seconds: the maps' share of it allows none before the end
    assert [m.step for m in maps] == [report["steps"]]
    assert list((tmp_path / "cache").iterdir())  # the timing profile was cached for the next run


def test_config_problems_end_the_command_with_one_message(tmp_path: Path) -> None:
    result = run_recipe(
        "train.py",
        "experiment=resnet50_cub200",
        f"paths.data_dir={tmp_path}",
        "elastic.speedup=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr[result.stderr.index("The configuration has") :].strip().splitlines()  # after Lightning's
    assert lines[0] == "The configuration has 3 problems; nothing was run:"
    assert lines[1].startswith(f"  - dataset: CUB-200-2011 is not in {tmp_path / 'CUB_200_2011'}: ")
    assert lines[2].startswith("  - model: Pretrained weights for `resnet50` are not on this machine: ")
    assert lines[3] == "  - elastic: `speedup` must be a finite number > 1. Found: 1"
    assert lines[4] == "docs/errors.md says what to do about each."


def test_a_speedup_this_device_cannot_reach_ends_the_command_with_its_message(tmp_path: Path) -> None:
    """Found only once `fit` has profiled the model: still a plain message and exit status 2, before training."""
    result = run_recipe(
        "train.py",
        "experiment=demo",
        "model=tiny",
        "dataset.image_size=16",
        "trainer.limit_train_batches=4",
        "elastic.probe_steps=2",
        "elastic.speedup=50",
        "device.threads=1",
        "paths.cache_dir=null",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "`speedup` must be at most" in result.stderr and "Found: 50" in result.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_profile_command_prints_and_saves_the_timing_table(tmp_path: Path) -> None:
    result = run_recipe(
        "profile_model.py",
        "model=tiny",
        "dataset.image_size=16",
        "device.threads=1",
        "paths.cache_dir=null",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "profile.json").read_text())
    # Reference: the parameters of the module the recipe builds (tiny CNN, ELPV's 4 classes).
    expected = [name for name, _ in ImageClassifier(tiny_cnn(num_classes=4), num_classes=4).named_parameters()]
    assert saved["names"] == expected
    assert read_profile(tmp_path / "profile.json").names == tuple(expected)  # the library's one reader reads it
    table = (tmp_path / "profile.md").read_text()
    assert table in result.stdout
    assert all(f"| {name} |" in table for name in expected)


@pytest.mark.slow
def test_a_profile_from_the_profile_command_is_the_training_steps_of_a_fit_with_the_same_settings(
    tmp_path: Path,
) -> None:
    """The command profiles the module's own `training_step`, so a fit given its `profile.json` finds the profile's
    fingerprint in its step, and says nothing about it. Before, it profiled `cross_entropy(module(images))`, which
    leaves out the step's accuracy metric: every fit given its profile warned that the profile was another step's."""
    shared = ["model=tiny", "dataset.image_size=16", "dataset.batch_size=64", "device.threads=1"]
    cache = f"paths.cache_dir={tmp_path / 'cache'}"  # a fit given a profile reads no cache: the check is the step's
    profiled = run_recipe("profile_model.py", *shared, cache, f"hydra.run.dir={tmp_path / 'profile'}")
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    assert "self.log" not in profiled.stderr  # the step's logging, with no Trainer to log to, is not the user's concern
    given = tmp_path / "profile" / "profile.json"
    result = run_recipe(
        "train.py",
        "experiment=demo",
        *shared,
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=6",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.enable_checkpointing=false",
        "logger=none",
        "elastic.probe_steps=2",
        "elastic.speedup=1.25",
        f"+elastic.profile={given}",
        cache,
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "does not match this fit's training step" not in result.stderr


def test_profile_command_checks_its_values_up_front(tmp_path: Path) -> None:
    # A misspelt `time_model` used to reach `profile(...)` and end in a ValueError's traceback (exit 1).
    result = run_recipe(
        "profile_model.py", "model=tiny", "time_model=flop", "device.threads=0", f"hydra.run.dir={tmp_path}"
    )
    assert config_error_lines(result) == [
        "The configuration has 2 problems; nothing was run:",
        "  - device: `threads` must be a positive int or null. Found: 0",
        "  - top level: `time_model` must be one of ('measured', 'flops'). Found: 'flop'",
        "docs/errors.md says what to do about each.",
    ]
    assert not (tmp_path / "profile.json").exists()


def test_train_command_checks_the_seed_and_thread_count_before_applying_them(tmp_path: Path) -> None:
    # `device.threads=0` used to reach `torch.set_num_threads` first and end in a RuntimeError's traceback.
    # `seed=abc` reached Lightning's `seed_everything` first and ended in a ValueError's traceback.
    result = run_recipe(
        "train.py",
        "model=tiny",
        "seed=abc",
        "device.threads=0",
        "elastic.speedup=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert config_error_lines(result) == [
        "The configuration has 3 problems; nothing was run:",
        "  - top level: `seed` must be an int from 0 to 4294967295. Found: 'abc'",
        "  - device: `threads` must be a positive int or null. Found: 0",
        "  - elastic: `speedup` must be a finite number > 1. Found: 1",
        "docs/errors.md says what to do about each.",
    ]


def config_error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The config error of a command that must end with exit status 2 and no traceback, line by line."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr[result.stderr.index("The configuration has") :].strip().splitlines()
