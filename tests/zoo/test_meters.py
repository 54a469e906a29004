"""The benchmark's meters: step times and the validation curve, peak memory, and energy (measured or estimated)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic_zoo.meters import EnergyMeter, RunRecorder, nvml_energy_reader
from elastic_zoo.models import tiny_cnn
from elastic_zoo.module import ImageClassifier
from tests.integration.tiny import tiny_trainer


def _loader(samples: int, seed: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, 8, 8, generator=generator)
    return DataLoader(TensorDataset(images, torch.arange(samples) % 2), batch_size=8)


def test_recorder_times_every_step_and_records_the_metric_after_every_validation() -> None:
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.05)
    recorder = RunRecorder("val/acc")
    values = []

    class Keep(RunRecorder):
        def on_validation_end(self, trainer: object, pl_module: object) -> None:  # type: ignore[override]
            values.append(float(trainer.callback_metrics["val/acc"]))  # type: ignore[attr-defined]

    trainer = tiny_trainer(max_epochs=3, num_sanity_val_steps=2, callbacks=[recorder, Keep("val/acc")])
    started = time.perf_counter()
    trainer.fit(module, _loader(40, 0), _loader(16, 1))
    elapsed = time.perf_counter() - started
    record = recorder.record
    assert len(record.step_seconds) == 3 * 5 and all(s > 0 for s in record.step_seconds)
    assert [p.epoch for p in record.curve] == [0, 1, 2]  # the sanity check is not a point of the curve
    assert [p.value for p in record.curve] == pytest.approx(values[-3:])
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
