"""ImportanceEvaluator against hand-computed values, an independent recomputation, and brute force."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import Tensor, nn

from lightning_elastic.importance import Gradient, ImportanceEvaluator, true_loss_drop
from lightning_elastic.importance_window import ImportanceWindow, LatestImportance

Batch = tuple[Tensor, Tensor]
# Per step: the gradients the step consumed, the weights before and after it.
Record = tuple[list[Tensor | None], list[Tensor], list[Tensor]]

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "sgd-momentum-wd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam-wd-foreach": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, foreach=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
}


def mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)
    ).to(dtype)


def deep_mlp(seed: int) -> nn.Sequential:
    """22 tensors (Linear and LayerNorm): enough for a rank correlation to mean something."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 32), nn.LayerNorm(32), nn.Tanh()]
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.LayerNorm(32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 3)).double()


def batches(count: int, seed: int = 1, size: int = 32, dtype: torch.dtype = torch.float64) -> list[Batch]:
    """Synthetic classification with a known structure: the class depends on the first two inputs only."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(size, 6, generator=generator, dtype=dtype)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        out.append((x, y))
    return out


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[Batch],
    evaluator: ImportanceEvaluator | None = None,
    frozen: Callable[[int], list[Tensor]] = lambda step: [],
) -> list[Record]:
    """Plain training steps (with the evaluator wired in, if any); records what each step did."""
    params = list(model.parameters())
    records: list[Record] = []
    for step, (x, y) in enumerate(data):
        for p in params:
            p.requires_grad_(all(p is not q for q in frozen(step)))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        before = [p.detach().clone() for p in params]
        if evaluator is not None:
            evaluator.before_step()
        optimizer.step()
        if evaluator is not None:
            evaluator.after_step()
            # The evaluator only reads: the gradients are still those the step consumed.
            for p, g in zip(params, grads, strict=True):
                assert p.grad is None if g is None else p.grad is not None and torch.equal(p.grad, g)
        records.append((grads, before, [p.detach().clone() for p in params]))
    return records


def reference(records: list[Record], gradient: Gradient = "average") -> Tensor:
    """-sum over steps of g . dw, g as `gradient` says; g_before where no finite g_after follows."""
    n = len(records[0][0])
    total = torch.zeros(n, dtype=torch.float64)
    for t, (grads, before, after) in enumerate(records):
        following = records[t + 1][0] if t + 1 < len(records) else [None] * n
        for k in range(n):
            g, g_next = grads[k], following[k]
            if g is None:
                continue
            dw = (after[k] - before[k]).double()
            contribution = -(g.double() * dw).sum()
            if gradient != "before" and g_next is not None and torch.isfinite(g_next).all():
                g_after = g_next.double() if gradient == "after" else (g.double() + g_next.double()) / 2
                contribution = -(g_after * dw).sum()
            if torch.isfinite(contribution):
                total[k] += contribution
    return total


def assert_same_state(a: Any, b: Any) -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    ("gradient", "expected"),
    [
        # (g + g/2) / 2 . g/2: the exact loss drop of a quadratic.
        ("average", [1.875, 3.375]),
        ("before", [2.5, 4.5]),  # g . g/2
        ("after", [1.25, 2.25]),  # g/2 . g/2
    ],
)
def test_sgd_exact_values(gradient: Gradient, expected: list[float]) -> None:
    # L = |w|^2 / 2, so g = w; SGD with lr 0.5 halves w: dw = -g/2 and the after-gradient is g/2.
    w1 = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    w2 = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([w1, w2], lr=0.5)
    evaluator = ImportanceEvaluator([w1, w2], gradient=gradient)

    def loss() -> Tensor:
        return (w1.square().sum() + w2.square().sum()) / 2

    loss().backward()
    evaluator.before_step()
    optimizer.step()
    evaluator.after_step()
    # Until the after-gradient comes, the before-gradient: I = lr * |g|^2 = [0.5 * 5, 0.5 * 9].
    assert evaluator.importance.tolist() == [2.5, 4.5]
    assert evaluator.steps == 1

    optimizer.zero_grad()
    loss().backward()
    evaluator.before_step()  # brings the after-gradient g/2
    evaluator.finish()  # drops the step just opened: it never happened
    assert evaluator.importance.tolist() == expected
    assert evaluator.steps == 1
    if gradient != "average":
        return
    w1.data.mul_(2)
    w2.data.mul_(2)
    drops = true_loss_drop(loss, [w1, w2], [-w1.detach() / 2, -w2.detach() / 2])
    assert drops.tolist() == [1.875, 3.375]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_matches_recorded_updates_and_leaves_training_untouched(name: str) -> None:
    data = batches(4)
    model = mlp()
    optimizer = OPTIMIZERS[name](list(model.parameters()))
    evaluator = ImportanceEvaluator(list(model.parameters()), gradient="average")
    records = train(model, optimizer, data, evaluator)
    evaluator.finish()

    expected = reference(records)
    torch.testing.assert_close(evaluator.importance, expected, rtol=1e-10, atol=1e-14)
    assert evaluator.steps == 4
    assert (expected.abs() > 0).all()

    plain_model = mlp()
    plain_optimizer = OPTIMIZERS[name](list(plain_model.parameters()))
    train(plain_model, plain_optimizer, data)
    assert_same_state(optimizer.state_dict(), plain_optimizer.state_dict())
    assert_same_state(model.state_dict(), plain_model.state_dict())
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("gradient", ["before", "after"])
def test_other_gradients_match_recorded_updates(gradient: Gradient) -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    evaluator = ImportanceEvaluator(list(model.parameters()), gradient=gradient)
    bias = model[2].bias
    assert isinstance(bias, Tensor)
    # `bias` is frozen at step 2, so its step-1 update has no after-gradient.
    records = train(model, optimizer, batches(3), evaluator, frozen=lambda step: [bias] if step == 2 else [])
    evaluator.finish()
    torch.testing.assert_close(evaluator.importance, reference(records, gradient), rtol=1e-10, atol=1e-14)


def test_frozen_tensors_are_skipped_and_fall_back_to_the_before_gradient() -> None:
    model = mlp()
    first, head = model[0].weight, model[6].bias
    assert isinstance(first, Tensor) and isinstance(head, Tensor)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    evaluator = ImportanceEvaluator(list(model.parameters()), gradient="average")
    # `head` is frozen throughout; `first` trains at steps 0, 2, 3 and is frozen at step 1, so its
    # step-0 update has no after-gradient.
    records = train(
        model,
        optimizer,
        batches(4),
        evaluator,
        frozen=lambda step: [head, first] if step == 1 else [head],
    )
    evaluator.finish()

    index = {id(p): k for k, p in enumerate(model.parameters())}
    importance = evaluator.importance
    torch.testing.assert_close(importance, reference(records), rtol=1e-10, atol=1e-14)
    assert importance[index[id(head)]] == 0.0
    assert importance[index[id(first)]] != 0.0
    grads, before, after = records[0]
    g0, dw0 = grads[index[id(first)]], after[index[id(first)]] - before[index[id(first)]]
    assert g0 is not None
    step0_alone = -(g0 * dw0).sum()
    grads2, before2, after2 = records[2]
    g2, g3 = grads2[index[id(first)]], records[3][0][index[id(first)]]
    assert g2 is not None and g3 is not None
    step2 = -((g2 + g3) / 2 * (after2[index[id(first)]] - before2[index[id(first)]])).sum()
    g3_alone = -(g3 * (records[3][2][index[id(first)]] - records[3][1][index[id(first)]])).sum()
    torch.testing.assert_close(importance[index[id(first)]], step0_alone + step2 + g3_alone)


def test_frozen_tensor_holds_no_copy() -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    model(batches(1)[0][0]).sum().backward()
    evaluator = ImportanceEvaluator(list(model.parameters()), gradient="average")
    evaluator.before_step()
    assert sorted(evaluator._buffers) == list(range(1, 8))
    evaluator.finish()
    assert not evaluator._buffers


def test_skipped_step_contributes_nothing_and_overflow_falls_back() -> None:
    # What torch.amp.GradScaler does on overflow: the gradients hold inf and the step is skipped.
    model = mlp()
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=0.01)
    evaluator = ImportanceEvaluator(params, gradient="average")
    records: list[Record] = []
    for step, (x, y) in enumerate(batches(3)):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == 1:
            params[2].grad[0, 0] = float("inf")  # type: ignore[index]
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        before = [p.detach().clone() for p in params]
        evaluator.before_step()
        if step != 1:
            optimizer.step()
        evaluator.after_step()
        records.append((grads, before, [p.detach().clone() for p in params]))
    evaluator.finish()

    importance = evaluator.importance
    assert torch.isfinite(importance).all()
    torch.testing.assert_close(importance, reference(records), rtol=1e-10, atol=1e-14)
    # Step 0's update of tensor 2 is settled with its before-gradient: the after-gradient overflowed.
    g0, dw0 = records[0][0][2], records[0][2][2] - records[0][1][2]
    g2, dw2 = records[2][0][2], records[2][2][2] - records[2][1][2]
    assert g0 is not None and g2 is not None
    torch.testing.assert_close(importance[2], -(g0 * dw0).sum() - (g2 * dw2).sum())
    assert evaluator.steps == 3


def test_low_precision_parameters() -> None:
    model = mlp(dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    evaluator = ImportanceEvaluator(list(model.parameters()), gradient="average")
    records = train(model, optimizer, batches(3, dtype=torch.bfloat16), evaluator)
    evaluator.finish()
    # bf16 products are exact in float32; only the float32 summation differs from float64.
    torch.testing.assert_close(evaluator.importance, reference(records), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("gradient", ["average", "before"])
@pytest.mark.parametrize(("name", "lr"), [("sgd", 0.05), ("adam", 3e-3)], ids=["sgd-momentum", "adam"])
def test_ranking_matches_brute_force_loss_drop(name: str, lr: float, gradient: Gradient) -> None:
    data = batches(14, size=64)
    model = deep_mlp(seed=3)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=lr)
    train(model, optimizer, data[:10])  # past initialisation, with warm optimizer state

    rhos = []
    for x, y in data[10:]:

        def loss(x: Tensor = x, y: Tensor = y) -> Tensor:
            return F.cross_entropy(model(x), y)

        evaluator = ImportanceEvaluator(params, gradient=gradient)
        optimizer.zero_grad()
        loss().backward()
        before = [p.detach().clone() for p in params]
        evaluator.before_step()
        optimizer.step()
        evaluator.after_step()
        updates = [p.detach() - w for p, w in zip(params, before, strict=True)]
        optimizer.zero_grad()
        loss().backward()  # the after-gradient, on the same batch
        evaluator.before_step()
        evaluator.finish()

        after = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, before, strict=True):
                p.copy_(w)
        drops = true_loss_drop(loss, params, updates)
        with torch.no_grad():
            for p, w in zip(params, after, strict=True):
                p.copy_(w)
        rhos.append(spearmanr(evaluator.importance.numpy(), drops.numpy()).statistic)
    assert min(rhos) >= 0.8, rhos


def test_state_dict_round_trip() -> None:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    evaluator = ImportanceEvaluator(list(model.parameters()), gradient="average")
    train(model, optimizer, batches(3), evaluator)
    # Mid-window, the latest update counts with its before-gradient, as after finish().
    state = json.loads(json.dumps(evaluator.state_dict()))
    assert state["steps"] == 3
    evaluator.finish()
    assert state["importance"] == evaluator.importance.tolist()

    restored = ImportanceEvaluator(list(model.parameters()), gradient="average")
    restored.load_state_dict(state)
    assert restored.importance.tolist() == state["importance"]
    assert restored.steps == 3
    # A restored evaluator keeps accumulating on top.
    records = train(model, optimizer, batches(2, seed=7), restored)
    restored.finish()
    assert restored.steps == 5
    expected = torch.tensor(state["importance"], dtype=torch.float64) + reference(records)
    torch.testing.assert_close(restored.importance, expected, rtol=1e-10, atol=1e-14)


def test_reset_starts_a_new_window() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    evaluator = ImportanceEvaluator(list(model.parameters()), gradient="average")
    train(model, optimizer, batches(2), evaluator)
    evaluator.reset()
    assert evaluator.steps == 0
    assert evaluator.importance.tolist() == [0.0] * 8
    records = train(model, optimizer, batches(2, seed=5), evaluator)
    evaluator.finish()
    torch.testing.assert_close(evaluator.importance, reference(records), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        ([], ValueError, "`params` must hold at least one tensor. Found: an empty sequence"),
        ([torch.zeros(2), 3], TypeError, "`params` must hold only tensors. Found: int at index 1"),
        ([torch.zeros(2, dtype=torch.long)], ValueError, "floating-point tensors. Found: torch.int64 at index 0"),
        (torch.zeros(2), TypeError, "`params` must be a sequence of tensors, not one tensor"),
        (3, TypeError, "`params` must be a sequence of tensors. Found: int"),  # it read "'int' object is not iterable"
    ],
)
def test_invalid_params(params: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        ImportanceEvaluator(params)


def test_invalid_gradient() -> None:
    with pytest.raises(
        ValueError, match=re.escape("`gradient` must be one of ('average', 'before', 'after'). Found: 'mean'")
    ):
        ImportanceEvaluator([torch.zeros(1)], gradient="mean")  # type: ignore[arg-type]


def test_duplicate_params() -> None:
    w = torch.zeros(2)
    with pytest.raises(ValueError, match=re.escape("must not hold the same tensor twice. Found: indices 0 and 2")):
        ImportanceEvaluator([w, torch.zeros(1), w])


def test_call_order_is_checked() -> None:
    w = torch.ones(2, requires_grad=True)
    evaluator = ImportanceEvaluator([w])
    with pytest.raises(
        RuntimeError,
        match=r"before_step\(\), optimizer.step\(\), after_step\(\).*Found: "
        r"after_step\(\) without before_step\(\)",
    ):
        evaluator.after_step()
    w.sum().backward()
    evaluator.before_step()
    with pytest.raises(RuntimeError, match=r"Found: before_step\(\) twice without after_step\(\)"):
        evaluator.before_step()
    w.grad = None
    with pytest.raises(
        RuntimeError,
        match=r"before the gradients are zeroed. Found: no gradient at "
        r"after_step\(\) for tensors \[0\]",
    ):
        evaluator.after_step()


@pytest.mark.parametrize("gradient", ["before", "average"])
def test_non_finite_steps_are_left_out_and_counted(gradient: Gradient) -> None:
    """A NaN gradient in tensor 0 at step 1 (the step skipped, as GradScaler does): that step of tensor 0 neither
    adds to its sum nor to its count, so its importance per step is the mean of its finite steps alone."""
    model = mlp()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    evaluator = ImportanceEvaluator(params, gradient=gradient)
    steps: list[float] = []
    for step, (x, y) in enumerate(batches(3)):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == 1:
            params[0].grad[0, 0] = float("nan")  # type: ignore[index]
        g, w = params[0].grad.clone(), params[0].detach().clone()  # type: ignore[union-attr]
        evaluator.before_step()
        if step != 1:
            optimizer.step()
            steps.append(float(-(g * (params[0].detach() - w)).sum()))
        evaluator.after_step()
    evaluator.finish()
    assert evaluator.counts[0] == 2 and evaluator.counts[1:] == [3] * (len(params) - 1)
    assert evaluator.nonfinite == [1] + [0] * (len(params) - 1)
    assert torch.isfinite(evaluator.importance).all()
    assert float(evaluator.importance[0]) / evaluator.counts[0] == pytest.approx(sum(steps) / 2, rel=1e-9)
    evaluator.reset()
    assert evaluator.nonfinite == [0] * len(params)


def test_sparse_gradients_are_rejected() -> None:
    embedding = nn.Embedding(4, 2, sparse=True)
    embedding(torch.tensor([1])).sum().backward()
    evaluator = ImportanceEvaluator([embedding.weight])
    with pytest.raises(
        RuntimeError, match=re.escape("dense gradients. Found: a torch.sparse_coo gradient for tensor 0")
    ):
        evaluator.before_step()


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"importance": [1.0], "steps": 1}, r"list of 2 finite numbers \(one per tensor\). Found: 1 entries"),
        ({"importance": [1.0, float("nan")], "steps": 1}, "Found: nan at index 1"),
        ({"steps": 1}, "Found: None"),
        ({"importance": [1.0, 2.0], "steps": -1}, r"`state\['steps'\]` must be a non-negative int. Found: -1"),
    ],
)
def test_invalid_state(state: dict[str, Any], message: str) -> None:
    evaluator = ImportanceEvaluator([torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError, match=message):
        evaluator.load_state_dict(state)


def test_true_loss_drop_on_a_quadratic() -> None:
    a = torch.tensor([1.0, -2.0], dtype=torch.float64)
    b = torch.tensor([[3.0]], dtype=torch.float64)

    def loss() -> Tensor:
        return a.square().sum() + 2 * b.square().sum()

    drops = true_loss_drop(loss, [a, b], [torch.tensor([1.0, 1.0], dtype=torch.float64), None])
    # |a|^2 goes from 5 to 4 + 1; b is left alone.
    assert drops.tolist() == [0.0, 0.0]
    drops = true_loss_drop(loss, [a, b], [torch.tensor([-1.0, 1.0], dtype=torch.float64), -b])
    assert drops.tolist() == [4.0, 18.0]
    assert a.tolist() == [1.0, -2.0] and b.tolist() == [[3.0]]
    with pytest.raises(ValueError, match=r"`updates\[0\]` must have the shape of `params\[0\]` \(2,\). Found: \(1,\)"):
        true_loss_drop(loss, [a], [torch.zeros(1)])
    with pytest.raises(ValueError, match=r"one entry per tensor of `params` \(2\). Found: 1"):
        true_loss_drop(loss, [a, b], [None])


def test_the_default_evaluator_holds_no_copy_of_the_weights() -> None:
    """Memory: around each step the "before" evaluator creates no tensor larger than a 64K-element chunk, however
    large the parameters (the other modes keep one copy of each trained tensor for the after-gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in ptrs:
                    self.numel = max(self.numel, t.numel())
            return out

    model = nn.Linear(512, 512, dtype=torch.float32)  # 262144 weights: four chunks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for gradient, largest in (("before", 1 << 16), ("average", 512 * 512)):
        evaluator = ImportanceEvaluator(list(model.parameters()), gradient=gradient)  # type: ignore[arg-type]
        model(torch.ones(2, 512)).square().mean().backward()
        ptrs |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
        with Largest() as mode:
            evaluator.before_step()
            optimizer.step()
            evaluator.after_step()
        optimizer.zero_grad(set_to_none=False)
        assert mode.numel == largest, gradient


def scalar_steps(grads: dict[str, list[float]]) -> ImportanceEvaluator:
    """Plain SGD with lr 1 on scalar tensors given their gradients: each step contributes exactly ``g ** 2``."""
    params = {name: torch.zeros(1, dtype=torch.float64, requires_grad=True) for name in grads}
    optimizer = torch.optim.SGD(params.values(), lr=1.0)
    evaluator = ImportanceEvaluator(list(params.values()))
    for step in range(len(next(iter(grads.values())))):
        for name, param in params.items():
            param.grad = torch.tensor([grads[name][step]], dtype=torch.float64)
        evaluator.before_step()
        optimizer.step()
        evaluator.after_step()
    return evaluator


def test_one_outlier_step_does_not_dominate_the_window() -> None:
    """`steady` contributes 4 at each of five steps, `spiky` 1 at four and 100 at one: a plain mean (the window's
    sum over its count, 24 against 4) ranks `spiky` first on the strength of that one step; the trimmed mean drops
    the largest and the smallest of five values and ranks them by their ordinary steps, 4 against 1."""
    evaluator = scalar_steps({"steady": [2.0] * 5, "spiky": [1.0, 1.0, 10.0, 1.0, 1.0]})
    evaluator.finish()
    plain = [total / count for total, count in zip(evaluator.importance.tolist(), evaluator.counts, strict=True)]
    assert plain == [4.0, 20.8]  # the plain mean would train `spiky` first
    assert evaluator.per_step.tolist() == [4.0, 1.0]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([5.0], 5.0),
        ([1.0, 9.0], 5.0),  # two values: no outlier can be told apart, the mean
        ([1.0, 2.0, 90.0], 2.0),  # three: the median
        ([3.0, -50.0, 1.0, 2.0], 1.5),  # four: the two middle values
        ([float(v) for v in range(1, 20)] + [1000.0], 10.5),  # twenty: two dropped at each end
    ],
)
def test_the_trimmed_mean_against_hand_computed_values(values: list[float], expected: float) -> None:
    window = ImportanceWindow(1)
    for step, value in enumerate(values):  # a negative contribution: a step that raised the loss
        window.add((step, [0], torch.tensor([value], dtype=torch.float64)))
        window.close_step([0])
    assert window.per_step().tolist() == [expected]


