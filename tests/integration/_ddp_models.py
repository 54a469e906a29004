"""A fit with `ElasticTensorSelection` whose decisions are reproducible, on one process or under DDP.

Shared by `ddp_fit.py` (the script that `test_ddp.py` starts) and the single-process reference of the test, and
importable by processes that `strategy="ddp_spawn"` starts (everything here is module level, hence picklable).

Reproducible decisions: the selection depends on measured times, which differ between runs. The fit pins them
(`PinTimings`): the callback profiles the model for real, then gets a fixed profile, and its step timers read a
clock on which every step lasts that profile's full step. What remains is importance, averaged over ranks.

The data make selections change: the label depends on the first four features in blocks of four optimizer steps
and on the last four in the blocks between, and each four features have their own input layer. Probe windows (two
steps before each selection, every four steps) alternate between the blocks, so the selected input layer alternates:
tensors are frozen and unfrozen again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_elastic.profiling.harness
from lightning_elastic import ElasticTensorSelection
from lightning_elastic.distributed import selective_allreduce_state
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.profiling import profile as real_profile

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 8
BLOCK_STEPS = 4
MAX_EPOCHS = 3
SPEEDUP = 1.2
# Frozen from the first step on, after the profiler's backward passes reached it: DDP's reducer must forget those.
NEVER = "left.bias"


class TwoBranchNet(L.LightningModule):
    """Two input layers (one per group of four features) and a linear head. No BatchNorm: the batch is split."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.left = nn.Linear(4, 16)
        self.right = nn.Linear(4, 16)
        self.head = nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.cat([self.left(x[:, :4]), self.right(x[:, 4:])], dim=1).relu())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Momentum and weight decay: a frozen tensor given a zero gradient instead of None would still move.
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return shifting_data(self.trainer.world_size, self.trainer.global_rank)


def shifting_data(world_size: int = 1, rank: int = 0) -> DataLoader[tuple[Tensor, ...]]:
    """This rank's share of `STEPS_PER_EPOCH` global batches, in order; the informative features switch every block.

    Rank r takes samples r, r + world_size, ... (Lightning's own sampler would shuffle them), so that the ranks'
    batches of one step together are the single-process batch of that step.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * GLOBAL_BATCH, 8, generator=generator)
    left = (x[:, 0] + x[:, 1] - x[:, 2] > 0).long()
    right = (x[:, 4] - x[:, 5] + x[:, 7] > 0).long()
    block = torch.arange(len(x)) // (BLOCK_STEPS * GLOBAL_BATCH)
    y = torch.where(block % 2 == 0, left, right)
    data = TensorDataset(x, y)
    sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)


def pinned_profile(module: nn.Module) -> TimingProfile:
    """A timing profile in which computing a tensor's gradient costs one microsecond per element.

    Gradients below the input layers are never needed, and the head's input gradient is cheap, so the selector
    weighs the two branches alike: at `SPEEDUP` the head and one branch fit, two branches do not.
    """
    named = list(module.named_parameters())
    numel = tuple(p.numel() for _, p in named)
    t_dw = tuple(n * 1e-6 for n in numel)
    t_dy = tuple(1e-6 if name == "head.weight" else 0.0 for name, _ in named)
    t_fw = 100e-6
    return TimingProfile(
        names=tuple(n for n, _ in named),
        t_dw=t_dw,
        t_dy=t_dy,
        t_fw=t_fw,
        t_full=t_fw + sum(t_dw) + sum(t_dy),
        device="cpu",
        fingerprint="pinned",
        unused=(),
        method="flops",
        numel=numel,
    )


class PinTimings(Callback):
    """The elastic callback profiles for real (backward passes outside DDP's forward included) but gets `profile`.

    Patches the profiler where the callback calls it, in `setup`, so that it holds in the processes that `ddp_spawn`
    starts, and restores it in `teardown`. With `calibrate=False` the callback then decides on `profile` alone.
    """

    def __init__(self, profile: TimingProfile) -> None:
        self.profile = profile

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        def measure_then_pin(model: nn.Module, compute_loss: Any, **kwargs: Any) -> TimingProfile:
            real_profile(model, compute_loss, warmup=0, repeats=1, **kwargs)
            return self.profile

        lightning_elastic.profiling.harness.profile = measure_then_pin

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        lightning_elastic.profiling.harness.profile = real_profile


class Recorder(Callback):
    """Per optimizer step on this rank: the mask, the loss, bytes all-reduced, and frozen tensors that moved."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[int] = []
        self.masks: list[tuple[bool, ...]] = []
        self.losses: list[float] = []
        self.sent: list[int] = []
        self.full: list[int] = []
        self.moved_while_frozen: list[str] = []
        self._before: list[Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.steps.append(trainer.global_step)
        self.masks.append(tuple(p.requires_grad for p in pl_module.parameters()))
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        for (name, p), before, trained in zip(pl_module.named_parameters(), self._before, self.masks[-1], strict=True):
            if not trained and not torch.equal(before, p):
                self.moved_while_frozen.append(f"{name}@{self.steps[-1]}")
        state = selective_allreduce_state(trainer.strategy.model)
        if state is not None:
            self.sent.append(state.last_step_bytes)
            self.full.append(state.last_step_full_bytes)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elastic = next(c for c in trainer.callbacks if isinstance(c, ElasticTensorSelection))  # type: ignore[attr-defined]
        record = {
            "steps": self.steps,
            "masks": self.masks,
            "losses": self.losses,
            "sent": self.sent,
            "full": self.full,
            "moved_while_frozen": self.moved_while_frozen,
            "selections": [r.mask.bits() for r in elastic.history],
            "numel": [p.numel() for p in pl_module.parameters()],
            "params": [p.detach().clone() for p in pl_module.parameters()],
        }
        torch.save(record, self.out.with_name(f"{self.out.name}_rank{trainer.global_rank}.pt"))


def fit(
    out: Path,
    strategy: str = "auto",
    devices: int = 1,
    ckpt_path: str | None = None,
    checkpoint_dir: Path | None = None,
) -> None:
    """Fit `TwoBranchNet` on `GLOBAL_BATCH` samples per step, split over `devices` processes; record every rank."""
    module = TwoBranchNet()
    elastic = ElasticTensorSelection(
        speedup=SPEEDUP,
        interval=BLOCK_STEPS,
        interval_unit="step",
        probe_steps=2,
        train_never=[NEVER],
        cache_dir=False,
        calibrate=False,
    )
    callbacks: list[Callback] = [PinTimings(pinned_profile(module)), elastic, Recorder(out)]
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, every_n_epochs=1, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_epochs=MAX_EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoint_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
