"""Elastic selection under data parallelism: one mask on every rank, and only trained gradients all-reduced.

How PyTorch's `DistributedDataParallel` (DDP) meets a `requires_grad` that changes during training (torch 2.14):

- When DDP wraps the model, its reducer takes the parameters that require grad *at that moment*, lays their
  gradients out in buckets and hooks their gradient accumulators. A tensor frozen then is outside every bucket:
  unfrozen later, its gradient is never averaged and the ranks drift apart without an error (Lightning's
  `BackboneFinetuning` under DDP). `ElasticTensorSelection` never freezes a tensor before the model is wrapped,
  never trains a tensor the user froze, and `selective_allreduce_hook` stops training if such a tensor ever
  requires grad.
- A tensor frozen after wrapping produces no gradient, so its bucket never becomes ready and the next step fails
  with "Expected to have finished reduction in the prior iteration". With `find_unused_parameters=True` the
  reducer walks the autograd graph after each forward, marks the parameters outside it ready (a zero slot in
  their bucket), all-reduces a map of the tensors each rank used (4 bytes per tensor) and leaves the `.grad` of
  tensors no rank used untouched: frozen tensors keep `grad=None`, which every optimizer skips (momentum and
  weight decay included). `prepare_strategy` sets it, and refuses `static_graph=True`.
- A backward pass run outside DDP's forward (the timing profiler's, under `no_sync`) still marks the tensors it
  reaches as used until the next synchronised step; a tensor frozen by then fails the reducer's check
  ("Encountered gradient which is undefined, but still allreduced"). `install_selective_allreduce` runs after
  the profiler and clears that map.
- DDP's default communication all-reduces whole buckets, frozen slots included. `selective_allreduce_hook`
  all-reduces only the slots of tensors that require grad. Every rank holds the same mask at the same step, so
  every rank sends the same slots; the hook checks that across ranks whenever a bucket's mask changes.

FSDP, DeepSpeed and model-parallel strategies shard or flatten parameters, which fixes `requires_grad` per flat
shard when the model is wrapped: `prepare_strategy` refuses them and says what to use instead.
"""

import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
    XLAStrategy,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_elastic.errors import ElasticConfigError

# The reducer's map of used tensors holds one int32 per tensor of the reducer.
USED_MAP_BYTES_PER_TENSOR = 4


def prepare_strategy(strategy: Strategy) -> None:
    """Check that `strategy` can train a changing selection, and set what DDP needs before it wraps the model.

    Call it before the strategy wraps the model (a callback's `setup`). Single-device strategies need nothing.
    DDP strategies (`"ddp"`, `"ddp_spawn"`, `"ddp_fork"`, `"ddp_notebook"`, or a `DDPStrategy`) get
    `find_unused_parameters=True` unless it was given: frozen tensors produce no gradient, and the reducer must
    treat them as unused. Raises ValueError for settings and strategies that cannot work, saying what to use.

    Example:
        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> strategy = DDPStrategy()
        >>> prepare_strategy(strategy)
        >>> strategy._ddp_kwargs
        {'find_unused_parameters': True}
    """
    name = type(strategy).__name__
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, XLAStrategy)):
        raise ElasticConfigError(
            "`ElasticTensorSelection` supports single-device strategies and DDP (`strategy='ddp'`, 'ddp_spawn', "
            "'ddp_fork', 'ddp_notebook'; the model must fit on each device). FSDP and DeepSpeed flatten and shard "
            "parameters, which fixes `requires_grad` per shard when the model is wrapped, so tensors cannot leave "
            "or rejoin training; XLA is untested. For a model too large for one device, freeze a fixed part instead "
            f"(Lightning's `BaseFinetuning`). Found: {name}"
        )
    if isinstance(strategy, SingleDeviceStrategy):
        return
    if not isinstance(strategy, DDPStrategy):
        raise ElasticConfigError(
            "`ElasticTensorSelection` supports single-device strategies and DDP (`strategy='ddp'`, 'ddp_spawn', "
            f"'ddp_fork', 'ddp_notebook'). Found: {name}"
        )
    kwargs: dict[str, Any] = strategy._ddp_kwargs
    problems = []
    if kwargs.get("static_graph", False):
        problems.append(
            "DDP's `static_graph` must be False: each selection changes which tensors receive gradients. "
            "Found: static_graph=True"
        )
    if kwargs.get("find_unused_parameters", True) is not True:
        problems.append(
            "DDP's `find_unused_parameters` must be True (frozen tensors produce no gradient; use `strategy='ddp'` "
            "and the callback sets it). Found: find_unused_parameters="
            f"{kwargs['find_unused_parameters']!r}"
        )
    if problems:
        raise ElasticConfigError("`ElasticTensorSelection` under DDP: " + "; ".join(problems))
    if "find_unused_parameters" not in kwargs:
        kwargs["find_unused_parameters"] = True
        rank_zero_info(
            "ElasticTensorSelection: set `find_unused_parameters=True` on the DDP strategy: frozen tensors produce "
            "no gradient, and DDP must treat them as unused (costs one graph traversal and a 4-byte-per-tensor "
            "all-reduce per step; DDP warns once if a step happens to use every tensor)"
        )
    if getattr(strategy, "_ddp_comm_hook", None) is not None:
        rank_zero_warn(
            "ElasticTensorSelection: the DDP strategy has its own `ddp_comm_hook`, which all-reduces whole buckets: "
            "training stays correct, but the gradients of frozen tensors (zeros) are still sent"
        )


