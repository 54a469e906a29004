"""The `method/` config group: each option composes into a method that trains what it says, in a recipe and alone."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from elastic_zoo.benchmark.methods import BASELINES, method_config
from elastic_zoo.method import FineTuningMethod
from elastic_zoo.models import tiny_cnn
from elastic_zoo.module import ImageClassifier
from elastic_zoo.recipe import ConfigError, build
from lightning_elastic import ElasticTensorSelection, TimingProfile
from tests.recipes.recipe_fakes import CONF, compose_config
from tests.recipes.test_cli import run_recipe

METHODS = sorted(path.stem for path in (CONF / "method").glob("*.yaml"))
NAMES = [f"model.{layer}.{kind}" for layer in (0, 1, 3, 4, 6, 10) for kind in ("weight", "bias")]  # the tiny CNN's
HEAD = {"model.10.weight", "model.10.bias"}
NORM = {"model.1.weight", "model.1.bias", "model.4.weight", "model.4.bias"}
BIASES = {n for n in NAMES if n.endswith(".bias")}
# Read off the tiny CNN's layers: what each method trains as the fit starts (its optimizer's parameters).
TRAINED_AT_START = {
    "full": set(NAMES),
    "elastic": set(NAMES),  # the `elastic` group's callback, not the method, chooses at its first selection
    "head_only": HEAD,
    "bitfit": HEAD | NORM | BIASES,
    "static_last_k": set(NAMES[-6:]),  # one time unit per tensor, a budget of half the full step's 12 units
    "backbone_finetuning": HEAD | NORM,  # Lightning's BackboneFinetuning keeps norm layers training (train_bn)
    "linear_freeze": set(NAMES),  # nothing is frozen before `freeze_start` of training
}


def test_the_group_has_every_method_and_the_benchmark_runs_its_baselines() -> None:
    assert set(METHODS) == set(TRAINED_AT_START)
    assert set(BASELINES) == set(METHODS) - {"elastic"}


class TrainedAtStart(L.Callback):
    """Records the parameters that require grad and those the optimizer holds, as training starts."""

    def __init__(self) -> None:
        self.requires_grad: set[str] = set()
        self.optimized: set[str] = set()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.requires_grad = {n for n, p in pl_module.named_parameters() if p.requires_grad}
        ids = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        self.optimized = {n for n, p in pl_module.named_parameters() if id(p) in ids}


def unit_profile(tmp_path: Path) -> Path:
    """A profile of the tiny CNN in which every tensor's gradient costs one unit and nothing else costs anything."""
    zeros = (0.0,) * len(NAMES)
    timing = TimingProfile(names=tuple(NAMES), t_dw=(1.0,) * len(NAMES), t_dy=zeros, t_fw=0.0, t_full=12.0,
                           device="cpu", fingerprint="unit", unused=(), method="measured", numel=(1,) * len(NAMES))  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(timing.to_dict()))
    return path


@pytest.mark.parametrize("name", METHODS)
def test_each_method_trains_what_it_says_as_the_fit_starts(name: str, tmp_path: Path) -> None:
    overrides = ["model=tiny", f"method={name}", f"+elastic.profile={unit_profile(tmp_path)}"]
    cfg = compose_config([*overrides, "method.static_speedup=2"] if name == "static_last_k" else overrides, tmp_path)
    method = instantiate(cfg.method)
    assert isinstance(method, FineTuningMethod) and method.name == name and method.uses_elastic == (name == "elastic")
    torch.manual_seed(0)
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2)
    assert [n for n, _ in module.named_parameters()] == NAMES
    setup = method.prepare(module, datamodule=None)  # a saved profile: static_last_k reads no data
    probe = TrainedAtStart()
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[*setup.callbacks, probe])  # fmt: skip
    data = TensorDataset(torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 0, 1]))
    trainer.fit(module, DataLoader(data, batch_size=4))
    assert probe.requires_grad == probe.optimized == TRAINED_AT_START[name]
    fixed = name not in ("backbone_finetuning", "linear_freeze", "elastic")  # schedules change their set
    assert setup.trained_tensors == len(TRAINED_AT_START[name]) or not fixed


def test_the_benchmark_takes_each_method_from_the_group_with_its_own_settings(tmp_path: Path) -> None:
    cfg = compose_config(["benchmark.static_speedup=1.5", "benchmark.freeze_start=0.25"], tmp_path, name="benchmark")
    assert method_config(cfg, "static_last_k").static_speedup == 1.5
    assert method_config(cfg, "linear_freeze").freeze_start == 0.25
    assert method_config(cfg, "bitfit")._target_ == "elastic_zoo.method.BitFit"


DEMO = ["experiment=demo", "model=tiny", "dataset.image_size=16", "logger=none"]


@pytest.mark.parametrize(
    ("overrides", "method", "elastic_callback"),
    [([], "elastic", True), (["elastic=none"], "full", False), (["method=bitfit"], "bitfit", False),
     (["method=full", "elastic=none"], "full", False), (["method=elastic", "elastic.speedup=3"], "elastic", True)],
)  # fmt: skip
def test_the_method_follows_elastic_when_unset_and_runs_the_callback_only_when_elastic(
    overrides: list[str], method: str, elastic_callback: bool, tmp_path: Path
) -> None:
    parts = build(compose_config([*DEMO, *overrides], tmp_path))
    assert parts.method.name == method
    callbacks = [c for c in parts.trainer.callbacks if isinstance(c, ElasticTensorSelection)]  # type: ignore[attr-defined]
    assert len(callbacks) == int(elastic_callback)


def test_an_elastic_method_without_the_elastic_callback_is_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        build(compose_config([*DEMO, "method=elastic", "elastic=none"], tmp_path))
    assert raised.value.problems == [
        "method: `method=elastic` trains with the `elastic` group's callback, which `elastic=none` turns off: drop "
        "`elastic=none`, or pick a method without it (method=full trains every tensor). Found: elastic=none"
    ]


@pytest.mark.slow
def test_train_command_runs_a_baseline_method(tmp_path: Path) -> None:
    result = run_recipe("train.py", *DEMO, "method=bitfit", "debug=fdr", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "run" / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda name: pytest.fail(f"summary.json is not JSON: {name}"))
    assert (summary["method"], summary["epochs"], summary["target_speedup"]) == ("bitfit", 1, None)
    assert summary["run_files"] == ["config", "log", "summary.json"]  # no selection map without the callback
    assert f"({', '.join(summary['run_files'])})" in result.stdout
    assert "method=bitfit, 1 epoch(s)" in result.stdout and "n/a: method=bitfit runs no elastic selection" in result.stdout
    refused = run_recipe("train.py", *DEMO, "method=elastic", "elastic=none", f"hydra.run.dir={tmp_path / 'refused'}")
    assert refused.returncode == 2 and "`method=elastic` trains with the `elastic` group's callback" in refused.stderr
