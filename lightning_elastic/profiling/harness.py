"""The first training batch to the loss on the real training step: the one harness every caller shares.

`training_step` is that loss as a callable; `ProfileChoice` says which time model a fit profiles with (what it can
pay for); `measure_profile` measures one on that step, or reads it from the cache, on the first batch or on the
batch of the fit's first step (`first_step.FirstStep`). Which profile a fit can use without measuring is `reuse`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_elastic import warmup, windows
from lightning_elastic.distributed import any_rank
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.profiling.first_step import FirstStep, loss_in
from lightning_elastic.profiling.flops import tensors_in
from lightning_elastic.profiling.profile import TimeModel, TimingMethod, TimingProfile
from lightning_elastic.profiling.runner import profile
from lightning_elastic.timing import collector_paused

__all__ = [
    "Measured",
    "PhaseLines",
    "ProfileChoice",
    "measure_profile",
    "training_step",
]


# What a first profile's passes cost, in full training steps (docs/time_model.md). The fingerprint's pass (one step)
# unless the fit's first step is it (`FirstStep`); then "measured" times every backward node in three instrumented
# passes (input gradients only, full, forward only: about two steps; Lite0 on ELPV at 96 px 0.9-1.5 s, steps of
# 0.46 s) where "flops" counts each op's work in one forward pass, or takes the first step's counts; both scale to a
# plain full step between two plain forward passes (about a third of a step each, FORWARD_SHARE), or, on CPU where
# the first step's backward pass is that step's, to one plain forward pass. Until 2026-12-07 the measured profile
# also timed plain steps at four more selections to rescale each quarter of the backward pass on its own: 2.2-3.3 s
# more there, and no better at ranking selections but on Lite0 at 64 px (docs/time_model.md).
INSTRUMENTED_STEPS = 2

# `time_model="auto"` measures the profile when it and the first probe window it times after it (`FIRST_WINDOW`: the
# fit's full step `T`, which both time models need) cost at most the own-time share of the planned fit
# (`windows.OWN_SHARE`, which the later probe windows get what is left of), else takes the analytic one: so that the
# fit's whole own time can fit the share. Tried three times with the profile of 6 full steps (from 360 steps at 2x) and
# not kept: it moved fits that had measured to the analytic profile, which cost Fashion-MNIST's 400-step fit 1.7 points
# (2026-11-27), the published ELPV run 1.7 points (2026-12-06 11:53; a tie on 12-07 05:40) and few-shot ELPV at 1.5x
# (200 steps) 1.5 points and its contract (2026-12-07 08:16: three fits at 1.19-1.34x, `T` timed by a process the
# analytic profile had left cold). With the profile of 2.3 full steps (2026-12-07) every one of those fits measures
# (from 214 steps at 2x, 160 at 1.5x) and the fits that took the analytic profile still do (ELPV's 150-step fit,
# few-shot ELPV at 2x, MiniLM's 90 steps), where the profile alone would have moved them to a measured profile and
# their own time above the share (the first window's 3 full steps are 4% of a 150-step fit at 2x).
# A share that shrinks, above 2x, with the room a selected step has above the forward pass every step pays (about this
# share of a full step: backward about twice the forward; Lite0 on Fashion-MNIST, the head alone 0.28-0.30 of a full
# step), against that room at 2x (`ProfileChoice.room`). At 3x there is none to spare: on Fashion-MNIST's 400-step fit
# the measured profile took 3.0-5.0 s of the 7-12 s its selections had above the head alone, and 3 of 8 first runs
# trained the head and little more (70-73%); with the analytic one (0.9-3.2 s) 8 of 8 reached 75.5-83.3%, the same mean
# within the spread (docs/results.md, 2026-11-27).
FORWARD_SHARE = 1 / 3
# The first probe window after a timed profile, in full steps: its warm-up step, then the steady samples of `T`.
FIRST_WINDOW = warmup.first_window(warmup.PROFILED_WARMUP_STEPS)


class ProfileChoice(NamedTuple):
    """The time model a fit profiles with (`of`), whether a cached measured profile comes first (`auto`), whether
    profiling takes the fit's first step as its first pass (`first_step`, `FirstStep`), and whether that step's
    backward pass is the profile's full step's (`first_backward`: on CPU, `measure_profile`)."""

    method: TimingMethod
    auto: bool
    first_step: bool = False
    first_backward: bool = False

    @classmethod
    def of(
        cls,
        time_model: TimeModel,
        total_steps: int | None,
        speedup: float,
        first_step: bool = False,
        first_backward: bool = False,
    ) -> ProfileChoice:
        """`time_model`, or for "auto" the measured model when its first profile (`steps`) and the first probe window
        after it (`FIRST_WINDOW`) cost at most `windows.OWN_SHARE` of the fit's planned `total_steps / speedup` full
        steps, times `room(speedup)` (always when the length is unknown), else the analytic one ("flops"); a measured
        profile already in the cache is used either way (`measure_profile`).

        Example:
            >>> ProfileChoice.of("auto", 307, 2.0).method, ProfileChoice.of("auto", 306, 2.0).method
            ('measured', 'flops')
            >>> cpu = {"first_step": True, "first_backward": True}  # the first step is its first pass, its backward too
            >>> ProfileChoice.of("auto", 240, 2.0, **cpu).method, ProfileChoice.of("auto", 150, 2.0, **cpu).method
            ('measured', 'flops')
            >>> ProfileChoice.of("auto", 400, 3.0, first_step=True).method  # no room above the forward pass
            'flops'
            >>> ProfileChoice.of("auto", None, 2.0).method, ProfileChoice.of("measured", 10, 2.0)
            ('measured', ProfileChoice(method='measured', auto=False, first_step=False, first_backward=False))
        """
        first_backward = first_step and first_backward
        if time_model != "auto":
            return cls(time_model, auto=False, first_step=first_step, first_backward=first_backward)
        measured = cls("measured", auto=True, first_step=first_step, first_backward=first_backward)
        budget = windows.OWN_SHARE * cls.room(speedup) * (total_steps or 0) / speedup + 1e-9  # within rounding
        affordable = total_steps is None or measured.steps + FIRST_WINDOW <= budget
        return measured if affordable else measured._replace(method="flops")

    @classmethod
    def for_fit(
        cls, trainer: L.Trainer, pl_module: L.LightningModule, time_model: TimeModel, total_steps: int | None,
        speedup: float, fresh: bool,
    ) -> ProfileChoice:  # fmt: skip
        """`of` for a fit starting on `trainer`: its first step is the profile's first pass where `FirstStep` applies
        and the fit is `fresh` (a resumed one restores a selection), and on CPU that step's backward pass is the
        profile's full step's too (`FirstStep.backward_applies`)."""
        first_step = fresh and FirstStep.applies(trainer, pl_module)
        return cls.of(time_model, total_steps, speedup, first_step, FirstStep.backward_applies(pl_module))

    @property
    def counts(self) -> bool:
        """Whether the fit's first step counts the profile's ops as its forward pass runs (`FirstStep.counted`)."""
        return self.first_step and self.method == "flops"

    @staticmethod
    def room(speedup: float) -> float:
        """The room a selected step has above the forward pass (`1 / speedup - FORWARD_SHARE` of a full step) against
        that room at 2x, at most 1: where "auto"'s share holds in full (at 2x and below), where it shrinks,
        and where nothing is left for a measured profile (3x and above).

        Example:
            >>> [round(ProfileChoice.room(s), 2) for s in (1.5, 2.0, 2.5, 3.0, 4.0)]
            [1.0, 1.0, 0.4, 0.0, 0.0]
        """
        return min(1.0, max(0.0, (1 / speedup - FORWARD_SHARE) / (1 / 2 - FORWARD_SHARE)))

    @property
    def steps(self) -> float:
        """What the profile costs the fit, in full training steps: the fingerprint's pass unless the fit's first step
        is it; the measured profile's instrumented passes (`INSTRUMENTED_STEPS`), or the analytic one's counting
        forward pass unless that step counted; a plain full step between two plain forward passes, or one plain
        forward pass when that step's backward pass is the full step's.

        Example:
            >>> [ProfileChoice("flops", False, *first).steps for first in ((False, False), (True, False), (True, True))]
            [3.0, 1.6666666666666665, 0.3333333333333333]
            >>> [ProfileChoice("measured", False, *first).steps for first in ((False, False), (True, True))]
            [4.666666666666666, 2.3333333333333335]
        """
        fingerprint = 0 if self.first_step else 1
        passes = INSTRUMENTED_STEPS if self.method == "measured" else (0 if self.first_step else FORWARD_SHARE)
        full_step = FORWARD_SHARE if self.first_step and self.first_backward else 1 + 2 * FORWARD_SHARE
        return fingerprint + passes + full_step

    def _cost(self) -> str:
        """`steps` in words: "about 6 training steps", "less than one training step"."""
        steps = round(self.steps)
        if self.steps < 1:
            return "less than one training step"
        return f"about {steps} training step{'' if steps == 1 else 's'}"

    def opening(self, module: nn.Module, speedup: float, cache_on: bool) -> str:
        """The line said as profiling starts to time (`PhaseLines`: not said when the cache has the profile): what it
        costs, why "auto" took the analytic model, and with `cache_on` (a cache directory is on) that the cache keeps
        it for later fits."""
        count = sum(p.requires_grad for p in module.parameters())
        when = "after the first training step's backward pass" if self.first_step else "on the first batch"
        timed = "scaled to this step's backward pass" if self.first_backward else "one timed step"
        what = f"with the analytic time model (op counts, {timed})" if self.method == "flops" else "measured"
        why = ""
        if self.auto and self.method == "flops":
            room, cost = self.room(speedup), self._replace(method="measured")._cost()
            cost = f"; time_model='auto': a measured profile ({cost})"
            if room == 0.0:
                why = f"{cost} would eat the little room a selected step has above the forward pass at {speedup:g}x"
            else:
                share = windows.OWN_SHARE
                scaled = f"{share * room:.0%}" if share * room >= 0.01 else f"{share * room:.1%}"  # not "0%"
                why = f"{cost} and the first probe window after it ({FIRST_WINDOW} full steps) would be more than "
                why += f"{scaled} of this fit"
                if room < 1.0:
                    why += f" ({share:.0%}, scaled to the room a selected step has above the forward pass)"
            why += "; time_model='measured' measures anyway"
        cached = "; kept in the cache for later fits that profile this model on this device the same way"
        return (
            f"ElasticTensorSelection: profiling {count} tensors {when}, {what} ({self._cost()}, "
            f"more on a busy machine{cached if cache_on else ''}{why})"
        )


def measure_profile(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    choice: ProfileChoice,
    cache_dir: Path | None,
    speedup: float,
    first: FirstStep | None = None,
) -> Measured:
    """Profile the real training step on the first training batch (or read it from the cache), saying so
    (`ProfileChoice.opening`, then one line a phase: `PhaseLines`) once it is not in the cache.

    With `first`, on the batch of the fit's first step, which has just run its forward and backward pass: its
    signature keys the cache, so profiling takes no pass of its own for it, if its inputs have the shapes of the
    first batch (`_first_batch`, in data set order); the analytic profile then takes the ops that step's forward pass
    counted (`FirstStep.counted`), with no counting pass; on CPU either profile is scaled to that step's timed
    backward pass (`FirstStep.backward`), with no full step of its own. Else, as without `first`,
    on the first batch with a pass of its own for the key. The key must not depend on the shuffle: inputs whose shapes
    vary per batch (text padded to the longest in its batch) would key a shuffled batch's shapes, and the next run, or
    the check of a resume or a second fit (`stale_reason`, on the first batch), would profile again. So the key, and
    the shapes timed, are the first batch's in every run. `Measured.timed` says whether this process ran the timing
    passes (which warm it up) or read the cache, with the `choice`'s method (for "auto", a cached measured profile
    first).
    """
    with collector_paused():  # no collection inside the profile's passes nor its account (`timing.collector_paused`)
        batch = _first_batch(trainer)
        signature, backward, counted = None, None, None
        if first is not None and _shapes(first.batch) == _shapes(batch):
            batch, signature, counted = first.batch, first.signature, first.counted
            backward = first.backward if choice.first_backward else None
        batch_idx = 0 if first is None else first.batch_idx  # the branch of `training_step` the fit's first step took
        opening = choice.opening(pl_module, speedup, cache_on=cache_dir is not None)
        with PhaseLines(opening) as phases, training_step(trainer, pl_module, batch, batch_idx) as compute_loss:
            profiled = profile(
                pl_module,
                compute_loss,
                method=choice.method,
                cache_dir=cache_dir,
                progress=phases,
                signature=signature,
                backward=backward,
                counted=counted,  # the step counted its ops only for an analytic profile (`ProfileChoice.counts`)
                cached_first=("measured",) if choice.auto else (),  # `profile` looks each method up once
            )
    timed = phases.timed
    if trainer.world_size > 1:  # the same profile on every rank, timed where every rank timed it: the first window's
        # length follows from it (`warmup.FirstWindow.warmup_steps`), and every rank must end that window alike
        profiled = TimingProfile.from_dict(trainer.strategy.broadcast(profiled.to_dict(), src=0))
        timed = not any_rank(trainer.strategy, not timed, pl_module.device)
    return Measured(profiled, timed)


class Measured(NamedTuple):
    """`measure_profile`'s profile, and whether this process ran its timing passes (`timed`), or read the cache."""

    profile: TimingProfile
    timed: bool


