"""Offline image-classification data sets as LightningDataModules.

Every data module splits its data with a seeded, stratified split, so that runs with the same seed see the
same data. Small sets (`InMemoryImageData`: ELPV) are loaded once into memory as normalised float tensors at
the requested size. Big sets (`LazyImageData`: Oxford-IIIT Pet, CUB-200-2011, Fashion-MNIST, any image
folder) keep their images as uint8 (decoded from file on access, or held small) and are resized, made RGB
and normalised batch by batch. Nothing is ever downloaded: `missing()` says what a machine lacks to load a
set, and loading a set that is not there raises that message.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".tif", ".tiff", ".webp")
ElpvLabels = Literal["defect4", "defect2"]
Batch = tuple[Tensor, Tensor]


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


class ClassificationData(L.LightningDataModule, ABC):
    """What every data module of the zoo shares: validated loader arguments, seeded splits and loaders.

    Subclasses set `num_classes`, fill `self._splits` ("train", "val", "test") in `setup()` and may override
    `missing()` and `_collate()`. `problems` are a subclass's own settings found wrong: reported with these.
    """

    num_classes: int

    def __init__(
        self,
        batch_size: int = 32,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        train_per_class: int | None = None,
        problems: Sequence[str] = (),
    ) -> None:
        super().__init__()
        problems = list(problems)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            problems.append(f"`batch_size` must be a positive int. Found: {batch_size!r}")
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not (isinstance(value, (int, float)) and 0 < value < 0.5):
                problems.append(f"`{name}` must be a number in (0, 0.5). Found: {value!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            problems.append(f"`num_workers` must be a non-negative int. Found: {num_workers!r}")
        if train_per_class is not None and (
            isinstance(train_per_class, bool) or not isinstance(train_per_class, int) or train_per_class < 1
        ):
            problems.append(f"`train_per_class` must be a positive int or None. Found: {train_per_class!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_per_class = train_per_class
        self._splits: dict[str, Dataset[Any]] = {}

    @abstractmethod
    def setup(self, stage: str | None = None) -> None:
        """Fill `self._splits` once; later calls do nothing."""

    def _few_shot(self, train: Tensor, labels: Tensor) -> Tensor:
        """`train` (indices into `labels`), cut to `train_per_class` images of each class when it is set."""
        if self.train_per_class is None:
            return train
        return train[per_class(labels[train], self.train_per_class, self.seed)]

    def missing(self) -> list[str]:
        """What this machine lacks to load the data set (a package, a folder, a file); empty when nothing."""
        return []

    def _raise_if_missing(self) -> None:
        problems = self.missing()
        if problems:
            raise FileNotFoundError("; ".join(problems))

    def _collate(self, split: str) -> Callable[[list[Any]], Batch] | None:
        """The loader's `collate_fn` for `split`; None for PyTorch's default."""
        return None

    def _loader(self, split: str, shuffle: bool) -> DataLoader[Any]:
        self.setup()
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self._splits[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.num_workers,
            collate_fn=self._collate(split),
            generator=generator if shuffle else None,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader("test", shuffle=False)


class ImageDataModule(ClassificationData):
    """The base of the image data sets: a square `image_size` and random flips of training images (`augment`)."""

    def __init__(self, image_size: int = 112, augment: bool = True, **kwargs: Any) -> None:
        problems = []
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
            problems.append(f"`image_size` must be an int >= 8. Found: {image_size!r}")
        super().__init__(problems=problems, **kwargs)
        self.image_size = image_size
        self.augment = augment


class InMemoryImageData(ImageDataModule):
    """Base for data modules whose whole data set fits in memory as tensors.

    Subclasses implement `load()` returning uint8 or float images (N, H, W) or (N, C, H, W) and int labels.
    """

    @abstractmethod
    def load(self) -> tuple[Tensor, Tensor]:
        """Return all images and integer labels of the data set."""

    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        images, labels = self.load()
        images = to_normalised_rgb(images, self.image_size)
        train, val, test = stratified_split(labels, (self.val_fraction, self.test_fraction), self.seed)
        train = self._few_shot(train, labels)
        self._splits = {
            "train": TensorImages(images[train], labels[train], augment=self.augment),
            "val": TensorImages(images[val], labels[val]),
            "test": TensorImages(images[test], labels[test]),
        }


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

    def __init__(self, labels: ElpvLabels = "defect4", **kwargs: Any) -> None:
        if labels not in ("defect4", "defect2"):
            raise ValueError(f"`labels` must be one of ('defect4', 'defect2'). Found: {labels!r}")
        super().__init__(**kwargs)
        self.labels = labels
        self.num_classes = 4 if labels == "defect4" else 2

    def missing(self) -> list[str]:
        if importlib.util.find_spec("elpv_dataset") is None:
            return [_ELPV_MISSING]
        return []

    def load(self) -> tuple[Tensor, Tensor]:
        try:
            from elpv_dataset.utils import load_dataset
        except ImportError as err:
            raise ImportError(_ELPV_MISSING) from err
        images, probabilities, _ = load_dataset()
        levels = np.rint(probabilities * 3).astype(np.int64)
        labels = levels if self.labels == "defect4" else (levels >= 2).astype(np.int64)
        return torch.from_numpy(images), torch.from_numpy(labels)


_ELPV_MISSING = (
    "The ELPV data set ships in the package `elpv-dataset`, which is not installed: "
    "pip install 'lightning-elastic[zoo]'"
)


class ImageSource(NamedTuple):
    """A whole data set for `LazyImageData`: uint8 images with int labels, and the official test split if any.

    `images[i]` is `(uint8 image (C, H, W), label)`; every image of the set has the same size.
    """

    images: Dataset[tuple[Tensor, int]]
    labels: Tensor
    is_test: Tensor | None


class LazyImageData(ImageDataModule):
    """Base for data sets too big to hold as float tensors: uint8 images, normalised batch by batch.

    Subclasses implement `source()`. When it gives an official test split, `test_fraction` is not used and
    `val_fraction` is the fraction of the official training part held out for validation; otherwise the set is
    split like `InMemoryImageData`'s. Training batches are flipped left-right at random when `augment`.
    """

    @abstractmethod
    def source(self) -> ImageSource:
        """The whole data set; raise `FileNotFoundError` with `missing()`'s message when it is not there."""

    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        images, labels, is_test = self.source()
        if is_test is None:
            train, val, test = stratified_split(labels, (self.val_fraction, self.test_fraction), self.seed)
        else:
            test = torch.nonzero(is_test).flatten()
            rest = torch.nonzero(~is_test).flatten()
            inner_train, inner_val = stratified_split(labels[rest], (self.val_fraction,), self.seed)
            train, val = rest[inner_train], rest[inner_val]
        train = self._few_shot(train, labels)
        self._splits = {
            name: Subset(images, part.tolist())
            for name, part in zip(("train", "val", "test"), (train, val, test), strict=True)
        }

    def _collate(self, split: str) -> Callable[[list[Any]], Batch]:
        return NormalisedBatch(self.image_size, flip=self.augment and split == "train")


