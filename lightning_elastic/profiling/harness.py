"""The first training batch to the loss on the real training step: the one harness every caller shares.

`current_profile` chooses the profile a fit uses: the one given, a checkpoint's or the last fit's while it still
describes the training step, else one measured on that step (or read from the cache).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics import Metric

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.profiling.profile import (
    TimingMethod,
    TimingProfile,
    load_given_profile,
    mismatch,
    resolve_cache_dir,
)
from lightning_elastic.profiling.runner import Progress, fingerprint, profile

__all__ = ["current_profile", "measure_profile", "stale_reason"]


def current_profile(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    given: TimingProfile | str | os.PathLike[str] | None,
    restored: Mapping[str, Any] | None,
    previous: TimingProfile | None,
    method: TimingMethod,
    cache_dir: str | os.PathLike[str] | Literal[False] | None,
) -> TimingProfile:
    """The given profile; else the checkpoint's (`restored`) or the last fit's, if they describe this module; else
    one measured on the training step (`measure_profile`, which reads `cache_dir` first)."""
    loaded = load_given_profile(given)
    if loaded is not None:
        return loaded
    for source, candidate in (
        ("checkpoint's", TimingProfile.from_dict(restored) if restored else None),
        ("previous fit's", previous),
    ):
        if candidate is None:
            continue
        reason = stale_reason(trainer, pl_module, candidate)
        if reason is None:
            return candidate
        rank_zero_info(
            f"ElasticTensorSelection: the {source} timing profile does not describe this model ({reason}); "
            "profiling again."
        )
    count = sum(p.requires_grad for p in pl_module.parameters())
    rank_zero_info(
        f"ElasticTensorSelection: profiling {count} tensors on the first batch (about 7 training steps, more "
        "on a busy machine; a cached profile of this model on this device is used instead when there is one)"
    )
    return measure_profile(trainer, pl_module, method, resolve_cache_dir(cache_dir))


def measure_profile(
    trainer: L.Trainer, pl_module: L.LightningModule, method: TimingMethod, cache_dir: Path | None
) -> TimingProfile:
    """Profile the real training step on the first training batch (or read it from the cache)."""
    with _training_step(trainer, pl_module) as compute_loss:
        profiled = profile(pl_module, compute_loss, method=method, cache_dir=cache_dir, progress=_phase_lines())
    if trainer.world_size == 1:
        return profiled
    return TimingProfile.from_dict(trainer.strategy.broadcast(profiled.to_dict(), src=0))  # the same on every rank


def _phase_lines(clock: Callable[[], float] = time.perf_counter) -> Progress:
    """One rank-zero line as each profiling phase starts, with the seconds spent so far: a large model's profile
    takes minutes, and says where it is."""
    start = clock()

    def announce(k: int, n: int, what: str) -> None:
        rank_zero_info(f"ElasticTensorSelection: profiling, phase {k} of {n}: {what} ({clock() - start:.1f} s so far)")

    return announce


def stale_reason(trainer: L.Trainer, pl_module: L.LightningModule, prof: TimingProfile) -> str | None:
    """Why ``prof`` (a checkpoint's or an earlier fit's) no longer describes ``pl_module``'s training step, or None.

    Checks the parameters (`mismatch`), the kind of device, and the fingerprint of the step as it runs now (one
    forward and backward pass on the first batch): a step whose graph changed (gradient checkpointing turned on, a
    changed functional op, another input shape) costs differently. Rank zero's answer holds on every rank.
    """
    reason = mismatch(prof, pl_module)
    if reason is None and not prof.device.startswith(pl_module.device.type):
        reason = f"taken on {prof.device}, training runs on {pl_module.device.type}"
    if reason is None:
        with _training_step(trainer, pl_module) as compute_loss:
            if fingerprint(pl_module, compute_loss, prof.method) != prof.fingerprint:
                reason = "the training step's fingerprint differs (its graph, its input or the device changed)"
    return reason if trainer.world_size == 1 else trainer.strategy.broadcast(reason, src=0)


@contextmanager
def _training_step(trainer: L.Trainer, pl_module: L.LightningModule) -> Iterator[Callable[[], Tensor]]:
    """The loss of the real training step on the first batch, as a callable, with logging muted and no DDP sync."""
    batch = _first_batch(trainer)
    with _muted(pl_module), _block_parallel_sync_behavior(trainer.strategy, block=True):

        def compute_loss() -> Tensor:
            # Eager even where torch.compile would run the step (the module given to `fit`, a compiled submodule):
            # the hooks see every op and autograd node, and profiling compiles no graph. `torch.compiler.disable`
            # would not do: a compiled submodule called inside it still compiles.
            with torch.compiler.set_stance("force_eager"), trainer.precision_plugin.train_step_context():
                return _loss_of(pl_module.training_step(batch, 0))

        yield compute_loss


def _loss_of(output: Any) -> Tensor:
    """The loss a `training_step` returned (a tensor, or a mapping with "loss")."""
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise ElasticConfigError(
            "`ElasticTensorSelection` profiles the real training step, so `training_step` must return the loss "
            f"(a tensor or a dict with 'loss'). Found: {type(output).__name__}"
        )
    return loss


def _first_batch(trainer: L.Trainer) -> Any:
    """One real batch of the training data, on the training device, drawn without disturbing training.

    A map-style data set gives its first samples directly, so the sampler's random state is not advanced (the
    epoch's shuffle stays what it would have been); other loaders are iterated once. Global RNG is restored.
    The batch then takes the path of Lightning's own training loop (``TrainingEpochLoop.advance``): the precision
    plugin's input conversion (``"bf16-true"``, ``"64-true"``), `on_before_batch_transfer`, and the strategy's
    transfer to the device with `on_after_batch_transfer`.
    """
    loaders = trainer.train_dataloader
    with torch.random.fork_rng(devices=[]):
        if isinstance(loaders, DataLoader) and isinstance(loaders.dataset, Sized) and loaders.batch_size:
            size = min(loaders.batch_size, len(loaders.dataset))
            batch = loaders.collate_fn([loaders.dataset[i] for i in range(size)])
            dataloader_idx = 0
        else:
            combined = CombinedLoader(loaders, mode="max_size_cycle")
            iter(combined)
            batch, _, dataloader_idx = next(iter(combined))
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)


@contextmanager
def _muted(pl_module: L.LightningModule) -> Iterator[None]:
    """Run the training step for profiling without logging, and leave its metrics as they were."""
    metrics = [m for m in pl_module.modules() if isinstance(m, Metric)]
    counts = [m.update_count for m in metrics]
    pl_module.log = _ignore  # type: ignore[method-assign]
    pl_module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
        for metric, count in zip(metrics, counts, strict=True):
            if metric.update_count != count:
                metric.reset()


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