class SelectiveAllReduce:
    """State of `selective_allreduce_hook`: the process group, per-bucket layouts and what was sent.

    Byte counts are of what was all-reduced (elements x element size), summed over buckets; one step is one
    synchronised backward pass. `full` figures are what DDP's default hook would have sent (whole buckets).

    Args:
        process_group: the group to average over; None for the default group.
        module: the module DDP wraps, to catch tensors outside DDP's buckets that start requiring grad.
        ignored: names of parameters that DDP was told to ignore (they are the user's business).

    Attributes:
        steps: synchronised backward passes so far.
        bytes_sent: bytes all-reduced so far (mask checks included).
        full_bytes: bytes the default hook would have all-reduced so far.
        last_step_bytes: bytes all-reduced in the last step.
        last_step_full_bytes: bytes the default hook would have all-reduced in the last step.
        mask_checks: cross-rank mask checks so far (one per bucket whose mask changed).

    Example:
        >>> state = SelectiveAllReduce()
        >>> state.steps, state.bytes_sent
        (0, 0)
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        module: nn.Module | None = None,
        ignored: Sequence[str] = (),
    ) -> None:
        self.process_group = process_group
        self.steps = 0
        self.bytes_sent = 0
        self.full_bytes = 0
        self.last_step_bytes = 0
        self.last_step_full_bytes = 0
        self.mask_checks = 0
        self._named = [] if module is None else [(n, p) for n, p in module.named_parameters() if n not in ignored]
        # Per bucket index: buffer elements, parameters, their (start, end) slots; the last mask and its runs.
        self._layouts: dict[int, tuple[int, list[Tensor], list[tuple[int, int]]]] = {}
        self._masks: dict[int, tuple[bool, ...]] = {}
        self._runs: dict[int, list[tuple[int, int]]] = {}
        self._in_buckets: set[int] = set()
        self._outside: list[tuple[str, Tensor]] | None = None
        self._step_bytes = 0
        self._step_full_bytes = 0

    def allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Average the trained slots of `bucket` over the group; the future's value is the bucket's buffer."""
        buffer = bucket.buffer()
        runs = self._trained_runs(bucket)
        self._check_outside(bucket)
        self._count(bucket, sum(end - start for start, end in runs))
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        if not runs:
            done: torch.futures.Future[Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        if len(runs) == 1:
            view = buffer[runs[0][0] : runs[0][1]]
            view.div_(world_size)
            work = dist.all_reduce(view, group=group, async_op=True)
            assert work is not None
            return work.get_future().then(lambda _: buffer)
        packed = torch.cat([buffer[start:end] for start, end in runs])
        packed.div_(world_size)
        work = dist.all_reduce(packed, group=group, async_op=True)
        assert work is not None

        def unpack(_: torch.futures.Future[Any]) -> Tensor:
            for (start, end), part in zip(runs, packed.split([end - start for start, end in runs]), strict=True):
                buffer[start:end].copy_(part)
            return buffer

        return work.get_future().then(unpack)

    def _trained_runs(self, bucket: dist.GradBucket) -> list[tuple[int, int]]:
        """Contiguous `(start, end)` element ranges of the bucket's buffer that hold gradients of trained tensors.

        Cached per bucket and mask (DDP never rebuilds buckets under `find_unused_parameters=True`); a changed
        mask is checked against every other rank first.
        """
        index = bucket.index()
        buffer = bucket.buffer()
        layout = self._layouts.get(index)
        if layout is None or layout[0] != buffer.numel():
            params = bucket.parameters()
            starts = [int(g.storage_offset() - buffer.storage_offset()) for g in bucket.gradients()]
            slots = [(start, start + p.numel()) for start, p in zip(starts, params, strict=True)]
            layout = self._layouts[index] = (buffer.numel(), params, slots)
            self._in_buckets.update(id(p) for p in params)
            self._masks.pop(index, None)
        _, params, slots = layout
        mask = tuple(p.requires_grad for p in params)
        if self._masks.get(index) != mask:
            self._check_same_mask(index, mask, buffer.device)
            runs: list[tuple[int, int]] = []
            for (start, end), trained in zip(slots, mask, strict=True):
                if not trained:
                    continue
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], end)
                else:
                    runs.append((start, end))
            self._masks[index], self._runs[index] = mask, runs
        return self._runs[index]

    def _count(self, bucket: dist.GradBucket, sent: int) -> None:
        """Account `sent` elements all-reduced for this bucket; close the step at the last bucket."""
        buffer = bucket.buffer()
        if bucket.index() == 0:
            self._step_bytes = self._step_full_bytes = 0
        self._step_bytes += sent * buffer.element_size()
        self._step_full_bytes += buffer.numel() * buffer.element_size()
        if bucket.is_last():
            self.steps += 1
            self.bytes_sent += self._step_bytes
            self.full_bytes += self._step_full_bytes
            self.last_step_bytes, self.last_step_full_bytes = self._step_bytes, self._step_full_bytes

    def _check_outside(self, bucket: dist.GradBucket) -> None:
        """At the last bucket of a step: raise if a tensor DDP left out of its buckets now requires grad."""
        if not bucket.is_last():
            return
        if self._outside is None:  # every bucket has been seen once
            self._outside = [(n, p) for n, p in self._named if id(p) not in self._in_buckets]
        unsynced = [n for n, p in self._outside if p.requires_grad]
        if unsynced:
            raise RuntimeError(
                "Tensors that did not require grad when DDP wrapped the model must not be trained under DDP: DDP "
                "never averages their gradients, so the ranks would drift apart. Unfreeze them before `fit` (and let "
                f"`ElasticTensorSelection` freeze what it selects), or keep them frozen. Found: {unsynced}"
            )

    def _check_same_mask(self, index: int, mask: tuple[bool, ...], device: torch.device) -> None:
        """Every rank must all-reduce the same slots: compare a fingerprint of this bucket's mask across ranks."""
        digest = hashlib.blake2b(bytes(mask) + index.to_bytes(4, "little"), digest_size=7).digest()
        fingerprint = int.from_bytes(digest, "little")
        extremes = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.process_group)
        self.mask_checks += 1
        self.bytes_sent += extremes.numel() * extremes.element_size()
        highest, lowest = extremes[0].item(), -extremes[1].item()
        if highest != fingerprint or lowest != fingerprint:
            raise RuntimeError(
                f"Every rank must train the same tensors at the same step, so that DDP all-reduces the same "
                f"gradients. Found: a different selection on another rank for DDP bucket {index}"
            )


