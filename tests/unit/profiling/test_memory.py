"""What profiling's passes hold on top of the caller's step (docs/memory.md): exact counts, not resident sets."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_elastic.profiling import profile
from lightning_elastic.profiling.graph import Pass
from lightning_elastic.profiling.runner import Runner
from tests.unit.profiling.fakes import FakeClock


class Net(nn.Module):
    """Three layers; `saved` holds a weak reference to each forward's hidden activation (saved for backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.saved: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.a(x))
        self.saved.append(weakref.ref(h))
        return self.c(torch.relu(self.b(h)))


def first_step(net: Net, x: Tensor) -> list[Tensor]:
    """The caller's step has run its backward pass: its gradients are held while profiling runs."""
    net(x).square().mean().backward()
    net.saved.clear()
    return [p.grad for p in net.parameters() if p.grad is not None]


def grad_bytes(params: list[nn.Parameter]) -> int:
    return sum(p.grad.nbytes for p in params if p.grad is not None)


def test_a_pass_holds_no_second_set_of_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the end of every pass's backward (its gradients' peak) no gradient of its own is held: only the step's."""
    net, x = Net(), torch.randn(8, 16)
    held = first_step(net, x)
    after_backward: list[int] = []
    for name in ("plain", "instrumented"):
        original = getattr(Runner, name)

        def counted(self: Runner, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            out = _original(self, *args, **kwargs)
            after_backward.append(grad_bytes(self.params))
            return out

        monkeypatch.setattr(Runner, name, counted)
    profile(net, lambda: net(x).square().mean(), clock=FakeClock())
    assert len(after_backward) > 5 and after_backward == [0] * len(after_backward)  # before the fix: every param's
    assert [p.grad for p in net.parameters()] == held  # the step's own, the same tensors, given back


def test_the_records_keep_no_input_and_only_the_graph_attribution_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input leaves (module inputs that need no gradient, made leaves that do) are freed with their gradients once
    a pass has run, and only a full pass's record keeps its autograd nodes."""
    net, x = Net(), torch.randn(8, 16)
    records: list[tuple[str, Pass]] = []
    original = Runner.instrumented

    def kept(self: Runner, kind: Any, keep: Any = None) -> Pass:
        record = original(self, kind, keep)
        records.append((kind, record))
        return record

    monkeypatch.setattr(Runner, "instrumented", kept)
    profile(net, lambda: net(x).square().mean(), clock=FakeClock())
    assert [kind for kind, _ in records] == ["dx", "full", "none"]
    for kind, record in records:
        assert bool(record.nodes) == bool(record.leaf_nodes) == (kind == "full")
        assert len(record.node_names) == len(record.node_seconds)
        inputs = [node.variable for node in record.leaf_nodes if not isinstance(node.variable, nn.Parameter)]
        assert len(inputs) == (kind == "full")  # x, turned into a leaf
        assert [(t.numel(), t.grad) for t in inputs] == [(0, None)] * len(inputs)  # before: 8 x 16, and its grad


@pytest.mark.parametrize("method", ["measured", "flops"])
def test_no_recorded_graph_holds_activations_during_the_plain_timings(
    monkeypatch: pytest.MonkeyPatch, method: Any
) -> None:
    """The "flops" method records a forward pass without running its backward: its graph holds every saved
    activation, released before the plain timings run (before the fix, until profiling ended)."""
    net, x = Net(), torch.randn(8, 16)
    alive: list[int] = []
    original = Runner.plain

    def plain(self: Runner, mask: Any) -> tuple[float, float]:
        alive.append(sum(ref() is not None for ref in net.saved))
        return original(self, mask)

    monkeypatch.setattr(Runner, "plain", plain)
    profile(net, lambda: net(x).square().mean(), method=method, clock=FakeClock())
    assert alive and alive == [0] * len(alive)