def test_the_per_step_values_survive_a_checkpoint_and_old_checkpoints_still_load() -> None:
    evaluator = scalar_steps({"a": [1.0, 1.0, 10.0], "b": [2.0, 2.0, 2.0]})
    state = json.loads(json.dumps(evaluator.state_dict()))
    assert state["per_step"] == [[1.0, 4.0], [1.0, 4.0], [100.0, 4.0]]
    restored = ImportanceEvaluator([torch.zeros(1), torch.zeros(1)])
    restored.load_state_dict(state)
    assert restored.per_step.tolist() == evaluator.per_step.tolist() == [1.0, 4.0]
    assert restored.importance.tolist() == evaluator.importance.tolist() == [102.0, 12.0]
    # A checkpoint of sums alone (before per-step values were kept): each tensor's mean, repeated over its steps.
    old = ImportanceEvaluator([torch.zeros(1), torch.zeros(1)])
    old.load_state_dict({"importance": [102.0, 12.0], "steps": 3, "counts": [3, 2]})
    assert old.per_step.tolist() == [34.0, 6.0] and old.importance.tolist() == [102.0, 12.0]
    with pytest.raises(ValueError, match=r"`state\['per_step'\]` must be a list of rows of 2 numbers or None. Found: "):
        old.load_state_dict({**state, "per_step": [[1.0]]})


