"""`profile` itself: the passes of one profile, by hooks (``"measured"``) or op counts (``"flops"``)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from lightning_elastic.profiling.attribution import Structure
from lightning_elastic.profiling.calibration import SEGMENTS, calibrate, calibration_knots, suffix_times
from lightning_elastic.profiling.flops import default_mem_weight, op_costs, tensors_in
from lightning_elastic.profiling.graph import (
    ACCUMULATE_GRAD,
    InputLeaves,
    Node,
    OpGraph,
    OpRecorder,
    Pass,
    StepSignature,
    walk,
)
from lightning_elastic.profiling.profile import TimingMethod, TimingProfile, cache_key, device_name, load_cached, store
from lightning_elastic.profiling.state import ModelState, python_rng_kept
from lightning_elastic.timing import DeviceClock

__all__ = ["Progress", "fingerprint", "profile"]

Progress = Callable[[int, int, str], None]  # phase k of n starts, doing `what`
PHASES = 3

def profile(
    model: nn.Module,
    compute_loss: Callable[[], Tensor],
    *,
    method: TimingMethod = "measured",
    cache_dir: str | os.PathLike[str] | None = None,
    warmup: int = 0,
    repeats: int = 1,
    clock: Callable[[], float] | None = None,
    progress: Progress | None = None,
    signature: Mapping[str, Any] | None = None,
) -> TimingProfile:
    """Measure how long each parameter tensor of ``model`` costs in a training step on its device.

    The model is left exactly as found: ``requires_grad`` flags, ``.grad`` tensors, buffers (BatchNorm
    running statistics), train/eval modes, every other attribute of its submodules (state that ``forward``
    keeps, such as an RNN's stored hidden state) and the global RNG state (torch CPU and CUDA, Python
    ``random``). The optimizer's update is not part of the profile.

    Args:
        model: the module whose parameters requiring grad are profiled (the others stay frozen).
        compute_loss: runs one forward pass on a real batch already on the device and returns the scalar
            loss; it is called about 11 times (more when timings are disturbed, see ``repeats``).
        method: ``"measured"`` (hooks + plain timings) or ``"flops"`` (analytic op costs scaled to one
            measured step).
        cache_dir: where profiles are stored as JSON, keyed by a fingerprint of the device (GPU name or
            CPU thread count), torch version, the parameters (names, shapes, dtypes, which require grad),
            the module types in forward order with the shapes and dtypes of their inputs, the autograd
            graph of the step (node types: functional ops and gradient checkpointing change it), the
            module calls that backward recomputes, and ``method``. A matching file is reused; a stale,
            mismatched or corrupt one is reported with a warning and replaced by a new measurement.
        warmup: plain training steps run before any timing, beyond the forward and backward pass that takes the
            fingerprint (which warms up the device too).
        repeats: instrumented passes of each kind, and rounds of plain timings that calibrate them; medians are
            kept. A round counts when the plain forward passes timed around it agree; rounds that do not (another
            process used the device) are left out and replaced, up to three times as many rounds in all. A first
            profile costs about 7-8 full training steps with the defaults on a quiet device (breakdown and the time
            model's accuracy in docs/time_model.md), about 4 more per disturbed round; ``warmup=1, repeats=3`` was
            the earlier default, about 20.
        clock: seconds counter to use instead of ``time.perf_counter`` (and instead of CUDA events).
        progress: called as each phase starts with ``(k, n, what)``: phase ``k`` of ``n`` (1: the fingerprint,
            which a cached profile ends with; 2: the instrumented or op-counting passes; 3: the plain timings).
        signature: the step's `StepSignature`, recorded by the caller on a training step that just ran on the same
            batch (the fit's first, `harness.FirstStep`): then profiling takes no fingerprint pass of its own, and
            that step was the device's warm-up. Its backward graph must be the one of every candidate trained.

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
    if method not in get_args(TimingMethod):
        raise ValueError(f"`method` must be one of {get_args(TimingMethod)}. Found: {method!r}")
    for arg, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{arg}` must be an int >= {low}. Found: {value!r}")
    with _kept_as_found(model, compute_loss, clock) as runner:
        start = runner.clock.now()
        runner.progress = progress or runner.progress
        if signature is None:
            runner.progress(1, PHASES, "the step's fingerprint (one forward and backward pass)")
            fingerprint = runner.fingerprint(method)
        else:
            fingerprint = cache_key(signature, runner.device, runner.candidates, method)
        path = None if cache_dir is None else Path(cache_dir) / f"timing-{fingerprint[:24]}.json"
        cached = None if path is None else load_cached(path, fingerprint)
        if cached is not None:
            return cached
        result = runner.run(method, warmup, repeats)
        candidates = runner.candidates
        prof = TimingProfile(
            names=tuple(candidates[c][0] for c in result.order),
            t_dw=tuple(result.t_dw),
            t_dy=tuple(result.t_dy),
            t_fw=result.t_fw,
            t_full=result.t_full,
            device=device_name(runner.device),
            fingerprint=fingerprint,
            unused=tuple(candidates[c][0] for c in range(len(candidates)) if c not in set(result.order)),
            method=method,
            numel=tuple(candidates[c][1].numel() for c in result.order),
            t_tail=result.t_tail,
            profile_seconds=runner.clock.now() - start,
        )
        if path is not None:
            store(path, prof)
        return prof


def fingerprint(model: nn.Module, compute_loss: Callable[[], Tensor], method: TimingMethod) -> str:
    """The fingerprint `profile` would give this model and step now (one forward and backward pass, nothing timed).

    A `TimingProfile` whose ``fingerprint`` differs was taken of another model, step, device or input.
    """
    with _kept_as_found(model, compute_loss, None) as runner:
        return runner.fingerprint(method)


@contextmanager
def _kept_as_found(
    model: nn.Module, compute_loss: Callable[[], Tensor], clock: Callable[[], float] | None
) -> Iterator[Runner]:
    """A `Runner` for ``model``, which is left exactly as found afterwards (see `profile`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module. Found: {type(model).__name__}")
    if not callable(compute_loss):
        raise TypeError(f"`compute_loss` must be callable. Found: {type(compute_loss).__name__}")
    candidates = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not candidates:
        raise ValueError("`model` must have at least one parameter that requires grad. Found: none")
    device = candidates[0][1].device
    cuda_devices = sorted({p.device.index or 0 for _, p in candidates if p.device.type == "cuda"})
    state = ModelState(model)
    # The passes need their gradients computed, not kept: each is dropped as soon as it is accumulated, so that a
    # pass never holds a second set of gradients on top of the caller's (the first step's, held by `state`).
    drops = [p.register_post_accumulate_grad_hook(_drop_grad) for _, p in candidates]
    try:
        with torch.random.fork_rng(devices=cuda_devices), python_rng_kept():
            yield Runner(model, compute_loss, candidates, DeviceClock(device, clock))
    finally:
        for handle in drops:
            handle.remove()
        state.restore()


def _drop_grad(param: Tensor) -> None:
    param.grad = None


def _release(leaves: list[Tensor]) -> None:
    """Free the memory of a pass's input leaves (module inputs, and their gradients) once its backward has run.

    A full pass's record keeps their autograd nodes (`Pass.leaf_nodes`: attribution needs them as graph nodes, not
    their values), and each node keeps its leaf: without this, the record would keep those inputs (activations),
    and their gradients, through the passes that follow.
    """
    for leaf in leaves:
        leaf.grad = None
        leaf.data = leaf.data.new_empty(0)


@dataclass
class Result:
    """What the passes of one profile found, before it becomes a `TimingProfile` (indices into the candidates)."""

    order: list[int]
    t_dw: list[float]
    t_dy: list[float]
    t_tail: float
    t_fw: float
    t_full: float


class Runner:
    """Runs the passes of one profile."""

    def __init__(
        self,
        model: nn.Module,
        compute_loss: Callable[[], Tensor],
        candidates: list[tuple[str, nn.Parameter]],
        clock: DeviceClock,
    ) -> None:
        self.model = model
        self.compute_loss = compute_loss
        self.candidates = candidates
        self.params = [p for _, p in candidates]
        self.all_params = list(model.parameters())
        self.device = self.params[0].device
        self.clock = clock
        self.leaves = InputLeaves(model)
        self.progress: Progress = lambda k, n, what: None

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

    def signature(self) -> dict[str, Any]:
        """What the cache key must cover beyond the parameters (`StepSignature`), from one forward+backward."""
        recorder = StepSignature(self.model)
        try:
            self._set_mask([True] * len(self.params))
            loss = self._loss()
            recorder.loss(loss.grad_fn)
            if loss.requires_grad:
                loss.backward()
        finally:
            recorder.close()
        return recorder.signature()

    def fingerprint(self, method: TimingMethod) -> str:
        """The cache key of this model's profile by ``method`` on this device (see `signature`)."""
        return cache_key(self.signature(), self.device, self.candidates, method)

    def instrumented(self, kind: Literal["full", "dx", "none"], keep: Callable[..., Any] | None = None) -> Pass:
        """One pass with forward ops timed and, unless ``kind == "none"``, every backward node timed.

        With ``keep`` (what to keep of each forward op), the record also keeps the pass's graph for attribution.
        """
        self._set_mask([kind == "full"] * len(self.params))
        recorder = OpRecorder(self.clock, keep or (lambda func, args, kwargs, out: None))
        record = Pass()
        if kind == "none":
            with recorder:
                self._loss()
        else:
            with self.leaves.active(recorder) as (leaves, sources):
                with recorder:
                    loss = self._loss()
                if keep is not None:  # the graph that attribution walks
                    record.sources = sources
                if loss.requires_grad:
                    self._timed_backward(loss, record, keep_graph=keep is not None)
                elif kind == "full":
                    raise ValueError("`compute_loss` must return a tensor that requires grad. Found: no grad_fn")
            _release(leaves)
        record.op_names = recorder.names
        record.op_seconds = recorder.seconds()
        record.op_kept = recorder.kept
        return record

    def _timed_backward(self, loss: Tensor, record: Pass, keep_graph: bool) -> None:
        """Time every node of the backward pass of ``loss``; keep the nodes themselves only with ``keep_graph``.

        Passes kept with their nodes keep small objects alive all over the memory their activations took, which
        the allocator then cannot reuse for the larger blocks of the next passes: only the graph attribution walks
        is kept (see docs/memory.md).
        """
        nodes = walk(loss.grad_fn)
        starts: dict[Node, Any] = {}
        ends: dict[Node, Any] = {}
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

        def seconds(node: Node) -> float:
            return self.clock.seconds(starts[node], ends[node]) if node in ends else 0.0

        ops = sorted((n for n in nodes if n.name() != ACCUMULATE_GRAD), key=lambda n: n._sequence_nr())
        record.node_names = [n.name() for n in ops]
        record.node_seconds = [seconds(n) for n in ops]
        leaves = [n for n in nodes if n.name() == ACCUMULATE_GRAD]
        record.leaf_seconds = [seconds(n) for n in leaves]
        if keep_graph:
            record.nodes, record.leaf_nodes = ops, leaves

    # -- the two methods ------------------------------------------------------------------------------

    def run(self, method: TimingMethod, warmup: int, repeats: int) -> Result:
        n = len(self.params)
        passes = "one pass counting each op's work" if method == "flops" else f"{3 * repeats} instrumented passes"
        self.progress(2, PHASES, f"{warmup} plain warm-up step(s), then {passes}" if warmup else passes)
        for _ in range(warmup):
            self.plain([True] * n)
        if method == "flops":
            return self._run_flops(repeats)
        return self._run_measured(repeats)

    def _run_measured(self, repeats: int) -> Result:
        dx_passes = [self.instrumented("dx") for _ in range(repeats)]
        ids = {id(p) for p in self.params}

        def keep(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> OpGraph:
            inputs = tensors_in(args) + tensors_in(kwargs)
            return OpGraph(
                outputs=[t.grad_fn for t in tensors_in(out) if t.grad_fn is not None],
                inputs=[t.grad_fn for t in inputs if id(t) not in ids and t.grad_fn is not None],
                params=[id(t) for t in inputs if id(t) in ids],
            )

        full_passes = [self.instrumented("full", keep=keep) for _ in range(repeats)]
        none_passes = [self.instrumented("none") for _ in range(repeats)]
        structure = Structure(full_passes[0], self.params)
        t_dw, t_dy, t_tail = structure.costs(full_passes, dx_passes, none_passes).model()
        order = structure.order
        del structure, full_passes  # their graph's nodes, small but all over memory, before the plain timings
        knots = calibration_knots(t_dw, t_dy, SEGMENTS)
        self.progress(3, PHASES, f"plain timings of {len(knots)} selections, {repeats} or more rounds (calibration)")
        t_fw, times = suffix_times(self.plain, len(self.params), order, knots, repeats)
        t_dw, t_dy, t_tail = calibrate(t_fw, t_dw, t_dy, t_tail, list(zip(knots, times, strict=True)))
        return Result(order, t_dw, t_dy, t_tail, t_fw=t_fw, t_full=times[0])

    def _run_flops(self, repeats: int) -> Result:
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
        recorder = OpRecorder(self.clock, keep)
        with recorder:
            loss = self._loss()
        if not loss.requires_grad:
            raise ValueError("`compute_loss` must return a tensor that requires grad. Found: no grad_fn")
        record = Pass(op_names=recorder.names, op_kept=recorder.kept)
        record.nodes = sorted(
            (n for n in walk(loss.grad_fn) if n.name() != ACCUMULATE_GRAD), key=lambda n: n._sequence_nr()
        )
        record.leaf_nodes = [n for n in walk(loss.grad_fn) if n.name() == ACCUMULATE_GRAD]
        structure = Structure(record, self.params)
        raw, order = structure.flop_costs(record), structure.order
        # The recorded graph ran no backward pass: its nodes still hold the forward's saved activations.
        del loss, record, structure, recorder
        # A full step bracketed by plain forwards, re-timed while the machine is disturbed (as calibration does).
        self.progress(3, PHASES, f"plain timings of a full step, {repeats} or more rounds")
        t_fw, (t_full,) = suffix_times(self.plain, len(self.params), order, [0], repeats)
        # A backward pass never takes no time; the floor only keeps noise on tiny models from zeroing it.
        scale = max(t_full - t_fw, 1e-9) / max(raw.total(), 1e-30)
        raw.scale(scale)
        return Result(order, *raw.model(), t_fw=t_fw, t_full=t_full)