class NormalisedBatch:
    """Collates uint8 images into an ImageNet-normalised RGB float batch at `size`, flipped left-right at random.

    Example:
        >>> images, labels = NormalisedBatch(16)([(torch.zeros(1, 28, 28, dtype=torch.uint8), 3)] * 2)
        >>> images.shape, labels.tolist()
        (torch.Size([2, 3, 16, 16]), [3, 3])
    """

    def __init__(self, size: int, flip: bool = False) -> None:
        self.size = size
        self.flip = flip

    def __call__(self, items: list[tuple[Tensor, int]]) -> Batch:
        images = to_normalised_rgb(torch.stack([image for image, _ in items]), self.size)
        if self.flip:
            flipped = torch.rand(len(images)) < 0.5
            images[flipped] = images[flipped].flip(-1)
        return images, torch.tensor([int(label) for _, label in items])


class SquareUInt8:
    """Resizes a PIL image's shorter side to `size`, crops the centre square, returns uint8 (3, size, size).

    Example:
        >>> from PIL import Image
        >>> SquareUInt8(32)(Image.new("RGB", (80, 40))).shape
        torch.Size([3, 32, 32])
    """

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: Any) -> Tensor:
        from PIL import Image

        image = image.convert("RGB")
        width, height = image.size
        scale = self.size / min(width, height)
        width, height = max(self.size, round(width * scale)), max(self.size, round(height * scale))
        image = image.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=3.0)
        left, top = (width - self.size) // 2, (height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)


