"""What a benchmark run measures: balanced accuracy (besides torchmetrics' plain accuracy), step times, the
validation curves in wall-clock time, peak memory and energy.

Energy is read from the GPU's own counter through NVML (`libnvidia-ml`, loaded with ctypes, so no extra package)
when the run is on an NVIDIA GPU that has one; everywhere else it is estimated as wall time x a power figure, and
the result says which of the two it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_elastic.timing import StepTimer

EnergySource = Literal["nvml", "estimate"]


class BalancedAccuracy(Metric):
    """The mean over classes of each class's recall, counted over every batch since the last reset.

    Exact over a whole split: it keeps, per class, the samples of that class (the confusion matrix's row sums) and
    those predicted right (its diagonal), not a mean of per-batch figures. A class with no sample among the labels
    counted is left out of the mean (its recall is undefined), even when it was predicted.

    Args:
        num_classes: how many classes the logits score.

    Example:
        >>> metric = BalancedAccuracy(num_classes=3)
        >>> logits = torch.eye(3)[[0, 0, 0, 1, 2]]  # predicts 0, 0, 0, 1, 2
        >>> metric.update(logits, torch.tensor([0, 0, 0, 0, 1]))  # class 0: 3 of 4, class 1: 0 of 1, class 2: absent
        >>> metric.compute()
        tensor(0.3750)
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    correct: Tensor
    support: Tensor

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.add_state("correct", default=torch.zeros(num_classes, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("support", default=torch.zeros(num_classes, dtype=torch.long), dist_reduce_fx="sum")

    @override
    def update(self, logits: Tensor, labels: Tensor) -> None:
        right = logits.argmax(dim=1) == labels
        self.support += torch.bincount(labels, minlength=self.num_classes)
        self.correct += torch.bincount(labels[right], minlength=self.num_classes)

    @override
    def compute(self) -> Tensor:
        present = self.support > 0
        return (self.correct[present] / self.support[present]).mean()


@dataclass
class EpochPoint:
    """One validation: the epoch it closed, seconds since fitting started, and each monitored metric's value.

    `train_seconds` is `seconds` without the validations so far (this one included): the training time spent
    to reach `values`, the clock on which methods are compared at equal wall clock. `values` maps each logged
    name (e.g. "val/acc") to its value, NaN when it was not logged.
    """

    epoch: int
    seconds: float
    values: dict[str, float]
    train_seconds: float


@dataclass
class RunRecord:
    """What `RunRecorder` measured in one fit."""

    step_seconds: list[float] = field(default_factory=list)
    validation_seconds: float = 0.0
    curve: list[EpochPoint] = field(default_factory=list)


class RunRecorder(Callback):
    """Records every training step's time, the time spent validating, and each of `monitors` after each validation.

    Times of the validation curve count from `setup` of the fit, so they include everything the fit did before:
    profiling, probes, selections, earlier validations.

    Args:
        monitors: the logged metrics to record after each validation, e.g. ["val/acc", "val/balanced_acc"].
        clock: seconds from a monotonic clock (injectable for tests).

    Example:
        >>> recorder = RunRecorder(["val/acc", "val/balanced_acc"])
        >>> trainer = L.Trainer(callbacks=[recorder], max_epochs=1)
    """

    def __init__(self, monitors: Sequence[str], clock: Callable[[], float] = time.perf_counter) -> None:
        self.monitors = list(monitors)
        self.record = RunRecord()
        self._clock = clock
        self._started = math.nan
        self._validation_started = math.nan
        self._timer: StepTimer | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._started = self._clock()
            self._timer = StepTimer(trainer.strategy.root_device, clock=self._clock)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._timer is not None
        self._timer.start()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._timer is not None
        self._timer.stop()

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            _synchronize(pl_module.device)
            self._validation_started = self._clock()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        _synchronize(pl_module.device)
        now = self._clock()
        self.record.validation_seconds += now - self._validation_started
        logged = trainer.callback_metrics
        values = {name: float(logged[name]) if name in logged else math.nan for name in self.monitors}
        seconds = now - self._started
        point = EpochPoint(trainer.current_epoch, seconds, values, seconds - self.record.validation_seconds)
        self.record.curve.append(point)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self._timer is not None
        self.record.step_seconds.extend(self._timer.pop())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- peak memory


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement: CUDA's allocator peak, or the process's resident-set high-water mark.

    On Linux, writing 5 to /proc/self/clear_refs resets the high-water mark to the current resident set; where that
    is not possible the measurement falls back to the process's lifetime peak (`getrusage`).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """MiB at the peak since `reset_peak_memory`: allocated CUDA memory, or the process's resident set on a CPU.

    Example:
        >>> reset_peak_memory(torch.device("cpu"))
        >>> peak_memory_mb(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if maxrss > 2**32 else maxrss / 1024


# ---------------------------------------------------------------------- energy


def nvml_energy_reader(device: torch.device) -> Callable[[], float] | None:
    """A function returning the GPU's total energy counter in joules, or None where NVML cannot give one.

    NVML's `nvmlDeviceGetTotalEnergyConsumption` (Volta and newer) counts millijoules since the driver loaded.
    """
    if device.type != "cuda":
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            return None
    except (OSError, AttributeError):
        return None

    def read() -> float:
        millijoules = ctypes.c_ulonglong()
        if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)) != 0:
            return math.nan
        return millijoules.value / 1000.0

    return read if math.isfinite(read()) else None


class EnergyMeter:
    """Joules used between `start()` and `stop()`: measured by `reader` when given, else `power_watts` x seconds.

    Args:
        power_watts: the device's power draw while training, for the estimate.
        reader: returns a cumulative energy counter in joules (see `nvml_energy_reader`).
        clock: seconds from a monotonic clock (injectable for tests).

    Example:
        >>> ticks = iter([10.0, 13.0])
        >>> meter = EnergyMeter(power_watts=15.0, clock=lambda: next(ticks))
        >>> meter.start(); meter.stop()
        (45.0, 'estimate')
    """

    def __init__(
        self,
        power_watts: float,
        reader: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(power_watts, bool) or not isinstance(power_watts, (int, float)) or not power_watts > 0:
            raise ValueError(f"`power_watts` must be a positive number of watts. Found: {power_watts!r}")
        self.power_watts = float(power_watts)
        self._reader = reader
        self._clock = clock
        self._started = (math.nan, math.nan)

    def start(self) -> None:
        """Begin measuring."""
        self._started = (self._clock(), self._reader() if self._reader is not None else math.nan)

    def stop(self) -> tuple[float, EnergySource]:
        """Joules since `start()`, and whether they were measured ("nvml") or estimated."""
        seconds = self._clock() - self._started[0]
        if self._reader is not None:
            joules = self._reader() - self._started[1]
            if math.isfinite(joules) and joules >= 0:
                return joules, "nvml"
        return seconds * self.power_watts, "estimate"
