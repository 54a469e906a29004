"""Offline image-classification data sets as LightningDataModules.

Each data module loads its images once into memory as normalised float tensors at the requested size, with
a seeded, stratified train / val / test split, so that runs with the same seed see the same data.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ElpvLabels = Literal["defect4", "defect2"]


class TensorImages(Dataset[tuple[Tensor, Tensor]]):
    """Images (N, C, H, W) and labels (N,) held in memory; random flips when `augment`."""

    def __init__(self, images: Tensor, labels: Tensor, augment: bool = False) -> None:
        self.images = images
        self.labels = labels
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = self.images[index]
        if self.augment:
            flips = [dim for dim in (-1, -2) if torch.rand(()) < 0.5]
            if flips:
                image = image.flip(flips)
        return image, self.labels[index]


class InMemoryImageData(L.LightningDataModule, ABC):
    """Base for data modules whose whole data set fits in memory as tensors.

    Subclasses implement `load()` returning uint8 or float images (N, H, W) or (N, C, H, W) and int labels.
    """

    num_classes: int

    def __init__(
        self,
        image_size: int = 112,
        batch_size: int = 32,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        augment: bool = True,
    ) -> None:
        super().__init__()
        problems = []
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
            problems.append(f"`image_size` must be an int >= 8. Found: {image_size!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            problems.append(f"`batch_size` must be a positive int. Found: {batch_size!r}")
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not (isinstance(value, (int, float)) and 0 < value < 0.5):
                problems.append(f"`{name}` must be a number in (0, 0.5). Found: {value!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            problems.append(f"`num_workers` must be a non-negative int. Found: {num_workers!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self.image_size = image_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.augment = augment
        self._splits: dict[str, TensorImages] = {}

    @abstractmethod
    def load(self) -> tuple[Tensor, Tensor]:
        """Return all images and integer labels of the data set."""

    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        images, labels = self.load()
        images = to_normalised_rgb(images, self.image_size)
        parts = stratified_split(labels, (self.val_fraction, self.test_fraction), self.seed)
        train, val, test = parts
        self._splits = {
            "train": TensorImages(images[train], labels[train], augment=self.augment),
            "val": TensorImages(images[val], labels[val]),
            "test": TensorImages(images[test], labels[test]),
        }

    def _loader(self, split: str, shuffle: bool) -> DataLoader[tuple[Tensor, Tensor]]:
        self.setup()
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self._splits[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.num_workers,
            generator=generator if shuffle else None,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader("test", shuffle=False)


class ElpvDataModule(InMemoryImageData):
    """ELPV: 2,624 real 300x300 electroluminescence images of solar cells with defect probabilities.

    `labels="defect4"` classifies the four annotated defect probabilities (0, 1/3, 2/3, 1); `"defect2"` the
    binary task "defective" (probability >= 0.5). Images ship with the package `elpv-dataset`.

    Example:
        >>> data = ElpvDataModule(image_size=64, batch_size=8)
        >>> images, labels = next(iter(data.train_dataloader()))
        >>> images.shape, data.num_classes
        (torch.Size([8, 3, 64, 64]), 4)
    """

    def __init__(self, labels: ElpvLabels = "defect4", **kwargs: object) -> None:
        if labels not in ("defect4", "defect2"):
            raise ValueError(f"`labels` must be one of ('defect4', 'defect2'). Found: {labels!r}")
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.labels = labels
        self.num_classes = 4 if labels == "defect4" else 2

    def load(self) -> tuple[Tensor, Tensor]:
        try:
            from elpv_dataset.utils import load_dataset
        except ImportError as err:
            raise ImportError(
                "The ELPV data set ships in the package `elpv-dataset`, which is not installed: "
                "pip install 'lightning-elastic[zoo]'"
            ) from err
        images, probabilities, _ = load_dataset()
        levels = np.rint(probabilities * 3).astype(np.int64)
        labels = levels if self.labels == "defect4" else (levels >= 2).astype(np.int64)
        return torch.from_numpy(images), torch.from_numpy(labels)


def to_normalised_rgb(images: Tensor, size: int, chunk: int = 256) -> Tensor:
    """Resize uint8/float images (N, H, W) or (N, C, H, W) to `size`, make them 3-channel, ImageNet-normalise."""
    if images.dim() == 3:
        images = images.unsqueeze(1)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    out = torch.empty(len(images), 3, size, size)
    for start in range(0, len(images), chunk):
        part = images[start : start + chunk].float()
        if images.dtype == torch.uint8:
            part = part / 255.0
        part = F.interpolate(part, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if part.shape[1] == 1:
            part = part.expand(-1, 3, -1, -1)
        out[start : start + chunk] = (part - mean) / std
    return out


def stratified_split(labels: Tensor, fractions: Sequence[float], seed: int) -> list[Tensor]:
    """Indices of a seeded split that keeps class proportions: the rest first, then one part per fraction."""
    generator = torch.Generator().manual_seed(seed)
    parts: list[list[Tensor]] = [[] for _ in range(len(fractions) + 1)]
    for cls in labels.unique(sorted=True):
        members = torch.nonzero(labels == cls).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        start = 0
        sizes = [math.floor(f * len(members) + 0.5) for f in fractions]
        rest = len(members) - sum(sizes)
        for part, size in zip(parts, [rest, *sizes], strict=True):
            part.append(members[start : start + size])
            start += size
    return [torch.cat(p).sort().values for p in parts]
