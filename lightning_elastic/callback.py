"""`ElasticTensorSelection`: train, at every moment, only the tensors that matter most under a time budget.

The callback is the method's table of contents; each step lives in its own module:

1. profile    (`profiler.profile`)          per-tensor backward times of this model on this device, once;
2. probe      (`importance.ImportanceEvaluator`) importance from a window of ordinary full training steps;
3. select     (`budget.step_time_model`, `selector.select`) the exact DP under `full step / speedup`;
4. apply      (`freezing.apply_mask`)        `requires_grad` on or off, so autograd does less work;
5. inspect    (`inspection`)                 what was trained when, and what it cost, to every logger.

`schedule.Schedule` says when probe windows open and selections happen.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Sequence, Sized
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics import Metric
from typing_extensions import override

from lightning_elastic.budget import StepTimeModel, step_time_model
from lightning_elastic.distributed import SelectiveAllReduce, install_selective_allreduce, prepare_strategy
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.freezing import BN_POLICIES, BnPolicy, apply_bn_policy, apply_mask, match_patterns
from lightning_elastic.importance import ImportanceEvaluator
from lightning_elastic.inspection import profile_table, selection_heatmap
from lightning_elastic.profiler import TimingProfile, profile
from lightning_elastic.schedule import IntervalUnit, Schedule
from lightning_elastic.selector import select
from lightning_elastic.timing import StepTimer

TimeModel = Literal["measured", "flops"]
TIME_MODELS: tuple[str, ...] = ("measured", "flops")
INTERVAL_UNITS: tuple[str, ...] = ("epoch", "step")
STATE_VERSION = 1


@dataclass
class _Costs:
    """Seconds measured in the current probe window and since the last selection."""

    probe_steps: list[float] = field(default_factory=list)
    probe_overhead: list[float] = field(default_factory=list)
    optimizer: list[float] = field(default_factory=list)
    selected_steps: list[float] = field(default_factory=list)


class ElasticTensorSelection(Callback):
    """Trains, at every moment, only the parameter tensors worth their time under a per-step time budget.

    Before each selection, `probe_steps` ordinary training steps with every candidate tensor trainable measure
    each tensor's importance (the loss drop its real updates bring). An exact dynamic program then picks the
    tensors of greatest total importance whose training step fits in `1 / speedup` of a full step, under a time
    model profiled on this device; the others get `requires_grad=False`, so autograd skips their weight
    gradients and stops at the deepest selected tensor. Any tensor may leave or rejoin at each selection.

    Args:
        speedup: target per-step speedup over training every tensor; > 1.
        interval: re-select every `interval` epochs or optimizer steps (see `interval_unit`).
        interval_unit: "epoch" (re-select as an epoch starts, the probe window ending the epoch before) or "step".
        probe_steps: full training steps that measure importance before each selection.
        time_model: "measured" (per-tensor times profiled on this device) or "flops" (analytic fallback).
        train_always: shell-style patterns of parameter names (as `LightningModule.named_parameters()` gives
            them) that are always trained, e.g. a new classifier head: `["model.fc.*"]`.
        train_never: patterns of parameter names that are never trained. Parameters that do not require grad when
            training starts are never trained either.
        bn_policy: BatchNorm layers whose tensors are all frozen: "update" keeps updating their running
            statistics in training mode (PyTorch's default behaviour); "freeze" puts them in eval mode, so the
            frozen part of the network is a fixed function.
        resolution: time quantisation of the dynamic program (units of the budget).
        cache_dir: directory where timing profiles are cached across runs; None profiles every run.
        profile: a timing profile to use instead of profiling when training starts: a `TimingProfile`, or the
            path of one saved as JSON (`recipes/profile_model.py` writes them). Its tensor names must be the
            module's parameter names.
        calibrate: correct the profile with the optimizer and loop times measured in each probe window, so that
            the budget is a fraction of the real step. False uses the profile alone: decisions then depend on
            importance only, the same in every run (useful to compare runs).
        log_images: write the selection heatmap to TensorBoard loggers.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[ElasticTensorSelection(speedup=2.0)], max_epochs=1)
    """

    def __init__(
        self,
        speedup: float = 2.0,
        interval: int = 1,
        interval_unit: IntervalUnit = "epoch",
        probe_steps: int = 10,
        time_model: TimeModel = "measured",
        train_always: Sequence[str] = (),
        train_never: Sequence[str] = (),
        bn_policy: BnPolicy = "update",
        resolution: int = 1000,
        cache_dir: str | None = None,
        profile: TimingProfile | str | os.PathLike[str] | None = None,
        calibrate: bool = True,
        log_images: bool = True,
    ) -> None:
        problems = []
        if (
            isinstance(speedup, bool)
            or not isinstance(speedup, (int, float))
            or not math.isfinite(speedup)
            or speedup <= 1
        ):
            problems.append(f"`speedup` must be a finite number > 1. Found: {speedup!r}")
        if not _positive_int(interval):
            problems.append(f"`interval` must be a positive int. Found: {interval!r}")
        if interval_unit not in INTERVAL_UNITS:
            problems.append(f"`interval_unit` must be one of {INTERVAL_UNITS}. Found: {interval_unit!r}")
        if not _positive_int(probe_steps):
            problems.append(f"`probe_steps` must be a positive int. Found: {probe_steps!r}")
        if time_model not in TIME_MODELS:
            problems.append(f"`time_model` must be one of {TIME_MODELS}. Found: {time_model!r}")
        for name, patterns in (("train_always", train_always), ("train_never", train_never)):
            if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
                problems.append(f"`{name}` must be a list of non-empty name patterns. Found: {patterns!r}")
        if bn_policy not in BN_POLICIES:
            problems.append(f"`bn_policy` must be one of {BN_POLICIES}. Found: {bn_policy!r}")
        if not _positive_int(resolution):
            problems.append(f"`resolution` must be a positive int. Found: {resolution!r}")
        if profile is not None and not isinstance(profile, (TimingProfile, str, os.PathLike)):
            problems.append(
                f"`profile` must be a TimingProfile, a path to one saved as JSON, or None. Found: {profile!r}"
            )
        if problems:
            raise ElasticConfigError("; ".join(problems))
        self._speedup = float(speedup)
        self._interval = interval
        self._interval_unit: IntervalUnit = interval_unit
        self._probe_steps = probe_steps
        self._time_model: TimeModel = time_model
        self._train_always = tuple(train_always)
        self._train_never = tuple(train_never)
        self._bn_policy: BnPolicy = bn_policy
        self._resolution = resolution
        self._cache_dir = cache_dir
        self._given_profile = profile
        self._calibrate = calibrate
        self._log_images = log_images

        # Runtime state, built in `on_train_start`.
        self._profile: TimingProfile | None = None
        self._params: list[nn.Parameter] = []
        self._required: tuple[bool, ...] = ()
        self._forbidden: tuple[bool, ...] = ()
        self._schedule: Schedule | None = None
        self._evaluator: ImportanceEvaluator | None = None
        self._step_timer: StepTimer | None = None
        self._optimizer_timer: StepTimer | None = None
        self._overhead_timer: StepTimer | None = None
        self._bn_frozen: list[str] = []
        self._allreduce: SelectiveAllReduce | None = None
        self._costs = _Costs()
        self._step_at_batch_start = 0
        self._step_seconds = 0.0
        # Checkpointed state.
        self._mask: tuple[bool, ...] | None = None
        self._probe_end: int | None = None
        self._pending_selection = False
        self._history: list[dict[str, Any]] = []
        self._totals = {"profile_seconds": 0.0, "probe_seconds": 0.0, "select_seconds": 0.0}
        self._restored: dict[str, Any] | None = None

    # ------------------------------------------------------------------ checks that need the trainer

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ElasticConfigError(
                "`ElasticTensorSelection` needs automatic optimization (it measures importance around each "
                "optimizer step). Found: `automatic_optimization = False`"
            )
        prepare_strategy(trainer.strategy)
        if not any(p.requires_grad for p in pl_module.parameters()):
            raise ElasticConfigError("`ElasticTensorSelection` needs a model with trainable parameters. Found: none")

    # ------------------------------------------------------------------ 1. profile, once

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:
            self._schedule = self._make_schedule(trainer)
        except ElasticConfigError as err:
            if not getattr(trainer, "fast_dev_run", False):  # set by the Trainer; not in its type stubs
                raise
            self._schedule = None  # a smoke test too short for a probe window and a selection: stay off
            rank_zero_info(f"ElasticTensorSelection: off under `fast_dev_run`, every tensor trains ({err})")
            return
        started = time.perf_counter()
        self._profile = (
            self._restored_profile(pl_module)
            or _load_profile(self._given_profile)
            or self._measure_profile(trainer, pl_module)
        )
        self._totals["profile_seconds"] += time.perf_counter() - started
        self._profile = _same_on_every_rank(trainer, self._profile)
        named = dict(pl_module.named_parameters())
        missing = [n for n in self._profile.names if n not in named]
        if missing:
            raise ElasticConfigError(
                f"`profile` must describe this module's parameters (names as `named_parameters()` gives them). "
                f"Found names the module does not have: {missing[:5]}"
            )
        self._params = [named[name] for name in self._profile.names]
        user_frozen = tuple(not p.requires_grad for p in self._params)
        self._required = match_patterns(self._profile.names, self._train_always, "train_always")
        never = match_patterns(self._profile.names, self._train_never, "train_never")
        self._forbidden = tuple(a or b for a, b in zip(never, user_frozen, strict=True))
        clash = [n for n, r, f in zip(self._profile.names, self._required, self._forbidden, strict=True) if r and f]
        if clash:
            raise ElasticConfigError(
                "`train_always` must not name tensors that `train_never` names or that do not require grad. "
                f"Found: {clash}"
            )
        if all(self._forbidden):
            raise ElasticConfigError(
                "`train_never` must leave at least one trainable tensor. Found: every tensor excluded"
            )
        self._check_reachable(step_time_model(self._profile))
        self._evaluator = ImportanceEvaluator(self._params)
        device = pl_module.device
        self._step_timer, self._optimizer_timer, self._overhead_timer = (StepTimer(device) for _ in range(3))
        self._restore_runtime_state()
        self._allreduce = install_selective_allreduce(trainer.strategy)
        rank_zero_info(
            f"ElasticTensorSelection: {len(self._params)} tensors profiled on {self._profile.device} "
            f"(full forward+backward {self._profile.t_full * 1e3:.1f} ms, forward {self._profile.t_fw * 1e3:.1f} ms); "
            f"target speedup {self._speedup:g}, {self._schedule.probe_steps} probe steps every "
            f"{self._interval} {self._interval_unit}(s)"
        )
        self._log_profile(trainer)

    def _measure_profile(self, trainer: L.Trainer, pl_module: L.LightningModule) -> TimingProfile:
        batch = _first_batch(trainer)
        with _muted(pl_module), _block_parallel_sync_behavior(trainer.strategy, block=True):

            def compute_loss() -> Tensor:
                with trainer.precision_plugin.train_step_context():
                    return _loss_of(pl_module.training_step(batch, 0))

            return profile(pl_module, compute_loss, method=self._time_model, cache_dir=self._cache_dir)

    def _restored_profile(self, pl_module: L.LightningModule) -> TimingProfile | None:
        if self._restored is None or self._restored.get("profile") is None:
            return None
        restored = TimingProfile.from_dict(self._restored["profile"])
        names = {n for n, p in pl_module.named_parameters()}
        if not restored.device.startswith(pl_module.device.type) or not set(restored.names) <= names:
            rank_zero_warn(
                "ElasticTensorSelection: the checkpoint's profile is for another device or model; re-profiling"
            )
            return None
        return restored

    def _check_reachable(self, model: StepTimeModel, full: float | None = None) -> None:
        reachable = model.max_speedup(self._required, self._forbidden, full)
        if reachable < self._speedup:
            raise ElasticConfigError(
                f"`speedup` must be at most {reachable:.2f} for this model on this device: the forward pass and "
                f"the parts of a step that every selection pays (at least the `train_always` tensors, or one "
                f"tensor) take {1 / reachable:.0%} of a full step. Found: {self._speedup:g}"
            )

    def _make_schedule(self, trainer: L.Trainer) -> Schedule:
        batches = trainer.num_training_batches
        steps_per_epoch = math.ceil(batches / trainer.accumulate_grad_batches) if math.isfinite(batches) else math.inf
        schedule = Schedule(self._interval, self._interval_unit, self._probe_steps, steps_per_epoch)
        if schedule.period <= self._probe_steps:
            raise ElasticConfigError(
                f"`probe_steps` must be fewer than the optimizer steps between two selections ({schedule.period:g} "
                f"= `interval` {self._interval} x {'steps per epoch' if self._interval_unit == 'epoch' else '1 step'}"
                f"). Found: {self._probe_steps}"
            )
        return schedule

    # ------------------------------------------------------------------ 2. probe: open windows, measure importance

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._schedule is None:  # off for this fit
            return
        if self._pending_selection:
            self._select_and_apply(trainer, pl_module)
        elif self._schedule.opens_at_epoch_start(trainer.current_epoch) and self._probe_end is None:
            self._open_probe(trainer, trainer.global_step + self._probe_steps)
        self._bn_frozen = apply_bn_policy(pl_module, self._bn_policy, self._bn_frozen)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._schedule is None:
            return
        assert self._step_timer is not None
        step = trainer.global_step
        self._step_at_batch_start = step
        first_of_step = batch_idx % trainer.accumulate_grad_batches == 0
        if first_of_step and self._probe_end is None and (end := self._schedule.window_end(step)) is not None:
            self._open_probe(trainer, end)
        self._step_timer.start()

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._schedule is None:
            return
        if self._probe_end is None:
            return
        assert self._evaluator is not None and self._overhead_timer is not None and self._optimizer_timer is not None
        self._overhead_timer.start()
        self._evaluator.before_step()
        self._overhead_timer.stop()
        self._optimizer_timer.start()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._schedule is None:
            return
        assert self._step_timer is not None and self._evaluator is not None
        assert self._overhead_timer is not None and self._optimizer_timer is not None
        if trainer.global_step == self._step_at_batch_start:  # accumulating gradients: the step goes on
            self._step_timer.stop()
            self._step_seconds += sum(self._step_timer.pop())
            return
        if self._probe_end is None:
            self._step_timer.stop()
            self._costs.selected_steps.append(self._step_seconds + sum(self._step_timer.pop()))
            self._step_seconds = 0.0
            return
        self._optimizer_timer.stop()
        self._overhead_timer.start()
        self._evaluator.after_step()
        self._overhead_timer.stop()
        self._step_timer.stop()
        self._costs.probe_steps.append(self._step_seconds + sum(self._step_timer.pop()))
        self._step_seconds = 0.0
        self._costs.optimizer.extend(self._optimizer_timer.pop())
        self._costs.probe_overhead.append(sum(self._overhead_timer.pop()))
        if trainer.global_step >= self._probe_end:
            self._evaluator.finish()
            self._probe_end = None
            if self._schedule.selects_at_epoch_start(trainer.global_step):
                self._pending_selection = True
            else:
                self._select_and_apply(trainer, pl_module)

    def _open_probe(self, trainer: L.Trainer, end: int) -> None:
        assert self._evaluator is not None
        self._log_interval_timing(trainer)
        self._probe_end = end
        self._costs = _Costs()
        self._evaluator.reset()
        apply_mask(self._params, [not f for f in self._forbidden])
        self._bn_frozen = apply_bn_policy(trainer.lightning_module, self._bn_policy, self._bn_frozen)

    # ------------------------------------------------------------------ 3. select and 4. apply

    def _select_and_apply(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self._profile is not None and self._evaluator is not None
        started = time.perf_counter()
        self._pending_selection = False
        importance = trainer.strategy.reduce(self._evaluator.importance.to(pl_module.device), reduce_op="mean")
        importance = importance.double().cpu()
        probe = torch.tensor(
            [_mean(self._costs.probe_steps) - _mean(self._costs.probe_overhead), _mean(self._costs.optimizer)],
            dtype=torch.float64,
            device=pl_module.device,
        )
        full, optimizer_seconds = trainer.strategy.reduce(probe, reduce_op="mean").cpu().tolist()
        if not (self._calibrate and math.isfinite(full) and math.isfinite(optimizer_seconds)):
            full, optimizer_seconds = self._profile.t_full, 0.0
        loop_seconds = max(0.0, full - self._profile.t_full - optimizer_seconds)
        model = step_time_model(self._profile, optimizer_seconds=optimizer_seconds, loop_seconds=loop_seconds)
        budget = model.budget(self._speedup, full)
        floor = model.predict(self._required) - model.t_fixed if any(self._required) else 0.0
        if budget <= floor:
            rank_zero_warn(
                f"ElasticTensorSelection: with the step times measured in this run (full step {full * 1e3:.1f} ms), "
                f"a speedup of {self._speedup:g} leaves no time for any tensor; training the cheapest selection. "
                f"Largest reachable: {model.max_speedup(self._required, self._forbidden, full):.2f}"
            )
        selection = select(
            model.t_dw,
            model.t_dy,
            importance.tolist(),
            max(budget, _with_grid_slack(floor, sum(self._required), self._resolution), 1e-12),
            self._resolution,
            required=self._required,
            forbidden=self._forbidden,
        )
        mask = selection.mask if any(selection.mask) else _cheapest_single(model, importance, self._forbidden)
        select_seconds = time.perf_counter() - started
        self._totals["select_seconds"] += select_seconds
        self._totals["probe_seconds"] += sum(self._costs.probe_steps)
        apply_mask(self._params, mask)
        self._bn_frozen = apply_bn_policy(pl_module, self._bn_policy, self._bn_frozen)
        _invalidate_compiled_graphs(pl_module)
        self._mask = tuple(mask)
        record = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "mask": "".join("1" if m else "0" for m in mask),
            "importance": importance.tolist(),
            "predicted_seconds": model.predict(mask),
            "full_seconds": full,
            "budget_seconds": budget,
        }
        self._history.append(record)
        self._costs.selected_steps = []
        self._log_selection(trainer, record, select_seconds, optimizer_seconds)

    # ------------------------------------------------------------------ 5. inspect

    def summary(self) -> dict[str, float]:
        """Figures of the run so far: measured speedup, selected fraction, and the method's own costs in seconds."""
        last = self._history[-1] if self._history else None
        selected = [s for r in self._history for s in r.get("selected_steps", [])]
        full = _mean([r["full_seconds"] for r in self._history])
        return {
            "selections": float(len(self._history)),
            "selected_fraction": (last["mask"].count("1") / len(last["mask"])) if last else math.nan,
            "full_step_seconds": full,
            "selected_step_seconds": _mean(selected),
            "measured_speedup": full / _mean(selected) if selected else math.nan,
            **self._totals,
        }

    def _log_interval_timing(self, trainer: L.Trainer) -> None:
        """Close the interval of the last selection: its measured step times against the prediction."""
        steps = self._costs.selected_steps
        if not self._history or not steps:
            return
        record = self._history[-1]
        record["selected_steps"] = list(steps)
        measured = _mean(steps)
        metrics = {
            "elastic/measured_step_ms": measured * 1e3,
            "elastic/predicted_step_ms": record["predicted_seconds"] * 1e3,
            "elastic/measured_speedup": record["full_seconds"] / measured,
        }
        if self._allreduce is not None and self._allreduce.last_step_full_bytes:
            metrics["elastic/allreduce_fraction"] = (
                self._allreduce.last_step_bytes / self._allreduce.last_step_full_bytes
            )
        _log_metrics(trainer, metrics)

    def _log_selection(
        self, trainer: L.Trainer, record: dict[str, Any], select_seconds: float, optimizer_seconds: float
    ) -> None:
        assert self._profile is not None
        trained = [c == "1" for c in record["mask"]]
        elements = sum(n for n, m in zip(self._profile.numel, trained, strict=True) if m)
        predicted_ms, full_ms = record["predicted_seconds"] * 1e3, record["full_seconds"] * 1e3
        _log_metrics(
            trainer,
            {
                "elastic/selected_fraction": sum(trained) / len(trained),
                "elastic/selected_elements_fraction": elements / sum(self._profile.numel),
                "elastic/predicted_step_ms": predicted_ms,
                "elastic/full_step_ms": full_ms,
                "elastic/target_step_ms": full_ms / self._speedup,
                "elastic/optimizer_ms": optimizer_seconds * 1e3,
                "elastic/probe_overhead_ms": _mean(self._costs.probe_overhead) * 1e3,
                "elastic/select_ms": select_seconds * 1e3,
            },
        )
        for writer in _tensorboard_writers(trainer):
            step = trainer.global_step
            writer.add_histogram("elastic/importance", torch.tensor(record["importance"]), step)
            if self._log_images:
                history = [[c == "1" for c in r["mask"]] for r in self._history]
                image = selection_heatmap(history, self._required, self._forbidden)
                writer.add_image("elastic/selection", image, step, dataformats="HWC")
            names = ", ".join(n for n, m in zip(self._profile.names, trained, strict=True) if m)
            writer.add_text(
                "elastic/selection",
                f"step {step}, epoch {record['epoch']}: {sum(trained)}/{len(trained)} tensors trained; predicted "
                f"step {predicted_ms:.1f} ms of {full_ms:.1f} ms.  \n{names}",
                step,
            )

    def _log_profile(self, trainer: L.Trainer) -> None:
        assert self._profile is not None
        for writer in _tensorboard_writers(trainer):
            writer.add_text("elastic/profile", profile_table(self._profile), trainer.global_step)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._schedule is None:
            return
        self._log_interval_timing(trainer)
        self._costs.selected_steps = []
        summary = self.summary()
        rank_zero_info(
            "ElasticTensorSelection: " + ", ".join(f"{k} {v:.4g}" for k, v in summary.items() if math.isfinite(v))
        )

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "profile": None if self._profile is None else self._profile.to_dict(),
            "profile_fingerprint": None if self._profile is None else self._profile.fingerprint,
            "mask": None if self._mask is None else list(self._mask),
            "probe_end": self._probe_end,
            "pending_selection": self._pending_selection,
            "importance": None if self._evaluator is None else self._evaluator.state_dict(),
            "history": [dict(r) for r in self._history],
            "totals": dict(self._totals),
            "bn_frozen": list(self._bn_frozen),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def _restore_runtime_state(self) -> None:
        """Put the checkpoint's selection back in force before the first resumed step."""
        state, self._restored = self._restored, None
        if not state:
            return
        assert self._profile is not None and self._evaluator is not None
        mask = state.get("mask")
        if mask is not None and len(mask) == len(self._params):
            self._mask = tuple(bool(m) for m in mask)
            apply_mask(self._params, self._mask)
        self._probe_end = state.get("probe_end")
        self._pending_selection = bool(state.get("pending_selection", False))
        if self._probe_end is not None:
            apply_mask(self._params, [not f for f in self._forbidden])
            if state.get("importance") is not None:
                self._evaluator.load_state_dict(state["importance"])
        self._history = list(state.get("history", []))
        self._totals.update(state.get("totals", {}))
        self._bn_frozen = list(state.get("bn_frozen", []))


