"""A tiny LightningModule and data for integration tests with a real `Trainer`."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elastic.profiling import TimingProfile


class TinyNet(L.LightningModule):
    """A 4-layer MLP with BatchNorm: deep enough that freezing a prefix saves backward work."""

    def __init__(self, width: int = 64, classes: int = 3, optimizer: str = "sgd", lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, width),
            nn.BatchNorm1d(width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, classes),
        )
        self.optimizer_name = optimizer
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def tiny_data(samples: int = 256, batch_size: int = 32, seed: int = 0) -> DataLoader[tuple[Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    y = (x[:, :3].argmax(dim=1)).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=generator)


def tiny_trainer(**kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def synthetic_profile(module: nn.Module, forward_share: float = 0.3) -> TimingProfile:
    """A fixed timing profile for `module` (weight tensors cost in proportion to their size), so that decisions
    depend on importance alone and tests do not depend on this machine's timing noise."""
    named = [(n, p) for n, p in module.named_parameters()]
    t_dw = tuple(1e-6 * p.numel() for _, p in named)
    t_dy = tuple(1e-6 * p.numel() if p.dim() > 1 else 0.0 for _, p in named)
    backward = sum(t_dw) + sum(t_dy[1:])
    t_fw = forward_share / (1 - forward_share) * backward
    return TimingProfile(
        names=tuple(n for n, _ in named),
        t_dw=t_dw,
        t_dy=t_dy,
        t_fw=t_fw,
        t_full=t_fw + backward,
        device="cpu",
        fingerprint="synthetic",
        unused=(),
        method="measured",
        numel=tuple(p.numel() for _, p in named),
    )


class Crash(Callback):
    """Raises at the start of optimizer step `at_step`: a fit that dies mid-training."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            raise RuntimeError("simulated crash")
