"""What the callback reads and refuses as a fit starts, before any of its state exists.

`check_supported` refuses a module the method cannot run with (as the fit is set up), `check_parameters` one whose
layers (built by then) are lazy or all frozen (as it starts); `fit_schedule` reads the Trainer's epochs and the fit's
length (`epoch_lengths`) into the schedule of probe windows and selections (`windows.plan_schedule`), or says why the
callback stays off. Once the profile is known, `profiled_parameters` binds its tensors (refusing a profile of another
module) and `check_dense` refuses sparse gradients. What the fit can reach, once its session exists, is checked as
it begins (`begin.check_reach`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, TypeVar

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_elastic.distributed import prepare_strategy
from lightning_elastic.errors import ElasticConfigError, one_closure
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.profiling.profile import mismatch
from lightning_elastic.schedule import IntervalUnit, Schedule, counted_from
from lightning_elastic.windows import ScheduleRefusal, late_first_window, plan_schedule

C = TypeVar("C", bound=Callback)
# Optimizers whose `step(closure)` evaluates the closure (the training step and its backward pass) more than once.
MULTI_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def check_supported(trainer: L.Trainer, pl_module: L.LightningModule, kind: type[Callback]) -> None:
    """Refuse, as the fit is set up, a module the method cannot run with, or a second callback of `kind` (the
    `ElasticTensorSelection` class) in the Trainer; prepare the strategy for the method."""
    instances = sum(isinstance(c, kind) for c in trainer.callbacks)  # type: ignore[attr-defined]
    if instances > 1:
        raise ElasticConfigError(
            "`ElasticTensorSelection` must be the only instance in a Trainer (each sets `requires_grad` for the whole "
            f"module and keeps its own wall-clock contract): compare speedups in separate fits. Found: {instances}"
        )
    if not pl_module.automatic_optimization:
        raise ElasticConfigError(
            "`ElasticTensorSelection` needs automatic optimization (it measures importance and time around each "
            "optimizer step that Lightning runs): a module that steps its optimizers itself (a GAN's two) is not "
            "supported; train it without the callback. Found: `automatic_optimization = False`"
        )
    if torch._dynamo.compiled_autograd.compiled_autograd_enabled:
        # Enabled around the fit (`compiled_autograd._enable`): it would compile the profiler's backward passes, whose
        # per-node times are then a capture's.
        raise ElasticConfigError(
            "`ElasticTensorSelection` times autograd's nodes one by one, so it cannot run with compiled autograd "
            "(`torch._dynamo.compiled_autograd`): "
            "fit without it (a compiled module is supported). Found: compiled autograd enabled"
        )
    prepare_strategy(trainer.strategy)


def check_parameters(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Refuse, as the fit starts (after the module's `setup` and `configure_model`, which may build its layers, and
    after the strategy made its optimizers), a module with lazy parameters left or none to train, or an optimizer
    that evaluates its closure more than once a step."""
    if several := [type(o).__name__ for o in trainer.optimizers if isinstance(o, MULTI_CLOSURE_OPTIMIZERS)]:
        raise one_closure(", ".join(several))
    lazy = [n for n, p in pl_module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ElasticConfigError(
            "`ElasticTensorSelection` profiles every parameter as training starts, so lazy modules must be "
            "materialised first (run one batch through the model, e.g. in `setup` or `configure_model`). Found "
            f"uninitialised: {lazy[:5]}"
        )
    if not any(p.requires_grad for p in pl_module.parameters()):
        raise ElasticConfigError("`ElasticTensorSelection` needs a model with trainable parameters. Found: none")


def profiled_parameters(pl_module: L.LightningModule, prof: TimingProfile) -> list[nn.Parameter]:
    """The module's parameters in the profile's order.

    Raises:
        ElasticConfigError: when `prof` describes another module (`profiling.profile.mismatch`), or a step that takes
            no time (a profile made by hand, or timed by a clock that did not advance).
    """
    reason = mismatch(prof, pl_module)
    if reason is None and not prof.t_full > 0:  # every share of a step, the speedup's first, divides by it
        raise ElasticConfigError(
            "`profile` must time a full step of more than 0 seconds (every share of a step is of it): profile this "
            f"module on this device (leave `profile` unset). Found: `t_full` {prof.t_full!r}"
        )
    if reason is not None:
        raise ElasticConfigError(
            "`profile` must describe this module's parameters (names as `named_parameters()` gives them, their "
            f"shapes, every tensor that requires grad): profile this module. Found: {reason}"
        )
    named = dict(pl_module.named_parameters())
    return [named[name] for name in prof.names]


def check_dense(pl_module: L.LightningModule, names: Sequence[str], forbidden: Sequence[bool]) -> None:
    """Refuse sparse gradients (an embedding built with `sparse=True`) on a tensor that a selection may train."""
    sparse = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in pl_module.named_modules()
        if getattr(module, "sparse", False) is True
        for name, _ in module.named_parameters(recurse=False)
    }
    sparse_trained = [n for n, f in zip(names, forbidden, strict=True) if n in sparse and not f]
    if sparse_trained:
        raise ElasticConfigError(
            "`ElasticTensorSelection` needs dense gradients to measure importance: build embeddings with "
            f"`sparse=False`, or keep them out with `train_never`. Found sparse gradients for: {sparse_trained}"
        )