def selective_allreduce_hook(state: SelectiveAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that averages only the gradients of tensors that require grad.

    Slots of frozen tensors (zeros, written by DDP's reducer for unused parameters) are neither sent nor changed.
    One contiguous range of trained slots is all-reduced in place; several are packed into one tensor first.
    Register with `DistributedDataParallel(..., find_unused_parameters=True)`; see `register_selective_allreduce`.

    Example:
        >>> import os
        >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        >>> dist.init_process_group("gloo", rank=0, world_size=1)
        >>> ddp = DistributedDataParallel(nn.Linear(2, 1), find_unused_parameters=True)
        >>> state = SelectiveAllReduce()
        >>> ddp.register_comm_hook(state, selective_allreduce_hook)
        >>> _ = ddp.module.weight.requires_grad_(False)
        >>> ddp(torch.ones(3, 2)).sum().backward()
        >>> state.last_step_bytes, state.last_step_full_bytes, ddp.module.weight.grad
        (4, 12, None)
        >>> dist.destroy_process_group()
    """
    return state.allreduce(bucket)


_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, SelectiveAllReduce]" = weakref.WeakKeyDictionary()


def register_selective_allreduce(model: DistributedDataParallel) -> SelectiveAllReduce:
    """Register `selective_allreduce_hook` on a DDP model and forget the tensors marked as used so far.

    Call it once the model is wrapped and after any backward pass run outside DDP's forward (profiling), before
    the first training step. Needs `find_unused_parameters=True` and `static_graph=False`.

    Example:
        >>> import os
        >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
        >>> dist.init_process_group("gloo", rank=0, world_size=1)
        >>> ddp = DistributedDataParallel(nn.Linear(2, 1), find_unused_parameters=True)
        >>> state = register_selective_allreduce(ddp)
        >>> selective_allreduce_state(ddp) is state
        True
        >>> dist.destroy_process_group()
    """
    if not model.find_unused_parameters or model.static_graph:
        raise ValueError(
            "`register_selective_allreduce` needs a DDP model with `find_unused_parameters=True` and "
            f"`static_graph=False`. Found: find_unused_parameters={model.find_unused_parameters}, "
            f"static_graph={model.static_graph}"
        )
    _forget_used_tensors(model)
    state = SelectiveAllReduce(model.process_group, model.module, tuple(model.parameters_to_ignore))
    model.register_comm_hook(state, selective_allreduce_hook)
    _INSTALLED[model] = state
    return state


def any_rank(strategy: Strategy, flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (on one process: `flag`); a collective, which every rank must reach.

    Example:
        >>> any_rank(SingleDeviceStrategy("cpu"), True, torch.device("cpu"))
        True
    """
    votes = torch.tensor([float(flag)], dtype=torch.float64, device=device)
    return float(strategy.reduce(votes, reduce_op="sum").item()) > 0.0


def install_selective_allreduce(strategy: Strategy) -> SelectiveAllReduce | None:
    """Under DDP: forget the profiler's backward passes and register `selective_allreduce_hook`.

    Call it once profiling is done (under DDP that is in `on_train_start`) and after a checkpoint's selection is
    applied. The reducer's
    record of used tensors is cleared in every case under DDP (correctness); the hook is registered unless the
    strategy registered its own `ddp_comm_hook` (DDP takes one). Returns the hook's state (bytes sent), or None.

    Example:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> install_selective_allreduce(SingleDeviceStrategy("cpu")) is None
        True
    """
    model = strategy.model
    if not isinstance(model, DistributedDataParallel):
        return None
    if getattr(strategy, "_ddp_comm_hook", None) is not None and strategy.root_device.type == "cuda":
        _forget_used_tensors(model)
        return None  # Lightning registered the user's hook (DDP takes one); `prepare_strategy` warned
    return register_selective_allreduce(model)


def _forget_used_tensors(model: DistributedDataParallel) -> None:
    """Clear the reducer's record of tensors used by backward passes run outside DDP's forward (profiling).

    A tensor frozen since would otherwise fail the reducer's check at the next synchronised step. Under
    `find_unused_parameters=True` the reset touches nothing else: DDP never rebuilds buckets then.
    """
    model.reducer._reset_state()


def selective_allreduce_state(model: nn.Module | None) -> SelectiveAllReduce | None:
    """The state of the hook registered on `model` (a DDP model) by `register_selective_allreduce`, if any.

    Takes `trainer.strategy.model` as it is (None before the strategy has a model).

    Example:
        >>> selective_allreduce_state(nn.Linear(2, 1)) is None
        True
    """
    return None if model is None else _INSTALLED.get(model)
