"""Composing the real configs, and tiny fake copies of the data sets in their real on-disk layouts.

Every fake image is one solid colour that encodes its class (`class_value`), so a test can check that the
loaders give each image its own label: the normalised pixel values say which class was read.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
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


# A tiny BERT checkpoint in Hugging Face's file layout: the vocabulary of the fake e-mails below, and the words'
# ids for tests that check the tokenizer.
BERT_VOCAB = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "buy", "cheap", "pills", "now", "free", "meeting", "the",
              "code", "review", "tomorrow", "patch", "hello", "offer", "kernel", "##s", ".", "!")  # fmt: skip
TINY_BERT = {"vocab_size": len(BERT_VOCAB), "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 16, "max_position_embeddings": 16, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
             "hidden_act": "gelu", "model_type": "bert", "pad_token_id": 0}  # fmt: skip


def bert_weight_shapes(config: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The weights of Hugging Face's `BertModel` (pooler included) and their shapes, written out by hand."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config["vocab_size"], hidden),
        "embeddings.position_embeddings.weight": (config["max_position_embeddings"], hidden),
        "embeddings.token_type_embeddings.weight": (config["type_vocab_size"], hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
        "pooler.dense.weight": (hidden, hidden),
        "pooler.dense.bias": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"encoder.layer.{i}"
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes[f"{layer}.{name}.weight"], shapes[f"{layer}.{name}.bias"] = (hidden, hidden), (hidden,)
        shapes[f"{layer}.intermediate.dense.weight"], shapes[f"{layer}.intermediate.dense.bias"] = (
            (inner, hidden),
            (inner,),
        )
        shapes[f"{layer}.output.dense.weight"], shapes[f"{layer}.output.dense.bias"] = (hidden, inner), (hidden,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{layer}.{norm}.weight"], shapes[f"{layer}.{norm}.bias"] = (hidden,), (hidden,)
    return shapes


def fake_bert_checkpoint(folder: Path, seed: int = 0, drop: str | None = None) -> dict[str, torch.Tensor]:
    """config.json, model.safetensors (random weights, `drop` left out) and tokenizer.json; returns the weights."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    generator = torch.Generator().manual_seed(seed)
    state = {
        name: (1.0 if name.endswith("LayerNorm.weight") else 0.0) + 0.5 * torch.randn(shape, generator=generator)
        for name, shape in bert_weight_shapes(TINY_BERT).items()
        if name != drop
    }
    save_file({**state, "embeddings.position_ids": torch.arange(16).unsqueeze(0)}, str(folder / "model.safetensors"))
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(BERT_VOCAB)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    (folder / "tokenizer.json").write_text(tokenizer.to_str())
    return state


HAM = "From: dev@lists.example\nSubject: Code review tomorrow {i}\n\nHello, the patch for the kernel. Meeting tomorrow."
SPAM = (
    "From: offer@spam.example\nSubject: FREE pills {i}\nMIME-Version: 1.0\nContent-Type: multipart/alternative; "
    'boundary="b"\n\n--b\nContent-Type: text/html\n\n<p>Buy <b>cheap</b> pills now!</p>\n--b--\n'
)


def fake_spam_assassin(root: Path, counts: dict[str, int] | None = None) -> list[str]:
    """The npm package's layout: data/file_list.json and one folder per group, plus one exact copy of an e-mail.

    Returns the file names in the list's order. Ham says "code review", spam "cheap pills"; the group of an
    e-mail is its folder.
    """
    counts = counts or {"easy-ham-1": 8, "hard-ham-1": 6, "spam-2": 8}
    names = []
    for folder, count in counts.items():
        (root / "data" / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            name = f"{folder}/{i:05d}.{i:032x}.txt"
            (root / "data" / name).write_text((SPAM if folder.startswith("spam") else HAM).format(i=f"{folder} {i}"))
            names.append(name)
    copy = f"{next(iter(counts))}/99999.{0:032x}.txt"
    (root / "data" / copy).write_bytes((root / "data" / names[0]).read_bytes())
    names.append(copy)
    (root / "data" / "file_list.json").write_text(json.dumps(names))
    return names