class ImageFiles(Dataset[tuple[Tensor, int]]):
    """Image files decoded on access into uint8 (3, size, size) squares (see `SquareUInt8`).

    Example:
        >>> import tempfile
        >>> from PIL import Image
        >>> path = Path(tempfile.mkdtemp()) / "cat.png"
        >>> Image.new("RGB", (50, 30)).save(path)
        >>> image, label = ImageFiles([path], [1], size=24)[0]
        >>> image.shape, image.dtype, label
        (torch.Size([3, 24, 24]), torch.uint8, 1)
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], labels: Sequence[int], size: int) -> None:
        if len(paths) != len(labels):
            raise ValueError(f"`paths` and `labels` must have the same length. Found: {len(paths)} and {len(labels)}")
        self.paths = [Path(p) for p in paths]
        self.labels = [int(label) for label in labels]
        self.square = SquareUInt8(size)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        from PIL import Image

        with Image.open(self.paths[index]) as image:
            # JPEG decodes at a reduced scale when the file is much larger than needed: far less work.
            image.draft("RGB", (self.square.size, self.square.size))
            return self.square(image), self.labels[index]


class UInt8Images(Dataset[tuple[Tensor, int]]):
    """uint8 images (N, C, H, W) and labels (N,) held in memory."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.images[index], int(self.labels[index])


class OxfordPetsDataModule(LazyImageData):
    """Oxford-IIIT Pet: 7,349 photos of 37 cat and dog breeds, read with torchvision's `OxfordIIITPet` loader.

    `root` is the folder that holds `oxford-iiit-pet/` (with `images/` and `annotations/` extracted from the
    official `images.tar.gz` and `annotations.tar.gz`); nothing is downloaded. Official trainval / test split.

    Example:
        >>> data = OxfordPetsDataModule(root="/nowhere")
        >>> data.num_classes, data.missing()[0][:44]
        (37, 'Oxford-IIIT Pet is not in /nowhere/oxford-ii')
    """

    num_classes = 37
    URL = "https://www.robots.ox.ac.uk/~vgg/data/pets/"

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)

    def missing(self) -> list[str]:
        base = self.root.absolute() / "oxford-iiit-pet"
        needed = [base / "images", base / "annotations" / "trainval.txt", base / "annotations" / "test.txt"]
        absent = [str(path) for path in needed if not path.exists()]
        if importlib.util.find_spec("torchvision") is None:
            return [
                "Oxford-IIIT Pet is read by torchvision, which is not installed: pip install 'lightning-elastic[zoo]'"
            ]
        if absent:
            return [
                f"Oxford-IIIT Pet is not in {base}: {', '.join(absent)} not found. Download images.tar.gz and "
                f"annotations.tar.gz from {self.URL} and extract both there, or point `root` at the folder that "
                f"holds oxford-iiit-pet/ (Hydra: dataset.root=DIR)"
            ]
        return []

    def source(self) -> ImageSource:
        self._raise_if_missing()
        from torchvision.datasets import OxfordIIITPet

        square = SquareUInt8(self.image_size)
        splits = [OxfordIIITPet(self.root, split=s, transform=square, download=False) for s in ("trainval", "test")]
        # The loader parses the annotation files; its label list saves decoding every image to stratify.
        labels = [torch.tensor(split._labels, dtype=torch.int64) for split in splits]
        is_test = torch.cat(
            [torch.zeros(len(labels[0]), dtype=torch.bool), torch.ones(len(labels[1]), dtype=torch.bool)]
        )
        return ImageSource(ConcatDataset(splits), torch.cat(labels), is_test)