# ---------------------------------------------------------------------- helpers


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _loss_of(output: Any) -> Tensor:
    """The loss a `training_step` returned (a tensor, or a mapping with "loss")."""
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise ElasticConfigError(
            "`ElasticTensorSelection` profiles the real training step, so `training_step` must return the loss "
            f"(a tensor or a dict with 'loss'). Found: {type(output).__name__}"
        )
    return loss


def _first_batch(trainer: L.Trainer) -> Any:
    """One real batch of the training data, on the training device, drawn without disturbing training.

    A map-style data set gives its first samples directly, so the sampler's random state is not advanced (the
    epoch's shuffle stays what it would have been); other loaders are iterated once. Global RNG is restored.
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
    return trainer.strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)


def _load_profile(given: TimingProfile | str | os.PathLike[str] | None) -> TimingProfile | None:
    if given is None or isinstance(given, TimingProfile):
        return given
    path = Path(given)
    try:
        return TimingProfile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ElasticConfigError(
            f"`profile` must be a readable timing profile saved as JSON. Found: {str(path)!r} ({err})"
        ) from err


@contextmanager
def _muted(pl_module: L.LightningModule) -> Iterator[None]:
    """Run the training step for profiling without logging, and leave its metrics as they were."""
    metrics = [m for m in pl_module.modules() if isinstance(m, Metric)]
    counts = [m.update_count for m in metrics]
    pl_module.log = _ignore  # type: ignore[method-assign]
    pl_module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
        for metric, count in zip(metrics, counts, strict=True):
            if metric.update_count != count:
                metric.reset()


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _same_on_every_rank(trainer: L.Trainer, profiled: TimingProfile) -> TimingProfile:
    """Rank zero's profile everywhere, so that every rank makes the same decisions."""
    if trainer.world_size == 1:
        return profiled
    return TimingProfile.from_dict(trainer.strategy.broadcast(profiled.to_dict(), src=0))


