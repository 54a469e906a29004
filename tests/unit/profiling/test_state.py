"""Profiling leaves the model exactly as found."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, defaultdict

import torch
from torch import Tensor, nn

from lightning_elastic.profiling import profile


class _Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x)))).mean((2, 3))
        return self.head(self.frozen(h))


def test_profile_leaves_the_model_exactly_as_found() -> None:
    torch.manual_seed(0)
    net = _Stateful()
    net.frozen.requires_grad_(False)
    net.head.eval()  # an odd mode that must survive
    x = torch.randn(4, 3, 10, 10)
    net(x).sum().backward()  # existing gradients and running statistics
    net.head.bias.grad = None
    params = list(net.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    grad_values = [None if g is None else g.clone() for g in grads]
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    buffer_ids = {k: id(v) for k, v in net.named_buffers()}
    modes = [m.training for m in net.modules()]
    rng = torch.get_rng_state()
    py_rng = random.getstate()

    profile(net, lambda: net(x).sum(), repeats=1)

    assert [p.requires_grad for p in params] == flags
    for p, g, v in zip(params, grads, grad_values, strict=True):
        assert p.grad is g
        if v is not None:
            assert torch.equal(p.grad, v)
    for k, v in net.named_buffers():
        assert torch.equal(v, buffers[k]) and id(v) == buffer_ids[k], k
    assert [m.training for m in net.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py_rng


class _Recurrent(nn.Module):
    """Keeps state between calls the way user code does: plain attributes set and updated in `forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 1)
        self.hidden: tuple[Tensor, Tensor] | None = None
        self.calls = 0
        self.total = torch.zeros(1)  # a plain tensor attribute updated in place

    def forward(self, x: Tensor) -> Tensor:
        out, (h, c) = self.lstm(x, self.hidden)
        self.hidden = (h.detach(), c.detach())
        self.calls += 1
        self.total.add_(1.0)
        self.last_input = x  # an attribute that did not exist before
        return self.head(out[:, -1])


def test_profile_leaves_attributes_set_in_forward_as_found() -> None:
    torch.manual_seed(0)
    net = _Recurrent()
    x = torch.randn(2, 5, 4)
    net(x)  # a stored hidden state from an earlier batch
    hidden, total = net.hidden, net.total
    assert hidden is not None
    hidden_values = tuple(t.clone() for t in hidden)
    del net.last_input

    profile(net, lambda: net(x).sum(), repeats=1)

    assert net.hidden is hidden
    assert all(torch.equal(a, b) for a, b in zip(net.hidden, hidden_values, strict=True))
    assert net.calls == 1
    assert net.total is total and torch.equal(net.total, torch.ones(1))
    assert not hasattr(net, "last_input")


class _Collecting(nn.Module):
    """Collects what each call saw in a list, a dict and a set, as a `training_step` collects its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.outputs: list[Tensor] = []
        self.by_shape: dict[tuple[int, ...], int] = {}
        self.seen: set[int] = set()

    def forward(self, x: Tensor) -> Tensor:
        out = self.layer(x)
        self.outputs.append(out.detach())
        self.by_shape[tuple(x.shape)] = self.by_shape.get(tuple(x.shape), 0) + 1
        self.seen.add(len(self.outputs))
        return out


def test_profile_gives_lists_dicts_and_sets_appended_to_in_place_their_items_back() -> None:
    torch.manual_seed(0)
    net = _Collecting()
    x = torch.randn(3, 4)
    net(x)  # the fit's own step, before profiling
    outputs, by_shape, seen = net.outputs, net.by_shape, net.seen
    first = outputs[0]

    profile(net, lambda: net(x).sum(), repeats=1)

    assert net.outputs is outputs and len(outputs) == 1 and outputs[0] is first
    assert net.by_shape is by_shape and by_shape == {(3, 4): 1}
    assert net.seen is seen and seen == {1}


class _Tallies(nn.Module):
    """Keeps tallies in dict subclasses, each updated in place by `forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.counts: Counter[str] = Counter()
        self.ordered: OrderedDict[str, int] = OrderedDict(first=0)
        self.by_call: defaultdict[str, list[int]] = defaultdict(list)

    def forward(self, x: Tensor) -> Tensor:
        self.counts["calls"] += 1
        calls = self.counts["calls"]
        self.ordered[f"call {calls}"] = calls
        self.ordered.move_to_end("first")
        self.by_call[f"call {calls}"].append(calls)
        return self.lin(x)


def test_profile_gives_counters_ordered_and_default_dicts_their_items_back_in_order() -> None:
    """A `Counter` given its items as pairs would count the pairs (`Counter.update`): its counts come back as they
    were, an `OrderedDict` in its order, a `defaultdict` with its factory."""
    net = _Tallies()
    x = torch.randn(3, 4)
    net(x)  # the fit's own step, before profiling
    counts, ordered, by_call = net.counts, net.ordered, net.by_call
    profile(net, lambda: net(x).sum(), repeats=1)
    assert net.counts is counts and type(counts) is Counter and dict(counts) == {"calls": 1}
    assert net.ordered is ordered and list(ordered.items()) == [("call 1", 1), ("first", 0)]
    assert net.by_call is by_call and dict(by_call) == {"call 1": [1]} and by_call.default_factory is list