class Cub200DataModule(LazyImageData):
    """CUB-200-2011: 11,788 photos of 200 bird species, read from the official `CUB_200_2011` folder layout.

    `root` holds `images.txt`, `image_class_labels.txt`, `train_test_split.txt` and `images/`, as extracted from
    the official `CUB_200_2011.tgz`; the official train / test split is used.

    Example:
        >>> data = Cub200DataModule(root="/nowhere/CUB_200_2011")
        >>> data.num_classes, data.missing()[0][:40]
        (200, 'CUB-200-2011 is not in /nowhere/CUB_200_')
    """

    num_classes = 200
    FILES: tuple[str, ...] = ("images.txt", "image_class_labels.txt", "train_test_split.txt", "images")

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)

    def missing(self) -> list[str]:
        root = self.root.absolute()
        absent = [name for name in self.FILES if not (root / name).exists()]
        if absent:
            return [
                f"CUB-200-2011 is not in {root}: {', '.join(absent)} not found. Extract the official "
                f"CUB_200_2011.tgz (https://www.vision.caltech.edu/datasets/cub_200_2011/) and point `root` at its "
                f"CUB_200_2011 folder (Hydra: dataset.root=DIR)"
            ]
        return []

    def source(self) -> ImageSource:
        self._raise_if_missing()
        paths = _read_id_table(self.root / "images.txt")
        classes = _read_id_table(self.root / "image_class_labels.txt")
        is_train = _read_id_table(self.root / "train_test_split.txt")
        ids = sorted(paths)
        if set(classes) != set(ids) or set(is_train) != set(ids):
            raise ValueError(
                f"The files of {self.root} list different image ids: the folder is not the official layout"
            )
        # Class ids in the files start at 1.
        labels = torch.tensor([int(classes[i]) - 1 for i in ids])
        is_test = torch.tensor([is_train[i] == "0" for i in ids])
        images = ImageFiles([self.root / "images" / paths[i] for i in ids], labels.tolist(), self.image_size)
        return ImageSource(images, labels, is_test)


def _read_id_table(path: Path) -> dict[int, str]:
    """`<image id> <value>` lines (the format of CUB's metadata files) as {id: value}."""
    table = {}
    for line in path.read_text().splitlines():
        if line.strip():
            key, value = line.split(maxsplit=1)
            table[int(key)] = value.strip()
    return table


class FashionMnistDataModule(LazyImageData):
    """Fashion-MNIST: 70,000 28x28 grey images of 10 clothing classes, from the original idx files.

    `root` holds `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and
    `t10k-labels-idx1-ubyte`, gzipped (`.gz`) or not, as Debian's package `dataset-fashion-mnist` installs them
    (conf/dataset/fashion_mnist.yaml names its folder). Official 60,000 / 10,000 train / test split.

    Example:
        >>> data = FashionMnistDataModule(root="/nowhere")
        >>> data.num_classes, data.missing()[0][:39]
        (10, 'Fashion-MNIST is not in /nowhere: train')
    """

    num_classes = 10
    FILES: tuple[str, ...] = (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)

    def _find(self, name: str) -> Path | None:
        for candidate in (self.root / name, self.root / f"{name}.gz"):
            if candidate.is_file():
                return candidate
        return None

    def missing(self) -> list[str]:
        absent = [name for name in self.FILES if self._find(name) is None]
        if absent:
            return [
                f"Fashion-MNIST is not in {self.root.absolute()}: {', '.join(absent)} (or .gz) not found. On Debian "
                f"or Ubuntu: sudo apt-get install dataset-fashion-mnist (conf/dataset/fashion_mnist.yaml points at the "
                f"folder it installs); or point `root` at a folder with the four idx files "
                f"(Hydra: dataset.root=DIR)"
            ]
        return []

    def source(self) -> ImageSource:
        self._raise_if_missing()
        found = {name: self._find(name) for name in self.FILES}
        train_images, train_labels, test_images, test_labels = (read_idx(path) for path in found.values() if path)
        images = torch.cat([train_images, test_images]).unsqueeze(1)
        labels = torch.cat([train_labels, test_labels]).long()
        if len(images) != len(labels):
            raise ValueError(f"The idx files in {self.root} hold {len(images)} images but {len(labels)} labels")
        is_test = torch.arange(len(labels)) >= len(train_labels)
        return ImageSource(UInt8Images(images, labels), labels, is_test)


