"""A plain classification LightningModule: the user's code, which the callback never needs to change.

Its network maps a batch's inputs to logits: images for the vision models, token ids for `bert.BertClassifier`.
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from elastic_zoo.meters import BalancedAccuracy

OptimizerName = Literal["sgd", "adam", "adamw"]
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")


class ImageClassifier(L.LightningModule):
    """Fine-tunes `model` with cross-entropy; logs its loss, accuracy and balanced accuracy.

    Logged: `train/loss`, `train/acc`, `val/loss`, `val/acc`, `test/loss`, `test/acc`, and `val/balanced_acc`,
    `test/balanced_acc`: the mean over classes of each class's recall over the whole split (`BalancedAccuracy`).

    Example:
        >>> from elastic_zoo.models import tiny_cnn
        >>> module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.01)
        >>> module(torch.zeros(1, 3, 8, 8)).shape
        torch.Size([1, 2])
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optimizer: OptimizerName = "adam",
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        problems = []
        if optimizer not in OPTIMIZERS:
            problems.append(f"`optimizer` must be one of {OPTIMIZERS}. Found: {optimizer!r}")
        if not (isinstance(lr, (int, float)) and lr > 0):
            problems.append(f"`lr` must be a positive number. Found: {lr!r}")
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
            problems.append(f"`weight_decay` must be a non-negative number. Found: {weight_decay!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.optimizer_name = optimizer
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.label_smoothing = label_smoothing
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_balanced_acc = BalancedAccuracy(num_classes)
        self.test_balanced_acc = BalancedAccuracy(num_classes)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        images, labels = batch
        logits = self(images)
        return F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing), logits, labels

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, logits, labels = self._loss(batch)
        self.train_acc(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.val_acc(logits, labels)
        self.log("val/loss", loss)
        self.log("val/acc", self.val_acc, prog_bar=True)
        self.val_balanced_acc(logits, labels)
        self.log("val/balanced_acc", self.val_balanced_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.test_acc(logits, labels)
        self.log("test/loss", loss)
        self.log("test/acc", self.test_acc)
        self.test_balanced_acc(logits, labels)
        self.log("test/balanced_acc", self.test_balanced_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