def test_a_value_not_measured_again_is_read_fallen_as_much_as_the_measured_tensors_fell() -> None:
    """Hand-computed: each fold multiplies the level by the median of new / aged old values over the tensors measured
    again, leaving out the pinned tensor (3) and every pair that is not positive (tensor 4 measured 0 at first)."""
    latest = LatestImportance.unmeasured(5)
    pinned = [False, False, False, True, False]
    latest.fold({0: 8.0, 1: 6.0, 2: 4.0, 3: 100.0, 4: 0.0}, pinned)  # a window: nothing measured before, level 1
    assert latest.now() == [8.0, 6.0, 4.0, 100.0, 0.0] and latest.level == 1.0
    # Tensors 0, 1 fell to 1/2 and 1/3, the head to 1/100 (left out), tensor 4 from 0 (left out): median 5/12.
    latest.fold({0: 4.0, 1: 2.0, 3: 1.0, 4: 3.0}, pinned)
    assert latest.level == pytest.approx(5 / 12)
    assert latest.now() == pytest.approx([4.0, 2.0, 4.0 * 5 / 12, 1.0, 3.0])
    # Tensor 2, unmeasured since level 1, now reads 4 x 5/12; measured again at 1.0 it sets the fall (ratio 0.6) alone
    # with tensor 1's (2.0 -> 1.0, 0.5): median 0.55, and tensors 0 and 4, not measured, age by it.
    latest.fold({1: 1.0, 2: 1.0}, pinned)
    assert latest.level == pytest.approx(5 / 12 * 0.55)
    assert latest.now() == pytest.approx([4.0 * 0.55, 1.0, 1.0, 1.0 * 0.55, 3.0 * 0.55])
    latest.fold({}, pinned)  # a fold that measured nothing changes nothing
    assert latest.now() == pytest.approx([4.0 * 0.55, 1.0, 1.0, 0.55, 3.0 * 0.55])


def test_the_fall_of_importance_survives_a_checkpoint_and_old_checkpoints_read_their_values_as_of_now() -> None:
    latest = LatestImportance.unmeasured(2)
    latest.fold({0: 4.0, 1: 2.0}, [False, False])
    latest.fold({0: 1.0}, [False, False])
    restored = LatestImportance.unmeasured(2)
    restored.load_state_dict(json.loads(json.dumps(latest.state_dict())))
    assert restored == latest and restored.now() == [1.0, 0.5]
    old = LatestImportance.unmeasured(2)
    old.load_state_dict({"latest": [1.0, 2.0]})  # a checkpoint from before the levels
    old.fold({0: 0.5}, [False, False])
    assert old.now() == [0.5, 1.0]