def fit_schedule(
    trainer: L.Trainer,
    interval: int,
    unit: IntervalUnit,
    probe_steps: int | Literal["auto"],
    speedup: float,
    origin: int = 0,
) -> tuple[Schedule | None, int | None]:
    """This fit's schedule (None: off under a `fast_dev_run` too short for it) and its optimizer steps (None: unknown),
    both counted from global optimizer step `origin`, where the fit started (`schedule.counted_from`).

    Raises:
        ElasticConfigError: when probe windows do not fit between two selections.
    """
    lengths, total = counted_from(*epoch_lengths(trainer), origin)
    schedule = plan_schedule(interval, unit, probe_steps, speedup, lengths, total)
    if isinstance(schedule, ScheduleRefusal):
        if not getattr(trainer, "fast_dev_run", False):  # set by the Trainer; not in its type stubs
            raise ElasticConfigError(schedule.message)
        rank_zero_info(f"ElasticTensorSelection: off under `fast_dev_run`, every tensor trains ({schedule.message})")
        return None, total
    if (warning := late_first_window(schedule)) is not None:
        rank_zero_warn(warning)
    return schedule, total


def accumulation(trainer: L.Trainer, epoch: int) -> int:
    """The micro-batches of an optimizer step in `epoch`: a `GradientAccumulationScheduler`'s (which sets the Trainer's
    only as each epoch starts, after `on_train_start`), else the Trainer's `accumulate_grad_batches`."""
    scheduler = _callback(trainer, GradientAccumulationScheduler)
    return int(scheduler.get_accumulate_grad_batches(epoch)) if scheduler else int(trainer.accumulate_grad_batches)


def _callback(trainer: L.Trainer, kind: type[C]) -> C | None:
    """The Trainer's first callback of `kind`, or None."""
    callbacks = getattr(trainer, "callbacks", ())  # set by the Trainer; not in its type stubs
    return next((c for c in callbacks if isinstance(c, kind)), None)


def step_profile(trainer: L.Trainer, prof: TimingProfile) -> TimingProfile:
    """`prof` (one pass) as the profile of one optimizer step of the epoch under way: the pass once a micro-batch.
    With more than one, `t_step` and its `t_update` (a step of one micro-batch, remembered by an earlier fit) are no
    reference: 0."""
    k = accumulation(trainer, trainer.current_epoch)
    return prof if k == 1 else replace(prof.scaled(k), t_step=0.0, t_update=0.0)


def epoch_lengths(trainer: L.Trainer) -> tuple[tuple[int, ...] | float, int | None]:
    """Optimizer steps of each epoch (the last repeating; `math.inf` when unknown) and of the fit (None: unknown).

    A `GradientAccumulationScheduler` changes the micro-batches of a step as epochs start, and
    `StochasticWeightAveraging` adds an epoch without optimizer steps (to update BatchNorm statistics): the Trainer's
    own estimate of the fit's steps sees neither.
    """
    batches = trainer.num_training_batches
    estimated = trainer.estimated_stepping_batches
    # unknown: infinite, or `max_steps` (-1 when unset) for a loader of unknown length, whatever `max_epochs` says
    total = int(estimated) if math.isfinite(estimated) and estimated > 0 else None
    if not math.isfinite(batches):
        return math.inf, total
    scheduler = _callback(trainer, GradientAccumulationScheduler)
    swa = _callback(trainer, StochasticWeightAveraging)
    if scheduler is None:
        lengths: tuple[int, ...] = (math.ceil(batches / trainer.accumulate_grad_batches),)
    else:
        lengths = tuple(
            math.ceil(batches / scheduler.get_accumulate_grad_batches(e)) for e in range(max(scheduler.epochs) + 1)
        )
    epochs = trainer.max_epochs
    if swa is not None and swa._model_contains_batch_norm:  # its last epoch only runs BatchNorm statistics
        epochs = swa._max_epochs
    if (scheduler is not None or swa is not None) and epochs is not None and epochs >= 0:
        steps = sum(lengths[min(e, len(lengths) - 1)] for e in range(max(epochs, 1)))
        total = min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps
    return lengths, total
