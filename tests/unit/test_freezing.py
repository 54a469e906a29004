from functools import reduce

import pytest
import torch
from torch import nn

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.freezing import (
    CHANGED,
    INTERNALS,
    RESET_CODE,
    CompiledCodes,
    apply_bn_policy,
    apply_mask,
    match_patterns,
    pins,
)
from lightning_elastic.records import Mask


def test_patterns_match_shell_style_and_reject_typos() -> None:
    names = ["backbone.0.weight", "backbone.1.weight", "head.weight", "head.bias"]
    assert match_patterns(names, ["head.*"], "train_always") == (False, False, True, True)
    assert match_patterns(names, ["*.weight", "head.bias"], "x") == (True, True, True, True)
    assert match_patterns(names, [], "x") == (False,) * 4
    with pytest.raises(
        ValueError, match=r"`train_never` patterns must each match .* Found patterns matching nothing: \['hed\.\*'\]"
    ):
        match_patterns(names, ["head.*", "hed.*"], "train_never")


def test_apply_mask_freezes_and_drops_gradients() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model(torch.randn(2, 3)).sum().backward()
    params = list(model.parameters())
    assert apply_mask(params, [False, False, True, True]) == 2
    assert [p.requires_grad for p in params] == [False, False, True, True]
    assert params[0].grad is None and params[1].grad is None
    assert params[2].grad is not None
    model(torch.randn(2, 3)).sum().backward()  # autograd now skips the frozen layer
    assert params[0].grad is None
    assert apply_mask(params, [True, True, True, True]) == 2
    with pytest.raises(ValueError, match=r"`mask` must have one entry per parameter \(4\). Found: 3"):
        apply_mask(params, [True] * 3)


def test_bn_policy_freeze_stops_running_statistics_of_frozen_layers_only() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).train()
    model[1].requires_grad_(False)
    frozen = apply_bn_policy(model, "freeze")
    assert frozen == ["1"]
    before = model[1].running_mean.clone(), model[3].running_mean.clone()
    model(torch.randn(8, 3, 5, 5))
    assert torch.equal(model[1].running_mean, before[0])
    assert not torch.equal(model[3].running_mean, before[1])
    model[1].requires_grad_(True)
    assert apply_bn_policy(model, "freeze", frozen) == []
    assert model[1].training


def test_bn_policy_update_leaves_modes_alone() -> None:
    model = nn.Sequential(nn.BatchNorm1d(2), nn.BatchNorm1d(2)).train()
    model.requires_grad_(False)
    model[1].eval()  # the user's own choice is respected
    assert apply_bn_policy(model, "update") == []
    assert model[0].training and not model[1].training
    with pytest.raises(ValueError, match=r"`bn_policy` must be one of \('update', 'freeze'\). Found: 'off'"):
        apply_bn_policy(model, "off")  # type: ignore[arg-type]


def test_pins_name_what_always_and_never_trains_and_refuse_contradictions() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]  # 0.weight, 0.bias, 1.weight, 1.bias
    params = list(model.parameters())
    model[0].bias.requires_grad_(False)  # frozen by the user: never trained either
    required, forbidden = pins(names, params, ["1.*"], ["0.weight"])
    assert required == Mask.of([False, False, True, True]) and forbidden == Mask.of([True, True, False, False])
    with pytest.raises(ElasticConfigError, match=r"`train_always` must not name .* Found: \['0.bias'\]$"):
        pins(names, params, ["0.bias"], [])
    with pytest.raises(ElasticConfigError, match=r"^`train_never` must leave at least one trainable tensor\. Found"):
        pins(names, params, [], ["*"])
    with pytest.raises(ElasticConfigError, match=r"`train_always` patterns must each match"):
        pins(names, params, ["2.*"], [])


def test_compiled_codes_reset_only_the_code_compiled_since_a_change() -> None:
    """What compiled between `watch` and `collect` is the fit's: reset, it compiles again; another function's cache,
    compiled before, is left as it was (before: `torch._dynamo.reset()` dropped both)."""
    from torch._dynamo.testing import CompileCounter

    def ours(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def theirs(x: torch.Tensor) -> torch.Tensor:
        return x - 3

    ours_count, theirs_count = CompileCounter(), CompileCounter()
    ours_compiled = torch.compile(ours, backend=ours_count)
    theirs_compiled = torch.compile(theirs, backend=theirs_count)
    x = torch.ones(3)
    theirs_compiled(x)
    codes = CompiledCodes()
    ours_compiled(x)
    codes.collect()
    assert codes.codes == {ours.__code__}
    codes.reset()
    ours_compiled(x), theirs_compiled(x)
    assert (ours_count.frame_count, theirs_count.frame_count) == (2, 1)


@pytest.mark.parametrize("missing", INTERNALS)
def test_compiled_codes_without_a_torch_internal_reset_all_of_dynamo_and_say_so_once(
    missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch upgrade that removes an internal `CompiledCodes` reads: no crash, each change still resets what the
    fit compiled (all of dynamo: `torch._dynamo.reset()`, counted here), and one warning names what is missing and
    what it costs. Before: an AttributeError inside the fit's step, or no reset at all."""
    owner, _, name = missing.rpartition(".")
    monkeypatch.delattr(reduce(getattr, owner.split(".")[1:], torch), name)
    resets: list[int] = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))  # torch's own reads what was removed here
    codes = CompiledCodes()
    codes.collect()
    with pytest.warns(UserWarning) as warned:
        codes.reset()
        codes.reset()
    assert resets == [1, 1] and codes.missing == (missing,) and len(warned) == 1
    assert str(warned[0].message).startswith(
        f"ElasticTensorSelection: this torch ({torch.__version__}) lacks {missing},"
    )
    assert "resets all of dynamo instead (`torch._dynamo.reset()`)" in str(warned[0].message)
    assert "every other function or model compiled in this process" in str(warned[0].message)


