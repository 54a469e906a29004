"""`ElasticTensorSelection`: a fit `speedup` times faster, training at every moment only the tensors that matter most.

The callback is the method's table of contents; each step lives in its own module:

1. profile  (`profiling.profile`)              per-tensor backward times of this model on this device, cached;
2. plan     (`planner.WallClockPlan`)         the wall-clock contract: what every step may cost from here on;
3. probe    (`importance.ImportanceEvaluator`) importance from real updates: of every tensor in probe windows,
                                                of the trained ones at every other step;
4. select   (`selector.decide`)               the exact DP under the plan's step target and `time_model`;
5. apply    (`freezing.apply_mask`)           `requires_grad` on or off, so autograd does less work;
6. inspect  (`reporting`, `inspection`)       what was trained when, and what it cost, to every logger.

`schedule.Schedule` says when probe windows open and selections happen.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from numpy import bool_ as np_bool
from torch import nn
from typing_extensions import override

from lightning_elastic import reporting
from lightning_elastic.distributed import install_selective_allreduce, prepare_strategy
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.freezing import BN_POLICIES, BnPolicy, apply_bn_policy
from lightning_elastic.inspection import profile_table, selection_map
from lightning_elastic.planner import WallClockPlan, auto_probe_plan, reachable_speedup
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.profiling.harness import measure_profile, stale_reason
from lightning_elastic.profiling.profile import load_given_profile, resolve_cache_dir
from lightning_elastic.records import SelectionRecord
from lightning_elastic.schedule import IntervalUnit, Schedule
from lightning_elastic.selector import decide
from lightning_elastic.session import FitSession
from lightning_elastic.time_model import StepTimeModel

TimeModel = Literal["measured", "flops"]
TIME_MODELS: tuple[str, ...] = ("measured", "flops")
INTERVAL_UNITS: tuple[str, ...] = ("epoch", "step")
STATE_VERSION = 2  # 2: typed selection records and the wall-clock plan; version 1 checkpoints are still read


class ElasticTensorSelection(Callback):
    """Makes the training part of a fit `speedup` times faster by training only the tensors worth their time.

    The promise is end to end: every training step, probe windows, profiling and selection included, take
    `1 / speedup` of the same fit without the callback (validation is the same for both and left out). A plan
    (`planner.WallClockPlan`) gives each interval what is left of that budget, and measured step times feed back
    into it. Within a step's share, an exact dynamic program picks the tensors of greatest total importance (the
    loss drop their real updates bring); the others get `requires_grad=False`, so autograd skips their weight
    gradients and stops at the deepest selected tensor. Any tensor may leave or rejoin at each selection.
    A speedup this fit cannot reach is refused before training, with the reachable figure.

    Args:
        speedup: how many times faster the training part of the fit should be; > 1.
        interval: re-select every `interval` epochs or optimizer steps (see `interval_unit`).
        interval_unit: "epoch" (re-select as an epoch starts) or "step".
        probe_steps: "auto" (default) sizes probe windows so that their extra cost stays a small share (3%) of
            the fit; or the steps of every window, each full training steps that measure every tensor's importance.
        time_model: "measured" (per-tensor times profiled on this device) or "flops" (analytic fallback).
        train_always: shell-style patterns of parameter names always trained, e.g. a new head: `["model.fc.*"]`.
        train_never: patterns of parameter names never trained. Parameters that do not require grad when training
            starts are never trained either, and get their flags back when the fit ends.
        bn_policy: BatchNorm layers whose tensors are all frozen: "update" keeps updating their running statistics
            (PyTorch's default behaviour); "freeze" puts them in eval mode, so the frozen part is a fixed function.
        resolution: time quantisation of the dynamic program (units of the budget).
        cache_dir: where timing profiles are cached across runs; None (default) is the per-user cache
            (`$LIGHTNING_ELASTIC_CACHE_DIR`, else `$XDG_CACHE_HOME/lightning-elastic`, else
            `~/.cache/lightning-elastic`); False profiles every run.
        profile: a timing profile to use instead of profiling: a `TimingProfile`, or the path of one saved as JSON.
        calibrate: plan the wall clock from measured step times (the contract). False gives every selected step
            `1 / speedup` of the profile's full step, with no feedback: decisions then depend on importance only,
            the same in every run (for comparing runs), and the whole-fit speedup is not kept.
        log_images: write the selection map to TensorBoard loggers.
        clock: seconds of a monotonic clock for CPU timing (CUDA steps are timed with events); injectable for tests.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[ElasticTensorSelection(speedup=2.0)], max_epochs=1)
    """

    def __init__(
        self,
        speedup: float = 2.0,
        interval: int = 1,
        interval_unit: IntervalUnit = "epoch",
        probe_steps: int | Literal["auto"] = "auto",
        time_model: TimeModel = "measured",
        train_always: Sequence[str] = (),
        train_never: Sequence[str] = (),
        bn_policy: BnPolicy = "update",
        resolution: int = 1000,
        cache_dir: str | os.PathLike[str] | Literal[False] | None = None,
        profile: TimingProfile | str | os.PathLike[str] | None = None,
        calibrate: bool = True,
        log_images: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        problems = []
        if isinstance(speedup, bool) or not isinstance(speedup, numbers.Real) or not 1 < float(speedup) < math.inf:
            problems.append(f"`speedup` must be a finite number > 1. Found: {speedup!r}")
        if not _positive_int(interval):
            problems.append(f"`interval` must be a positive int. Found: {interval!r}")
        if interval_unit not in INTERVAL_UNITS:
            problems.append(f"`interval_unit` must be one of {INTERVAL_UNITS}. Found: {interval_unit!r}")
        if probe_steps != "auto" and not _positive_int(probe_steps):
            problems.append(f"`probe_steps` must be a positive int or 'auto'. Found: {probe_steps!r}")
        if time_model not in TIME_MODELS:
            problems.append(f"`time_model` must be one of {TIME_MODELS}. Found: {time_model!r}")
        for name, patterns in (("train_always", train_always), ("train_never", train_never)):
            if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
                problems.append(f"`{name}` must be a list of non-empty name patterns. Found: {patterns!r}")
        if bn_policy not in BN_POLICIES:
            problems.append(f"`bn_policy` must be one of {BN_POLICIES}. Found: {bn_policy!r}")
        if not _positive_int(resolution):
            problems.append(f"`resolution` must be a positive int. Found: {resolution!r}")
        if cache_dir not in (None, False) and not isinstance(cache_dir, (str, os.PathLike)):
            problems.append(
                f"`cache_dir` must be a directory path, None (the user cache) or False. Found: {cache_dir!r}"
            )
        if profile is not None and not isinstance(profile, (TimingProfile, str, os.PathLike)):
            problems.append(
                f"`profile` must be a TimingProfile, a path to one saved as JSON, or None. Found: {profile!r}"
            )
        for name, flag in (("calibrate", calibrate), ("log_images", log_images)):
            if not isinstance(flag, (bool, np_bool)):
                problems.append(f"`{name}` must be True or False. Found: {flag!r}")
        if not callable(clock):
            problems.append(f"`clock` must be a callable returning seconds. Found: {clock!r}")
        if problems:
            raise ElasticConfigError("; ".join(problems))
        self._speedup = float(speedup)
        self._interval = int(interval)
        self._interval_unit: IntervalUnit = interval_unit
        self._probe_steps = probe_steps
        self._time_model: TimeModel = time_model
        self._train_always = tuple(train_always)
        self._train_never = tuple(train_never)
        self._bn_policy: BnPolicy = bn_policy
        self._resolution = int(resolution)
        self._cache_dir = cache_dir
        self._given_profile = profile
        self._calibrate = bool(calibrate)
        self._log_images = bool(log_images)
        self._clock = clock
        self._profile: TimingProfile | None = None  # carries from fit to fit on purpose (same model: no re-profiling)
        self._fit: FitSession | None = None
        self._restored: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(speedup=self._speedup, interval=self._interval, unit=self._interval_unit)

    @property
    def timing_profile(self) -> TimingProfile | None:
        """The timing profile in use (None before the first fit starts)."""
        return self._profile

    @property
    def history(self) -> tuple[SelectionRecord, ...]:
        """Every selection of the current (or last) fit, oldest first."""
        return tuple(self._fit.history) if self._fit else ()

    def summary(self) -> dict[str, float]:
        """Figures of the fit so far: whole-fit and per-step speedup, selected fraction, the method's own seconds."""
        return self.report().figures()

    def report(self) -> reporting.FitSummary:
        """The fit so far against full fine-tuning, where the callback's time went, and what was trained most."""
        fit, profile = self._fit, self._profile
        if fit is None or profile is None:
            return reporting.fit_summary((), None, {}, (), (), self._speedup)
        return reporting.fit_summary(fit.history, fit.plan, fit.totals, profile.names, profile.numel, self._speedup)

    def selection_map(self) -> np.ndarray | None:
        """The selection map of the current (or last) fit as an RGB image (H, W, 3); None before any selection."""
        fit, profile = self._fit, self._profile
        if fit is None or profile is None or not fit.history:
            return None
        pins = (fit.required, fit.forbidden)
        return selection_map(fit.history, profile.names, profile.numel, *pins, axis=self._interval_unit)

    # ------------------------------------------------------------------ checks that need the trainer

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        lazy = [n for n, p in pl_module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            raise ElasticConfigError(
                "`ElasticTensorSelection` profiles every parameter before training, so lazy modules must be "
                "materialised first (run one batch through the model, e.g. in `setup`). Found uninitialised: "
                f"{lazy[:5]}"
            )
        if not pl_module.automatic_optimization:
            raise ElasticConfigError(
                "`ElasticTensorSelection` needs automatic optimization (it measures importance around each "
                "optimizer step). Found: `automatic_optimization = False`"
            )
        prepare_strategy(trainer.strategy)
        if not any(p.requires_grad for p in pl_module.parameters()):
            raise ElasticConfigError("`ElasticTensorSelection` needs a model with trainable parameters. Found: none")

    # ------------------------------------------------------------------ 1. profile and 2. plan, as training starts

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit = None  # each fit starts clean
        schedule, total_steps = self._make_schedule(trainer)
        if schedule is None:
            return
        started = self._clock()
        self._profile = self._current_profile(trainer, pl_module)
        profile_seconds = self._clock() - started
        pins = (self._train_always, self._train_never)
        fit = FitSession.start(trainer, pl_module, self._profile, schedule, *pins, self._bn_policy, self._clock)
        fit.plan = WallClockPlan(self._speedup, total_steps, full_step=self._profile.t_full)
        fit.plan.spend_overhead(profile_seconds)
        fit.totals["profile_seconds"] += profile_seconds
        self._fit = fit
        self._check_reachable(fit, profile_seconds)
        fit.restore(self._restored)
        self._restored = None
        fit.allreduce = install_selective_allreduce(trainer.strategy)
        rank_zero_info(
            f"ElasticTensorSelection: {len(fit.params)} tensors profiled on {self._profile.device} (full "
            f"forward+backward {self._profile.t_full * 1e3:.1f} ms, forward {self._profile.t_fw * 1e3:.1f} ms); target "
            f"speedup {self._speedup:g} for the fit's {_steps(total_steps)}; {schedule.probe_steps} probe steps "
            f"before the first selection and every {schedule.probe_every} of the selections every "
            f"{self._interval} {self._interval_unit}(s)"
        )
        for writer in reporting.tensorboard_writers(trainer):
            writer.add_text("elastic/profile", profile_table(self._profile), trainer.global_step)
            writer.add_custom_scalars(reporting.CHARTS)

    def _current_profile(self, trainer: L.Trainer, pl_module: L.LightningModule) -> TimingProfile:
        """The given profile; else the checkpoint's or the last fit's, if they describe this module; else measured."""
        given = load_given_profile(self._given_profile)
        if given is not None:
            return given
        restored = self._restored.get("profile") if self._restored else None
        for source, candidate in (
            ("checkpoint's", TimingProfile.from_dict(restored) if restored else None),
            ("previous fit's", self._profile),
        ):
            if candidate is None:
                continue
            reason = stale_reason(trainer, pl_module, candidate)
            if reason is None:
                return candidate
            rank_zero_info(
                f"ElasticTensorSelection: the {source} timing profile does not describe this model ({reason}); "
                "profiling again."
            )
        count = sum(p.requires_grad for p in pl_module.parameters())
        rank_zero_info(
            f"ElasticTensorSelection: profiling {count} tensors on the first batch (about 20 training steps; "
            "a cached profile of this model on this device is used instead when there is one)"
        )
        return measure_profile(trainer, pl_module, self._time_model, resolve_cache_dir(self._cache_dir))

    def _make_schedule(self, trainer: L.Trainer) -> tuple[Schedule | None, int | None]:
        lengths, total = _epoch_lengths(trainer)
        shape = Schedule(self._interval, self._interval_unit, 0, lengths, 1, total or math.inf)
        period = shape.period
        if self._probe_steps == "auto":
            selections = None if total is None or math.isinf(period) else 1 + shape.selections_until(total - 1)
            probes = auto_probe_plan(total, selections, self._speedup)
            steps = min(probes.steps, int(period) - 1) if math.isfinite(period) else probes.steps
            every = probes.every
        else:
            steps, every = int(self._probe_steps), 1
        if period <= steps or steps < 1:
            message = (
                f"`probe_steps` must be fewer than the optimizer steps between two selections ({period:g} = "
                f"`interval` {self._interval} x {'steps per epoch' if self._interval_unit == 'epoch' else '1 step'}). "
                f"Found: {self._probe_steps}"
            )
            if not getattr(trainer, "fast_dev_run", False):  # set by the Trainer; not in its type stubs
                raise ElasticConfigError(message)
            rank_zero_info(f"ElasticTensorSelection: off under `fast_dev_run`, every tensor trains ({message})")
            return None, total
        schedule = replace(shape, probe_steps=steps, probe_every=every)
        if schedule.first_window_end != steps:
            rank_zero_warn(
                f"ElasticTensorSelection: `probe_steps` {steps} leave the first selection no step to train before the "
                f"next window opens ({period:g} optimizer steps between selections), so the first window runs on "
                f"until step {schedule.first_window_end} and the first selection comes there. Fewer than "
                f"{period / 2:g} `probe_steps` select earlier."
            )
        return schedule, total

    def _check_reachable(self, fit: FitSession, profile_seconds: float) -> None:
        """Refuse, before any step, a speedup that the cheapest selection at every step could not deliver.

        What profiling cost this run counts in the plan but is paid once (the profile is cached): a speedup that only
        it puts out of reach is warned about, with the figure of this run and of the next.
        """
        assert self._profile is not None and fit.plan is not None
        model = StepTimeModel.from_profile(self._profile)
        floor = model.cheapest(fit.required, fit.forbidden) / model.full
        total = fit.plan.total_steps
        if total is None or not self._calibrate:
            reachable, sunk, scope, probes = 1.0 / floor, 1.0 / floor, "(per step)", 0
        else:
            probes = fit.schedule.probe_steps_between(0, total)
            sunk_steps = profile_seconds / self._profile.t_full
            reachable = reachable_speedup(total, probes, 0.0, floor)
            sunk = reachable_speedup(total, probes, sunk_steps, floor)
            scope = f"in a fit of {total} steps with {probes} probe steps at full cost"
        if reachable < self._speedup:
            raise ElasticConfigError(
                f"`speedup` must be at most {_at_most(reachable)} for this model on this device "
                f"{scope}: the forward pass and the parts of a step that every selection pays (at least the "
                f"`train_always` tensors, or one tensor) take {floor:.0%} of a full step. Train fewer tensors always, "
                f"use fewer `probe_steps`, a longer fit, or a lower speedup. Found: {self._speedup!r}"
            )
        if sunk < self._speedup:
            rank_zero_warn(
                f"ElasticTensorSelection: profiling took {profile_seconds:.1f} s ({profile_seconds / model.full:.0f} "
                f"full steps) of this fit's budget, so this fit reaches at most {_at_most(sunk)}x of the `speedup` "
                f"{self._speedup!r} asked. The profile is cached: later fits on this device reach "
                f"{_at_most(reachable)}x."
            )

    # ------------------------------------------------------------------ 3. probe: windows, and importance at every step

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (fit := self._fit) is None:
            return
        fit.check_trainable()
        fit.step_timer.start()
        step = trainer.global_step
        if fit.pending_selection or (self._interval_unit == "epoch" and fit.schedule.selects_at(step)):
            self._select_and_apply(trainer, pl_module)
        elif fit.schedule.opens_at_epoch_start(trainer.current_epoch) and fit.probe_end is None:
            fit.open_probe(trainer, step + fit.schedule.probe_steps)
        fit.bn_frozen = apply_bn_policy(pl_module, self._bn_policy, fit.bn_frozen)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if (fit := self._fit) is None:
            return
        fit.check_trainable()
        fit.step_at_batch_start = step = trainer.global_step
        first_of_step = batch_idx % trainer.accumulate_grad_batches == 0
        if first_of_step and fit.probe_end is None and (end := fit.schedule.window_end(step)) is not None:
            fit.open_probe(trainer, end)
        self._show_progress(pl_module)

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._fit is not None:
            self._fit.before_optimizer_step()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (fit := self._fit) is None or trainer.global_step == fit.step_at_batch_start:
            return  # off, or accumulating gradients: the optimizer step is still to come
        fit.after_optimizer_step()
        step = trainer.global_step
        if fit.probe_end is not None and step >= fit.probe_end:
            fit.close_probe()
            if fit.schedule.selects_at_epoch_start(step):
                fit.pending_selection = True
            else:
                self._select_and_apply(trainer, pl_module)
        elif self._interval_unit == "step" and fit.schedule.selects_at(step):
            self._select_and_apply(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None and trainer.training:
            self._fit.step_timer.start()  # validation is the same with and without the callback: not counted

    # ------------------------------------------------------------------ 4. select and 5. apply

    def _select_and_apply(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fit, profile = self._fit, self._profile
        assert fit is not None and fit.plan is not None and profile is not None
        started = self._clock()
        fit.pending_selection = False
        self._close_interval(trainer)
        importance = fit.importance(trainer)
        full, optimizer = fit.probe_figures(trainer)
        if self._calibrate and math.isfinite(full) and math.isfinite(optimizer):
            model = StepTimeModel.calibrated(profile, full, optimizer)
            target = fit.target(trainer, trainer.global_step)
        else:
            full, optimizer = profile.t_full, 0.0
            model = StepTimeModel.from_profile(profile)
            target = full / self._speedup
        decision = decide(
            model, importance, target, required=fit.required, forbidden=fit.forbidden, resolution=self._resolution
        )
        if decision.starved and not fit.warned_starved:
            fit.warned_starved = True
            rank_zero_warn(
                f"ElasticTensorSelection: at step {trainer.global_step} the plan leaves {target * 1e3:.1f} ms a step "
                f"(full step {full * 1e3:.1f} ms, {fit.plan.spent:.1f} s spent of {fit.plan.planned():.1f} s planned); "
                f"the cheapest selection takes {decision.predicted_seconds * 1e3:.1f} ms, so this interval spends more "
                f"than its share of `speedup` {self._speedup!r} (largest per-step speedup: "
                f"{_at_most(model.max_speedup(fit.required, fit.forbidden, full))}x). Later intervals pay it back if "
                "they can: the summary's `fit_speedup` is the outcome. Warned once a fit."
            )
        select_seconds = self._clock() - started
        fit.set_trainable(decision.mask)
        fit.bn_frozen = apply_bn_policy(pl_module, self._bn_policy, fit.bn_frozen)
        if fit.warming:
            _invalidate_compiled_graphs(pl_module)
        apply_seconds = self._clock() - started - select_seconds
        fit.totals["select_seconds"] += select_seconds
        fit.totals["apply_seconds"] += apply_seconds
        fit.plan.spend_overhead(select_seconds + apply_seconds)
        fit.mask = decision.mask
        record = SelectionRecord(trainer.global_step, trainer.current_epoch, decision, full_seconds=full)
        fit.history.append(record)
        fit.step_timer.start()  # the selection's own time is charged above, not to the next step
        self._log_selection(trainer, record, select_seconds, optimizer)

    def _close_interval(self, trainer: L.Trainer) -> None:
        """The last selection's measured steps: into its record, into the plan's correction, to the loggers."""
        fit = self._fit
        assert fit is not None and fit.plan is not None
        steps, fit.selected_steps = fit.selected_steps, []
        if not fit.history or not steps:
            return
        record = fit.history[-1] = replace(fit.history[-1], measured_seconds=tuple(steps))
        fit.plan.observe_selected_steps(record.measured_step, record.decision.predicted_seconds)
        metrics = {
            "elastic/measured_step_ms": record.measured_step * 1e3,
            "elastic/predicted_step_ms": record.decision.predicted_seconds * 1e3,
            **reporting.contract_metrics(fit.plan),
        }
        if fit.plan.full_samples:  # measured against measured: without `calibrate` the record's T is the profile's
            metrics["elastic/measured_speedup"] = fit.plan.full_step / record.measured_step
        if fit.allreduce is not None and fit.allreduce.last_step_full_bytes:
            metrics["elastic/allreduce_fraction"] = fit.allreduce.last_step_bytes / fit.allreduce.last_step_full_bytes
        reporting.log_metrics(trainer, metrics)

    # ------------------------------------------------------------------ 6. inspect

    def _log_selection(self, trainer: L.Trainer, record: SelectionRecord, select_s: float, optimizer_s: float) -> None:
        fit, profile = self._fit, self._profile
        assert fit is not None and fit.plan is not None and profile is not None
        mask = record.mask
        reporting.log_metrics(
            trainer,
            {
                "elastic/selected_fraction": mask.count(True) / len(mask),
                "elastic/selected_elements_fraction": mask.elements(profile.numel) / sum(profile.numel),
                "elastic/predicted_step_ms": record.decision.predicted_seconds * 1e3,
                "elastic/full_step_ms": record.full_seconds * 1e3,
                "elastic/target_step_ms": record.decision.target_seconds * 1e3,
                "elastic/optimizer_ms": optimizer_s * 1e3,
                "elastic/select_ms": select_s * 1e3,
                **reporting.contract_metrics(fit.plan),
            },
        )
        for writer in reporting.tensorboard_writers(trainer):
            step = trainer.global_step
            writer.add_histogram("elastic/importance", torch.tensor(record.decision.importance), step)
            for tag, value in reporting.top_importance(record, profile.names).items():
                writer.add_scalar(tag, value, step)
            if self._log_images and (image := self.selection_map()) is not None:
                writer.add_image("elastic/selection", image, step, dataformats="HWC")
            writer.add_text("elastic/selection", reporting.selection_text(record, profile.names), step)

    def _show_progress(self, pl_module: L.LightningModule) -> None:
        """The phase and the share of tensors this step trains, in the progress bar (not sent to loggers).

        `elastic/probing` is 1 in a probe window (every tensor trains and is measured), 0 under a selection.
        """
        fit = self._fit
        assert fit is not None
        if fit.probe_end is not None or fit.mask is None:
            probing, trained = 1.0, 1.0
        else:
            probing, trained = 0.0, fit.mask.count(True) / len(fit.mask)
        pl_module.log("elastic/probing", probing, prog_bar=True, logger=False, batch_size=1)
        pl_module.log("elastic/trained", trained, prog_bar=True, logger=False, batch_size=1)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is None:
            return
        self._close_interval(trainer)
        rank_zero_info(f"ElasticTensorSelection, the fit against training every tensor:\n{self.report().table()}")

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None:
            self._fit.give_back(pl_module)  # the user's model trains every tensor it did before the fit

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_fit_end(trainer, pl_module)

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"version": STATE_VERSION, "profile": self._profile and self._profile.to_dict()}
        if self._fit is not None:
            state.update(self._fit.state_dict())
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)


def _positive_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) > 0