class PhaseLines:
    """One rank-zero line as each profiling phase starts, with the seconds spent so far (a large model's profile
    takes minutes, and says where it is); and whether the timing passes ran (`timed`), which a cached profile skips.
    Phase 1 (the fingerprint, with which a profile read from the cache ends) is held back, and said after `opening`
    as phase 2 starts: a fit that reads its profile is told so (`messages`), not that profiling starts. Used as a
    context, it says what it held when profiling fails before phase 2 (above the error, as before it held them).
    """

    def __init__(self, opening: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock, self.start, self.timed = clock, clock(), False
        self.held = [opening]

    def __call__(self, k: int, n: int, what: str) -> None:
        self.timed = self.timed or k >= 2  # phase 1 is the fingerprint, which a cached profile ends with
        line = f"ElasticTensorSelection: profiling, phase {k} of {n}: {what} ({self.clock() - self.start:.1f} s so far)"
        self.held.append(line)
        if k >= 2:
            self.flush()

    def flush(self) -> None:
        """Say the lines held back."""
        for line in self.held:
            rank_zero_info(line)
        self.held = []

    def __enter__(self) -> PhaseLines:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.flush()


@contextmanager
def training_step(
    trainer: L.Trainer, pl_module: L.LightningModule, batch: Any = None, batch_idx: int = 0
) -> Iterator[Callable[[], Tensor]]:
    """The loss of the real training step on `batch` (default: the first batch) at `batch_idx` as a callable, with
    logging muted and no DDP sync."""
    batch = _first_batch(trainer) if batch is None else batch
    with _muted(pl_module), _block_parallel_sync_behavior(trainer.strategy, block=True):

        def compute_loss() -> Tensor:
            # Eager even where torch.compile would run the step (the module given to `fit`, a compiled submodule):
            # the hooks see every op and autograd node, and profiling compiles no graph. `torch.compiler.disable`
            # would not do: a compiled submodule called inside it still compiles.
            with torch.compiler.set_stance("force_eager"), trainer.precision_plugin.train_step_context():
                return _loss_of(pl_module.training_step(batch, batch_idx), batch_idx)

        yield compute_loss


def _loss_of(output: Any, batch_idx: int) -> Tensor:
    """The loss a `training_step` returned, which profiling needs."""
    loss = loss_in(output)
    if loss is None:
        raise ElasticConfigError(
            "`ElasticTensorSelection` profiles the real training step, so `training_step` must return the loss "
            f"(a tensor or a dict with 'loss') on the batch it profiles (batch_idx {batch_idx}). Found: "
            f"{type(output).__name__}"
        )
    return loss


def _shapes(batch: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of every tensor in a batch, in order."""
    return [(tuple(t.shape), t.dtype) for t in tensors_in(batch)]


def _first_batch(trainer: L.Trainer) -> Any:
    """One real batch of the training data, on the training device, drawn without disturbing training.

    A map-style data set gives its first samples directly, so the sampler's random state is not advanced (the
    epoch's shuffle stays what it would have been); other loaders are iterated once. Global RNG is restored.
    The batch then takes the path of Lightning's own training loop (``TrainingEpochLoop.advance``): the precision
    plugin's input conversion (``"bf16-true"``, ``"64-true"``), `on_before_batch_transfer`, and the strategy's
    transfer to the device with `on_after_batch_transfer`.
    """
    loaders = trainer.train_dataloader
    with torch.random.fork_rng(devices=[]):
        if isinstance(loaders, DataLoader) and isinstance(loaders.dataset, Sized) and loaders.batch_size:
            size = min(loaders.batch_size, len(loaders.dataset))
            batch = loaders.collate_fn([loaders.dataset[i] for i in range(size)])
            dataloader_idx = 0
        else:
            combined = CombinedLoader(loaders, mode="max_size_cycle")
            iter(combined)
            batch, _, dataloader_idx = next(iter(combined))
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)


@contextmanager
def _muted(pl_module: L.LightningModule) -> Iterator[None]:
    """Run the training step for profiling without logging. Its metrics get their states back with the rest of the
    module (`profiling.state.ModelState`: tensor states their values, list states their items, the update count)."""
    pl_module.log = _ignore  # type: ignore[method-assign]
    pl_module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