def failing_reset(error: Exception, monkeypatch: pytest.MonkeyPatch) -> tuple[CompiledCodes, list[int]]:
    """`CompiledCodes` with one code of the fit, on a torch whose `reset_code` raises `error`, and the resets of all
    of dynamo it makes (counted, not run)."""

    def reset_code(code: object) -> None:
        raise error

    resets: list[int] = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "reset_code", reset_code)
    codes = CompiledCodes()
    codes.codes.add(failing_reset.__code__)
    return codes, resets


@pytest.mark.parametrize("error", [TypeError("takes 2 arguments"), AttributeError("no .co_x"), RuntimeError("new")])
def test_compiled_codes_with_a_failing_internal_reset_all_of_dynamo_and_say_so_once(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An internal that raises what a changed signature or behaviour raises (`CHANGED`) puts `CompiledCodes` on the
    fallback of a missing one: each reset is all of dynamo's, and one warning names the internal and its error."""
    codes, resets = failing_reset(error, monkeypatch)
    with pytest.warns(UserWarning) as warned:
        codes.reset()
        codes.reset()
    assert resets == [1, 1] and len(warned) == 1 and isinstance(error, CHANGED)
    assert codes.failed is not None and codes.failed.internal == RESET_CODE and codes.failed.error is error
    assert f"has {RESET_CODE}, but using it raised {type(error).__name__}: {error} " in str(warned[0].message)


def test_compiled_codes_let_an_error_of_another_kind_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other error an internal raises is not about its shape: it reaches the caller as it is, with no fallback."""
    codes, resets = failing_reset(ValueError("a bad code"), monkeypatch)
    with pytest.raises(ValueError, match="a bad code"):
        codes.reset()
    assert codes.failed is None and resets == []


def test_bn_policy_freeze_leaves_a_layer_the_user_put_in_eval_mode_as_it_was() -> None:
    """Only layers it put in eval mode go back to train mode: one the user left in eval stays there throughout."""
    model = nn.Sequential(nn.BatchNorm1d(2), nn.BatchNorm1d(2)).train()
    model[0].eval()  # the user's choice, inside a model in train mode
    model.requires_grad_(False)
    frozen = apply_bn_policy(model, "freeze")
    assert frozen == ["1"] and not model[0].training and not model[1].training
    assert apply_bn_policy(model, "freeze", frozen) == ["1"]  # still ours while its tensors stay frozen
    model.requires_grad_(True)
    assert apply_bn_policy(model, "freeze", frozen) == []
    assert not model[0].training and model[1].training
    model.requires_grad_(False)
    model[1].eval()  # e.g. a layer ours since a checkpoint, in eval mode as the resumed fit starts
    assert apply_bn_policy(model, "freeze", ["1"]) == ["1"]
    assert apply_bn_policy(model, "update", ["1"]) == [] and model[1].training and not model[0].training


def test_patterns_match_a_tied_parameter_by_every_name_it_has() -> None:
    """`out.weight = emb.weight`: `named_parameters()` names it `emb.weight` only, so `train_always=["out.*"]` pinned
    the head's bias and not its weight, and `train_never=["out.weight"]` was refused as matching nothing."""
    from lightning_elastic.freezing import tied_names

    model = nn.ModuleDict({"emb": nn.Embedding(10, 4), "mid": nn.Linear(4, 4), "out": nn.Linear(4, 10)})
    model.out.weight = model.emb.weight
    named = list(model.named_parameters())
    names, params = [n for n, _ in named], [p for _, p in named]
    assert names == ["emb.weight", "mid.weight", "mid.bias", "out.bias"]
    required, _ = pins(names, params, ["out.*"], [], tied_names(model))
    assert required.flags == (True, False, False, True)
    _, forbidden = pins(names, params, [], ["out.weight"], tied_names(model))
    assert forbidden.flags == (True, False, False, False)
    with pytest.raises(ElasticConfigError, match=r"names: emb.weight \(also out.weight\), mid.weight"):
        pins(names, params, ["head.*"], [], tied_names(model))