def _epoch_lengths(trainer: L.Trainer) -> tuple[tuple[int, ...] | float, int | None]:
    """Optimizer steps of each epoch (the last repeating; `math.inf` when unknown) and of the fit (None: unknown).

    A `GradientAccumulationScheduler` changes the micro-batches of a step as epochs start, and
    `StochasticWeightAveraging` adds an epoch without optimizer steps (to update BatchNorm statistics): the Trainer's
    own estimate of the fit's steps sees neither.
    """
    batches = trainer.num_training_batches
    estimated = trainer.estimated_stepping_batches
    total = int(estimated) if math.isfinite(estimated) else None
    if not math.isfinite(batches):
        return math.inf, total
    callbacks = getattr(trainer, "callbacks", ())  # set by the Trainer; not in its type stubs
    scheduler = next((c for c in callbacks if isinstance(c, GradientAccumulationScheduler)), None)
    swa = next((c for c in callbacks if isinstance(c, StochasticWeightAveraging)), None)
    if scheduler is None:
        lengths: tuple[int, ...] = (math.ceil(batches / trainer.accumulate_grad_batches),)
    else:
        lengths = tuple(
            math.ceil(batches / scheduler.get_accumulate_grad_batches(e)) for e in range(max(scheduler.epochs) + 1)
        )
    epochs = trainer.max_epochs
    if swa is not None and swa._model_contains_batch_norm:  # its last epoch only runs BatchNorm statistics
        epochs = swa._max_epochs
    if (scheduler is not None or swa is not None) and epochs is not None and epochs >= 0:
        steps = sum(lengths[min(e, len(lengths) - 1)] for e in range(max(epochs, 1)))
        total = min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps
    return lengths, total


def _at_most(limit: float) -> str:
    """`limit` rounded down to two decimals: a figure shown as a ceiling is never above the true one."""
    return f"{math.floor(limit * 100) / 100:.2f}"


def _steps(total: int | None) -> str:
    return f"{total} optimizer steps" if total is not None else "steps (length unknown: planned per interval)"


def _invalidate_compiled_graphs(pl_module: nn.Module) -> None:
    """Drop torch.compile's graphs of the previous selection.

    Dynamo's guards on `requires_grad` already keep a stale graph from running, but each new selection adds a
    cache entry; past the cache-size limit dynamo silently falls back to eager mode. Resetting keeps one graph, so
    each change of the trainable set compiles once: that first step is charged to the fit as warm-up
    (`warmup_seconds`, `compiled_graphs` in the summary) and kept out of the step times the plan learns from.
    """
    if any(type(m).__name__ == "OptimizedModule" for m in pl_module.modules()) or getattr(
        pl_module, "_compiler_ctx", None
    ):
        torch._dynamo.reset()
