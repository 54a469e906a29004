"""The fine-tuning methods of the `method/` config group: what each trains, turned into callbacks for one fit.

Each `conf/method/<name>.yaml` instantiates one of these classes. `prepare` is the one place that turns a
method into the callbacks (and trainable sets) of a fit: `recipes/train.py method=<name>` and every run of the
benchmark call it, after the parts are built and before `fit`. The elastic method's callback is the `elastic`
group's; the other methods train without it.

Example:
    >>> from elastic_zoo.models import tiny_cnn
    >>> from elastic_zoo.module import ImageClassifier
    >>> module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2)
    >>> setup = HeadOnly("model.10.*").prepare(module, datamodule=None)
    >>> setup.trained_tensors, type(setup.callbacks[0]).__name__
    (2.0, 'TrainOnly')
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning as _LightningBackboneFinetuning
from torch import Tensor, nn

from elastic_zoo.baselines import LinearFreeze as _LinearFreezeCallback
from elastic_zoo.baselines import (
    TrainOnly,
    attach_backbone,
    bitfit,
    head_only,
    last_k_by_measured_steps,
    last_k_within_budget,
    names_of,
    suffix_sets,
    train_only,
)
from lightning_elastic import TimingProfile, profile, warmup
from lightning_elastic.arguments import speedup_problem
from lightning_elastic.freezing import tied_names
from lightning_elastic.profiling.profile import read_profile
from lightning_elastic.time_model import StepTimeModel
from lightning_elastic.timing import StepTimer


@dataclass
class MethodSetup:
    """What a method adds to a fit: its callbacks, how many tensors it trains, and its work before the fit.

    `trained_tensors` is NaN for a schedule (the trained set changes during the fit); `offline_seconds` is the
    time spent choosing the trained set before the fit (static_last_k's profile and timed steps), not part of it.
    """

    callbacks: list[L.Callback] = field(default_factory=list)
    trained_tensors: float = math.nan
    offline_seconds: float = 0.0


class FineTuningMethod:
    """A way of fine-tuning: `prepare` returns the callbacks that make a fit train what the method trains."""

    name: ClassVar[str]
    uses_elastic: ClassVar[bool] = False  # whether the fit runs the `elastic` group's callback

    def prepare(self, module: nn.Module, datamodule: Any) -> MethodSetup:
        """The method's callbacks for a fit of `module` on `datamodule`; every tensor trained unless overridden."""
        return MethodSetup(trained_tensors=float(len(list(module.parameters()))))


class Full(FineTuningMethod):
    """Full fine-tuning: every tensor trained at every step (the baseline the speedups are measured against)."""

    name = "full"


class Elastic(FineTuningMethod):
    """Elastic tensor selection: the `elastic` group's `ElasticTensorSelection` callback picks what to train."""

    name = "elastic"
    uses_elastic = True


class HeadOnly(FineTuningMethod):
    """The head alone: every other tensor frozen (linear probing)."""

    name = "head_only"

    def __init__(self, head: str) -> None:
        self.head = [head]

    def names(self, module: nn.Module) -> list[str]:
        return head_only(module, self.head)

    def prepare(self, module: nn.Module, datamodule: Any) -> MethodSetup:
        names = self.names(module)
        return MethodSetup([TrainOnly(names)], float(len(names)))


class BitFit(HeadOnly):
    """BitFit-like: the head, every bias and the scale and shift of every normalisation layer."""

    name = "bitfit"

    def names(self, module: nn.Module) -> list[str]:
        return bitfit(module, self.head)


class StaticLastK(FineTuningMethod):
    """The head and the last k tensors whose step fits `1 / static_speedup` of a full step, chosen once.

    The choice is made before the fit, on one batch of the training set on `accelerator`: the candidates are the
    suffixes of a timing profile (`profile`, a saved profile's JSON file, when given, else one taken on that batch
    with `time_model`), and the suffix chosen is the largest whose training step, timed there (`offline_step`),
    fits the budget; the profile, calibrated to a timed full step, only guides the search
    (`last_k_by_measured_steps`). Chosen by the profile's pass alone, "3x" static fits ran at 2.09-2.77x; by the
    profile calibrated to a timed full step, "1.5x" ones at 1.56-2.32x (docs/results.md). Without data
    (`datamodule` None) or with `calibrate` False (the elastic callback's `calibrate`, followed so that both choose
    under the same time model), under the profile's pass alone: the same choice in every run.
    """

    name = "static_last_k"

    def __init__(
        self,
        head: str,
        static_speedup: float,
        time_model: str,
        accelerator: str,
        profile: str | None = None,
        calibrate: bool = True,
    ) -> None:
        if (problem := speedup_problem(static_speedup, "static_speedup")) is not None:
            raise ValueError(problem)
        self.head = [head]
        self.static_speedup = float(static_speedup)
        self.time_model = time_model
        self.accelerator = accelerator
        self.profile = profile
        self.calibrate = calibrate

    def prepare(self, module: nn.Module, datamodule: Any) -> MethodSetup:
        """The largest suffix whose training step, timed offline (`offline_step`), fits the budget, so that the fit
        runs at `static_speedup` (neither the wait for batches nor Lightning's loop is timed, and the steps run in
        the module's own precision, not the trainer's: a fit whose loading or loop is slow runs a little under it,
        and one under mixed precision is timed as full precision); without data (`datamodule` None, a saved
        profile) or `calibrate`, under the profile's pass alone.

        Raises:
            ValueError: with neither a saved `profile` nor a `datamodule` to profile on.
        """
        started = time.perf_counter()
        batch = None if datamodule is None else first_batch(module, datamodule, self.accelerator)
        if self.profile:
            timing = read_profile(Path(self.profile))
        elif batch is not None:
            timing = offline_profile(module, batch, self.time_model)
        else:
            raise ValueError(
                "static_last_k chooses its tensors from a profile of the training step: it needs the training data "
                "(a datamodule) or a saved profile (`profile`, a JSON file). Found: neither"
            )
        if batch is None or not self.calibrate:
            names = last_k_within_budget(timing, self.static_speedup, self.head, aliases=tied_names(module))
            return MethodSetup([TrainOnly(names)], float(len(names)), time.perf_counter() - started)
        step, update = offline_step(module, batch)
        model = StepTimeModel.calibrated(timing, full_step=step, optimizer_seconds=update)
        sets = suffix_sets(timing, self.head, tied_names(module))

        def timed(mask: tuple[bool, ...]) -> float:
            return offline_step(module, batch, trained=names_of(timing, mask))[0]

        chosen = names_of(timing, sets[last_k_by_measured_steps(sets, timed, step, self.static_speedup, model)])
        return MethodSetup([TrainOnly(chosen)], float(len(chosen)), time.perf_counter() - started)


class BackboneFinetuning(FineTuningMethod):
    """Lightning's `BackboneFinetuning`: the head (and norm layers) first, the backbone from an epoch on."""

    name = "backbone_finetuning"

    def __init__(self, head: str, backbone_unfreeze_epoch: int) -> None:
        if (
            isinstance(backbone_unfreeze_epoch, bool)
            or not isinstance(backbone_unfreeze_epoch, int)
            or (backbone_unfreeze_epoch < 0)
        ):
            raise ValueError(f"`backbone_unfreeze_epoch` must be an int >= 0. Found: {backbone_unfreeze_epoch!r}")
        self.head = [head]
        self.backbone_unfreeze_epoch = backbone_unfreeze_epoch

    def prepare(self, module: nn.Module, datamodule: Any) -> MethodSetup:
        attach_backbone(module, self.head)
        return MethodSetup([_LightningBackboneFinetuning(unfreeze_backbone_at_epoch=self.backbone_unfreeze_epoch)])


class LinearFreeze(FineTuningMethod):
    """Composer's layer freezing: layers frozen from the input side, linearly from `freeze_start` of training."""

    name = "linear_freeze"

    def __init__(self, head: str, freeze_start: float, freeze_level: float) -> None:
        self.callback = _LinearFreezeCallback([head], freeze_start, freeze_level)  # checks both shares

    def prepare(self, module: nn.Module, datamodule: Any) -> MethodSetup:
        return MethodSetup([self.callback])


def first_batch(module: nn.Module, datamodule: Any, accelerator: str) -> tuple[Tensor, Tensor]:
    """The first training batch on the training device (with `module` moved there), read without advancing any
    random state, so that training then sees the same batches as every other method."""
    device = torch.device("cuda" if accelerator in ("cuda", "gpu") else "cpu")
    module.to(device)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    with torch.random.fork_rng(devices=[]):
        size = min(int(loader.batch_size), len(loader.dataset))
        inputs, labels = loader.collate_fn([loader.dataset[i] for i in range(size)])
    return inputs.to(device), labels.to(device)


def offline_profile(module: nn.Module, batch: tuple[Tensor, Tensor], time_model: str) -> TimingProfile:
    """The timing profile the static selection is chosen from, taken before training on the first training batch,
    as the elastic callback takes its own."""
    return profile(
        module,
        lambda: batch_loss(module, batch),
        method="flops" if time_model == "flops" else "measured",
        cache_dir=None,
    )


def batch_loss(module: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The loss of a training step on `batch`, as static_last_k profiles and times it."""
    inputs, labels = batch
    return F.cross_entropy(module(inputs), labels)


# `offline_step` times this many training steps after the process's first `warmup.WARMUP_STEPS`, which are slower.
OFFLINE_STEPS = 3


def offline_step(
    module: nn.Module,
    batch: tuple[Tensor, Tensor],
    clock: Callable[[], float] = time.perf_counter,
    trained: Collection[str] | None = None,
) -> tuple[float, float]:
    """Seconds of a steady training step (forward, backward, the module's optimizer update, clearing the
    gradients) and of its update alone, training every tensor or, with `trained`, those alone (the others frozen
    before the optimizer is built, as `TrainOnly` freezes them): the median of `OFFLINE_STEPS` steps after
    `warmup.WARMUP_STEPS`, each timed on the device (`StepTimer`). They run on a copy of `module` with its own
    optimizer (`configure_optimizers`), under a forked random state: the module, its data and every method's random
    draws are as they were.

    Raises:
        ValueError: when `configure_optimizers` returns anything but one optimizer, or a name in `trained` is not a
            parameter of `module`.
    """
    device, warmup_steps = batch[0].device, warmup.WARMUP_STEPS
    twin = copy.deepcopy(module)
    if trained is not None:
        train_only(twin, trained)
    optimizer = twin.configure_optimizers()  # type: ignore[operator]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            "static_last_k times a training step with the module's optimizer: `configure_optimizers` must return "
            f"one `torch.optim.Optimizer`. Found: {type(optimizer).__name__}"
        )
    step, update = StepTimer(device, clock), StepTimer(device, clock)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for _ in range(warmup_steps + OFFLINE_STEPS):
            step.start()
            batch_loss(twin, batch).backward()
            update.start()
            optimizer.step()
            update.stop()
            optimizer.zero_grad()
            step.stop()
    return statistics.median(step.pop()[warmup_steps:]), statistics.median(update.pop()[warmup_steps:])
