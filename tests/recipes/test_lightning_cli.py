"""LightningCLI configures the callback like any other: a YAML `class_path`/`init_args`, or `--trainer.callbacks+=`.

Each test runs `tests/recipes/lightning_cli_app.py` (a tiny model and `LightningCLI`) as a user runs a program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.tiny import synthetic_profile
from tests.recipes.lightning_cli_app import TinyCLINet
from tests.recipes.recipe_fakes import REPO

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (the `dev` extra)")

QUIET = ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]


def run_cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The program run from `folder` (where LightningCLI saves its `config.yaml`), with the repository importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tests.recipes.lightning_cli_app", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_yaml_class_path_configures_the_callback_and_the_fit_runs(tmp_path: Path) -> None:
    # A fixed profile without calibration: two steps (a probe, a selected one) decide alike on any machine. It is
    # given inline, as `TimingProfile`'s fields (a profile saved as JSON cannot be given by its path here: see
    # docs/quickstart.md).
    profile = synthetic_profile(TinyCLINet()).to_dict()
    del profile["version"]
    config = tmp_path / "elastic.yaml"
    config.write_text(
        "trainer:\n"
        "  max_steps: 2\n"
        "  callbacks:\n"
        "    - class_path: lightning_elastic.ElasticTensorSelection\n"
        "      init_args:\n"
        "        speedup: 2.0\n"
        "        probe_steps: 1\n"
        "        interval: 2\n"
        "        interval_unit: step\n"
        "        calibrate: false\n"
        f"        profile: {json.dumps(profile)}\n"
    )
    result = run_cli(tmp_path, "fit", f"--config={config}", *QUIET)
    assert result.returncode == 0, result.stderr[-3000:]
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert done == {"global_step": 2, "elastic_callbacks": 1, "speedup": 2.0, "selections": 1}


def test_the_command_line_appends_the_callback_with_its_arguments(tmp_path: Path) -> None:
    result = run_cli(
        tmp_path,
        "fit",
        "--trainer.callbacks+=ElasticTensorSelection",
        "--trainer.callbacks.speedup=2.5",
        "--print_config",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "- class_path: lightning_elastic.ElasticTensorSelection\n    init_args:\n      speedup: 2.5\n" in result.stdout
    )


BAD_SPEEDUP = 'Parser key "speedup":\n          Not of type Speedup: `speedup` must be a finite number > 1. Found: '


@pytest.mark.parametrize(("value", "shown"), [("abc", "'abc'"), ("0.5", "0.5"), ("inf", "inf")])
def test_a_bad_speedup_on_the_command_line_ends_the_parse_with_the_callbacks_message(
    tmp_path: Path, value: str, shown: str
) -> None:
    # `speedup` is annotated `Speedup`, which the library registers with jsonargparse: the parser checks it as it
    # reads it and exits 2 with the constructor's message, before anything is built (no traceback, no fit).
    result = run_cli(
        tmp_path, "fit", "--trainer.callbacks+=ElasticTensorSelection", f"--trainer.callbacks.speedup={value}", *QUIET
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert BAD_SPEEDUP + shown + "\n" in result.stderr
    assert result.stdout == ""


def test_a_bad_speedup_in_a_yaml_config_ends_the_parse_with_the_callbacks_message(tmp_path: Path) -> None:
    config = tmp_path / "elastic.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_elastic.ElasticTensorSelection\n"
        "      init_args:\n"
        "        speedup: 0.5\n"
    )
    result = run_cli(tmp_path, "fit", f"--config={config}", *QUIET)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert BAD_SPEEDUP + "0.5\n" in result.stderr


@pytest.mark.parametrize(
    ("argument", "value", "shown"),
    [("interval", "0", "0"), ("probe_steps", "0", "0"), ("resolution", "x", "'x'"), ("interval", "1.5", "'1.5'")],
)
def test_a_bad_count_on_the_command_line_ends_the_parse_with_a_message_that_names_it(
    tmp_path: Path, argument: str, value: str, shown: str
) -> None:
    # `interval`, `probe_steps` and `resolution` are annotated `PositiveInt`: the parser names the argument and
    # gives the type's message, exit 2, before anything is built
    result = run_cli(
        tmp_path,
        "fit",
        "--trainer.callbacks+=ElasticTensorSelection",
        f"--trainer.callbacks.{argument}={value}",
        *QUIET,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f'Parser key "{argument}":\n' in result.stderr
    assert f"Not of type PositiveInt: must be a positive int. Found: {shown}\n" in result.stderr


@pytest.mark.parametrize("given", ["false", "False", "null"])
def test_cache_dir_false_on_the_command_line_is_no_cache_not_a_folder_named_false(tmp_path: Path, given: str) -> None:
    result = run_cli(
        tmp_path,
        "fit",
        "--trainer.callbacks+=ElasticTensorSelection",
        f"--trainer.callbacks.cache_dir={given}",
        "--print_config",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    shown = "false" if given != "null" else "null"
    assert f"      cache_dir: {shown}\n" in result.stdout, result.stdout
