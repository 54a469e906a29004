"""One fit's runtime state: the tensors, the schedule, the measurements, the plan and what was selected.

`FitSession` is created as each fit's training starts (so a second fit with the same callback starts clean); `resume`
saves it into a checkpoint and restores it from one. It measures every optimizer step (from the end of the one
before, validation excepted), keeps the importance of every tensor up to date (in probe windows every tensor's, in
between the trained tensors' own), and gives the BatchNorm modes it changed back when the fit ends (the user's
`requires_grad` flags, taken before the fit froze its `train_never` tensors: `freezing.UserState`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Literal

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_elastic.arguments import Settings
from lightning_elastic.distributed import SelectiveAllReduce, any_rank
from lightning_elastic.errors import one_closure
from lightning_elastic.freezing import (
    CompiledCodes,
    apply_bn_policy,
    apply_mask,
    compiled_graphs,
    is_compiled,
    pins,
    refuse_changed,
    tied_names,
)
from lightning_elastic.importance import ImportanceEvaluator
from lightning_elastic.importance_window import LatestImportance
from lightning_elastic.inspection import MapPace
from lightning_elastic.messages import nonfinite_warning, unprofiled_warning
from lightning_elastic.pace import PACE_SAMPLES
from lightning_elastic.planner import FORECAST_STEPS, WallClockPlan
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.profiling.cache import remember_step, resolve_cache_dir
from lightning_elastic.records import Decision, Mask, SelectionRecord
from lightning_elastic.schedule import Schedule
from lightning_elastic.startup import check_dense, profiled_parameters
from lightning_elastic.summary import TOTALS
from lightning_elastic.terms import mean_over_ranks, off_plan, steady_update
from lightning_elastic.timing import StepClock
from lightning_elastic.units import Units
from lightning_elastic.warmup import FirstWindow


@dataclass
class FitSession:
    """The state of one fit (see the module docstring). Built by `start`."""

    schedule: Schedule
    profile: TimingProfile  # of one optimizer step: the profiled pass once a micro-batch (`start`)
    params: list[nn.Parameter]
    required: Mask
    forbidden: Mask
    evaluator: ImportanceEvaluator
    clock: StepClock  # every optimizer step's seconds, its update's, the callback's own, and the wait for its batch
    settings: Settings  # the callback's arguments
    plan: WallClockPlan
    units: Units  # the groups of tensors a selection trains or freezes whole (`units.layer_units`)
    allreduce: SelectiveAllReduce | None = None
    latest: LatestImportance = field(default_factory=lambda: LatestImportance.unmeasured(0))  # as last measured
    history: list[SelectionRecord] = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOTALS, 0.0))
    mask: Mask | None = None
    probe_end: int | None = None
    pending_selection: bool = False
    bn_frozen: list[str] = field(default_factory=list)
    probe_full: list[float] = field(default_factory=list)
    probe_optimizer: list[float] = field(default_factory=list)
    probe_forward: list[float] = field(default_factory=list)  # the forward pass of each of `probe_full`'s steps
    forwards: list[float] = field(default_factory=list)  # the latest steady steps' forward passes (`pace.pace_of`)
    selected_steps: list[float] = field(default_factory=list)
    step_at_batch_start: int = -1
    epoch_started: int = -1  # the last epoch whose start the callback saw (a resumed fit's first gets no hook)
    shown: dict[str, float] = field(default_factory=dict)  # what the progress bar shows (`reporting.progress_metrics`)
    warned_starved: int = 0  # 0: not warned; 1: before `T` was measured; 2: after, early; 3: after (`say_starved`)
    warned_nonfinite: bool = False
    warming: bool = False  # the next step is the first with a new trainable set of a compiled module: not a sample
    steps_timed: int = 0  # optimizer steps this session measured (in this process): the first few warm up (`windows`)
    graphs_at_start: int = field(default_factory=lambda: compiled_graphs())
    compiled: bool = False  # torch.compile runs the module: a new trainable set recompiles
    compiled_codes: CompiledCodes = field(default_factory=CompiledCodes)  # what this fit compiled, reset at changes
    warmup: FirstWindow = field(default_factory=FirstWindow)  # the process's warm-up, as the first window saw it
    outside: dict[str, nn.Parameter] = field(default_factory=dict)  # frozen as the fit started, not in the profile
    origin: int = 0  # the global optimizer step this fit counts its steps from (`step_of`)
    unprofiled: dict[str, nn.Parameter] = field(default_factory=dict)  # trainable, unused on the profiled batch
    maps: MapPace = field(default_factory=MapPace)  # when the selection map is drawn (not checkpointed)

    @classmethod
    def start(
        cls,
        pl_module: L.LightningModule,
        prof: TimingProfile,
        schedule: Schedule,
        plan: WallClockPlan,
        settings: Settings,
        origin: int = 0,
    ) -> FitSession:
        """Bind the profile's tensors of `pl_module` and the `train_always` pins of `settings`, as training starts.
        `prof` is the profile of one optimizer step: with gradient accumulation, the profiled pass scaled to the step's
        micro-batches. `origin`: the global step the fit counts from (`step_of`).

        The `train_never` tensors are frozen by then (`freezing.freeze_never`, which keeps what the user had, to give
        back): like the tensors the user froze, they do not require grad, so no selection trains them.
        """
        params = profiled_parameters(pl_module, prof)
        profiled = set(prof.names)
        outside = {n: p for n, p in pl_module.named_parameters() if n not in profiled and not p.requires_grad}
        unused = set(prof.unused)
        unprofiled = {n: p for n, p in pl_module.named_parameters() if n in unused and p.requires_grad}
        required, forbidden = pins(prof.names, params, settings.train_always, (), tied_names(pl_module))
        check_dense(pl_module, prof.names, forbidden)
        device = pl_module.device
        return cls(
            schedule=schedule,
            profile=prof,
            params=params,
            required=required,
            forbidden=forbidden,
            evaluator=ImportanceEvaluator(params),
            clock=StepClock(device, settings.clock),
            settings=settings,
            plan=plan,
            units=Units.of(settings.units, pl_module, prof.names),
            latest=LatestImportance.unmeasured(len(params)),
            compiled=is_compiled(pl_module),
            warmup=FirstWindow(warm_step=prof.t_step),
            outside=outside,
            origin=origin,
            unprofiled=unprofiled,
        )

    def step_of(self, trainer: L.Trainer) -> int:
        """The Trainer's optimizer step counted from this fit's `origin`: the step the schedule, the plan and the
        selection records count in (the global step in a fit from step 0, as most are)."""
        return trainer.global_step - self.origin

    @property
    def names(self) -> tuple[str, ...]:
        """The profiled tensors' names, in the order of `params`."""
        return self.profile.names

    def charge_start(self, seconds: float) -> None:
        """Charge the callback's own seconds as the fit began (profiling and the plan's start) to the plan."""
        self.plan.spend_overhead(seconds)
        self.totals["profile_seconds"] += seconds

    def enter_at_step(self, trainer: L.Trainer, seconds: float) -> None:
        """Begin inside an optimizer step (the first whose pass keyed the profile): charge its `seconds` up to the
        update, with any earlier steps whose `training_step` returned None, and open the probe window it lies in
        (a window from here if those steps used up the first), so that its update measures importance. Being the
        first step of the process, it is a warm-up step: charged, never a sample of `T`."""
        step = self.step_of(trainer)
        self.plan.spend(seconds, steps=step)  # steps skipped before it; this one counts when it ends
        self.totals["warmup_seconds"] += seconds
        self.step_at_batch_start = step
        end = self.schedule.window_end(step)
        if end is None and not self.history and step > 0:
            end = step + self.schedule.first_steps
        if self.probe_end is None and end is not None:
            self.open_probe(trainer, end)
        if self.probe_end is not None:  # full steps (its update's part is added as it ends), and any skipped before
            self.warmup.full_seconds += seconds
            self.warmup.full_steps += step
        self.clock.step.start()

    # ------------------------------------------------------------------ steps and probe windows

    def open_probe(self, trainer: L.Trainer, end: int) -> None:
        """Train every candidate tensor until optimizer step `end`: their importance is measured afresh."""
        self._fold_importance(trainer)
        self.probe_end = end
        self.probe_full, self.probe_optimizer, self.probe_forward = [], [], []
        self.set_trainable([not f for f in self.forbidden])
        self.hold_bn(trainer.lightning_module)

    def set_trainable(self, mask: Sequence[bool]) -> None:
        """Set `requires_grad` to `mask`; if that changes the trainable set of a compiled model (or dynamo compiled
        in this fit), the next step warms up (torch.compile guards on `requires_grad`). An eager step with a new set
        is as fast as the next, so it is a sample of step time: Lite0 on ELPV, two fits re-selecting every 8 steps,
        the first step of a selection 190 and 151 ms against 189 and 154 ms for the one after it."""
        if [p.requires_grad for p in self.params] != list(mask):
            apply_mask(self.params, mask)
            self.warming = self.warming or self.compiled or compiled_graphs() > self.graphs_at_start
            self.compiled_codes.watch()

    def runs_on(self, trainer: L.Trainer, step: int) -> bool:
        """Whether the first probe window, ending at optimizer step `step`, runs on one step more: while a process
        that did not time the profile (`FirstWindow.cold`) is still warming up on any rank (`FirstWindow.runs_on`).
        Every rank votes, warm or cold, so that all run on alike and train the same tensors."""
        if not self.in_first_window:
            return False
        room = self.schedule.steps_to_next_change(step)
        # a window whose selection waits for an epoch's start ends there: running on would skip that start
        warming = not self.schedule.selects_at_epoch_start(step - self.warmup.ran_on) and self.warmup.runs_on(
            self.probe_full, self.plan.full_step, room
        )
        if not any_rank(trainer.strategy, warming, self.params[0].device):
            return False
        self.warmup.ran_on += 1
        self.probe_end = step + 1
        return True

    def selection_due(self, trainer: L.Trainer) -> Literal["window", "interval", "replan"] | None:
        """After an optimizer step: whether a selection is due now, and why. A probe window ended (unless it runs on,
        `runs_on`, or its selection waits for the epoch's start, `end_window`), a step interval began, or the
        selection in force runs off the plan (`terms.off_plan`, with `calibrate`)."""
        step = self.step_of(trainer)
        if self.probe_end is not None and step >= self.probe_end:
            return "window" if not self.runs_on(trainer, step) and self.end_window(trainer) else None
        if self.settings.interval_unit == "step" and self.schedule.selects_at(step):
            return "interval"
        return "replan" if self.settings.calibrate and off_plan(self, trainer) else None

    @property
    def in_first_window(self) -> bool:
        """No selection yet: the fit's first probe window, which its first selection closes before any other window
        opens (alike on every rank, unlike what each rank measured)."""
        return not self.history

    def close_probe(self) -> int:
        """The window's steady full steps measure `T` for the plan (none when all are warm-up steps); the step it was
        scheduled to end at (before it ran on)."""
        end = self.probe_end
        assert end is not None
        self.probe_end = None
        first = self.in_first_window
        samples = self.warmup.take_samples(self.probe_full, self.plan.full_step) if first else self.probe_full
        timed = zip_longest(self.probe_full, self.probe_forward, fillvalue=0.0)  # 0: a step whose forward was not timed
        self.plan.observe_full_steps(samples, [forward for step, forward in timed if step in samples])
        updates = zip(self.probe_full, self.probe_optimizer, strict=False)  # none from a checkpoint that kept none
        self.probe_optimizer = [update for step, update in updates if step in samples]  # the samples' (`steady_update`)
        if first:
            self.plan.full_step += self.prior_update  # 0 once the window measured a steady step
        if self.plan.full_samples and self.warmup.full_steps:  # against a measured `T` (a prior may be off), anew
            self.plan.warmup = self.warmup.excess(self.plan.full_step)  # as each window refines it
        return end - self.warmup.ran_on if first else end

    def end_window(self, trainer: L.Trainer) -> bool:
        """Close the probe window that ended at this step (`close_probe`): True when the selection it precedes is due
        now, False when it waits for the epoch's start (`pending_selection`). The first window to measure `T` in a
        process that timed its profile adds `T` to the profile's cache entry, for a later process to warm up to (a
        cold process's `T` may be unsettled)."""
        measured, end = self.plan.full_samples, self.close_probe()
        one_pass = trainer.accumulate_grad_batches == 1  # `t_step` is a step of one micro-batch (`step_profile`)
        if not (measured or self.warmup.cold) and self.plan.full_samples and trainer.is_global_zero and one_pass:
            started = self.settings.clock()
            cache_dir = resolve_cache_dir(self.settings.cache_dir)
            remember_step(cache_dir, self.profile, self.plan.full_step, steady_update(self))
            self.charge_start(self.settings.clock() - started)
        self.pending_selection = self.schedule.selects_at_epoch_start(end)
        return not self.pending_selection

    @property
    def prior_update(self) -> float:
        """The optimizer update `T` is planned with until a steady full step is measured (`FirstWindow`)."""
        return self.warmup.prior_update(measured=bool(self.plan.full_samples))

    def say_starved(self, decision: Decision) -> bool:
        """Whether to warn of a `starved` selection (`messages.starved_warning`): the first, the first once `T` is
        measured, whose warning says what the whole fit reaches, and the first once that figure is no early one
        (`FORECAST_STEPS`); never again."""
        level = 1 if not self.plan.full_samples else 2 if self.plan.selected_samples < FORECAST_STEPS else 3
        if not decision.starved or self.warned_starved >= level:
            return False
        self.warned_starved = level
        return True

    def check_trainable(self) -> None:
        """Refuse a trainable set that something else changed: it would escape the plan and the selection.

        The tensors outside the profile were frozen as the fit started (by the user, `train_never`, or another
        callback such as `BackboneFinetuning`, which freezes its backbone before training) and must stay frozen.

        Raises:
            ElasticConfigError: naming the tensors whose `requires_grad` differs from what the callback set.
        """
        if any(p.requires_grad for p in self.outside.values()):  # every step: lists only when one changed
            refuse_changed(list(self.outside.values()), [False] * len(self.outside), list(self.outside))
        if self.mask is None and self.probe_end is None:
            return  # before the first window opens nothing has been set yet
        probing = self.probe_end is not None or self.pending_selection
        expected = [not f for f in self.forbidden] if probing or self.mask is None else list(self.mask)
        refuse_changed(self.params, expected, self.names)

    def before_optimizer_step(self) -> None:
        if self.evaluator.in_step:  # the optimizer evaluates its closure again within the step
            raise one_closure("a second training step within one optimizer step")
        self.clock.overhead.start()
        if self.unprofiled and (used := [n for n, p in self.unprofiled.items() if p.grad is not None]):
            self.unprofiled = {}  # said once
            rank_zero_warn(unprofiled_warning(used))
        self.evaluator.before_step()
        self.clock.overhead.stop()
        self.clock.optimizer.start()

    def after_optimizer_step(self) -> None:
        """Measure the step that just ended (from the end of the one before) and charge it to the plan."""
        self.clock.optimizer.stop()
        self.clock.overhead.start()
        if self.evaluator.in_step:  # else no update ran: an `optimizer_step` that ran the closure alone moved nothing
            self.evaluator.after_step()
        self.clock.overhead.stop()
        seconds, overhead, optimizer, forward = self.clock.step_ended()
        self.plan.spend(seconds, steps=1)
        self.steps_timed += 1
        if self.probe_end is not None:  # every probe step is the callback's own time, warm-up or not
            self.totals["probe_seconds"] += seconds - overhead
            self.totals["probe_steps"] += 1
        if self.warming or self.steps_timed == 1:  # what the fit's first step, or a new set's, compiled is the fit's
            self.compiled_codes.collect()
        if self.warming or self.steps_timed <= self.warmup.warmup_steps:
            # One of the process's first steps, or the first step with a new trainable set of a compiled module
            # (torch.compile guards on `requires_grad`): charged to the fit, but no sample of the steady step time
            # that `T` and the correction read.
            if self.probe_end is not None and not self.history:  # a full step, as full fine-tuning's first ones
                self.warmup.full_seconds += seconds - overhead
                self.warmup.full_steps += 1
                if self.steps_timed > 1:
                    self.warmup.updates.append(optimizer)
            self.warming = False
            self.totals["warmup_seconds"] += seconds
            self.totals["compiled_graphs"] = float(compiled_graphs() - self.graphs_at_start)
            return
        if self.probe_end is not None:
            self.probe_full.append(seconds - overhead)  # a full step without the callback would not measure
            self.probe_optimizer.append(optimizer)
            self.probe_forward.append(forward)
        else:
            self.selected_steps.append(seconds)
        self.forwards = [*self.forwards, forward][-PACE_SAMPLES:]  # a steady step: the device's pace
        self.plan.observe_pace(self.forwards)

    # ------------------------------------------------------------------ what a selection reads

    def importance(self, trainer: L.Trainer) -> list[float]:
        """Every tensor's importance per step as it stands now: the latest measured, a value measured before the last
        window or interval aged by how far the others fell since (`LatestImportance`; the same on every rank)."""
        self._fold_importance(trainer)
        return self.latest.now()

    def _fold_importance(self, trainer: L.Trainer) -> None:
        """Move what the evaluator measured since its last reset into `latest`, as importance per step.

        Per step is the evaluator's trimmed mean over the window's steps, so that one outlier step does not decide
        a selection; a tensor the window did not measure (frozen, or only non-finite steps) keeps its last value,
        read aged by the fall of the tensors measured again (`LatestImportance.fold`).
        """
        counts, dropped = self.evaluator.counts, self.evaluator.nonfinite
        if any(dropped):
            self.totals["nonfinite_steps"] += sum(dropped)
            if not self.warned_nonfinite:
                self.warned_nonfinite = True
                rank_zero_warn(nonfinite_warning(self.names, dropped))
        if any(counts):
            per_step = mean_over_ranks(trainer, self.evaluator.per_step.tolist(), self.params[0].device)
            measured = {k: value for k, (value, count) in enumerate(zip(per_step, counts, strict=True)) if count}
            self.latest.fold(measured, pinned=self.required)
        self.evaluator.reset()

    # ------------------------------------------------------------------ a selection comes into force

    def close_interval(self) -> SelectionRecord | None:
        """The last selection's measured steps, into its record and the plan's correction; None if none was timed."""
        steps, self.selected_steps = self.selected_steps, []
        if not self.history or not steps:
            return None
        record = self.history[-1] = replace(self.history[-1], measured_seconds=tuple(steps))
        self.plan.observe_selected_steps(record.measured_seconds, record.decision.predicted_seconds)
        return record

    def apply(self, pl_module: nn.Module, mask: Mask) -> None:
        """Train the tensors of `mask`: their flags, the BatchNorm policy, and this fit's compiled graphs if the set
        changed (`freezing.CompiledCodes`: only the codes the fit's steps compiled, never dynamo as a whole)."""
        self.set_trainable(mask)
        self.hold_bn(pl_module)
        if self.warming:
            self.compiled_codes.reset()

    def hold_bn(self, pl_module: nn.Module) -> None:
        """The BatchNorm policy for the tensors trainable now (`freezing.apply_bn_policy`), from the layers' modes."""
        self.bn_frozen = apply_bn_policy(pl_module, self.settings.bn_policy, self.bn_frozen)

    def enter(self, record: SelectionRecord, select_seconds: float, apply_seconds: float) -> None:
        """Keep the selection now in force, and charge its own seconds to the plan (`logged` starts the next step)."""
        self.totals["select_seconds"] += select_seconds
        self.totals["apply_seconds"] += apply_seconds
        self.plan.spend_overhead(select_seconds + apply_seconds)
        self.mask = record.mask
        self.history.append(record)

    def logged(self, seconds: float) -> None:
        """Charge writing a selection to the loggers as own work, not to the next step (and the correction): now."""
        self.totals["log_seconds"] += seconds
        self.plan.spend_overhead(seconds)
        self.clock.restart()

    # ------------------------------------------------------------------ the end of the fit

    def give_back(self, pl_module: nn.Module) -> None:
        """The BatchNorm modes the fit changed, as the user had them (`freezing.UserState` gives the flags back)."""
        self.bn_frozen = apply_bn_policy(pl_module, "update", self.bn_frozen)
