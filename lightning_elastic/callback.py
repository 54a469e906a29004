"""`ElasticTensorSelection`: a fit `speedup` times faster, training at every moment only the tensors that matter most.

The callback is the method's table of contents; each step lives in its own module:

0. start    (`startup`)                        refuse what the method cannot run with; the schedule from the Trainer;
1. profile  (`profiling.harness`)              per-tensor backward times of this model on this device, cached,
                                                measured inside the fit's first step (`first_step.FirstStep`);
2. plan     (`begin`, `planner.WallClockPlan`) the wall-clock contract: what every step may cost from here on, and
                                                a speedup out of this fit's reach refused before its first update;
3. probe    (`importance.ImportanceEvaluator`) importance from real updates: of every tensor in probe windows,
                                                of the trained ones at every other step;
4. select   (`terms.select_now`)              the exact DP (`selector.decide`) under the plan's step target and
                                                `time_model` (`terms.step_terms`) over whole layers (`units`),
                                                re-planned when steps run off it;
5. apply    (`freezing`)                      `requires_grad` on or off, so autograd does less work;
6. inspect  (`reporting`, `inspection`)       what it cost to every logger; what was trained when to TensorBoard.

`schedule.Schedule` says when probe windows open and selections happen; `session.FitSession` holds one fit's state
(timers, importance, the plan, what was selected) and is what checkpoints save.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_elastic import reporting, resume
from lightning_elastic.arguments import PositiveInt, Settings, Speedup
from lightning_elastic.begin import begin_fit
from lightning_elastic.freezing import BnPolicy, UserState, freeze_never
from lightning_elastic.inspection import selection_map
from lightning_elastic.profiling import TimeModel, TimingProfile
from lightning_elastic.profiling.cache import resolve_cache_dir
from lightning_elastic.profiling.first_step import FirstStep
from lightning_elastic.profiling.harness import ProfileChoice, measure_profile
from lightning_elastic.profiling.reuse import reusable_profile
from lightning_elastic.records import SelectionRecord
from lightning_elastic.schedule import IntervalUnit, Schedule
from lightning_elastic.session import FitSession
from lightning_elastic.startup import check_parameters, check_supported, fit_schedule
from lightning_elastic.summary import FitSummary, fit_summary
from lightning_elastic.terms import select_now
from lightning_elastic.units import UnitKind

STATE_VERSION = 2  # 2: typed selection records and the wall-clock plan; version 1 checkpoints are still read


class ElasticTensorSelection(Callback):
    """Makes the training part of a fit `speedup` times faster by training only the tensors worth their time.

    The promise is end to end: every training step, probe windows, profiling and selection included, take
    `1 / speedup` of the same fit without the callback (validation is the same for both and left out). A plan
    (`planner.WallClockPlan`) gives each interval what is left of that budget, and measured step times feed back
    into it. Within a step's share, an exact dynamic program picks the tensors of greatest total importance (the
    loss drop their real updates bring); the others get `requires_grad=False`, so autograd skips their weight
    gradients and stops at the deepest selected tensor. Any tensor may leave or rejoin at each selection.
    A speedup this fit cannot reach is refused before the first update, with the reachable figure.

    Args:
        speedup: how many times faster the training part of the fit should be; > 1.
        interval: re-select every `interval` epochs or optimizer steps (see `interval_unit`).
        interval_unit: "epoch" (re-select as an epoch starts) or "step".
        probe_steps: "auto" (default) sizes probe windows so that they and the first profile take at most 5% of
            the planned fit, counted in whole steps (the first window long enough to time steady full steps when the
            fit can pay for it); or the steps of every window, each full training steps that measure every tensor's
            importance.
        time_model: "measured" (per-tensor times profiled on this device, about 5 training steps: 2-4 beyond the
            fit's first where that is its first pass), "flops" (op counts scaled to one timed step, about 3: where the
            fit's first step counts the ops, 2, and a plain forward pass on CPU, where that step's backward pass is
            the timed one), or "auto" (default): measured when it and the first probe window after it (3 full
            steps) cost at most 5% of the planned fit (a share that shrinks above 2x with the room a step has above
            its forward pass: none from 3x) or a measured profile is cached, else flops.
        train_always: shell-style patterns of parameter names always trained, e.g. a new head: `["model.fc.*"]`.
        train_never: patterns of parameter names never trained. Parameters that do not require grad when training
            starts are never trained either, and get their flags back when the fit ends.
        units: "layer" (default) selects each module's tensors together, a normalisation layer's with the module
            before it (a convolution and its BatchNorm); "tensor" selects every tensor on its own, as published.
        bn_policy: BatchNorm layers whose tensors are all frozen: "update" keeps updating their running statistics
            (PyTorch's default behaviour); "freeze" puts them in eval mode, so the frozen part is a fixed function.
        resolution: time quantisation of the dynamic program (units of the budget).
        cache_dir: where timing profiles are cached across runs; None (default) is the per-user cache
            (`$LIGHTNING_ELASTIC_CACHE_DIR`, else `$XDG_CACHE_HOME/lightning-elastic`, else
            `~/.cache/lightning-elastic`); False profiles every run.
        profile: a timing profile to use instead of profiling: a `TimingProfile`, or the path of one saved as JSON.
            One of other parameters is refused; one of another training step or device is used, with a warning.
        calibrate: plan the wall clock from measured step times (the contract). False gives every selected step
            `1 / speedup` of the profile's full step, with no feedback: decisions then depend on importance only,
            the same in every run (for comparing runs), and the whole-fit speedup is not kept.
        log_images: write the selection map to TensorBoard loggers: at selections, within 0.5% of the training time
            so far (a long fit's every selection, a short fit's few), and at the end.
        clock: seconds of a monotonic clock for CPU timing (CUDA steps are timed with events); injectable for tests.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[ElasticTensorSelection(speedup=2.0)], max_epochs=1)
    """

    def __init__(
        self,
        speedup: Speedup = 2.0,
        interval: PositiveInt = 1,
        interval_unit: IntervalUnit = "epoch",
        probe_steps: PositiveInt | Literal["auto"] = "auto",
        time_model: TimeModel = "auto",
        train_always: Sequence[str] = (),
        train_never: Sequence[str] = (),
        units: UnitKind = "layer",
        bn_policy: BnPolicy = "update",
        resolution: PositiveInt = 1000,
        cache_dir: Literal[False] | str | os.PathLike[str] | None = None,  # False first: LightningCLI tries in order
        profile: TimingProfile | str | os.PathLike[str] | None = None,
        calibrate: bool = True,
        log_images: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._settings = Settings.checked(
            speedup=speedup, interval=interval, interval_unit=interval_unit, probe_steps=probe_steps,
            time_model=time_model, train_always=train_always, train_never=train_never, bn_policy=bn_policy,
            resolution=resolution, cache_dir=cache_dir, profile=profile, calibrate=calibrate, log_images=log_images,
            clock=clock, units=units,
        )  # fmt: skip
        self._choice = ProfileChoice("measured", auto=False)  # this fit's time model (`ProfileChoice.of`)
        self._profile: TimingProfile | None = None  # carries from fit to fit on purpose (same model: no re-profiling)
        self._fit: FitSession | None = None
        self._first: FirstStep | None = None  # the fit's first step, while it is still to provide the profile
        self._schedule: tuple[Schedule | None, int | None, int] = (None, None, 0)  # and the step the fit counts from
        self._user = UserState()  # what the user had before the fit froze `train_never` (given back at its end)
        self._restored: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        speedup, interval, unit = self._settings.speedup, self._settings.interval, self._settings.interval_unit
        return self._generate_state_key(speedup=speedup, interval=interval, unit=unit)

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

    def report(self) -> FitSummary:
        """The fit so far against full fine-tuning, where the callback's time went, and what was trained most."""
        fit, profile = self._fit, self._profile
        if fit is None or profile is None:
            return fit_summary((), None, {}, (), (), self._settings.speedup)
        names, numel = profile.names, profile.numel
        settings = self._settings
        said = (settings.probe_steps, settings.calibrate, any(fit.required), settings.cache_dir is not False)
        return fit_summary(fit.history, fit.plan, fit.totals, names, numel, settings.speedup, *said)

    def selection_map(self) -> np.ndarray | None:
        """The selection map of the current (or last) fit as an RGB image (H, W, 3); None before any selection."""
        fit, profile = self._fit, self._profile
        if fit is None or profile is None or not fit.history:
            return None
        pins = (fit.required, fit.forbidden)
        return selection_map(fit.history, profile.names, profile.numel, *pins, axis=self._settings.interval_unit)

    # ------------------------------------------------------------------ checks that need the trainer

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_supported(trainer, pl_module, ElasticTensorSelection)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_parameters(trainer, pl_module)  # after `setup` and `configure_model`, which may build its layers

    # ------------------------------------------------------------------ 1. profile and 2. plan, as training starts

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit, self._first, self._user = None, None, UserState()  # each fit starts clean
        settings = self._settings
        unit, probe_steps = settings.interval_unit, settings.probe_steps
        # a fit counts its steps from where it starts (`Trainer.fit` again to train longer), a resumed one as it did
        origin = int(self._restored.get("origin", 0)) if self._restored else trainer.global_step
        schedule, total = fit_schedule(trainer, settings.interval, unit, probe_steps, settings.speedup, origin)
        self._schedule = (schedule, total, origin)
        if schedule is None:
            return
        started = settings.clock()
        self._user = freeze_never(pl_module, settings.train_always, settings.train_never, settings.bn_policy)  # first
        fresh, restored = self._restored is None, self._restored.get("profile") if self._restored else None
        choice = ProfileChoice.for_fit(trainer, pl_module, settings.time_model, total, settings.speedup, fresh)
        prof = reusable_profile(trainer, pl_module, settings.profile, restored, self._profile, choice)
        self._choice, timed = choice, False
        if prof is None:  # measured or read from the cache, which says which (`measure_profile`)
            if choice.first_step:  # see FirstStep
                self._first = FirstStep(pl_module.device, settings.clock, settings.clock() - started, choice.counts)
                return
            cache_dir = resolve_cache_dir(settings.cache_dir)
            prof, timed = measure_profile(trainer, pl_module, choice, cache_dir, settings.speedup)
        fit = self._begin(trainer, pl_module, prof, settings.clock() - started, timed)
        # A fit resumed mid-epoch (where `every_n_train_steps` checkpoints are) gets no `on_train_epoch_start` before
        # its first step: its step is timed, and the restored selection's BatchNorm modes are set, from here.
        fit.clock.step.start()
        fit.hold_bn(pl_module)

    def _profile_at_first_step(self, trainer: L.Trainer, pl_module: L.LightningModule, first: FirstStep) -> None:
        """The first step ran its forward and backward pass: profile on its batch, then begin before its update."""
        first.timer.stop()
        if first.signature is None:
            first.timer.start()  # no backward pass ran (`training_step` returned None): the next step is the first
            return
        self._first = None
        clock, cache_dir = self._settings.clock, resolve_cache_dir(self._settings.cache_dir)
        started = clock()
        prof, timed = measure_profile(trainer, pl_module, self._choice, cache_dir, self._settings.speedup, first)
        fit = self._begin(trainer, pl_module, prof, clock() - started + first.setup_seconds, timed)
        fit.enter_at_step(trainer, math.fsum(first.timer.pop()))

    def _begin(
        self, trainer: L.Trainer, pl_module: L.LightningModule, prof: TimingProfile, profile_seconds: float, timed: bool
    ) -> FitSession:
        """2. plan: the fit's session, its profile and wall-clock plan; refuse what is out of reach (`begin_fit`)."""
        self._profile, (schedule, total_steps, origin) = prof, self._schedule
        assert schedule is not None
        planned = (schedule, total_steps, origin)
        fit = begin_fit(trainer, pl_module, prof, self._settings, planned, self._restored, profile_seconds, timed)
        self._fit, self._restored = fit, None
        return fit

    # ------------------------------------------------------------------ 3. probe: windows, and importance at every step

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._first is not None:
            self._first.timer.start()
        if self._fit is not None:
            self._epoch_starts(trainer, pl_module, self._fit)

    def _epoch_starts(self, trainer: L.Trainer, pl_module: L.LightningModule, fit: FitSession) -> None:
        """A selection or window due as an epoch starts; also for the epoch a resumed fit starts at, which Lightning
        begins with no `on_train_epoch_start` (a checkpoint of an epoch's last step, with a selection pending)."""
        fit.epoch_started = trainer.current_epoch
        fit.check_trainable()
        fit.clock.step.start()
        step = fit.step_of(trainer)
        if fit.pending_selection or (self._settings.interval_unit == "epoch" and fit.schedule.selects_at(step)):
            self._select_and_apply(trainer, pl_module)
        elif fit.schedule.opens_at_epoch_start(trainer.current_epoch) and fit.probe_end is None:
            fit.open_probe(trainer, step + fit.schedule.probe_steps)
        fit.hold_bn(pl_module)
        fit.clock.loop.cancel()  # an epoch's first batch waits for its data loader to start: not a step's loop

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._first is not None:
            self._first.batch_start(pl_module, batch, batch_idx)
        if (fit := self._fit) is None:
            return
        if batch_idx == 0 and fit.epoch_started != trainer.current_epoch:  # resumed at the epoch's start
            self._epoch_starts(trainer, pl_module, fit)
        fit.check_trainable()
        fit.step_at_batch_start = step = fit.step_of(trainer)
        first_of_step = batch_idx % trainer.accumulate_grad_batches == 0
        if first_of_step:
            fit.clock.loop.stop()  # the wait for this step's batch ends
        if first_of_step and fit.probe_end is None and (end := fit.schedule.window_end(step)) is not None:
            fit.open_probe(trainer, end)
        fit.shown = reporting.show_progress(pl_module, fit.shown, fit.probe_end is not None, fit.mask, batch_idx == 0)
        fit.clock.forward.start()  # until the loss: the device's pace (`pace`)

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._first is not None:
            self._first.before_backward()
        if self._fit is not None:
            self._fit.clock.forward.stop()

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._first is not None:
            self._first.after_backward()

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._first is not None:
            self._profile_at_first_step(trainer, pl_module, self._first)
        if self._fit is not None:
            self._fit.before_optimizer_step()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._first is not None:
            self._first.close()  # a step that ran no backward pass records again next time
        if (fit := self._fit) is None or fit.step_of(trainer) == fit.step_at_batch_start:
            return  # off, or accumulating gradients: the optimizer step is still to come
        fit.after_optimizer_step()
        if (due := fit.selection_due(trainer)) is not None:  # a window closed, an interval began, or off the plan
            self._select_and_apply(trainer, pl_module, replanned=due == "replan")

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._first is not None:  # the epoch ended before its first step did (`on_train_batch_start` returned -1)
            self._first.close()  # the next epoch's first step records afresh, on its own batch
            self._first.timer.stop()

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._first is not None:  # after steps that skipped their backward pass: the first step is yet to come
            self._first.timer.stop()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return  # `trainer.training` is False here: Lightning sets it back after this hook
        if self._first is not None:
            self._first.timer.start()
        if self._fit is not None:
            self._fit.clock.step.start()  # validation is the same with and without the callback: not counted
            self._fit.clock.loop.cancel()

    # ------------------------------------------------------------------ 4. select and 5. apply

    def _select_and_apply(self, trainer: L.Trainer, pl_module: L.LightningModule, replanned: bool = False) -> None:
        fit, profile = self._fit, self._profile
        assert fit is not None and profile is not None
        started = self._settings.clock()
        fit.pending_selection = False
        self._close_interval(trainer, fit)
        closed = self._settings.clock()
        decision, terms = select_now(fit, trainer)  # the exact DP under the plan's step target, alike on every rank
        select_seconds = self._settings.clock() - closed
        fit.apply(pl_module, decision.mask)
        apply_seconds = self._settings.clock() - closed - select_seconds
        record = SelectionRecord(fit.step_of(trainer), trainer.current_epoch, decision, terms.full, replanned=replanned)
        fit.enter(record, select_seconds, apply_seconds)
        reporting.log_selection(trainer, record, fit.plan, profile, (select_seconds, terms.optimizer, terms.loop))
        self._write_map(trainer, fit, due=fit.maps.due(fit.plan.spent))  # 6. inspect: the map, within its share
        fit.logged(self._settings.clock() - started - select_seconds - apply_seconds)  # the interval's and this one's

    def _close_interval(self, trainer: L.Trainer, fit: FitSession) -> None:
        """The last selection's measured steps: into its record, into the plan's correction, to the loggers."""
        if (record := fit.close_interval()) is not None:
            metrics = reporting.interval_metrics(record, fit.plan, fit.allreduce)
            reporting.log_metrics(trainer, metrics, step=trainer.global_step - 1)  # before the next selection

    def _write_map(self, trainer: L.Trainer, fit: FitSession, due: bool) -> None:
        """The selection map to every TensorBoard writer when `due` and asked for, timed (`inspection.MapPace`)."""
        started = self._settings.clock()
        if due and self._settings.log_images and reporting.write_map(trainer, self.selection_map, trainer.global_step):
            fit.maps.drew(self._settings.clock() - started, len(fit.history))

    # ------------------------------------------------------------------ 6. inspect: the fit's summary

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None:
            self._close_interval(trainer, self._fit)
            self._write_map(trainer, self._fit, due=self._fit.maps.stale(len(self._fit.history)))  # the whole map
            rank_zero_info(f"ElasticTensorSelection, the fit against training every tensor:\n{self.report().table()}")

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None:
            self._fit.give_back(pl_module)
        self._user.give_back(pl_module)  # the user's model trains every tensor it did before the fit, however it ended
        self._user = UserState()  # once: a later call that fails (validate, test) must not give back this fit's flags

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._first is not None:
            self._first.close()
        self.on_fit_end(trainer, pl_module)

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"version": STATE_VERSION, "profile": self._profile and self._profile.to_dict()}
        if self._fit is not None:
            state.update(resume.fit_state(self._fit))
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
