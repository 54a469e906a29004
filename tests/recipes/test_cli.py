"""The real command lines, run as a user runs them: `python recipes/train.py ...`, `recipes/profile_model.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train import format_summary

from lightning_elastic.zoo.models import tiny_cnn
from lightning_elastic.zoo.module import ImageClassifier
from tests.recipes.recipe_fakes import REPO


def test_no_recipe_shadows_a_standard_module() -> None:
    # `python recipes/x.py` puts recipes/ first on sys.path: a recipes/profile.py would replace the standard
    # `profile` module that cProfile, and so Lightning, imports.
    names = {path.stem for path in (REPO / "recipes").glob("*.py")}
    assert names & set(sys.stdlib_module_names) == set()


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
    assert "Epoch 1: 100%" in result.stdout  # the progress bar
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
    assert len(events.Images("elastic/selection")) == 2
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
    table = (tmp_path / "profile.md").read_text()
    assert table in result.stdout
    assert all(f"| {name} |" in table for name in expected)
