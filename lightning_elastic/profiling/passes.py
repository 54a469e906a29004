"""The passes of one profile (`Runner`): plain timings, instrumented passes, and the two methods that combine them,
by hooks (``"measured"``) or op counts (``"flops"``). `runner.profile` runs them on a model it leaves as found."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_elastic.profiling.attribution import RawCosts, Structure
from lightning_elastic.profiling.cache import cache_key
from lightning_elastic.profiling.calibration import full_step_times
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
from lightning_elastic.profiling.profile import TimingMethod
from lightning_elastic.time_model import suffix_costs
from lightning_elastic.timing import DeviceClock

__all__ = ["PHASES", "OpCount", "Progress", "Result", "Runner"]

Progress = Callable[[int, int, str], None]  # phase k of n starts, doing `what`
PHASES = 3
# A profile takes the fit's first backward pass as its full step's only when it took at most this many
# plain forward passes (`Runner._scaled`). A steady backward pass takes about 1.5-2.6 (Lite0 at 96 px about 2.5,
# a 12-layer MLP 1.5), a process's first one of Lite0 2.3-4.0 (3 fresh processes); where each op's first call is a
# real share of it, far more, and the profile then times a full step of its own: a tiny MLP's first backward pass
# took 18-23 forward passes under bf16-mixed on CPU (16 ms for a steady 1.1 ms) and let 3.5x past the check before
# training, which the fit then missed at 1.5x; another callback's 10 ms in `on_after_backward` on a 0.7 ms forward
# pass is caught alike.
FIRST_BACKWARD_MAX = 5.0


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


class OpCount:
    """Each op's backward work (`flops.op_costs`) counted in one forward pass with every candidate trained, and the
    autograd graph it built: what the analytic profile scales to a timed full step. Its own pass (`Runner._run_flops`)
    or a training step's (`first_step.FirstStep`): `recorder` is entered around the forward pass, `ended` takes its
    loss. The graph's nodes are kept, not its activations: a training step's backward pass frees those as usual."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        ids = {id(p) for p in params}
        mem_weight = default_mem_weight(params[0].device)

        def keep(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            inputs = tensors_in(args) + tensors_in(kwargs)
            params = [t for t in inputs if id(t) in ids]
            costs = op_costs(getattr(func, "__name__", ""), args, kwargs, out, params, mem_weight)
            return costs, [t.grad_fn for t in inputs if id(t) not in ids and t.grad_fn is not None]

        self.recorder = OpRecorder(None, keep)  # nothing timed: the op's arguments and result are what count
        self.record = Pass()

    def ended(self, loss: Tensor) -> None:
        """The forward pass returned `loss`: its ops and graph are the record."""
        nodes = walk(loss.grad_fn) if loss.grad_fn is not None else []
        self.record = Pass(
            op_names=self.recorder.names,
            op_kept=self.recorder.kept,
            nodes=sorted((n for n in nodes if n.name() != ACCUMULATE_GRAD), key=lambda n: n._sequence_nr()),
            leaf_nodes=[n for n in nodes if n.name() == ACCUMULATE_GRAD],
        )


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
        self.received: set[int] = set()  # ids of the candidates whose gradient a pass computed (`runner.profile`)

    def hidden(self, order: Sequence[int]) -> list[str]:
        """The candidates that some pass computed a gradient for but that are not in `order`, the tensors found in
        the graph walked from the loss before backward: backward made their nodes as it ran (reentrant checkpoints
        recompute their segment there), so nothing could time them."""
        found = set(order)
        return [name for c, (name, p) in enumerate(self.candidates) if c not in found and id(p) in self.received]

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

    def run(
        self,
        method: TimingMethod,
        warmup: int,
        repeats: int,
        backward: float | None = None,
        counted: OpCount | None = None,
    ) -> Result:
        """The passes of `method`; `backward`: the seconds of the full backward pass of a training step that just ran
        on this batch (the fit's first), which both methods take instead of timing a full step (`_scaled`);
        `counted`: that step's forward pass, whose ops the analytic method counts instead of running a counting pass."""
        n = len(self.params)
        passes = f"{3 * repeats} instrumented passes"
        if method == "flops":
            passes = "one pass counting each op's work" if counted is None else "the ops the step that just ran counted"
        self.progress(2, PHASES, f"{warmup} plain warm-up step(s), then {passes}" if warmup else passes)
        for _ in range(warmup):
            self.plain([True] * n)
        if method == "flops":
            return self._run_flops(repeats, backward, counted)
        return self._run_measured(repeats, backward)

    def _run_measured(self, repeats: int, backward: float | None) -> Result:
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
        raw, order = structure.costs(full_passes, dx_passes, none_passes), structure.order
        del structure, full_passes  # their graph's nodes, small but all over memory, before the plain timings
        return self._scaled(raw, order, repeats, backward)

    def _run_flops(self, repeats: int, backward: float | None, counted: OpCount | None) -> Result:
        n = len(self.params)
        counting = math.inf  # the counting pass's seconds: a forward pass, with the counting's own work
        if counted is None:
            self._set_mask([True] * n)
            counted = OpCount(self.params)
            start = self.clock.now()
            with counted.recorder:
                loss = self._loss()
            counting = self.clock.now() - start
            if not loss.requires_grad:
                raise ValueError("`compute_loss` must return a tensor that requires grad. Found: no grad_fn")
            counted.ended(loss)
            del loss
        structure = Structure(counted.record, self.params)
        raw, order = structure.flop_costs(counted.record), structure.order
        # A graph of its own ran no backward pass: its nodes still hold the forward's saved activations.
        del structure, counted
        return self._scaled(raw, order, repeats, backward, counting)

    def _scaled(
        self, raw: RawCosts, order: list[int], repeats: int, backward: float | None, forward: float = math.inf
    ) -> Result:
        """`raw` costs (hook times or op counts) scaled so that the full step's backward pass is a plain one's.

        The plain full step is the training step's backward pass (`backward`) after a plain forward pass (the
        quicker of it and `forward`, another pass's forward: a disturbed one is slower), unless that backward took
        more than `FIRST_BACKWARD_MAX` forwards to be a steady one; else a full step of its own, bracketed by plain
        forward passes and re-timed while they say the machine is disturbed (`calibration.full_step_times`). One
        scale for every tensor: how selections compare is the hooks' or the counts' (docs/time_model.md: a
        round of plain steps at five selections, which rescaled each quarter of the backward pass on its own, cost
        about four full steps and ranked selections as well on six of eight models and inputs, better on Lite0 at
        64 px, far worse where a plain step was disturbed).
        """
        n = len(self.params)
        if backward is not None:
            self.progress(3, PHASES, "a plain forward pass (the full step's backward is the training step's)")
            forward = min(self.plain([False] * n)[0], forward)
            if backward <= FIRST_BACKWARD_MAX * forward:
                t_fw, t_full = forward, forward + backward
            else:
                times = f"{backward / forward:.1f}" if forward > 0 else f"more than {FIRST_BACKWARD_MAX:g}"
                self.progress(3, PHASES, f"the training step's backward pass took {times} forward passes, not steady")
                backward = None
        if backward is None:
            self.progress(3, PHASES, f"plain timings of a full step, {repeats} or more rounds")
            t_fw, t_full = full_step_times(self.plain, n, repeats)
        t_dw, t_dy, t_tail = raw.model()
        full_backward = (suffix_costs(t_dw, t_dy)[0] if t_dw else 0.0) + t_tail  # the time model's, all trained
        # A backward pass never takes no time; the floor only keeps noise on tiny models from zeroing it.
        scale = max(t_full - t_fw, 1e-9) / max(full_backward, 1e-30)
        return Result(
            order, [v * scale for v in t_dw], [v * scale for v in t_dy], t_tail * scale, t_fw=t_fw, t_full=t_full
        )
