"""The benchmark's meters: balanced accuracy, step times and the validation curves, peak memory, and energy
(measured or estimated)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_zoo.meters import BalancedAccuracy, EnergyMeter, RunRecorder, nvml_energy_reader
from elastic_zoo.models import tiny_cnn
from elastic_zoo.module import ImageClassifier
from tests.integration.tiny import tiny_trainer


def _loader(samples: int, seed: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, 8, 8, generator=generator)
    return DataLoader(TensorDataset(images, torch.arange(samples) % 2), batch_size=8)


# Four classes, 10 samples: class 0 has 6 (5 right), class 1 has 3 (1 right), class 2 has 1 (0 right), class 3 none
# but is predicted once. Plain accuracy 6 / 10; balanced accuracy (5/6 + 1/3 + 0) / 3 = 7/18, class 3 left out.
LABELS = [0, 0, 0, 0, 0, 0, 1, 1, 1, 2]
PREDICTED = [0, 0, 0, 0, 0, 1, 1, 3, 0, 0]
BALANCED = (5 / 6 + 1 / 3 + 0) / 3


def test_balanced_accuracy_is_the_mean_recall_of_the_classes_present_over_every_batch() -> None:
    metric = BalancedAccuracy(num_classes=4)
    logits = torch.eye(4)[PREDICTED]
    for start in (0, 4, 8):  # batches of 4, 4, 2: the mean of per-batch figures would differ
        metric.update(logits[start : start + 4], torch.tensor(LABELS[start : start + 4]))
    assert metric.compute().item() == pytest.approx(BALANCED)
    metric.reset()
    metric.update(torch.eye(4)[[1, 1]], torch.tensor([1, 1]))
    assert metric.compute().item() == 1.0


def test_the_module_logs_plain_and_balanced_accuracy_of_the_whole_split() -> None:
    # The network is the identity: each input is the one-hot logits of its prediction.
    module = ImageClassifier(nn.Identity(), num_classes=4)
    data = TensorDataset(torch.eye(4)[PREDICTED], torch.tensor(LABELS))
    trainer = tiny_trainer()
    [validated] = trainer.validate(module, DataLoader(data, batch_size=3), verbose=False)
    [tested] = trainer.test(module, DataLoader(data, batch_size=4), verbose=False)
    for logged, split in ((validated, "val"), (tested, "test")):
        assert logged[f"{split}/acc"] == pytest.approx(0.6)
        assert logged[f"{split}/balanced_acc"] == pytest.approx(BALANCED)


def test_recorder_times_every_step_and_records_the_metrics_after_every_validation() -> None:
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.05)
    monitors = ["val/acc", "val/balanced_acc", "val/missing"]
    recorder = RunRecorder(monitors)
    values = []

    class Keep(RunRecorder):
        def on_validation_end(self, trainer: object, pl_module: object) -> None:  # type: ignore[override]
            logged = trainer.callback_metrics  # type: ignore[attr-defined]
            values.append((float(logged["val/acc"]), float(logged["val/balanced_acc"])))

    trainer = tiny_trainer(max_epochs=3, num_sanity_val_steps=2, callbacks=[recorder, Keep(monitors)])
    started = time.perf_counter()
    trainer.fit(module, _loader(40, 0), _loader(16, 1))
    elapsed = time.perf_counter() - started
    record = recorder.record
    assert len(record.step_seconds) == 3 * 5 and all(s > 0 for s in record.step_seconds)
    assert [p.epoch for p in record.curve] == [0, 1, 2]  # the sanity check is not a point of the curve
    assert [p.values["val/acc"] for p in record.curve] == pytest.approx([a for a, _ in values[-3:]])
    assert [p.values["val/balanced_acc"] for p in record.curve] == pytest.approx([b for _, b in values[-3:]])
    assert all(math.isnan(p.values["val/missing"]) for p in record.curve)  # a metric never logged
    seconds = [p.seconds for p in record.curve]
    assert seconds == sorted(seconds) and seconds[-1] < elapsed
    # training time at the last validation: every validation so far taken out
    assert record.curve[-1].train_seconds == seconds[-1] - record.validation_seconds
    assert all(0 < p.train_seconds < p.seconds for p in record.curve)
    assert sum(record.step_seconds) + record.validation_seconds < elapsed
    assert record.validation_seconds > 0


def test_energy_meter_uses_the_counter_when_it_reads_and_the_estimate_otherwise() -> None:
    ticks = iter([100.0, 104.0])
    counter = iter([5_000.0, 5_123.5])
    meter = EnergyMeter(power_watts=15.0, reader=lambda: next(counter), clock=lambda: next(ticks))
    meter.start()
    assert meter.stop() == (123.5, "nvml")
    ticks = iter([100.0, 104.0])
    broken = EnergyMeter(power_watts=15.0, reader=lambda: math.nan, clock=lambda: next(ticks))
    broken.start()
    assert broken.stop() == (60.0, "estimate")
    with pytest.raises(ValueError, match=r"`power_watts` must be a positive number of watts. Found: 0"):
        EnergyMeter(power_watts=0)
    assert nvml_energy_reader(torch.device("cpu")) is None


def test_peak_memory_sees_a_large_allocation_after_a_reset() -> None:
    """In a fresh process, so that neither freed memory nor an earlier peak of this test run hides the block."""
    script = (
        "import torch\n"
        "from elastic_zoo.meters import peak_memory_mb, reset_peak_memory\n"
        "device = torch.device('cpu')\n"
        "reset_peak_memory(device)\n"
        "baseline = peak_memory_mb(device)\n"
        "block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched\n"
        "print(baseline, peak_memory_mb(device))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root)
    baseline, peak = (float(v) for v in out.stdout.split())
    assert peak >= baseline + 60
