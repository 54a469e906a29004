"""The transformer on text through the real command line: a tiny BERT checkpoint and a fake SpamAssassin package,
fine-tuned with the elastic selection; and the benchmark's text preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_zoo.benchmark.methods import methods_of
from tests.recipes.recipe_fakes import compose_config, fake_bert_checkpoint, fake_spam_assassin
from tests.recipes.test_cli import run_recipe


@pytest.mark.slow
def test_train_command_fine_tunes_a_bert_on_emails_with_the_elastic_selection(tmp_path: Path) -> None:
    fake_bert_checkpoint(tmp_path / "bert")
    fake_spam_assassin(tmp_path / "package", {"easy-ham-1": 40, "spam-1": 40})
    result = run_recipe(
        "train.py",
        "model=minilm",
        f"model.checkpoint={tmp_path / 'bert'}",
        "model.tokenizer.max_length=12",
        "dataset=spam_assassin",
        f"dataset.root={tmp_path / 'package'}",
        "dataset.batch_size=8",
        "trainer.max_epochs=2",
        "trainer.enable_checkpointing=false",
        "logger=none",
        "elastic.probe_steps=2",
        "elastic.time_model=flops",  # analytic costs: a tiny model's measured times are mostly noise
        "elastic.speedup=1.25",
        "device.threads=1",
        f"paths.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["model"], summary["dataset"], summary["method"]) == ("minilm", "spam_assassin", "elastic")
    assert summary["test_images"] == 12 and summary["epochs"] == 2  # 15% of the 80 distinct e-mails
    assert summary["elastic_report"]["selections"] >= 1
    assert 0.0 <= summary["test_accuracy"] <= 1.0


def test_the_text_preset_runs_every_method_on_minilm_and_spam_assassin(tmp_path: Path) -> None:
    cfg = compose_config(["benchmark=text"], tmp_path, name="benchmark")
    assert [m.name for m in methods_of(cfg)] == [
        "full", "head_only", "bitfit", "static_last_k", "backbone_finetuning", "linear_freeze",
        "elastic_1.5x", "elastic_2x", "elastic_2.5x",
    ]  # fmt: skip
    assert cfg.dataset._target_ == "elastic_zoo.text_data.SpamAssassinDataModule"
    assert cfg.model.net._target_ == "elastic_zoo.bert.bert_classifier" and cfg.model.head == "model.classifier.*"
    assert cfg.dataset.tokenizer.max_length == 32 and len(cfg.benchmark.seeds) >= 5


@pytest.mark.slow
def test_the_profile_command_profiles_a_transformer_on_texts_for_a_fit_given_its_profile(tmp_path: Path) -> None:
    """`recipes/profile_model.py` made up a batch of images whatever the model: a text model's step failed on it.
    Its made-up batch is now the tokenizer's ids of the fit's shape, so a fit given the profile finds its step."""
    fake_bert_checkpoint(tmp_path / "bert")
    fake_spam_assassin(tmp_path / "package", {"easy-ham-1": 40, "spam-1": 40})
    shared = [
        "model=minilm", f"model.checkpoint={tmp_path / 'bert'}", "model.tokenizer.max_length=12",
        "dataset=spam_assassin", f"dataset.root={tmp_path / 'package'}", "dataset.batch_size=8", "device.threads=1",
    ]  # fmt: skip
    profiled = run_recipe("profile_model.py", *shared, "time_model=flops", f"hydra.run.dir={tmp_path / 'profile'}")
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    assert "batch of 8 x 12." in profiled.stdout
    given = tmp_path / "profile" / "profile.json"
    result = run_recipe(
        "train.py",
        *shared,
        "trainer.max_epochs=1",
        "trainer.enable_checkpointing=false",
        "logger=none",
        "elastic.probe_steps=2",
        "elastic.speedup=1.25",
        f"+elastic.profile={given}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "does not match this fit's training step" not in result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["elastic_report"]["selections"] >= 1
