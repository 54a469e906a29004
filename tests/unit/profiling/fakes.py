"""A simulated device (ops that advance a fake clock by known amounts) and a small real model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

# ----------------------------------------------------------------------------------------------------
# A simulated device: ops that advance a fake clock by known amounts in forward and backward


class FakeClock:
    """A clock that only moves when simulated work runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Work(torch.autograd.Function):
    """``x * w`` whose forward, input-gradient and weight-gradient work cost known simulated time."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, clock: FakeClock, costs: tuple[float, float, float]) -> Tensor:
        clock.advance(costs[0])
        ctx.save_for_backward(x, w)
        ctx.clock, ctx.costs = clock, costs
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            ctx.clock.advance(ctx.costs[1])
            grad_x = grad * w
        if ctx.needs_input_grad[1]:
            ctx.clock.advance(ctx.costs[2])
            grad_w = (grad * x).sum(0)
        return grad_x, grad_w, None, None


class FakeLayer(nn.Module):
    """A layer with costs ``(forward, dx, dw)`` in simulated seconds."""

    def __init__(self, clock: FakeClock, costs: tuple[float, float, float]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.clock, self.costs = clock, costs

    def forward(self, x: Tensor) -> Tensor:
        return Work.apply(x, self.weight, self.clock, self.costs)


class FakeResidual(nn.Module):
    """``out(a(h) + c(b(h)))`` with ``h = stem(x)``: a skip connection over simulated layers."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.stem = FakeLayer(clock, (1.0, 2.0, 3.0))
        self.a = FakeLayer(clock, (1.0, 4.0, 1.0))
        self.b = FakeLayer(clock, (2.0, 1.5, 2.5))
        self.c = FakeLayer(clock, (1.0, 0.25, 0.75))
        self.out = FakeLayer(clock, (0.5, 3.0, 0.5))

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        return self.out(self.a(h) + self.c(self.b(h)))


def simulated_step(
    model: nn.Module, loss_fn: Callable[[], Tensor], clock: FakeClock, mask: Sequence[bool], names: Sequence[str]
) -> float:
    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(False)
        p.grad = None
    for name, flag in zip(names, mask, strict=True):
        params[name].requires_grad_(flag)
    start = clock()
    loss = loss_fn()
    if loss.requires_grad:
        loss.backward()
    return clock() - start


def small() -> tuple[nn.Module, Callable[[], Tensor]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    return net, lambda: net(x).square().mean()