def read_idx(path: str | os.PathLike[str]) -> Tensor:
    """Read an idx file (the MNIST format), gzipped or not, as a tensor of its type and shape.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "labels-idx1-ubyte"
        >>> _ = path.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
        >>> read_idx(path)
        tensor([7, 8, 9], dtype=torch.uint8)
    """
    path = Path(path)
    with gzip.open(path) if path.suffix == ".gz" else path.open("rb") as file:
        data = file.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an idx file: its header is {data[:4].hex()}")
    ndim = data[3]
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    dtype = _IDX_TYPES[data[2]]
    values = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim)
    if values.size != math.prod(shape):
        raise ValueError(f"{path} holds {values.size} values but its header says {shape}")
    return torch.from_numpy(values.astype(dtype.newbyteorder("="), copy=True).reshape(shape))


_IDX_TYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class ImageFolderDataModule(LazyImageData):
    """Any folder of images with one sub-folder per class (torchvision's ImageFolder layout).

    Classes are the sub-folder names in sorted order; files whose names end in one of `extensions` are used.
    The set is split into train / val / test like `InMemoryImageData`'s.

    Example:
        >>> import tempfile
        >>> from PIL import Image
        >>> root = Path(tempfile.mkdtemp())
        >>> for name in ("cat", "dog"):
        ...     (root / name).mkdir()
        ...     for i in range(4):
        ...         Image.new("RGB", (20, 20)).save(root / name / f"{i}.png")
        >>> data = ImageFolderDataModule(root, image_size=16, batch_size=2, val_fraction=0.25, test_fraction=0.25)
        >>> data.classes, next(iter(data.train_dataloader()))[0].shape
        (['cat', 'dog'], torch.Size([2, 3, 16, 16]))
    """

    def __init__(
        self, root: str | os.PathLike[str], extensions: Sequence[str] = IMAGE_EXTENSIONS, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)
        self.extensions = tuple(e.lower() for e in extensions)
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []
        self.num_classes = len(self.classes)

    def _files(self, name: str) -> list[Path]:
        folder = self.root / name
        return sorted(p for p in folder.rglob("*") if p.suffix.lower() in self.extensions and p.is_file())

    def missing(self) -> list[str]:
        root = self.root.absolute()
        if not root.is_dir():
            return [
                f"The image folder {root} does not exist: point `root` at a folder with one sub-folder of images "
                f"per class (Hydra: dataset.root=DIR)"
            ]
        if len(self.classes) < 2:
            return [
                f"The image folder {root} must hold one sub-folder of images per class, at least 2. "
                f"Found: {self.classes}"
            ]
        empty = [name for name in self.classes if not self._files(name)]
        if empty:
            return [f"These class folders of {root} hold no {'/'.join(self.extensions)} images: {', '.join(empty)}"]
        return []

    def source(self) -> ImageSource:
        self._raise_if_missing()
        paths: list[Path] = []
        labels: list[int] = []
        for label, name in enumerate(self.classes):
            files = self._files(name)
            paths += files
            labels += [label] * len(files)
        return ImageSource(ImageFiles(paths, labels, self.image_size), torch.tensor(labels), None)


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


def per_class(labels: Tensor, k: int, seed: int) -> Tensor:
    """Sorted positions of `k` items of every class of `labels`, drawn with `seed`: a few-shot training set.

    The draw depends on the labels and the seed alone, so every method run with one seed trains on the same images.

    Raises:
        ValueError: when a class has fewer than `k` items.

    Example:
        >>> per_class(torch.tensor([0, 1, 0, 1, 0, 1]), 2, seed=0).tolist()
        [0, 3, 4, 5]
    """
    generator = torch.Generator().manual_seed(seed)
    chosen = []
    for cls in labels.unique(sorted=True):
        members = torch.nonzero(labels == cls).flatten()
        if len(members) < k:
            raise ValueError(
                f"`train_per_class` must be at most the training images of every class: class {int(cls)} has "
                f"{len(members)}. Found: {k}"
            )
        chosen.append(members[torch.randperm(len(members), generator=generator)[:k]])
    return torch.cat(chosen).sort().values
