"""Composing the real configs, and tiny fake copies of the data sets in their real on-disk layouts.

Every fake image is one solid colour that encodes its class (`class_value`), so a test can check that the
loaders give each image its own label: the normalised pixel values say which class was read.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406])
IMAGENET_STD = np.array([0.229, 0.224, 0.225])


def compose_config(overrides: Sequence[str], output_dir: Path | None = None, name: str = "train") -> DictConfig:
    """`conf/<name>.yaml` composed with `overrides`, as the recipe would see it; output goes to `output_dir`."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # as in a run: the recipes read it from HydraConfig
        if output_dir is not None:
            cfg.paths.output_dir = str(output_dir)
    return cfg


def class_value(label: int) -> int:
    """The grey level (0-255) of every pixel of a fake image of class `label`."""
    return 30 + 40 * label


def normalised(label: int) -> np.ndarray:
    """The three normalised channel values of a fake image of class `label`."""
    return (class_value(label) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD


def save_image(path: Path, label: int, size: tuple[int, int] = (40, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (class_value(label),) * 3).save(path)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write `array` (uint8) as an idx file, gzipped when `path` ends in .gz."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def fake_fashion_mnist(root: Path, train: int = 30, test: int = 10, gz: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The four idx files with `train` + `test` 28 x 28 images of 3 classes; returns the labels."""
    root.mkdir(parents=True, exist_ok=True)
    labels = {"train": np.arange(train) % 3, "t10k": np.arange(test) % 3}
    suffix = ".gz" if gz else ""
    for split, split_labels in labels.items():
        images = np.stack([np.full((28, 28), class_value(int(y)), dtype=np.uint8) for y in split_labels])
        write_idx(root / f"{split}-images-idx3-ubyte{suffix}", images)
        write_idx(root / f"{split}-labels-idx1-ubyte{suffix}", split_labels.astype(np.uint8))
    return labels["train"], labels["t10k"]


def fake_cub(root: Path, classes: int = 3, per_class: int = 8) -> dict[int, tuple[int, bool]]:
    """The official CUB_200_2011 layout; returns {image id: (class index from 0, is_train)}."""
    images, labels, split = [], [], []
    truth = {}
    for image_id in range(1, classes * per_class + 1):
        label = (image_id - 1) % classes
        is_train = image_id % 4 != 0
        folder = f"{label + 1:03d}.Bird_{label + 1}"
        save_image(root / "images" / folder / f"Bird_{image_id:04d}.jpg", label)
        images.append(f"{image_id} {folder}/Bird_{image_id:04d}.jpg")
        labels.append(f"{image_id} {label + 1}")
        split.append(f"{image_id} {int(is_train)}")
        truth[image_id] = (label, is_train)
    (root / "images.txt").write_text("\n".join(images) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (root / "train_test_split.txt").write_text("\n".join(split) + "\n")
    return truth


def fake_pets(root: Path, classes: int = 3, trainval: int = 6, test: int = 3) -> None:
    """`root/oxford-iiit-pet/` with images/ and annotations/{trainval,test}.txt as torchvision reads them."""
    base = root / "oxford-iiit-pet"
    (base / "annotations").mkdir(parents=True, exist_ok=True)
    for split, count in (("trainval", trainval), ("test", test)):
        lines = []
        for label in range(classes):
            for i in range(count):
                name = f"Breed{label}_{split}{i}"
                save_image(base / "images" / f"{name}.jpg", label)
                lines.append(f"{name} {label + 1} {label % 2 + 1} {label + 1}")
        (base / "annotations" / f"{split}.txt").write_text("\n".join(lines) + "\n")


def fake_image_folder(root: Path, classes: Sequence[str] = ("cat", "dog", "eel"), per_class: int = 10) -> None:
    """One sub-folder of PNG images per class, plus a file that is not an image."""
    for label, name in enumerate(classes):
        for i in range(per_class):
            save_image(root / name / f"{i}.png", label)
    (root / classes[0] / "notes.txt").write_text("not an image")
