"""The fit's first training step as the profile's first pass (`FirstStep`): its batch, its signature (the cache key)
and its backward pass, recorded as Lightning runs it; `measure_profile` (`harness`) profiles on them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor

from lightning_elastic.freezing import is_compiled
from lightning_elastic.profiling.graph import BackwardRecorder, StepBackward, StepSignature
from lightning_elastic.profiling.passes import OpCount
from lightning_elastic.timing import DeviceClock, StepTimer

__all__ = ["FirstStep", "loss_in"]


class FirstStep:
    """The fit's first training step, run by Lightning as usual, taken as the profile's fingerprint pass.

    A profile is keyed by the step's `StepSignature` (one forward and backward pass with every candidate trained),
    and its timings need a device that has run the step once. The fit's first optimizer step is both: it opens the
    first probe window, so every candidate trains. The callback records its signature as it runs and profiles (or
    reads the cache) on its batch between its backward pass and its optimizer update: profiling takes no pass of its
    own for the fingerprint, on CPU the profile (either time model) takes the step's backward pass (`backward`, timed
    from this callback's `on_before_backward` to its `on_after_backward`: with whatever other hooks run between, one
    sample) as its full step's, and a speedup out of reach is still refused before any parameter changes. On CPU the
    first backward pass of a process runs about as fast as the later ones (Lite0 on ELPV, fresh processes: 443 and
    495 ms against 399-466 ms for steps 2-8), its forward pass does not (435 and 380 ms against 163-243 ms), so the
    forward is timed plain by the profile (a full step too after a first backward pass of over
    `passes.FIRST_BACKWARD_MAX` forwards); its full step's forward is that plain one, without the graph a training step
    records (a few percent of the forward), which the fit's calibration to the full step it measures makes up. Its
    seconds up to the update (`timer`) are the first step's, charged to the fit.

    Only for one process running an eager module (`applies`: Lightning's single-device strategy): under DDP, even on
    one device, the wrapper adds its own nodes to the step's graph, and a compiled module's hooks are traced, not
    run. The step runs eager while it records (`torch.compiler.set_stance("force_eager")`), as the profile's own
    passes do: a function compiled inside `training_step`, which `is_compiled` cannot see, compiles at the next step
    (once, as a fit without the callback compiles it at its first), and the signature, the counted ops and the timed
    backward pass are those of the eager step the profile times. And only with an optimizer that keeps state for
    each tensor (Adam, momentum SGD): the profiling passes run while the step's gradients are held for its update,
    which costs no memory above a training step only when the update holds at least as much; plain SGD (no
    momentum) keeps none, so its fits profile before the first step (docs/memory.md). The callback also needs a fit
    that starts afresh (a resumed one restores a selection).
    Otherwise profiling takes its own pass as training starts. `train_never` tensors are frozen before the first step
    (`freezing.freeze_never`): it does not train them, and the profile, like any profile, covers the tensors that
    require grad. With `count` (the analytic profile's), the step's forward pass also counts each op's work as it runs
    (`passes.OpCount`, `counted`), so that the profile runs no counting pass of its own: the counter's work within
    that forward pass (each op dispatched to it in Python) instead of a pass. The key is that of the data set's first
    batch (`measure_profile`): inputs whose shapes vary from batch to batch (padding to the longest sequence) take a
    pass of their own for it when this step's shapes differ.
    """

    def __init__(
        self, device: torch.device, clock: Callable[[], float], setup_seconds: float = 0.0, count: bool = False
    ) -> None:
        self.timer = StepTimer(device, clock)
        self.count = count  # count the forward pass's ops for the analytic profile (`counted`)
        self.counted: OpCount | None = None
        self.setup_seconds = setup_seconds  # what the callback spent as training started, charged with profiling
        # The recorded micro-batch's backward pass, on the profiler's clock (`profile` times every other pass of the
        # profile on it: CUDA events, else `time.perf_counter`), not the callback's `clock`, injected by tests.
        self._backward_clock = DeviceClock(device, None)
        self._backward: BackwardRecorder | None = None
        self.backward: StepBackward | None = None
        self.batch: Any = None
        self.batch_idx = 0  # of `batch` in its epoch: `training_step` may branch on it (skip batch 0, say)
        self.signature: dict[str, Any] | None = None
        self._recorder: StepSignature | None = None
        self._module: L.LightningModule | None = None
        self._own_step: Any = None

    @staticmethod
    def backward_applies(pl_module: L.LightningModule) -> bool:
        """Whether the step's backward pass may be the profile's full step's: on CPU, where a process's
        first backward pass runs as fast as its later ones; on a GPU it may load its kernels and tune their algorithms
        (`cudnn.benchmark`), which nothing here has measured, so the profile times a full step of its own there."""
        return pl_module.device.type == "cpu"

    @staticmethod
    def applies(trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        stateless = any(
            isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) == 0 for g in optimizer.param_groups)
            for optimizer in trainer.optimizers
        )
        return isinstance(trainer.strategy, SingleDeviceStrategy) and not is_compiled(pl_module) and not stateless

    def batch_start(self, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        """A step's first micro-batch starts: record it (until one step has recorded a whole signature).

        The loss's graph is taken from what `training_step` returns, as the profiler's own pass takes it, not from
        the loss Lightning differentiates (divided by the micro-batches, scaled by a mixed-precision scaler).
        """
        if self.signature is not None or self._recorder is not None:
            return
        self.batch, self.batch_idx, self._module, self.counted = batch, batch_idx, pl_module, None
        recorder = self._recorder = StepSignature(pl_module)
        self._own_step = vars(pl_module).get("training_step")
        step = pl_module.training_step
        params = [p for p in pl_module.parameters() if p.requires_grad]
        counting = OpCount(params) if self.count and params else None

        def recorded(*args: Any, **kwargs: Any) -> Any:
            with ExitStack() as recording:
                if not recorder.complete:  # eager, as the profile's own passes (`harness.training_step`)
                    recording.enter_context(torch.compiler.set_stance("force_eager"))
                    if counting is not None:
                        recording.enter_context(counting.recorder)
                output = step(*args, **kwargs)
            if (loss := loss_in(output)) is not None and not recorder.complete:
                recorder.loss(loss.grad_fn)
                if counting is not None:
                    counting.ended(loss)
                    self.counted = counting
            return output

        pl_module.training_step = recorded  # type: ignore[method-assign]

    def before_backward(self) -> None:
        """The recorded micro-batch's backward pass starts."""
        if self._recorder is not None and self._recorder.complete and self._module is not None:
            if self._backward is not None:  # a backward pass that never reported its end: not this one
                self._backward.cancel()
            params = [p for p in self._module.parameters() if p.requires_grad]
            self._backward = BackwardRecorder(self._backward_clock, params)

    def after_backward(self) -> None:
        if self._recorder is not None and self._recorder.complete:
            self.backward = None if self._backward is None else self._backward.stop()
            self._backward = None
            signature = self._recorder.signature()
            self.close()
            self.signature = signature

    def close(self) -> None:
        """End a recording (a step that ran no backward pass, because `training_step` returned None, or failed)."""
        if self._backward is not None:
            self._backward.cancel()
            self._backward = None
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self._module is not None:
            if self._own_step is None:
                vars(self._module).pop("training_step", None)
            else:
                self._module.training_step = self._own_step  # type: ignore[method-assign]
            self._module = None


def loss_in(output: Any) -> Tensor | None:
    """The loss a `training_step` returned (a tensor, or a mapping with "loss"); None when it returned none."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, Tensor) else None
