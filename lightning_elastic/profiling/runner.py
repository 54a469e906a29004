"""`profile` itself: the checks of its arguments, the cache, and the model left exactly as found; the passes of one
profile are `passes.Runner`'s."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import torch
from torch import Tensor, nn

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.profiling.cache import cache_file, cache_key, device_name, load_cached
from lightning_elastic.profiling.graph import StepBackward
from lightning_elastic.profiling.passes import PHASES, OpCount, Progress, Runner
from lightning_elastic.profiling.profile import TimingMethod, TimingProfile, store
from lightning_elastic.profiling.state import ModelState, python_rng_kept
from lightning_elastic.timing import DeviceClock, collector_paused

__all__ = ["fingerprint", "profile"]


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
    backward: StepBackward | None = None,
    counted: OpCount | None = None,
    cached_first: Sequence[TimingMethod] = (),
) -> TimingProfile:
    """Measure how long each parameter tensor of ``model`` costs in a training step on its device.

    The model is left exactly as found: ``requires_grad`` flags, ``.grad`` tensors, buffers (BatchNorm
    running statistics), train/eval modes, every other attribute of its submodules (state that ``forward``
    keeps, such as an RNN's stored hidden state) and the global RNG state (torch CPU and CUDA, Python
    ``random``). The optimizer's update is not part of the profile. Python's garbage collector is held off
    while it runs (`timing.collector_paused`): a collection falls after it, not inside a timed pass.

    Args:
        model: the module whose parameters requiring grad are profiled (the others stay frozen).
        compute_loss: runs one forward pass on a real batch already on the device and returns the scalar
            loss; it is called about 7 times (more when timings are disturbed, see ``repeats``).
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
        repeats: instrumented passes of each kind, and rounds of the plain full step that the costs are scaled to;
            medians are kept. A round counts when the plain forward passes timed around it agree; rounds that do not
            (another process used the device) are left out and replaced, up to three times as many rounds in all. A
            first profile costs about 4.7 full training steps with the defaults on a quiet device (breakdown and the
            time model's accuracy in docs/time_model.md), about 1.3 more per disturbed round; ``warmup=1, repeats=3``
            was the default until issue #11, about 20 with the plain timings of five selections it took then.
        clock: seconds counter to use instead of ``time.perf_counter`` (and instead of CUDA events).
        progress: called as each phase starts with ``(k, n, what)``: phase ``k`` of ``n`` (1: the fingerprint,
            which a cached profile ends with; 2: the instrumented or op-counting passes; 3: the plain timings).
        signature: the step's `StepSignature`, recorded by the caller on a training step that just ran on the same
            batch (the fit's first, `first_step.FirstStep`): then profiling takes no fingerprint pass of its own, and
            that step was the device's warm-up. Its backward graph must be the one of every candidate trained.
        backward: that step's backward pass (with `signature`): its seconds, which the ``"flops"`` method scales its
            op counts to, timing a plain forward pass alone and no full step of its own (`first_step.FirstStep`), and
            the parameters it computed gradients for.
        counted: that step's forward pass, its ops counted as it ran (with `signature`): the ``"flops"`` method takes
            them instead of a counting pass of its own.
        cached_first: methods whose cached profile of this step is taken, when there is one, before the cache of
            ``method`` is looked up or anything is timed (the callback's "auto" prefers a measured profile it
            need not pay for). A stale or corrupt entry of theirs is passed over without a word: this run does not
            measure them again.

    Returns:
        The `TimingProfile`.

    Raises:
        ValueError: unknown ``method``, bad ``warmup`` or ``repeats``, an empty ``cache_dir``, no parameter that
            requires grad, ``compute_loss`` does not return a scalar that requires grad, or ``backward`` or ``counted``
            without the ``signature`` of their step.
        TypeError: ``model`` is not a module, ``compute_loss`` or ``clock`` is not callable, ``cache_dir`` is not a
            path, or ``backward`` is not a `StepBackward`.

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
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"`cache_dir` must be a directory path, or None (no cache). Found: {cache_dir!r}")
    if cache_dir is not None and not os.fspath(cache_dir):
        raise ValueError(f"`cache_dir` must be a directory path, or None (no cache). Found: {cache_dir!r}")
    if clock is not None and not callable(clock):
        raise TypeError(f"`clock` must be a callable returning seconds, or None. Found: {clock!r}")
    if backward is not None and not isinstance(backward, StepBackward):
        raise TypeError(
            "`backward` must be a `StepBackward` (its seconds and the parameters it reached), or None. "
            f"Found: {backward!r}"
        )
    if backward is not None and (signature is None or not 0 <= backward.seconds < math.inf):
        raise ValueError(
            "`backward` must be the backward pass (seconds >= 0) of the step whose `signature` is given. "
            f"Found: {backward.seconds!r} s" + ("" if signature is not None else " with no `signature`")
        )
    if counted is not None and signature is None:
        raise ValueError("`counted` must be the forward pass of the step whose `signature` is given. Found: none given")
    with collector_paused(), _kept_as_found(model, compute_loss, clock) as runner:
        start = runner.clock.now()
        runner.progress = progress or runner.progress
        if signature is None:
            runner.progress(1, PHASES, "the step's fingerprint (one forward and backward pass)")
            signature = runner.signature()
        else:  # phases 2 and 3 follow and are numbered so
            runner.progress(1, PHASES, "the step's fingerprint, taken from the training step that just ran")
        for looked_up in dict.fromkeys((*cached_first, method)):  # a bad entry of one only asked first: no warning
            fingerprint = cache_key(signature, runner.device, runner.candidates, looked_up)
            path = None if cache_dir is None else cache_file(Path(cache_dir), fingerprint)
            cached = None if path is None else load_cached(path, fingerprint, quiet=looked_up != method)
            if cached is not None:
                return cached
        if backward is not None:  # what that step's backward pass computed is checked as the passes' is
            runner.received.update(backward.received)
        result = runner.run(method, warmup, repeats, None if backward is None else backward.seconds, counted)
        if hidden := runner.hidden(result.order):
            raise ElasticConfigError(
                "Every tensor that gets a gradient must be a node of the autograd graph of the loss `training_step` "
                "returns before backward runs, so that its cost can be timed and its training kept within the "
                "budget. Two ways to miss it: tensors under reentrant gradient checkpointing "
                "(`torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`, what some "
                "`gradient_checkpointing_enable()` pass) enter it only while backward recomputes them: use "
                "`use_reentrant=False`; and a loss that `training_step` does not return (added in an overridden "
                "`backward` or a hook): return the whole loss. Or keep them out with `train_never`. Found only "
                f"during backward: {hidden[:5]}"
            )
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
            shapes=tuple(tuple(candidates[c][1].shape) for c in result.order),
            t_tail=result.t_tail,
            profile_seconds=runner.clock.now() - start,
        )
        if path is not None:
            try:
                store(path, prof)
            except OSError as err:  # the profile is measured and good: a cache that cannot keep it ends no fit
                warnings.warn(
                    f"Timing profile cache {path} could not be written ({err}); this fit goes on with the profile it "
                    "measured, and the next process profiles again: set `cache_dir` to a folder that can be written, "
                    "or False.",
                    stacklevel=2,
                )
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
    runner = Runner(model, compute_loss, candidates, DeviceClock(device, clock))

    def drop_grad(param: Tensor) -> None:
        runner.received.add(id(param))
        param.grad = None

    # The passes need their gradients computed, not kept: each is dropped as soon as it is accumulated, so that a
    # pass never holds a second set of gradients on top of the caller's (the first step's, held by `state`).
    drops = [p.register_post_accumulate_grad_hook(drop_grad) for _, p in candidates]
    try:
        with torch.random.fork_rng(devices=cuda_devices), python_rng_kept():
            yield runner
    finally:
        for handle in drops:
            handle.remove()
        state.restore()
