"""Every config group option composes and resolves; configs are documented; model heads match real models."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from elastic_zoo.module import ImageClassifier
from elastic_zoo.recipe import ConfigError, build, check_settings
from tests.recipes.recipe_fakes import CONF, compose_config

GROUPS = ("device", "model", "dataset", "module", "elastic", "method", "trainer", "logger", "paths", "experiment", "debug")
OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]
EXPERIMENTS = [name for group, name in OPTIONS if group == "experiment"]
MODELS = [name for group, name in OPTIONS if group == "model"]
DEBUGS = [name for group, name in OPTIONS if group == "debug"]


def test_every_group_has_its_options() -> None:
    names = {group: {n for g, n in OPTIONS if g == group} for group in GROUPS}
    assert {"cpu", "cuda", "raspberry_pi_4b", "jetson_tx2"} <= names["device"]
    assert names["model"] == {"efficientnet_lite0", "resnet50", "vgg16", "mobilenet_v2", "vit_b_16", "tiny", "minilm"}
    assert names["dataset"] == {"elpv", "oxford_pets", "cub200", "fashion_mnist", "image_folder", "spam_assassin"}
    assert names["elastic"] == {"default", "none"}
    assert {"demo", "resnet50_cub200", "mobilenet_v2_pets", "vit_pets", "lite0_fashion_mnist"} <= names["experiment"]
    assert names["module"] == {"image_classifier"}
    assert names["debug"] == {"default", "fdr", "limit"}


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_resolves(group: str, option: str, tmp_path: Path) -> None:
    cfg = compose_config([f"{group}={option}"], output_dir=tmp_path)
    assert HydraConfig.get().runtime.choices[group] == option
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(resolved, dict)
    assert resolved["trainer"]["accelerator"] == resolved["device"]["accelerator"]
    if resolved["elastic"]["_target_"] is not None:
        assert resolved["elastic"]["train_always"] == [resolved["model"]["head"]]
        assert resolved["elastic"]["cache_dir"] == resolved["paths"]["cache_dir"]


def _commented_lines(path: Path) -> list[str]:
    """Lines setting a value without a comment saying what it is."""
    bad = []
    for line in path.read_text().splitlines():
        setting = re.match(r"^\s*(- )?[\w./@-]+:\s*(\S.*)?$", line.split(" #")[0].rstrip())
        if not setting or "#" in line:
            continue
        value = (setting.group(2) or "").strip()
        nested = value == ""  # a section header: its fields carry the comments
        if not nested and not line.strip().startswith(("_target_:", "- override", "- _self_")):
            bad.append(line)
    return bad


@pytest.mark.parametrize("path", sorted(p for p in CONF.rglob("*.yaml") if p.parent.name != "experiment"), ids=str)
def test_every_field_is_commented(path: Path) -> None:
    assert path.read_text().startswith("#"), f"{path} must open with a comment saying what it is"
    assert _commented_lines(path) == []


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiments_open_with_the_command_that_runs_them(name: str) -> None:
    lines = (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
    # Hydra reads `@package` only from the header, so the command is the first line after it.
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith(f"# Run: python recipes/train.py experiment={name}")


@pytest.mark.parametrize("name", DEBUGS)
def test_debug_options_open_with_the_command_that_runs_them(name: str) -> None:
    lines = (CONF / "debug" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith(f"# Run: python recipes/train.py debug={name}")


@pytest.mark.parametrize(
    ("option", "fast_dev_run", "epochs", "train_batches", "probe_steps"),
    [("default", False, 1, None, "auto"), ("fdr", 3, 1, None, 1), ("limit", False, 2, 6, 2)],
)
def test_debug_options_set_a_quick_deterministic_run_without_logger(
    option: str, fast_dev_run: bool | int, epochs: int, train_batches: int | None, probe_steps: int | str, tmp_path: Path
) -> None:
    # Applied last, over an experiment: the experiment's own epochs and logger give way.
    cfg = compose_config(["experiment=demo", f"debug={option}"], output_dir=tmp_path)
    trainer = cfg.trainer
    assert (trainer.fast_dev_run, trainer.max_epochs, trainer.limit_train_batches) == (fast_dev_run, epochs, train_batches)
    assert (trainer.deterministic, trainer.enable_checkpointing, cfg.logger._target_) == (True, False, None)
    assert (cfg.elastic.probe_steps, cfg.dataset.num_workers, cfg.task_name) == (probe_steps, 0, "debug")
    assert cfg.module.lr == 3.0e-4  # the rest of the experiment stays


@pytest.mark.parametrize("name", MODELS)
def test_model_head_pattern_names_exactly_the_new_head(name: str, tmp_path: Path) -> None:
    cfg = compose_config([f"model={name}"], output_dir=tmp_path)
    pretrained = {"pretrained": False} if "pretrained" in cfg.model.net else {}  # random weights: no files needed
    module = ImageClassifier(instantiate(cfg.model.net)(num_classes=3, **pretrained), num_classes=3)
    # Reference: the parameters of the last Linear layer, the new 3-class head every zoo model ends with.
    head = [m for m in module.modules() if isinstance(m, nn.Linear)][-1]
    assert head.out_features == 3
    expected = {n for n, p in module.named_parameters() if any(p is q for q in head.parameters())}
    matched = {n for n, _ in module.named_parameters() if fnmatch.fnmatchcase(n, cfg.model.head)}
    assert matched == expected
    if cfg.model.image_size is not None:  # an image model (a text model has none)
        assert cfg.model.min_image_size <= cfg.model.image_size <= (cfg.model.max_image_size or cfg.model.image_size)


def test_build_lists_every_problem_at_once(tmp_path: Path) -> None:
    cfg = compose_config(
        [
            "model=resnet50",
            f"model.net.weights_path={tmp_path / 'resnet50.pth'}",
            "dataset=cub200",
            f"dataset.root={tmp_path / 'CUB_200_2011'}",
            "dataset.image_size=16",
            "elastic.speedup=0.5",
            "device.power_watts=0",
        ],
        output_dir=tmp_path,
    )
    with pytest.raises(ConfigError) as raised:
        build(cfg)
    problems = raised.value.problems
    assert problems == [
        "device: `power_watts` must be a positive number of watts. Found: 0",
        "dataset: `image_size` must be at least 32 for resnet50. Found: 16",
        problems[2],
        problems[3],
        "elastic: `speedup` must be a finite number > 1. Found: 0.5",
    ]
    assert problems[2].startswith(f"dataset: CUB-200-2011 is not in {tmp_path / 'CUB_200_2011'}: images.txt, ")
    assert problems[3].startswith(f"model: Pretrained weights for `resnet50` are not on this machine: {tmp_path}")
    assert str(raised.value).startswith("The configuration has 5 problems; nothing was run:\n  - device: ")


def test_vit_needs_its_own_image_size_and_image_folder_needs_a_root(tmp_path: Path) -> None:
    cfg = compose_config(["model=vit_b_16", "dataset=image_folder", "dataset.image_size=112"], output_dir=tmp_path)
    assert check_settings(cfg) == [
        "dataset: `image_size` must be exactly 224 for vit_b_16. Found: 112",
        "dataset: `root` must be set: dataset.root=/path/to/images",
    ]


def test_a_head_pattern_that_matches_nothing_is_reported(tmp_path: Path) -> None:
    cfg = compose_config(["model=tiny", "model.head=model._fc.*", "logger=none"], output_dir=tmp_path)
    with pytest.raises(ConfigError) as raised:
        build(cfg)
    assert raised.value.problems == [
        "model: `head` must match the names of the head's parameters in the LightningModule, such as "
        "'model.10.bias'. Found: 'model._fc.*'"
    ]


@pytest.mark.parametrize(("override", "shown"), [("seed=-1", "-1"), ("seed=abc", "'abc'"), ("seed=1.5", "1.5"), ("seed=null", "None"), ("seed=4294967296", "4294967296")])
def test_a_seed_numpy_cannot_take_is_reported(override: str, shown: str, tmp_path: Path) -> None:
    cfg = compose_config([override], output_dir=tmp_path)
    assert check_settings(cfg) == [f"top level: `seed` must be an int from 0 to 4294967295. Found: {shown}"]


@pytest.mark.parametrize(
    ("overrides", "reads", "holds"),
    [(["model=minilm"], "texts", "images"), (["dataset=spam_assassin"], "images", "texts")],
)
def test_a_text_model_on_images_or_an_image_model_on_texts_is_reported(
    overrides: list[str], reads: str, holds: str, tmp_path: Path
) -> None:
    cfg = compose_config(overrides, output_dir=tmp_path)
    model, dataset = HydraConfig.get().runtime.choices["model"], HydraConfig.get().runtime.choices["dataset"]
    assert check_settings(cfg) == [
        f"dataset: the model reads {reads} but the data set holds {holds}: pair a text model (model=minilm) with a "
        f"text data set (dataset=spam_assassin), an image model with an image data set. Found: model={model}, "
        f"dataset={dataset}"
    ]
