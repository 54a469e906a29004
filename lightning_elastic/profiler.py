"""Per-device tensor timing profiler and the time model that the tensor selector optimises.

For every parameter tensor ``i`` (in forward order, index 0 nearest the input) a `TimingProfile` holds

* ``t_dw[i]``: the time to compute tensor ``i``'s own gradient (its share of the weight-gradient kernel
  and of the ``AccumulateGrad`` step);
* ``t_dy[i]``: the time to propagate the output gradient through the op that owns tensor ``i`` down to
  that op's input, plus the parameter-free ops between it and the previous tensor's op, plus the extra
  forward work of recording the autograd graph for those ops;

and predicts the time of one forward+backward pass in which only the tensors of a ``mask`` require grad:
``t_fixed + sum_k mask[k] * t_dw[k] + sum_{i > d} t_dy[i]`` with ``d`` the lowest selected index.

How ``profile(method="measured")`` measures, on the device the model is on:

1. Every backward node is timed by autograd node hooks (``Node.register_prehook`` / ``register_hook``,
   CUDA events on GPU). Each node gets a *level*: the highest forward index among the parameters that
   its gradient inputs depend on. A node is run iff the deepest selected tensor ``d`` is at most its
   level, so the model is exact for "everything above ``d``" selections, also with skip connections and
   attention (other selections are charged as if the ops above ``d`` all ran).
2. Weight-gradient work is separated from input-gradient work by a second pass with the parameters
   frozen and the inputs of the first parametrised modules turned into leaves that require grad, so
   every input-gradient path still runs; nodes are matched between the passes by position.
3. Forward ops are timed with a ``TorchFunctionMode`` with and without graph recording: a frozen
   prefix records no graph and is cheaper, and that saving is charged to the ``t_dy`` of the prefix.
4. Hooks cost time, so the hook-derived model is calibrated against plain, hook-free timings of a few
   "everything above ``d``" selections: the model is rescaled segment by segment to match them.

``method="flops"`` replaces the hooks with an analytic count of each op's backward work (see
`lightning_elastic.flops`), scaled so that the full step matches one plain measured step.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_elastic.flops import default_mem_weight, op_costs, tensors_in

__all__ = ["TimingMethod", "TimingProfile", "profile"]

TimingMethod = Literal["measured", "flops"]

_FORMAT_VERSION = 1
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
_SEGMENTS = 4  # calibration segments: plain timings of 5 selections, each repeated
_MAX_CORRECTION = 3.0  # hooks never mis-measure a segment by more; larger factors are noise
_NOISE_LIMIT = 0.1  # repeated plain timings whose median is this far above their fastest are disturbed ...
_NOISE_ROUNDS = 3  # ... and get up to this many times `repeats` rounds
_Node = Any  # torch.autograd.graph.Node; its C++ subclasses carry no useful static type


@dataclass(frozen=True)
class TimingProfile:
    """Per-tensor timings of one model on one device and the time model built on them.

    Attributes:
        names: parameter names (as ``model.named_parameters()`` gives them) in forward order, index 0
            nearest the input; tied parameters once; only parameters the forward pass uses.
        t_dw: seconds to compute each tensor's own gradient.
        t_dy: seconds to propagate the gradient through the op owning each tensor and the parameter-free
            ops between it and the previous tensor's op (one tensor per op carries it, the others get 0).
            ``t_dy[0]`` is reported as 0: nothing below the first tensor ever needs a gradient.
        t_fw: seconds of a plain forward pass (with the loss) when nothing requires grad.
        t_full: seconds of a plain forward + full backward pass.
        device: where it was measured, e.g. ``"cpu (2 threads)"`` or ``"cuda:0 (NVIDIA H100)"``.
        fingerprint: the cache key (see `profile`).
        unused: parameters that require grad but that the forward pass does not use.
        method: ``"measured"`` or ``"flops"``.
        numel: elements of each tensor.
        t_tail: seconds that every non-empty selection adds to ``t_fw``: backward of the loss and of the
            ops after the last tensor, graph recording of those ops and the autograd engine's start.
        profile_seconds: seconds that measuring this profile took.

    Example:
        >>> p = TimingProfile(names=("a", "b"), t_dw=(2.0, 1.0), t_dy=(0.0, 3.0), t_fw=4.0, t_full=10.0,
        ...                   device="cpu (1 threads)", fingerprint="f", unused=(), method="measured",
        ...                   numel=(10, 10))
        >>> p.predict([True, False]), p.predict([False, True]), p.predict([False, False])
        (9.0, 5.0, 4.0)
    """

    names: tuple[str, ...]
    t_dw: tuple[float, ...]
    t_dy: tuple[float, ...]
    t_fw: float
    t_full: float
    device: str
    fingerprint: str
    unused: tuple[str, ...]
    method: TimingMethod
    numel: tuple[int, ...]
    t_tail: float = 0.0
    profile_seconds: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.names)
        problems = [
            f"`{name}` has {len(getattr(self, name))} entries, `names` has {n}"
            for name in ("t_dw", "t_dy", "numel")
            if len(getattr(self, name)) != n
        ]
        if len(set(self.names)) != n:
            problems.append("`names` must be unique")
        times = {"t_fw": self.t_fw, "t_full": self.t_full, "t_tail": self.t_tail}
        times.update({f"t_dw[{i}]": v for i, v in enumerate(self.t_dw)})
        times.update({f"t_dy[{i}]": v for i, v in enumerate(self.t_dy)})
        problems += [
            f"`{key}` must be a finite number >= 0, got {value!r}"
            for key, value in times.items()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf
        ]
        if self.method not in get_args(TimingMethod):
            problems.append(f"`method` must be one of {get_args(TimingMethod)}, got {self.method!r}")
        if problems:
            raise ValueError("Invalid `TimingProfile`: " + "; ".join(problems) + ".")

    @property
    def t_fixed(self) -> float:
        """Seconds that every non-empty selection pays: the forward pass and the always-paid backward."""
        return self.t_fw + self.t_tail

    def predict(self, mask: Sequence[bool]) -> float:
        """Seconds of one forward+backward pass with only the tensors selected by ``mask`` requiring grad.

        Args:
            mask: one flag per tensor of `names`.

        Returns:
            ``t_fw`` for an empty selection, else ``t_fixed + sum_k mask[k] * t_dw[k] + sum_{i>d} t_dy[i]``.

        Example:
            >>> p = TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,))
            >>> p.predict([True])
            3.0
        """
        if len(mask) != len(self.names):
            raise ValueError(f"`mask` must have one entry per profiled tensor ({len(self.names)}). Found: {len(mask)}")
        selected = [i for i, flag in enumerate(mask) if flag]
        if not selected:
            return self.t_fw
        deepest = selected[0]
        return self.t_fixed + sum(self.t_dw[i] for i in selected) + sum(self.t_dy[deepest + 1 :])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; `from_dict` reads it back.

        Example:
            >>> p = TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,))
            >>> TimingProfile.from_dict(p.to_dict()) == p
            True
        """
        return {
            "version": _FORMAT_VERSION,
            "names": list(self.names),
            "t_dw": list(self.t_dw),
            "t_dy": list(self.t_dy),
            "t_fw": self.t_fw,
            "t_full": self.t_full,
            "t_tail": self.t_tail,
            "device": self.device,
            "fingerprint": self.fingerprint,
            "unused": list(self.unused),
            "method": self.method,
            "numel": list(self.numel),
            "profile_seconds": self.profile_seconds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TimingProfile:
        """Rebuild a profile from `to_dict` output, validating every field.

        Raises:
            ValueError: a field is missing, has the wrong type, or the format version differs.

        Example:
            >>> TimingProfile.from_dict({"version": 0})
            Traceback (most recent call last):
            ...
            ValueError: `data["version"]` must be 1. Found: 0
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"`data` must be a mapping. Found: {type(data).__name__}")
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(f'`data["version"]` must be {_FORMAT_VERSION}. Found: {data.get("version")!r}')
        fields = {
            "names": str,
            "t_dw": float,
            "t_dy": float,
            "unused": str,
            "numel": int,
        }
        kwargs: dict[str, Any] = {}
        for key, kind in fields.items():
            value = data.get(key)
            if not isinstance(value, list) or not all(_is_kind(v, kind) for v in value):
                raise ValueError(f'`data["{key}"]` must be a list of {kind.__name__}. Found: {value!r:.80}')
            kwargs[key] = tuple(float(v) if kind is float else v for v in value)
        for key in ("t_fw", "t_full", "t_tail", "profile_seconds"):
            if not _is_kind(data.get(key), float):
                raise ValueError(f'`data["{key}"]` must be a number. Found: {data.get(key)!r}')
            kwargs[key] = float(data[key])
        for key in ("device", "fingerprint", "method"):
            if not isinstance(data.get(key), str):
                raise ValueError(f'`data["{key}"]` must be a string. Found: {data.get(key)!r}')
            kwargs[key] = data[key]
        return cls(**kwargs)


def _is_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def profile(
    model: nn.Module,
    compute_loss: Callable[[], Tensor],
    *,
    method: TimingMethod = "measured",
    cache_dir: str | os.PathLike[str] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    clock: Callable[[], float] | None = None,
) -> TimingProfile:
    """Measure how long each parameter tensor of ``model`` costs in a training step on its device.

    The model is left exactly as found: ``requires_grad`` flags, ``.grad`` tensors, buffers (BatchNorm
    running statistics), train/eval modes and the global RNG state (torch CPU and CUDA, Python
    ``random``). The optimizer's update is not part of the profile.

    Args:
        model: the module whose parameters requiring grad are profiled (the others stay frozen).
        compute_loss: runs one forward pass on a real batch already on the device and returns the scalar
            loss; it is called about 15-25 times.
        method: ``"measured"`` (hooks + plain timings) or ``"flops"`` (analytic op costs scaled to one
            measured step).
        cache_dir: where profiles are stored as JSON, keyed by a fingerprint of the device (GPU name or
            CPU thread count), torch version, the parameters (names, shapes, dtypes, which require grad),
            the module types in forward order with the shapes and dtypes of their inputs, and ``method``.
            A matching file is reused; a stale, mismatched or corrupt one is reported with a warning and
            replaced by a new measurement.
        warmup: plain training steps run before any timing.
        repeats: plain timings and instrumented passes of each kind; medians are kept.
        clock: seconds counter to use instead of ``time.perf_counter`` (and instead of CUDA events).

    Returns:
        The `TimingProfile`.

    Raises:
        ValueError: unknown ``method``, bad ``warmup``/``repeats``, no parameter requires grad, or
            ``compute_loss`` does not return a scalar that requires grad.
        TypeError: ``model`` is not a module or ``compute_loss`` is not callable.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> x = torch.randn(4, 8)
        >>> prof = profile(net, lambda: net(x).square().mean(), repeats=1)
        >>> prof.names
        ('0.weight', '0.bias', '2.weight', '2.bias')
        >>> prof.predict([False, False, True, True]) <= prof.predict([True] * 4) + 1.0
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module. Found: {type(model).__name__}")
    if not callable(compute_loss):
        raise TypeError(f"`compute_loss` must be callable. Found: {type(compute_loss).__name__}")
    if method not in get_args(TimingMethod):
        raise ValueError(f"`method` must be one of {get_args(TimingMethod)}. Found: {method!r}")
    for arg, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{arg}` must be an int >= {low}. Found: {value!r}")
    candidates = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not candidates:
        raise ValueError("`model` must have at least one parameter that requires grad. Found: none")
    device = candidates[0][1].device
    cuda_devices = sorted({p.device.index or 0 for _, p in candidates if p.device.type == "cuda"})
    state = _ModelState(model)
    try:
        with torch.random.fork_rng(devices=cuda_devices), _python_rng_kept():
            runner = _Runner(model, compute_loss, candidates, _Clock(device, clock))
            start = runner.clock.now()
            fingerprint = _fingerprint(runner.signature(), device, candidates, method)
            path = None if cache_dir is None else Path(cache_dir) / f"timing-{fingerprint[:24]}.json"
            cached = None if path is None else _load_cached(path, fingerprint)
            if cached is not None:
                return cached
            result = runner.run(method, warmup, repeats)
            prof = TimingProfile(
                names=tuple(candidates[c][0] for c in result.order),
                t_dw=tuple(result.t_dw),
                t_dy=tuple(result.t_dy),
                t_fw=result.t_fw,
                t_full=result.t_full,
                device=_device_name(device),
                fingerprint=fingerprint,
                unused=tuple(candidates[c][0] for c in range(len(candidates)) if c not in set(result.order)),
                method=method,
                numel=tuple(candidates[c][1].numel() for c in result.order),
                t_tail=result.t_tail,
                profile_seconds=runner.clock.now() - start,
            )
            if path is not None:
                _store(path, prof)
            return prof
    finally:
        state.restore()


# ----------------------------------------------------------------------------------------------------
# Measurement plumbing


class _Clock:
    """Timestamps on the model's device: an injected clock, ``perf_counter`` or CUDA events."""

    def __init__(self, device: torch.device, clock: Callable[[], float] | None) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._events = self._cuda and clock is None
        self._read = clock if clock is not None else time.perf_counter

    def now(self) -> float:
        """Host seconds, after the device has finished the work queued so far."""
        self.sync()
        return self._read()

    def stamp(self) -> Any:
        """A mark of "now" that works inside hooks without synchronising (a CUDA event on GPU)."""
        if self._events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.now() if self._cuda else self._read()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two stamps (call `sync` first on GPU)."""
        if self._events:
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)

    def sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)


class _ModelState:
    """Snapshot of everything `profile` may disturb, restored bit-exactly."""

    def __init__(self, model: nn.Module) -> None:
        self._params = list(model.parameters())
        self._flags = [p.requires_grad for p in self._params]
        self._grads = [p.grad for p in self._params]
        self._buffers = [
            (module, name, buf, buf.detach().clone())
            for module in model.modules()
            for name, buf in module._buffers.items()
            if buf is not None
        ]
        self._modes = [(module, module.training) for module in model.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, buf, saved in self._buffers:
                module._buffers[name] = buf
                buf.copy_(saved)
        for p, flag, grad in zip(self._params, self._flags, self._grads, strict=True):
            p.requires_grad_(flag)
            p.grad = grad
        for module, mode in self._modes:
            module.training = mode


@contextmanager
def _python_rng_kept() -> Iterator[None]:
    saved = random.getstate()
    try:
        yield
    finally:
        random.setstate(saved)


class _OpRecorder(TorchFunctionMode):
    """Times every torch function call of a forward pass and keeps what it needs about each call."""

    def __init__(self, clock: _Clock, keep: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], Any]) -> None:
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
        start = self._clock.stamp()
        out = func(*args, **kwargs)
        end = self._clock.stamp()
        self.names.append(getattr(func, "__name__", type(func).__name__))
        self.stamps.append((start, end))
        self.kept.append(self._keep(func, args, kwargs, out))
        return out

    def seconds(self) -> list[float]:
        self._clock.sync()
        return [self._clock.seconds(a, b) for a, b in self.stamps]


class _InputLeaves:
    """Turns module inputs that need no gradient into leaves that do, so input-gradient paths run.

    The first use (with every parameter frozen) records where it converted; later uses convert at the
    same call positions, and where a tensor there already requires grad (it depends on a parameter),
    they note its ``grad_fn`` as a data source instead.
    """

    def __init__(self, model: nn.Module) -> None:
        self._modules = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        self.positions: set[tuple[int, int | str]] | None = None

    @contextmanager
    def active(self, recorder: _OpRecorder | None) -> Iterator[tuple[list[Tensor], list[_Node]]]:
        leaves: list[Tensor] = []
        sources: list[_Node] = []
        record = self.positions is None
        positions: set[tuple[int, int | str]] = set() if record else self.positions  # type: ignore[assignment]
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

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            call = next(calls)
            if recorder is not None:
                recorder.paused = True
            try:
                new_args = tuple(convert(call, i, a) for i, a in enumerate(args))
                new_kwargs = {k: convert(call, k, v) for k, v in kwargs.items()}
            finally:
                if recorder is not None:
                    recorder.paused = False
            return new_args, new_kwargs

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self._modules]
        try:
            yield leaves, sources
        finally:
            for handle in handles:
                handle.remove()
            if record:
                self.positions = positions


def _walk(root: _Node) -> list[_Node]:
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
class _Pass:
    """What one instrumented pass saw."""

    op_names: list[str] = field(default_factory=list)
    op_seconds: list[float] = field(default_factory=list)
    op_kept: list[Any] = field(default_factory=list)
    nodes: list[_Node] = field(default_factory=list)  # non-AccumulateGrad nodes by sequence number
    node_seconds: list[float] = field(default_factory=list)
    leaf_nodes: list[_Node] = field(default_factory=list)  # AccumulateGrad nodes
    leaf_seconds: list[float] = field(default_factory=list)
    sources: list[_Node] = field(default_factory=list)


@dataclass
class _Result:
    order: list[int]
    t_dw: list[float]
    t_dy: list[float]
    t_tail: float
    t_fw: float
    t_full: float


class _StructureMismatch(RuntimeError):
    """Two passes that should record the same graph did not.

    Raised for two passes with the same selection: `compute_loss` must run the same ops each time it is
    called (its control flow may depend on the batch, which is fixed, and on seeded randomness only).
    """


class _Runner:
    """Runs the passes of one profile."""

    def __init__(
        self,
        model: nn.Module,
        compute_loss: Callable[[], Tensor],
        candidates: list[tuple[str, nn.Parameter]],
        clock: _Clock,
    ) -> None:
        self.model = model
        self.compute_loss = compute_loss
        self.candidates = candidates
        self.params = [p for _, p in candidates]
        self.all_params = list(model.parameters())
        self.clock = clock
        self.leaves = _InputLeaves(model)

    # -- passes ------------------------------------------------------------------------------------

    def _set_mask(self, mask: Sequence[bool]) -> None:
        """Select the candidates to train; reset every gradient to None as training does.

        Also reseeds the RNGs (restored when `profile` returns), so that every pass draws the same
        dropout masks and takes the same random branches (stochastic depth) and records the same graph.
        """
        for p, flag in zip(self.params, mask, strict=True):
            p.requires_grad_(flag)
        torch.manual_seed(0)
        random.seed(0)
        for p in self.all_params:
            p.grad = None

    def _loss(self) -> Tensor:
        loss = self.compute_loss()
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"`compute_loss` must return a scalar tensor. Found: {shape}")
        return loss

    def plain(self, mask: Sequence[bool]) -> tuple[float, float]:
        """Seconds of the forward and of forward+backward with ``mask`` selected, no instrumentation."""
        self._set_mask(mask)
        start = self.clock.now()
        loss = self._loss()
        mid = self.clock.now()
        if loss.requires_grad:
            loss.backward()
        end = self.clock.now()
        return mid - start, end - start

    def plain_median(self, mask: Sequence[bool], repeats: int) -> tuple[float, float]:
        runs = [self.plain(mask) for _ in range(repeats)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    def signature(self) -> list[Any]:
        """Module types in forward order with the shapes and dtypes of their tensor inputs."""
        calls: list[Any] = []

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            tensors = tensors_in(args) + tensors_in(kwargs)
            calls.append([type(module).__name__, [[list(t.shape), str(t.dtype)] for t in tensors]])

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self.model.modules()]
        try:
            self._set_mask([False] * len(self.params))
            with torch.no_grad():
                self._loss()
        finally:
            for handle in handles:
                handle.remove()
        return calls

    def instrumented(self, kind: Literal["full", "dx", "none"], keep: Callable[..., Any] | None = None) -> _Pass:
        """One pass with forward ops timed and, unless ``kind == "none"``, every backward node timed."""
        self._set_mask([kind == "full"] * len(self.params))
        recorder = _OpRecorder(self.clock, keep or (lambda func, args, kwargs, out: None))
        record = _Pass()
        if kind == "none":
            with recorder:
                self._loss()
        else:
            with self.leaves.active(recorder) as (leaves, sources), recorder:
                loss = self._loss()
            record.sources = sources
            if loss.requires_grad:
                self._timed_backward(loss, record)
            elif kind == "full":
                raise ValueError("`compute_loss` must return a tensor that requires grad. Found: no grad_fn")
            del leaves
        record.op_names = recorder.names
        record.op_seconds = recorder.seconds()
        record.op_kept = recorder.kept
        return record

    def _timed_backward(self, loss: Tensor, record: _Pass) -> None:
        nodes = _walk(loss.grad_fn)
        starts: dict[_Node, Any] = {}
        ends: dict[_Node, Any] = {}
        handles = []
        for node in nodes:
            handles.append(node.register_prehook(lambda grads, node=node: starts.__setitem__(node, self.clock.stamp())))
            handles.append(node.register_hook(lambda gi, go, node=node: ends.__setitem__(node, self.clock.stamp())))
        try:
            loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        self.clock.sync()

        def seconds(node: _Node) -> float:
            return self.clock.seconds(starts[node], ends[node]) if node in ends else 0.0

        ops = sorted((n for n in nodes if n.name() != _ACCUMULATE_GRAD), key=lambda n: n._sequence_nr())
        record.nodes = ops
        record.node_seconds = [seconds(n) for n in ops]
        record.leaf_nodes = [n for n in nodes if n.name() == _ACCUMULATE_GRAD]
        record.leaf_seconds = [seconds(n) for n in record.leaf_nodes]

    # -- the two methods ------------------------------------------------------------------------------

    def run(self, method: TimingMethod, warmup: int, repeats: int) -> _Result:
        n = len(self.params)
        for _ in range(warmup):
            self.plain([True] * n)
        if method == "flops":
            return self._run_flops(repeats)
        return self._run_measured(repeats)

    def _run_measured(self, repeats: int) -> _Result:
        dx_passes = [self.instrumented("dx") for _ in range(repeats)]
        ids = {id(p) for p in self.params}

        def keep(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> _OpGraph:
            inputs = tensors_in(args) + tensors_in(kwargs)
            return _OpGraph(
                outputs=[t.grad_fn for t in tensors_in(out) if t.grad_fn is not None],
                inputs=[t.grad_fn for t in inputs if id(t) not in ids and t.grad_fn is not None],
                params=[id(t) for t in inputs if id(t) in ids],
            )

        full_passes = [self.instrumented("full", keep=keep) for _ in range(repeats)]
        none_passes = [self.instrumented("none") for _ in range(repeats)]
        structure = _Structure(full_passes[0], self.params)
        t_dw, t_dy, t_tail = structure.costs(full_passes, dx_passes, none_passes).model()
        knots = _knots(t_dw, t_dy, _SEGMENTS)
        t_fw, times = self._suffix_times(structure.order, knots, repeats)
        t_dw, t_dy, t_tail = _calibrate(t_fw, t_dw, t_dy, t_tail, list(zip(knots, times, strict=True)))
        return _Result(structure.order, t_dw, t_dy, t_tail, t_fw=t_fw, t_full=times[0])

    def _suffix_times(self, order: list[int], knots: list[int], repeats: int) -> tuple[float, list[float]]:
        """Plain forward time with nothing selected, and step times with tensors ``d..n-1`` selected.

        Rounds interleave the selections so that a slow drift of the machine hits them all alike.
        """
        masks = []
        for d in knots:
            mask = [False] * len(self.params)
            for c in order[d:]:
                mask[c] = True
            masks.append(mask)
        empty: list[float] = []
        steps: list[list[float]] = [[] for _ in knots]
        for rounds in range(1, _NOISE_ROUNDS * repeats + 1):
            empty.append(self.plain([False] * len(self.params))[0])
            for mask, column in zip(masks, steps, strict=True):
                column.append(self.plain(mask)[1])
            noise = max(_noise(column) for column in (empty, *steps))
            if rounds >= repeats and noise <= _NOISE_LIMIT:
                break
        if noise > _NOISE_LIMIT:
            warnings.warn(
                f"Profiling: repeated timings of the same step differ too much (median {noise:.0%} above the fastest, "
                f"after {rounds} rounds): something else is using this device, and the time model may be off. "
                "Profile on a quiet machine, or give more `repeats`.",
                stacklevel=4,
            )
        return statistics.median(empty), [statistics.median(column) for column in steps]

    def _run_flops(self, repeats: int) -> _Result:
        n = len(self.params)
        mem_weight = default_mem_weight(self.params[0].device)
        ids = {id(p) for p in self.params}

        def keep(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            inputs = tensors_in(args) + tensors_in(kwargs)
            params = [t for t in inputs if id(t) in ids]
            costs = op_costs(getattr(func, "__name__", ""), args, kwargs, out, params, mem_weight)
            data_fns = [t.grad_fn for t in inputs if id(t) not in ids and t.grad_fn is not None]
            return costs, data_fns

        self._set_mask([True] * n)
        recorder = _OpRecorder(self.clock, keep)
        with recorder:
            loss = self._loss()
        if not loss.requires_grad:
            raise ValueError("`compute_loss` must return a tensor that requires grad. Found: no grad_fn")
        record = _Pass(op_names=recorder.names, op_kept=recorder.kept)
        record.nodes = sorted(
            (n for n in _walk(loss.grad_fn) if n.name() != _ACCUMULATE_GRAD), key=lambda n: n._sequence_nr()
        )
        record.leaf_nodes = [n for n in _walk(loss.grad_fn) if n.name() == _ACCUMULATE_GRAD]
        structure = _Structure(record, self.params)
        del loss
        t_fw = self.plain_median([False] * n, repeats)[0]
        t_full = self.plain_median([True] * n, repeats)[1]
        raw = structure.flop_costs(record)
        # A backward pass never takes no time; the floor only keeps noise on tiny models from zeroing it.
        scale = max(t_full - t_fw, 1e-9) / max(raw.total(), 1e-30)
        raw.scale(scale)
        return _Result(structure.order, *raw.model(), t_fw=t_fw, t_full=t_full)


@dataclass
class _OpGraph:
    """Where one forward op sits in the autograd graph."""

    outputs: list[_Node]  # grad_fn of its outputs
    inputs: list[_Node]  # grad_fn of its tensor inputs other than the profiled parameters
    params: list[int]  # id() of the profiled parameters among its inputs


# ----------------------------------------------------------------------------------------------------
# From graphs and timings to the time model


@dataclass
class _RawCosts:
    """Costs before they are folded into the time model.

    ``dw[k]`` is tensor ``k``'s weight-gradient time; ``by_level[l + 1]`` the time that is paid iff the
    deepest selected tensor is at most ``l`` (``l = -1``: never paid; ``l = n - 1``: always paid).
    """

    dw: list[float]
    by_level: list[float]

    def total(self) -> float:
        return sum(self.dw) + sum(self.by_level[1:])

    def scale(self, factor: float) -> None:
        self.dw = [v * factor for v in self.dw]
        self.by_level = [v * factor for v in self.by_level]

    def model(self) -> tuple[list[float], list[float], float]:
        """``(t_dw, t_dy, t_tail)``: the cost paid iff ``d <= l`` becomes ``t_dy[l + 1]``."""
        n = len(self.dw)
        t_dy = [0.0] + [max(v, 0.0) for v in self.by_level[1:n]]
        return [max(v, 0.0) for v in self.dw], t_dy, max(self.by_level[n], 0.0)


class _Structure:
    """Forward order of the parameters and the level of every backward node, from one full graph."""

    def __init__(self, record: _Pass, params: list[nn.Parameter]) -> None:
        index = {id(p): c for c, p in enumerate(params)}
        leaf_param = {node: index.get(id(node.variable), -1) for node in record.leaf_nodes}
        first_use: dict[int, int] = {}
        for node in record.nodes:
            for nxt, _ in node.next_functions:
                c = leaf_param.get(nxt, -1)
                if c >= 0:
                    first_use[c] = min(first_use.get(c, node._sequence_nr()), node._sequence_nr())
        self.order = sorted(first_use, key=first_use.__getitem__)
        position = {c: i for i, c in enumerate(self.order)}
        self.n = len(self.order)
        self.numel = [params[c].numel() for c in self.order]
        self.record = record
        sources = set(record.sources)
        # level: highest forward index of the parameters a node's gradient reaches (-1: none);
        # data: whether it reaches a converted input, i.e. also runs when every parameter is frozen.
        self.level: dict[_Node, int] = {}
        self.data: dict[_Node, bool] = {}
        for node, c in leaf_param.items():
            self.level[node] = position.get(c, -1)
            self.data[node] = c < 0
        for node in record.nodes:  # inputs are created, hence numbered, before the ops that use them
            nexts = [nxt for nxt, _ in node.next_functions if nxt is not None]
            self.level[node] = max((self.level.get(nxt, -1) for nxt in nexts), default=-1)
            self.data[node] = any(self.data.get(nxt, False) or nxt in sources for nxt in nexts)
        self._owners_memo: dict[_Node, dict[int, float]] = {}
        self._position = {node: position[c] for node, c in leaf_param.items() if c in position}
        self._by_id = {id(params[c]): k for c, k in position.items()}
        self.sources = sources

    def _is_data_edge(self, node: _Node) -> bool:
        return self.data.get(node, False) or node in self.sources

    def owners(self, node: _Node) -> dict[int, float]:
        """Forward positions of the parameters that a parameter-only subgraph reaches, numel-weighted."""
        if node in self._owners_memo:
            return self._owners_memo[node]
        if node in self._position:
            found = {self._position[node]: 1.0}
        else:
            found = {}
            for nxt, _ in node.next_functions:
                if nxt is not None and not self._is_data_edge(nxt):
                    found.update(self.owners(nxt))
        self._owners_memo[node] = found
        return found

    def _split(self, owners: Mapping[int, float]) -> dict[int, float]:
        total = sum(self.numel[k] for k in owners)
        return {k: self.numel[k] / total for k in owners}

    def dx_level(self, node: _Node) -> int:
        return max(
            (self.level[nxt] for nxt, _ in node.next_functions if nxt is not None and self._is_data_edge(nxt)),
            default=-1,
        )

    def costs(self, full: list[_Pass], dx: list[_Pass], none: list[_Pass]) -> _RawCosts:
        """Median node and op times of the instrumented passes, turned into raw costs."""
        names = [n.name() for n in self.record.nodes]
        full_seconds = _aligned_median(names, full, lambda p: ([n.name() for n in p.nodes], p.node_seconds))
        data_nodes = [n for n in self.record.nodes if self.data[n]]
        data_names = [n.name() for n in data_nodes]
        full_data = [t for n, t in zip(self.record.nodes, full_seconds, strict=True) if self.data[n]]
        try:
            dx_list = _aligned_median(data_names, dx, lambda p: ([n.name() for n in p.nodes], p.node_seconds))
        except _StructureMismatch:
            # Some ops take another route when their parameters are frozen (matmul folds differently, a
            # parameter's expand disappears): line the two graphs up where they agree.
            dx_list = [
                statistics.median(column)
                for column in zip(
                    *(_matched([n.name() for n in p.nodes], p.node_seconds, data_names, full_data) for p in dx),
                    strict=True,
                )
            ]
        dx_seconds = dict(zip(data_nodes, dx_list, strict=True))
        raw = _RawCosts(dw=[0.0] * self.n, by_level=[0.0] * (self.n + 1))
        for node, seconds in zip(self.record.nodes, full_seconds, strict=True):
            if self.data[node]:
                level = self.dx_level(node)
                raw.by_level[level + 1] += dx_seconds[node]
                owners: dict[int, float] = {}
                for nxt, _ in node.next_functions:
                    if nxt is not None and not self._is_data_edge(nxt):
                        owners.update(self.owners(nxt))
                extra = seconds - dx_seconds[node]
                if owners:
                    for k, share in self._split(owners).items():
                        raw.dw[k] += extra * share
                else:
                    raw.by_level[level + 1] += extra
            else:
                for k, share in self._split(self.owners(node)).items():
                    raw.dw[k] += seconds * share
        leaf_seconds = [statistics.median(v) for v in zip(*(p.leaf_seconds for p in full), strict=True)]
        for node, seconds in zip(self.record.leaf_nodes, leaf_seconds, strict=True):
            if node in self._position:
                raw.dw[self._position[node]] += seconds
        self._forward_costs(full, dx, none, raw)
        return raw

    def _forward_costs(self, full: list[_Pass], dx: list[_Pass], none: list[_Pass], raw: _RawCosts) -> None:
        """Charge the forward work that graph recording adds.

        An op costs ``none`` when nothing it reads requires grad, ``dx`` when its input does (paid iff the
        deepest selected tensor is at most the input's level) and ``full`` when its parameters do too
        (the difference is paid iff those parameters are selected: part of their ``t_dw``).
        """
        names = self.record.op_names
        try:
            t_full = _aligned_median(names, full, lambda p: (p.op_names, p.op_seconds))
            t_dx = _aligned_median(names, dx, lambda p: (p.op_names, p.op_seconds))
            t_none = _aligned_median(names, none, lambda p: (p.op_names, p.op_seconds))
        except _StructureMismatch as err:
            warnings.warn(
                f"The forward pass runs different ops when nothing requires grad ({err}); the cost of "
                "recording the graph is left to the calibration against plain timings.",
                stacklevel=4,
            )
            return
        for op, a, b, c in zip(self.record.op_kept, t_full, t_dx, t_none, strict=True):
            out_levels = [self.level[node] for node in op.outputs if node in self.level]
            if not out_levels:
                continue  # recorded nothing that the loss depends on
            in_level = max((self.level.get(node, -1) for node in op.inputs), default=-1)
            raw.by_level[in_level + 1] += b - c
            owners = {self._by_id[i]: 1.0 for i in op.params if i in self._by_id}
            for node in op.inputs:
                if node in self.level and not self._is_data_edge(node):
                    owners.update(self.owners(node))
            if owners:
                for k, share in self._split(owners).items():
                    raw.dw[k] += (a - b) * share
            else:
                raw.by_level[max(out_levels) + 1] += a - b

    def flop_costs(self, record: _Pass) -> _RawCosts:
        """Analytic costs of the ops of ``record`` (kept by `_Runner._run_flops`)."""
        raw = _RawCosts(dw=[0.0] * self.n, by_level=[0.0] * (self.n + 1))
        for costs, data_fns in record.op_kept:
            level = max((self.level.get(node, -1) for node in data_fns), default=-1)
            raw.by_level[level + 1] += costs.dx
            for param_id, value in costs.dw.items():
                if param_id in self._by_id:
                    raw.dw[self._by_id[param_id]] += value
        return raw


def _aligned_median(
    names: list[str], passes: list[_Pass], get: Callable[[_Pass], tuple[list[str], list[float]]]
) -> list[float]:
    """Per-position median over passes whose sequences of names equal ``names``."""
    columns = []
    for record in passes:
        got_names, seconds = get(record)
        if got_names != names:
            first = next(i for i, pair in enumerate(itertools.zip_longest(got_names, names)) if pair[0] != pair[1])
            raise _StructureMismatch(
                f"{len(got_names)} vs {len(names)} entries, first difference at {first}: "
                + " vs ".join(repr(seq[first]) if first < len(seq) else "end" for seq in (got_names, names))
            )
        columns.append(seconds)
    return [statistics.median(values) for values in zip(*columns, strict=True)] if names else []


def _matched(
    got_names: Sequence[str], got_seconds: Sequence[float], names: Sequence[str], reference: Sequence[float]
) -> list[float]:
    """The seconds of a pass over a graph that differs from ``names``, put on the positions of ``names``.

    Runs of nodes that the two sequences share take their own times; a run of ``names`` that the pass did
    differently shares the time the pass spent on its replacement, in proportion to ``reference`` (times of
    the same positions measured elsewhere); work the pass did with no counterpart goes to the position before.
    """
    seconds = [0.0] * len(names)
    if not names:
        return seconds
    matcher = difflib.SequenceMatcher(None, list(names), list(got_names), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            seconds[i1:i2] = got_seconds[j1:j2]
        elif i1 == i2:
            seconds[max(i1 - 1, 0)] += sum(got_seconds[j1:j2])
        else:
            spent, weights = sum(got_seconds[j1:j2]), reference[i1:i2]
            total = sum(weights)
            for i, weight in zip(range(i1, i2), weights, strict=True):
                seconds[i] += spent * (weight / total if total > 0 else 1 / (i2 - i1))
    return seconds


def _noise(seconds: Sequence[float]) -> float:
    """How far the median of repeated timings lies above the fastest: other work on the device only adds time."""
    fastest = min(seconds)
    return statistics.median(seconds) / fastest - 1.0 if fastest > 0 else 0.0


def _suffix_cost(t_dw: Sequence[float], t_dy: Sequence[float], d: int) -> float:
    """Backward cost (tail excluded) of selecting tensors ``d..n-1``."""
    return sum(t_dw[d:]) + sum(t_dy[d + 1 :])


def _knots(t_dw: Sequence[float], t_dy: Sequence[float], segments: int) -> list[int]:
    """Deepest indices ``0 = d_0 < ... < d_m = n - 1`` that cut the backward cost into equal segments."""
    n = len(t_dw)
    total = _suffix_cost(t_dw, t_dy, 0)
    knots = [0]
    for j in range(segments - 1, 0, -1):
        target = total * j / segments
        d = max((i for i in range(n) if _suffix_cost(t_dw, t_dy, i) >= target), default=0)
        if knots[-1] < d < n - 1:
            knots.append(d)
    if knots[-1] != n - 1:
        knots.append(n - 1)
    return knots


def _calibrate(
    t_fw: float,
    t_dw: Sequence[float],
    t_dy: Sequence[float],
    t_tail: float,
    suffix_times: Sequence[tuple[int, float]],
) -> tuple[list[float], list[float], float]:
    """Rescale hook-derived costs so that the model reproduces plain timings.

    ``suffix_times`` holds ``(d, seconds)`` of plain steps with tensors ``d..n-1`` selected, for
    ``d = d_0 = 0 < d_1 < ... < d_m = n - 1``. The tail absorbs the error at ``d_m``; between two
    neighbouring ``d`` the tensors' ``t_dw`` and ``t_dy`` are scaled by one factor so that the
    difference of the two predictions equals the measured one. Hook overhead, autograd engine
    overhead and cache effects that the hooks cannot see are thus charged where they occur.
    """
    dw, dy = list(t_dw), list(t_dy)
    points = sorted(suffix_times)
    last, last_time = points[-1]
    tail = max(t_tail + last_time - (t_fw + t_tail + dw[last] + sum(dy[last + 1 :])), 0.0)
    for (lo, lo_time), (hi, hi_time) in itertools.pairwise(points):
        predicted = sum(dw[lo:hi]) + sum(dy[lo + 1 : hi + 1])
        measured = lo_time - hi_time
        if predicted <= 0.0:
            dy[lo + 1] += max(measured, 0.0)
            continue
        factor = min(max(measured / predicted, 1 / _MAX_CORRECTION), _MAX_CORRECTION)
        dw[lo:hi] = [v * factor for v in dw[lo:hi]]
        dy[lo + 1 : hi + 1] = [v * factor for v in dy[lo + 1 : hi + 1]]
    return dw, dy, tail


# ----------------------------------------------------------------------------------------------------
# Fingerprint and cache


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})"
    return str(device)


def _fingerprint(
    signature: list[Any], device: torch.device, candidates: list[tuple[str, nn.Parameter]], method: str
) -> str:
    payload = {
        "version": _FORMAT_VERSION,
        "device": _device_name(device),
        "torch": torch.__version__,
        "method": method,
        "params": [[name, list(p.shape), str(p.dtype)] for name, p in candidates],
        "calls": signature,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _load_cached(path: Path, fingerprint: str) -> TimingProfile | None:
    """The cached profile at ``path`` if it is current; else None, with a warning for a bad file."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        warnings.warn(f"Timing profile cache {path} is corrupt ({err}); measuring again.", stacklevel=3)
        return None
    if not isinstance(data, dict) or data.get("version") != _FORMAT_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        warnings.warn(
            f"Timing profile cache {path} is stale (format version {found!r}, expected {_FORMAT_VERSION}); "
            "measuring again.",
            stacklevel=3,
        )
        return None
    if data.get("fingerprint") != fingerprint:
        warnings.warn(
            f"Timing profile cache {path} does not match this model, device and input (fingerprint "
            f"{str(data.get('fingerprint'))[:12]}..., expected {fingerprint[:12]}...); measuring again.",
            stacklevel=3,
        )
        return None
    try:
        return TimingProfile.from_dict(data)
    except ValueError as err:
        warnings.warn(f"Timing profile cache {path} is corrupt ({err}); measuring again.", stacklevel=3)
        return None


def _store(path: Path, prof: TimingProfile) -> None:
    """Write atomically: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(prof.to_dict(), handle, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
