"""Recording a forward pass op by op and walking the autograd graph it builds."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_elastic.profiling.flops import tensors_in
from lightning_elastic.timing import DeviceClock

ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"

Node = Any  # torch.autograd.graph.Node; its C++ subclasses carry no useful static type


class OpRecorder(TorchFunctionMode):
    """Times every torch function call of a forward pass (with a `clock`; none: nothing timed) and keeps what it needs
    about each call."""

    def __init__(
        self, clock: DeviceClock | None, keep: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], Any]
    ) -> None:
        super().__init__()
        self._clock = clock
        self._keep = keep
        self.paused = False
        self.names: list[str] = []
        self.stamps: list[tuple[Any, Any]] = []
        self.kept: list[Any] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if self._clock is None:
            out = func(*args, **kwargs)
        else:
            start = self._clock.stamp()
            out = func(*args, **kwargs)
            self.stamps.append((start, self._clock.stamp()))
        self.names.append(getattr(func, "__name__", type(func).__name__))
        self.kept.append(self._keep(func, args, kwargs, out))
        return out

    def seconds(self) -> list[float]:
        if self._clock is None:
            return []
        self._clock.sync()
        return [self._clock.seconds(a, b) for a, b in self.stamps]


class InputLeaves:
    """Turns module inputs that need no gradient into leaves that do, so input-gradient paths run.

    The first use (with every parameter frozen) records where it converted; later uses convert at the
    same call positions, and where a tensor there already requires grad (it depends on a parameter),
    they note its ``grad_fn`` as a data source instead.
    """

    def __init__(self, model: nn.Module) -> None:
        self._modules = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        self.positions: set[tuple[int, int | str]] | None = None

    @contextmanager
    def active(self, recorder: OpRecorder | None) -> Iterator[tuple[list[Tensor], list[Node]]]:
        """Convert inputs while the block runs: the forward pass, and the backward pass that follows it.

        A backward pass that recomputes forward segments (gradient checkpointing) converts the recomputed inputs
        of the modules whose inputs the forward pass converted, so that the recomputation saves the same tensors.
        """
        leaves: list[Tensor] = []
        sources: list[Node] = []
        record = self.positions is None
        positions: set[tuple[int, int | str]] = set() if record else self.positions  # type: ignore[assignment]
        converted: set[tuple[int, int | str]] = set()  # (id(module), argument) converted in the forward pass
        calls = itertools.count()

        def convert(call: int, key: int | str, value: Any) -> Any:
            if not isinstance(value, Tensor) or not value.is_floating_point():
                return value
            if record:
                if value.requires_grad:
                    return value
                positions.add((call, key))
            elif (call, key) not in positions:
                return value
            if value.requires_grad:
                sources.append(value.grad_fn)
                return value
            leaf = value.detach().requires_grad_()
            leaves.append(leaf)
            return leaf

        def recomputed(value: Any) -> Any:
            if isinstance(value, Tensor) and value.is_floating_point() and not value.requires_grad:
                return value.detach().requires_grad_()
            return value

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if torch._C._current_autograd_node() is not None:  # a recomputation inside the backward pass
                new_args = tuple(recomputed(a) if (id(module), i) in converted else a for i, a in enumerate(args))
                new_kwargs = {k: recomputed(v) if (id(module), k) in converted else v for k, v in kwargs.items()}
                return new_args, new_kwargs
            call = next(calls)
            if recorder is not None:
                recorder.paused = True
            try:
                new_args = tuple(convert(call, i, a) for i, a in enumerate(args))
                new_kwargs = {k: convert(call, k, v) for k, v in kwargs.items()}
            finally:
                if recorder is not None:
                    recorder.paused = False
            converted.update((id(module), i) for i, (a, b) in enumerate(zip(args, new_args, strict=True)) if a is not b)
            converted.update((id(module), k) for k, v in new_kwargs.items() if v is not kwargs[k])
            return new_args, new_kwargs

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self._modules]
        try:
            yield leaves, sources
        finally:
            for handle in handles:
                handle.remove()
            if record:
                self.positions = positions


def walk(root: Node) -> list[Node]:
    """Every node reachable from ``root``, in an order fixed by the graph's structure alone.

    Iterative (graphs can be deeper than the recursion limit). The order must not depend on where nodes live in
    memory: callers sort by sequence number, and nodes that share one (several outputs of one op) keep this
    order, so that passes over the same graph line up position by position.
    """
    seen = {root}
    found = [root]
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                found.append(nxt)
                stack.append(nxt)
    return found


@dataclass
class Pass:
    """What one instrumented pass saw."""

    op_names: list[str] = field(default_factory=list)
    op_seconds: list[float] = field(default_factory=list)
    op_kept: list[Any] = field(default_factory=list)
    node_names: list[str] = field(default_factory=list)  # non-AccumulateGrad nodes by sequence number
    node_seconds: list[float] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)  # those nodes, kept only by a pass whose graph attribution walks
    leaf_nodes: list[Node] = field(default_factory=list)  # AccumulateGrad nodes (idem)
    leaf_seconds: list[float] = field(default_factory=list)
    sources: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class StepBackward:
    """The backward pass of a training step that just ran, as a profile keyed by its `StepSignature` takes it
    (`first_step.FirstStep`): its seconds on the profiler's clock, and the ``id()`` of every parameter it computed a
    gradient for (`runner.profile` refuses one the graph walked from the loss does not show)."""

    seconds: float
    received: frozenset[int]


class BackwardRecorder:
    """Times one backward pass on `clock` and notes the parameters it accumulates a gradient into."""

    def __init__(self, clock: DeviceClock, params: list[nn.Parameter]) -> None:
        self._clock, self._received = clock, set[int]()
        self._handles = [p.register_post_accumulate_grad_hook(lambda p: self._received.add(id(p))) for p in params]
        self._start = clock.stamp()

    def stop(self) -> StepBackward:
        """The backward pass ended: what it did (the hooks removed, also when reading the clock fails)."""
        try:
            seconds = self._clock.seconds(self._start, self._clock.stamp())
        finally:
            self.cancel()
        return StepBackward(seconds, frozenset(self._received))

    def cancel(self) -> None:
        """Remove the hooks; nothing is timed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass
class OpGraph:
    """Where one forward op sits in the autograd graph."""

    outputs: list[Node]  # grad_fn of its outputs
    inputs: list[Node]  # grad_fn of its tensor inputs other than the profiled parameters
    params: list[int]  # id() of the profiled parameters among its inputs


class StepSignature:
    """Records, while one forward and backward pass runs, what a profile's cache key covers beyond the parameters.

    ``calls``: module types in forward order with the shapes and dtypes of their tensor inputs; ``graph``: the
    autograd node types of the backward graph in structural order (a changed functional op, a
    ``CheckpointFunctionBackward``); ``recomputed``: the module calls that backward makes again (gradient
    checkpointing recomputes its segments' forward, whatever its implementation). The profiler's own fingerprint
    pass and the fit's first training step (`first_step.FirstStep`) record it alike: hooks on every module from
    construction until `close`, and the loss's `grad_fn` between the forward pass and the backward pass.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        >>> recorder = StepSignature(net)
        >>> loss = net(torch.ones(1, 3)).sum()
        >>> recorder.loss(loss.grad_fn); loss.backward(); recorder.close()
        >>> recorder.signature()["calls"][1], recorder.signature()["recomputed"]
        (['Linear', [[[1, 3], 'torch.float32']]], [])
    """

    def __init__(self, model: nn.Module) -> None:
        self._calls: list[Any] = []
        self._forward: list[Any] | None = None
        self._graph: list[str] = []
        self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in model.modules()]

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = tensors_in(args) + tensors_in(kwargs)
        self._calls.append([type(module).__name__, [[list(t.shape), str(t.dtype)] for t in tensors]])

    def loss(self, root: Node | None) -> None:
        """The forward pass ended with a loss whose grad_fn is ``root``: its graph, and the calls so far as the
        forward ones."""
        self._forward = list(self._calls)
        self._graph = [node.name() for node in walk(root)] if root is not None else []

    @property
    def complete(self) -> bool:
        """Whether a forward pass reached its loss (a step may end early: `training_step` returned None)."""
        return self._forward is not None

    def close(self) -> None:
        """Remove the hooks (after the backward pass, so that its recomputed calls are in)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def signature(self) -> dict[str, Any]:
        forward = self._forward if self._forward is not None else list(self._calls)
        return {"calls": forward, "graph": self._graph, "recomputed": self._calls[len(forward) :]}
