"""The zoo's data sets, read from tiny fake copies in their real layouts, and their missing-data messages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from elastic_zoo.data import (
    Cub200DataModule,
    ElpvDataModule,
    FashionMnistDataModule,
    ImageDataModule,
    ImageFolderDataModule,
    InMemoryImageData,
    NormalisedBatch,
    OxfordPetsDataModule,
    SquareUInt8,
    per_class,
    read_idx,
)
from tests.recipes.recipe_fakes import fake_cub, fake_fashion_mnist, fake_image_folder, fake_pets, normalised


def all_batches(data: ImageDataModule, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    loader = {"train": data.train_dataloader, "val": data.val_dataloader, "test": data.test_dataloader}[split]()
    images, labels = zip(*loader, strict=True)
    return torch.cat(images), torch.cat(labels)


def assert_pixels_encode_labels(images: torch.Tensor, labels: torch.Tensor, atol: float = 1e-4) -> None:
    """Every image is the solid colour of its own label (see conftest.class_value)."""
    for image, label in zip(images, labels, strict=True):
        expected = torch.tensor(normalised(int(label)), dtype=torch.float32).view(3, 1, 1).expand_as(image)
        torch.testing.assert_close(image, expected, atol=atol, rtol=0)


def test_read_idx_reads_every_type_and_rejects_other_files(tmp_path: Path) -> None:
    values = np.arange(-3, 3, dtype=">i4").reshape(2, 3)
    path = tmp_path / "ints-idx2"
    path.write_bytes(bytes([0, 0, 0x0C, 2]) + (2).to_bytes(4, "big") + (3).to_bytes(4, "big") + values.tobytes())
    assert read_idx(path).tolist() == values.tolist()
    floats = np.array([0.5, -2.0], dtype=">f4")
    path = tmp_path / "floats-idx1"
    path.write_bytes(bytes([0, 0, 0x0D, 1]) + (2).to_bytes(4, "big") + floats.tobytes())
    assert read_idx(path).tolist() == [0.5, -2.0]
    path = tmp_path / "short-idx1"
    path.write_bytes(bytes([0, 0, 0x08, 1]) + (5).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="holds 3 values but its header says"):
        read_idx(path)
    path = tmp_path / "image.png"
    Image.new("RGB", (2, 2)).save(path)
    with pytest.raises(ValueError, match="is not an idx file"):
        read_idx(path)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_idx_files_with_the_official_split(tmp_path: Path, gz: bool) -> None:
    _, test_labels = fake_fashion_mnist(tmp_path, train=30, test=10, gz=gz)
    data = FashionMnistDataModule(root=tmp_path, image_size=12, batch_size=4, val_fraction=0.2)
    assert data.missing() == []
    test_images, test_got = all_batches(data, "test")
    assert test_got.tolist() == test_labels.tolist()  # the official test set, in file order
    assert test_images.shape == (10, 3, 12, 12)
    assert_pixels_encode_labels(test_images, test_got)
    val_images, val_got = all_batches(data, "val")
    assert sorted(val_got.tolist()) == [0, 0, 1, 1, 2, 2]  # 20% of each class of the training part
    assert_pixels_encode_labels(val_images, val_got)
    train_images, train_got = all_batches(data, "train")
    assert len(train_got) == 24  # the rest, in whole batches of 4
    assert_pixels_encode_labels(train_images, train_got)


def test_fashion_mnist_missing_files_are_named_with_the_debian_package(tmp_path: Path) -> None:
    fake_fashion_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    data = FashionMnistDataModule(root=tmp_path)
    message = data.missing()[0]
    assert f"Fashion-MNIST is not in {tmp_path}: t10k-labels-idx1-ubyte (or .gz) not found" in message
    assert "apt-get install dataset-fashion-mnist" in message
    with pytest.raises(FileNotFoundError) as raised:
        data.setup()
    assert str(raised.value) == message


def test_cub200_follows_the_official_layout_and_split(tmp_path: Path) -> None:
    truth = fake_cub(tmp_path / "CUB_200_2011", classes=3, per_class=8)
    data = Cub200DataModule(root=tmp_path / "CUB_200_2011", image_size=16, batch_size=2, val_fraction=0.25)
    assert data.missing() == [] and data.num_classes == 200
    test_images, test_labels = all_batches(data, "test")
    assert test_labels.tolist() == [label for label, is_train in truth.values() if not is_train]
    assert_pixels_encode_labels(test_images, test_labels, atol=0.05)  # JPEG: grey levels within about 1/255
    _, val_labels = all_batches(data, "val")
    _, train_labels = all_batches(data, "train")
    assert len(val_labels) + len(train_labels) == sum(is_train for _, is_train in truth.values())


def test_cub200_names_the_missing_files(tmp_path: Path) -> None:
    fake_cub(tmp_path)
    (tmp_path / "train_test_split.txt").unlink()
    message = Cub200DataModule(root=tmp_path).missing()[0]
    assert message.startswith(f"CUB-200-2011 is not in {tmp_path}: train_test_split.txt not found.")
    assert "dataset.root=DIR" in message


def test_oxford_pets_reads_with_torchvision_and_its_split(tmp_path: Path) -> None:
    fake_pets(tmp_path, classes=3, trainval=6, test=3)
    data = OxfordPetsDataModule(root=tmp_path, image_size=16, batch_size=3, val_fraction=0.34)
    assert data.missing() == [] and data.num_classes == 37
    test_images, test_labels = all_batches(data, "test")
    assert test_labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert_pixels_encode_labels(test_images, test_labels, atol=0.05)
    _, val_labels = all_batches(data, "val")
    assert sorted(val_labels.tolist()) == [0, 0, 1, 1, 2, 2]


def test_oxford_pets_missing_names_the_folder_and_the_download(tmp_path: Path) -> None:
    message = OxfordPetsDataModule(root=tmp_path).missing()[0]
    base = tmp_path / "oxford-iiit-pet"
    assert message.startswith(f"Oxford-IIIT Pet is not in {base}: {base / 'images'}, ")
    assert "https://www.robots.ox.ac.uk/~vgg/data/pets/" in message


def test_image_folder_has_a_class_per_sub_folder_and_a_stratified_split(tmp_path: Path) -> None:
    fake_image_folder(tmp_path, classes=("cat", "dog", "eel"), per_class=10)
    data = ImageFolderDataModule(tmp_path, image_size=8, batch_size=1, val_fraction=0.2, test_fraction=0.3)
    assert data.classes == ["cat", "dog", "eel"] and data.num_classes == 3 and data.missing() == []
    counts = {}
    for split in ("train", "val", "test"):
        images, labels = all_batches(data, split)
        assert_pixels_encode_labels(images, labels)  # PNG: exact
        counts[split] = torch.bincount(labels, minlength=3).tolist()
    assert counts == {"train": [5, 5, 5], "val": [2, 2, 2], "test": [3, 3, 3]}


def test_image_folder_problems(tmp_path: Path) -> None:
    assert "does not exist" in ImageFolderDataModule(tmp_path / "nowhere").missing()[0]
    fake_image_folder(tmp_path / "one", classes=("cat",), per_class=2)
    assert "at least 2. Found: ['cat']" in ImageFolderDataModule(tmp_path / "one").missing()[0]
    (tmp_path / "one" / "dog").mkdir()
    message = ImageFolderDataModule(tmp_path / "one").missing()[0]
    assert message.startswith(f"These class folders of {tmp_path / 'one'} hold no ") and message.endswith(": dog")


def test_square_uint8_crops_the_centre_after_resizing_the_shorter_side() -> None:
    image = np.zeros((40, 120, 3), dtype=np.uint8)
    image[:, 40:80] = 200  # the centre third, which the crop must keep
    square = SquareUInt8(10)(Image.fromarray(image))
    assert square.shape == (3, 10, 10) and square.dtype == torch.uint8
    assert (square[:, :, 1:-1] == 200).all()
    assert (square[:, :, [0, -1]] > 100).all()  # the edges blend in a little of the dark sides, equally


def test_normalised_batch_flips_left_right_only() -> None:
    image = torch.zeros(1, 4, 4, dtype=torch.uint8)
    image[0, :, 0] = 255  # the left column white
    torch.manual_seed(0)
    images, labels = NormalisedBatch(4, flip=True)([(image, 1)] * 32)
    white = images[:, 0].amax()
    left, right = images[:, 0, :, 0], images[:, 0, :, -1]
    flipped = (right == white).all(dim=1)
    assert ((left == white).all(dim=1) ^ flipped).all()  # each image is the original or its mirror image
    assert 0 < int(flipped.sum()) < 32
    assert labels.tolist() == [1] * 32


def test_elpv_is_available_from_its_package() -> None:
    assert ElpvDataModule().missing() == []


def test_per_class_draws_k_of_every_class_with_the_seed() -> None:
    labels = torch.tensor([0, 1, 2] * 6)
    chosen = per_class(labels, 4, seed=3)
    assert torch.bincount(labels[chosen]).tolist() == [4, 4, 4] and chosen.tolist() == sorted(set(chosen.tolist()))
    assert torch.equal(per_class(labels, 4, seed=3), chosen)
    assert any(not torch.equal(per_class(labels, 4, seed=s), chosen) for s in range(4, 10))
    with pytest.raises(ValueError, match=r"`train_per_class` must be at most .* class 0 has 6. Found: 7"):
        per_class(labels, 7, seed=0)


def test_few_shot_training_sets_are_drawn_from_the_training_split_and_leave_evaluation_alone(tmp_path: Path) -> None:
    fake_fashion_mnist(tmp_path, train=30, test=10)

    def splits(**kwargs: object) -> dict[str, list[int]]:
        data = FashionMnistDataModule(root=tmp_path, image_size=12, batch_size=3, val_fraction=0.2, **kwargs)  # type: ignore[arg-type]
        data.setup()
        return {name: list(part.indices) for name, part in data._splits.items()}  # type: ignore[attr-defined]

    whole, few = splits(seed=1), splits(seed=1, train_per_class=3)
    assert few["val"] == whole["val"] and few["test"] == whole["test"]
    assert set(few["train"]) < set(whole["train"]) and len(few["train"]) == 9
    assert sorted(i % 3 for i in few["train"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # fake labels: index % 3
    assert splits(seed=1, train_per_class=3) == few  # every method of one seed trains on the same images

    class Tiny(InMemoryImageData):
        num_classes = 2

        def load(self) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.arange(40, dtype=torch.uint8).view(40, 1, 1).expand(40, 8, 8), torch.arange(40) % 2

    data = Tiny(image_size=8, batch_size=2, val_fraction=0.25, test_fraction=0.25, train_per_class=5, augment=False)
    data.setup()
    train = data._splits["train"]
    assert torch.bincount(train.labels).tolist() == [5, 5]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"`train_per_class` must be a positive int or None. Found: 0"):
        Tiny(train_per_class=0)
