"""Every experiment runs through `recipes/train.py`'s `run` with fast_dev_run, on small inputs.

Experiments whose data or weights are not on this machine run on tiny fake copies of their data sets in the
real layouts, with random weights; their data and their settings are otherwise the experiment's own.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elastic_zoo.data import Cub200DataModule, ElpvDataModule, FashionMnistDataModule, OxfordPetsDataModule
from elastic_zoo.recipe import ConfigError, build
from lightning_elastic import ElasticTensorSelection
from recipes.train import run
from tests.recipes.recipe_fakes import compose_config, fake_cub, fake_fashion_mnist, fake_pets

# fast_dev_run=3 with a 1-step probe: a selection after the first step, then two selected steps. One thread:
# on a machine whose cores are busy with other work, more threads make small steps several times slower.
# On inputs this small the forward pass is a large part of a step, so the reachable speedup is lower.
FAST = [
    "trainer.fast_dev_run=3",
    "elastic.probe_steps=1",
    "dataset.num_workers=0",
    "paths.cache_dir=null",
    "device.threads=1",
    "elastic.speedup=1.25",
]
Setup = Callable[[Path], list[str]]


def _cub(tmp: Path) -> list[str]:
    fake_cub(tmp / "CUB_200_2011", classes=3, per_class=8)
    return [f"dataset.root={tmp / 'CUB_200_2011'}", "model.net.pretrained=false", "dataset.image_size=32"]


def _pets(tmp: Path) -> list[str]:
    fake_pets(tmp, classes=3, trainval=4, test=2)
    return [f"dataset.root={tmp}", "model.net.pretrained=false", "dataset.image_size=32"]


def _pets_vit(tmp: Path) -> list[str]:
    fake_pets(tmp, classes=3, trainval=4, test=2)
    # ViT-B/16 takes only 224 x 224 inputs: one image per batch, and the analytic time model (profiling every
    # tensor of ViT-B would take most of a minute here).
    return [f"dataset.root={tmp}", "model.net.pretrained=false", "dataset.batch_size=1", "elastic.time_model=flops"]


def _fashion(tmp: Path) -> list[str]:
    fake_fashion_mnist(tmp, train=30, test=9)
    return [f"dataset.root={tmp}", "dataset.image_size=32", "dataset.batch_size=4"]


def _elpv(tmp: Path) -> list[str]:
    return ["dataset.image_size=32", "dataset.batch_size=8"]  # the real data set, which ships in a package


# experiment -> (make its data, data module type, (optimizer, lr, batch size) the experiment sets)
CASES: dict[str, tuple[Setup, type, tuple[str, float, int]]] = {
    "demo": (_elpv, ElpvDataModule, ("adam", 3e-4, 8)),
    "resnet50_cub200": (_cub, Cub200DataModule, ("sgd", 1e-4, 4)),
    "mobilenet_v2_pets": (_pets, OxfordPetsDataModule, ("sgd", 1e-4, 4)),
    "vit_pets": (_pets_vit, OxfordPetsDataModule, ("sgd", 1e-4, 1)),
    "lite0_fashion_mnist": (_fashion, FashionMnistDataModule, ("adam", 1e-3, 4)),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "vit_pets" else n for n in CASES])
def test_experiment_runs_with_fast_dev_run(name: str, tmp_path: Path) -> None:
    setup, data_type, (optimizer, lr, batch_size) = CASES[name]
    overrides = [f"experiment={name}", *setup(tmp_path / "data"), *FAST]
    summary, parts = run(compose_config(overrides, output_dir=tmp_path / "out"))
    # The experiment's own settings reached the parts.
    assert isinstance(parts.datamodule, data_type) and parts.datamodule.batch_size == batch_size
    assert parts.module.hparams["optimizer"] == optimizer and parts.module.hparams["lr"] == lr
    [callback] = [c for c in parts.callbacks if isinstance(c, ElasticTensorSelection)]
    # fast_dev_run=3: three optimizer steps, the first a probe, then one selection.
    assert parts.trainer.global_step == 3
    assert summary["selections"] == 1 and 0 < summary["selected_fraction"] <= 1
    assert set(callback.summary()) <= set(summary) and summary["fit_speedup"] > 0
    # The per-step speedup needs a measured full step; the one probe step is a warm-up step of the process
    # (`warmup.WARMUP_STEPS`): counted as a probe step, no sample of the full step, so it is not reported.
    assert summary["probe_steps"] == 1 and math.isnan(summary["measured_speedup"])
    # The summary's accuracy is the model's on the test batches fast_dev_run uses.
    parts.module.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in itertools.islice(parts.datamodule.test_dataloader(), 3):
            correct += int((parts.module(images).argmax(dim=1) == labels).sum())
            total += len(labels)
    assert summary["test_accuracy"] == pytest.approx(correct / total, abs=1e-6)
    assert math.isclose(summary["energy_wh_estimate"], summary["wall_seconds"] * summary["power_watts"] / 3600)
    assert (tmp_path / "out" / "summary.json").is_file()


@pytest.mark.parametrize("name", ["resnet50_cub200", "mobilenet_v2_pets", "vit_pets"])
def test_paper_experiments_without_data_or_weights_stop_with_one_message(name: str, tmp_path: Path) -> None:
    cfg = compose_config(
        [f"experiment={name}", f"paths.data_dir={tmp_path}", f"model.net.weights_path={tmp_path / 'w.pth'}"],
        output_dir=tmp_path / "out",
    )
    with pytest.raises(ConfigError) as raised:
        build(cfg)
    dataset, model = raised.value.problems
    assert dataset.startswith("dataset: ") and str(tmp_path) in dataset and "not found" in dataset
    assert model.startswith(f"model: Pretrained weights for `{cfg.model.net.name}` are not on this machine: ")
    assert "(Hydra: model.net.weights_path=" in model and "download.pytorch.org/models/" in model