def _with_grid_slack(seconds: float, tensors: int, resolution: int) -> float:
    """A budget that still holds `seconds` of `tensors` costs after each is rounded up to the selector's grid."""
    return seconds * resolution / max(resolution - tensors - 2, 1)


def _cheapest_single(model: StepTimeModel, importance: Tensor, forbidden: Sequence[bool]) -> tuple[bool, ...]:
    """When no tensor is worth training, train the most important of the cheapest-to-reach tensors: the last one."""
    allowed = [k for k in range(len(forbidden)) if not forbidden[k]]
    best = max(allowed, key=lambda k: (k, float(importance[k])))
    return tuple(k == best for k in range(len(forbidden)))


def _invalidate_compiled_graphs(pl_module: nn.Module) -> None:
    """Drop torch.compile's graphs of the previous selection.

    Dynamo's guards on `requires_grad` already keep a stale graph from running, but each new selection adds a
    cache entry; past the cache-size limit dynamo silently falls back to eager mode. Resetting keeps one graph.
    """
    if any(type(m).__name__ == "OptimizedModule" for m in pl_module.modules()) or getattr(
        pl_module, "_compiler_ctx", None
    ):
        torch._dynamo.reset()


def _log_metrics(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    clean = {k: v for k, v in metrics.items() if math.isfinite(v)}
    for logger in trainer.loggers:
        logger.log_metrics(clean, step=trainer.global_step)


def _tensorboard_writers(trainer: L.Trainer) -> list[Any]:
    if trainer.global_rank != 0:
        return []
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
