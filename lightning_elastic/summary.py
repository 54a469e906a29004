"""The fit's summary: its speedup against training every tensor, where the callback's time went, what was trained.

`fit_summary` builds a `FitSummary` from the fit's typed records (`records.SelectionRecord`), its plan
(`planner.WallClockPlan`) and the callback's own seconds; `shortfall` says why an asked speedup was not met.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

from lightning_elastic.planner import WallClockPlan, unpaused
from lightning_elastic.records import SelectionRecord

# The fit's running totals that `fit_summary` reads (`FitSession.totals`, kept in checkpoints).
TOTALS = (
    "profile_seconds",
    "probe_seconds",
    "probe_steps",
    "select_seconds",
    "apply_seconds",
    "log_seconds",
    "warmup_seconds",
    "compiled_graphs",
    "nonfinite_steps",
)

# The asked speedup counts as met within this share (the plan's own tolerance for noise in measured steps).
MET_WITHIN = 0.03
# A fit more than this share above the asked speedup is said so (`FitSummary.overshoot`): the plan spends what it is
# given, so that far over it either trained less than the budget allowed, or its estimate of training every tensor is
# too high (its full steps `T` ran slow: a host busy with other work timed 270-470 ms where plain fits took 2-11 ms,
# and the summary said "3.50x, met" of fits no faster than plain ones).
OVER_BY = 0.10


@dataclass(frozen=True)
class FitSummary:
    """A fit against what the user would otherwise do (train every tensor), and where the callback's time went.

    Attributes:
        target_speedup: the `speedup` asked.
        selections: how many selections the fit made.
        replans: of them, how many replaced a selection whose first steps measured off the plan.
        steps: optimizer steps the contract counted.
        probe_steps: of them, steps in probe windows (every tensor trained).
        selected_fraction: tensors trained at the last selection, as a share of all tensors.
        selected_elements_fraction: their parameter elements, as a share of all elements.
        full_step_seconds: a full training step (measured in probe windows; the profile's estimate before), at the
            pace of the steps that measured it.
        selected_step_seconds: the mean measured step under a selection.
        measured_speedup: per step: a full step at the device's mean pace over the fit (`full_step_seconds *
            mean_pace`) over `selected_step_seconds`, the mean over the fit too (at the pace at the end instead, a fit
            whose intervals measured 1.21-1.57x said 1.69x).
        fit_speedup: the whole training part: `full_fit_seconds / spent_seconds`.
        planned_seconds: what the contract allowed for the steps done.
        spent_seconds: what they took, the callback's own work included.
        full_fit_seconds: the estimate of full fine-tuning: `paced_steps` full steps of `full_step_seconds`, plus
            its process's warm-up (`warmup_excess_seconds`).
        paced_steps: the steps done, each counted at the device's pace as it ran (a step at pace 1.1 counts 1.1
            full steps; `steps` when the pace stayed 1).
        warmup_excess_seconds: what full fine-tuning's first steps take beyond `full_step_seconds` each, as this
            fit's first full steps measured it (`WallClockPlan.warmup`).
        profile_seconds: profiling, this fit (0 when the profile came from the cache).
        probe_seconds: the probe windows' steps, counted whole (the process's warm-up steps among them).
        select_seconds: choosing the selections.
        apply_seconds: applying them (flags, BatchNorm, compiled graphs).
        log_seconds: writing them to the loggers (metrics; to TensorBoard also their text and the selection map).
        warmup_seconds: the first step of every new trainable set (a recompile under torch.compile), charged to the
            fit but kept out of the step times the plan learns from.
        compiled_graphs: graphs torch.compile compiled during the fit.
        nonfinite_steps: tensor steps whose importance was NaN or inf, left out.
        most_trained: the tensors most often trained, with how many selections trained them.
        shortfall: why the asked speedup was not met and what to change; empty when it was (or is not known, or the
            fit kept no contract).
        contract: whether the fit kept the wall-clock contract (`calibrate=True`); without it the asked speedup set
            each selected step's share of the profile's full step, and nothing made up for the rest of the fit.
        pace: how fast the device ran at the end against the steps that measured `full_step_seconds` (a full step
            then took `full_step_seconds * pace`; `pace.pace_of`).
    """

    target_speedup: float
    selections: int
    replans: int
    steps: int
    probe_steps: int
    selected_fraction: float
    selected_elements_fraction: float
    full_step_seconds: float
    selected_step_seconds: float
    measured_speedup: float
    fit_speedup: float
    planned_seconds: float
    spent_seconds: float
    full_fit_seconds: float
    paced_steps: float
    warmup_excess_seconds: float
    profile_seconds: float
    probe_seconds: float
    select_seconds: float
    apply_seconds: float
    warmup_seconds: float
    compiled_graphs: int
    nonfinite_steps: int
    most_trained: tuple[tuple[str, int], ...]
    shortfall: str
    contract: bool = True
    pace: float = 1.0
    log_seconds: float = 0.0

    def figures(self) -> dict[str, float]:
        """The figures as one flat dict of numbers (what `ElasticTensorSelection.summary()` returns), with
        `probe_excess_seconds`."""
        numbers = asdict(self).items()
        figures = {k: float(v) for k, v in numbers if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return {**figures, "probe_excess_seconds": self.probe_excess_seconds}

    @property
    def probe_excess_seconds(self) -> float:
        """What the probe steps cost beyond the selected steps they stand in for: `probe_steps` times a full step at
        the device's mean pace less the mean selected step, as `measured_speedup` compares them (all of
        `probe_seconds` when no selected step was measured). A probe step is one of the fit's training steps, which
        without the probe would have been a selected one; the process's warm-up in its first steps, which full
        fine-tuning pays too (`warmup_excess_seconds`), is not counted.

        Example:
            >>> plan = WallClockPlan(2.0, 100, 0.4, spent=40.0, steps_done=100)
            >>> s = replace(fit_summary([], plan, {"probe_seconds": 3.0, "probe_steps": 6}, [], [], 2.0),
            ...     selected_step_seconds=0.25)
            >>> round(s.probe_excess_seconds, 6), replace(s, selected_step_seconds=math.nan).probe_excess_seconds
            (0.9, 3.0)
        """
        beyond = self.full_step_seconds * self.mean_pace - self.selected_step_seconds
        return self.probe_steps * max(beyond, 0.0) if math.isfinite(beyond) else self.probe_seconds

    @property
    def own_seconds(self) -> float:
        """The callback's own time, probe steps counted whole: profiling, probe steps, selections (choosing, applying
        and logging them)."""
        return self.profile_seconds + self.probe_seconds + self.selections_seconds

    @property
    def selections_seconds(self) -> float:
        """Choosing, applying and logging the selections."""
        return self.select_seconds + self.apply_seconds + self.log_seconds

    @property
    def own_excess_seconds(self) -> float:
        """The callback's own time with each probe step counted by what it cost beyond a selected step
        (`probe_excess_seconds`): what measuring cost the fit in training time."""
        return self.own_seconds - self.probe_seconds + self.probe_excess_seconds

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)

    def headline(self) -> str:
        """The fit's speedup against the one asked, e.g. "1.93x (asked 2x, met)"; no verdict without a contract."""
        if not self.contract:
            return (
                f"{self.fit_speedup:.2f}x (asked {self.target_speedup:g}x per selected step: `calibrate=False` keeps "
                "no whole-fit contract)"
            )
        verdict = "met" if not self.shortfall else "NOT met"
        return f"{self.fit_speedup:.2f}x (asked {self.target_speedup:g}x, {verdict})"

    def overshoot(self) -> str:
        """What a fit more than `OVER_BY` above its asked speedup means; empty when it is not (or keeps no contract).

        Example:
            >>> plan = WallClockPlan(2.0, 100, 1.0, spent=40.0, steps_done=100)
            >>> fit_summary([], plan, {}, [], [], target_speedup=2.0).overshoot()[:24]
            '25% faster than asked: t'
            >>> fit_summary([], WallClockPlan(2.0, 100, 1.0, spent=46.0, steps_done=100), {}, [], [], 2.0).overshoot()
            ''
        """
        if not self.contract or not math.isfinite(self.fit_speedup):
            return ""
        if self.fit_speedup <= self.target_speedup * (1 + OVER_BY):
            return ""
        return (
            f"{self.fit_speedup / self.target_speedup - 1:.0%} faster than asked: the selections trained less than the "
            f"budget allowed, or the full steps this fit timed ({self.full_step_seconds * 1e3:.1f} ms) ran slower than "
            "training every tensor takes on this device (other work on the machine), and the estimate above is high"
        )

    @property
    def mean_pace(self) -> float:
        """The device's mean pace over the fit's steps (`paced_steps` over `steps`; 1 before any)."""
        return self.paced_steps / self.steps if self.steps else 1.0

    def per_step(self) -> str:
        """A selected step against a full step, both measured; said so when no full step was (all warmed up)."""
        if math.isnan(self.selected_step_seconds):
            return f"no selected step measured; a full step {self.full_step_seconds * 1e3:.1f} ms"
        if math.isnan(self.measured_speedup):
            return (
                f"a selected step {self.selected_step_seconds * 1e3:.1f} ms; no steady full step measured (the probe "
                f"steps were the process's warm-up steps), estimated at {self.full_step_seconds * 1e3:.1f} ms"
            )
        mean_pace = self.mean_pace
        paced = f" (the device's mean pace over the fit, {mean_pace:.2f}, x {self.full_step_seconds * 1e3:.1f} ms)"
        return (
            f"{self.measured_speedup:.2f}x: a selected step {self.selected_step_seconds * 1e3:.1f} ms against a full "
            f"step {self.full_step_seconds * mean_pace * 1e3:.1f} ms{paced if abs(mean_pace - 1) >= 0.005 else ''}"
        )

    def _full_fit_terms(self) -> str:
        steps = f"{self.steps} steps"
        if abs(self.paced_steps - self.steps) >= 0.05:
            steps += f" ({self.paced_steps:.1f} at the device's pace as each ran)"
        warmup = f" + {self.warmup_excess_seconds:.1f} s of warm-up" if self.warmup_excess_seconds >= 0.05 else ""
        return f"{steps} x {self.full_step_seconds * 1e3:.1f} ms{warmup}"

    def table(self) -> str:
        """A small table for the terminal: speedups, where the time went, what was trained, and what to change; one
        line before any training step was measured (no fit yet, or one the callback stayed off in)."""
        if not math.isfinite(self.spent_seconds) or self.steps == 0:
            return f"  no training step measured (asked {self.target_speedup:g}x)"
        overhead, beyond = self.own_seconds, self.own_excess_seconds
        share = overhead / self.spent_seconds if self.spent_seconds > 0 else math.nan
        excess = beyond / self.spent_seconds if self.spent_seconds > 0 else math.nan
        trained = ", ".join(f"{name} ({n}/{self.selections})" for name, n in self.most_trained) or "none"
        lines = [
            f"  fit speedup        {self.headline()}: "
            f"{self.spent_seconds:.1f} s spent against {self.full_fit_seconds:.1f} s estimated for training every "
            f"tensor ({self._full_fit_terms()}); "
            f"{self.planned_seconds:.1f} s planned",
            f"  per-step speedup   {self.per_step()}",
            f"  elastic's own time {overhead:.1f} s ({share:.0%} of the fit; {excess:.0%} with a probe step counted by "
            f"what it cost beyond a selected step): profile {self.profile_seconds:.1f} s, probes "
            f"{self.probe_seconds:.1f} s ({self.probe_steps} full steps, {self.probe_excess_seconds:.1f} s beyond "
            f"selected steps), selections {self.selections_seconds:.2f} s ({self.selections}, "
            f"{self.replans} re-planned; {self.log_seconds:.2f} s of it writing them to the loggers)",
            f"  trained            {percent(self.selected_fraction)} of tensors, "
            f"{percent(self.selected_elements_fraction)} of parameter elements at the last selection",
            f"  most often trained {trained}",
        ]
        if self.shortfall:
            lines.append(f"  why not met        {self.shortfall}")
        if over := self.overshoot():
            lines.append(f"  above the asked    {over}")
        return "\n".join(lines)


def percent(fraction: float) -> str:
    """`fraction` as a percentage that says 100% only of all and 0% only of none (a frozen tensor of 0.2% of the
    elements read "100% of parameter elements").

    Example:
        >>> percent(0.5), percent(0.9977), percent(0.99999), percent(0.001), percent(1.0)
        ('50%', '99.8%', '>99.9%', '0.1%', '100%')
    """
    shown = f"{fraction:.0%}"
    if fraction in (0.0, 1.0) or shown not in ("0%", "100%") or math.isnan(fraction):
        return shown
    shown = f"{fraction:.1%}"
    return shown if shown not in ("0.0%", "100.0%") else ("<0.1%" if fraction < 0.5 else ">99.9%")


def fit_summary(
    history: Sequence[SelectionRecord],
    plan: WallClockPlan | None,
    totals: Mapping[str, float],
    names: Sequence[str],
    numel: Sequence[int],
    target_speedup: float,
    probe_steps: int | Literal["auto"] = "auto",
    contract: bool = True,
    pinned: bool = False,
    cache_on: bool = True,
) -> FitSummary:
    """The `FitSummary` of a fit from its selection records, its plan and the callback's own seconds; `probe_steps`,
    `pinned` (`train_always` tensors) and `cache_on` as the user set them (what `shortfall` may advise); `contract`
    False for a fit that kept none (`calibrate=False`)."""
    last = history[-1] if history else None
    selected = [s for r in history for s in r.measured_seconds]
    full = plan.full_step if plan is not None else math.nan
    mean_selected = math.fsum(selected) / len(selected) if selected else math.nan
    measured = selected and plan is not None and plan.full_samples and mean_selected > 0  # 0: a clock's coarse ticks
    counts = np.sum([r.mask.flags for r in history], axis=0) if history else np.zeros(len(names))
    top = [k for k in np.argsort(-counts, kind="stable")[:5] if counts[k] > 0]
    spent = plan.spent if plan is not None else math.nan
    summary = FitSummary(
        target_speedup=target_speedup,
        selections=len(history),
        replans=sum(r.replanned for r in history),
        steps=plan.steps_done if plan is not None else 0,
        probe_steps=int(totals.get("probe_steps", 0)),
        selected_fraction=(last.mask.count(True) / len(last.mask)) if last else math.nan,
        selected_elements_fraction=last.mask.elements(numel) / max(1, sum(numel)) if last else math.nan,
        full_step_seconds=full,
        selected_step_seconds=mean_selected,
        measured_speedup=math.nan,  # below: of `mean_pace`, derived from `paced_steps`
        fit_speedup=plan.speedup_so_far if plan is not None else math.nan,
        planned_seconds=plan.planned(plan.steps_done) if plan is not None else math.nan,
        spent_seconds=spent,
        full_fit_seconds=plan.full_fit(plan.steps_done) if plan is not None else math.nan,
        paced_steps=plan.steps_done + plan.paced_beyond if plan is not None else 0.0,
        warmup_excess_seconds=plan.warmup if plan is not None else 0.0,
        profile_seconds=totals.get("profile_seconds", 0.0),
        probe_seconds=totals.get("probe_seconds", 0.0),
        select_seconds=totals.get("select_seconds", 0.0),
        apply_seconds=totals.get("apply_seconds", 0.0),
        log_seconds=totals.get("log_seconds", 0.0),
        warmup_seconds=totals.get("warmup_seconds", 0.0),
        compiled_graphs=int(totals.get("compiled_graphs", 0)),
        nonfinite_steps=int(totals.get("nonfinite_steps", 0)),
        most_trained=tuple((names[k], int(counts[k])) for k in top),
        shortfall="",
        contract=contract,
        pace=plan.pace if plan is not None else 1.0,
    )
    per_step = full * summary.mean_pace / mean_selected if measured else math.nan
    why = shortfall(summary, history, probe_steps, pinned, cache_on) if contract else ""
    return replace(summary, measured_speedup=per_step, shortfall=why)


def shortfall(
    summary: FitSummary,
    history: Sequence[SelectionRecord],
    probe_steps: int | Literal["auto"] = "auto",
    pinned: bool = False,
    cache_on: bool = True,
) -> str:
    """Why `summary` misses its asked speedup, and what to change; empty when it meets it (or nothing was timed).

    Only a setting the user chose is advised: fewer `probe_steps` when they set a number, not under "auto" (the
    default), which already sizes the windows for the fit; fewer `train_always` tensors when they pinned some; the
    cache when they turned it off.

    Example:
        >>> s = fit_summary([], WallClockPlan(2.0, 100, 1.0, spent=80.0, steps_done=100), {"profile_seconds": 30.0},
        ...     [], [], target_speedup=2.0)
        >>> s.fit_speedup, s.shortfall.split(":")[0]
        (1.25, 'profiling took 30.0 s (38% of the fit)')
        >>> s.shortfall.split(": ")[1].split(";")[0]
        'with the profile cache on (`cache_dir`, the default) the next run on this device skips it'
    """
    s = summary
    if not math.isfinite(s.fit_speedup) or s.fit_speedup >= s.target_speedup * (1 - MET_WITHIN):
        return ""
    reasons = []
    if s.profile_seconds > 0.05 * s.spent_seconds:
        cache = "the default" if cache_on else "off in this fit: leave it unset"
        reasons.append(
            f"profiling took {s.profile_seconds:.1f} s ({s.profile_seconds / s.spent_seconds:.0%} of the fit): "
            f"with the profile cache on (`cache_dir`, {cache}) the next run on this device skips it"
        )
    if s.probe_seconds > 0.10 * s.spent_seconds:
        took = f"probe windows took {s.probe_seconds / s.spent_seconds:.0%} of the fit"
        reasons.append(
            f'{took} (sized by `probe_steps="auto"`, at least one step each): train longer'
            if probe_steps == "auto"
            else f"{took}: set fewer `probe_steps`, or train longer"
        )
    if any(r.decision.starved for r in history):
        pins = " or pin fewer `train_always` tensors" if pinned else ""
        reasons.append(
            f"even the cheapest selection took longer than the plan's step target: ask a lower `speedup`{pins}"
        )
    late = [  # as the correction reads them: paused steps are no cost of the step (`planner.unpaused`)
        statistics.fmean(kept) / r.decision.predicted_seconds for r in history if (kept := unpaused(r.measured_seconds))
    ]
    if late and max(late) > 1.15:
        reasons.append(
            f"selected steps took up to {max(late) - 1:.0%} longer than predicted (costs the profile does not see, "
            "e.g. data loading): a longer fit gives the correction time to make this up"
        )
    return "; ".join(reasons) or "the fit was too short to make up its first steps: train longer or ask less"
