import json
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_elastic import reporting, warmup
from lightning_elastic.distributed import SelectiveAllReduce
from lightning_elastic.messages import start_message, starved_warning
from lightning_elastic.planner import FORECAST_STEPS, WallClockPlan
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.reach import at_most
from lightning_elastic.records import Decision, Mask, SelectionRecord, StepTerms
from lightning_elastic.reporting import (
    interval_metrics,
    log_selection,
    progress_metrics,
    selection_metrics,
    top_importance,
    write_map,
    write_selection,
)
from lightning_elastic.schedule import Schedule
from lightning_elastic.summary import FitSummary, fit_summary
from lightning_elastic.time_model import StepTimeModel
from lightning_elastic.warmup import FirstWindow

NAMES = ("stem.weight", "block.weight", "head.weight")
NUMEL = (100, 300, 600)
PROFILE = TimingProfile(names=NAMES, t_dw=(0.001,) * 3, t_dy=(0.002,) * 3, t_fw=0.004, t_full=0.0125,
                        device="cpu", fingerprint="f", unused=(), method="measured", numel=NUMEL)


def record(flags: list[bool], measured: tuple[float, ...], predicted: float = 0.5, starved: bool = False) -> SelectionRecord:
    decision = Decision(Mask.of(flags), (0.1, 0.3, 0.2), predicted, 0.5, starved)
    return SelectionRecord(0, 0, decision, full_seconds=1.0, measured_seconds=measured)


def summarise(history: list[SelectionRecord], spent: float, totals: dict[str, float]) -> FitSummary:
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=1.0, spent=spent, steps_done=10, full_samples=2)
    return fit_summary(history, plan, totals, NAMES, NUMEL, target_speedup=2.0)


def test_summary_compares_the_fit_with_full_fine_tuning() -> None:
    history = [record([False, True, True], (0.5, 0.5)), record([False, False, True], (0.4, 0.6))]
    totals = {"profile_seconds": 0.0, "probe_seconds": 2.0, "probe_steps": 2, "select_seconds": 0.25, "apply_seconds": 0.05}
    s = summarise(history, spent=5.0, totals={**totals, "log_seconds": 0.2})
    assert (s.fit_speedup, s.full_fit_seconds, s.planned_seconds, s.measured_speedup) == (2.0, 10.0, 5.0, 2.0)
    assert s.selected_fraction == pytest.approx(1 / 3) and s.selected_elements_fraction == 0.6
    assert s.most_trained == (("head.weight", 2), ("block.weight", 1)) and s.shortfall == ""
    lines = s.table().splitlines()
    assert lines[0] == (
        "  fit speedup        2.00x (asked 2x, met): 5.0 s spent against 10.0 s estimated for training every tensor "
        "(10 steps x 1000.0 ms); 5.0 s planned"
    )
    assert lines[2] == (
        "  elastic's own time 2.5 s (50% of the fit; 30% with a probe step counted by what it cost beyond a selected "
        "step): profile 0.0 s, probes 2.0 s (2 full steps, 1.0 s beyond selected steps), selections 0.50 s (2, 0 re-planned; "
        "0.20 s of it writing them to the loggers)"
    )
    # the selected steps' mean is 0.5 s against a full step of 1 s: each probe step cost 0.5 s beyond one
    assert s.probe_excess_seconds == 1.0 and s.own_excess_seconds == pytest.approx(1.5)
    assert s.figures()["probe_excess_seconds"] == 1.0
    assert lines[4] == "  most often trained head.weight (2/2), block.weight (1/2)"
    assert len(lines) == 5  # no "why not met" line
    assert s.figures()["selections"] == 2.0 and "most_trained" not in s.figures()
    assert json.loads(json.dumps(s.to_dict()))["most_trained"] == [["head.weight", 2], ["block.weight", 1]]


def test_the_table_counts_the_steps_at_the_pace_each_ran_and_adds_up() -> None:
    # 4 steps at pace 1, then the device ran 25% slower for 6: full fine-tuning would have taken 4 + 6 x 1.25 = 11.5 T
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=0.2, full_samples=2)
    plan.spend(1.0, steps=4)
    plan.pace = 1.25
    plan.spend(0.2 * 10 - 1.0 + 0.3, steps=6)
    history = [record([False, True, True], (0.125,))]
    s = fit_summary(history, plan, {}, NAMES, NUMEL, target_speedup=2.0)
    assert s.paced_steps == pytest.approx(11.5)
    assert s.full_fit_seconds == pytest.approx(s.paced_steps * s.full_step_seconds + s.warmup_excess_seconds)
    lines = s.table().splitlines()
    assert "(10 steps (11.5 at the device's pace as each ran) x 200.0 ms)" in lines[0]
    assert f"{s.full_fit_seconds:.1f} s estimated" in lines[0]
    # per step: a full step at the mean pace over the fit (11.5 / 10 x 200 = 230 ms, the selected steps' mean is the
    # fit's too) over the selected step; not at the pace at the end (250 ms: 2.00x)
    assert s.measured_speedup == pytest.approx(1.84)
    assert lines[1] == (
        "  per-step speedup   1.84x: a selected step 125.0 ms against a full step 230.0 ms (the device's mean pace "
        "over the fit, 1.15, x 200.0 ms)"
    )


def test_a_probe_step_costs_what_a_full_step_at_the_mean_pace_takes_beyond_a_selected_one() -> None:
    """Own time beyond selected steps: each probe step counts the full step at the fit's mean pace (230 ms here) less
    the mean selected step (125 ms), its warm-up left out; counted whole when no selected step was measured."""
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=0.2, full_samples=2)
    plan.spend(1.0, steps=4)
    plan.pace = 1.25
    plan.spend(1.3, steps=6)
    totals = {"probe_seconds": 1.0, "probe_steps": 4, "profile_seconds": 0.5}
    s = fit_summary([record([False, True, True], (0.125,))], plan, totals, NAMES, NUMEL, target_speedup=2.0)
    assert s.probe_excess_seconds == pytest.approx(4 * (0.23 - 0.125))
    assert s.own_seconds == 1.5 and s.own_excess_seconds == pytest.approx(0.5 + 0.42)
    assert "(65% of the fit; 40% with a probe step counted by what it cost beyond a selected step)" in s.table()
    unmeasured = fit_summary([], plan, totals, NAMES, NUMEL, target_speedup=2.0)  # no selection: no selected step
    assert unmeasured.probe_excess_seconds == 1.0 and unmeasured.own_excess_seconds == unmeasured.own_seconds


def test_a_missed_speedup_says_why_and_what_to_change() -> None:
    history = [record([True, True, True], (0.9,), predicted=0.5, starved=True)]
    totals = {"profile_seconds": 1.0, "probe_seconds": 2.0, "select_seconds": 0.0, "apply_seconds": 0.0}
    s = summarise(history, spent=8.0, totals=totals)
    assert s.fit_speedup == 1.25
    reasons = s.shortfall.split("; ")
    assert [r.split(" ")[0] for r in reasons] == ["profiling", "probe", "even", "selected"]
    assert "`speedup`" in reasons[2] and "80% longer than predicted" in reasons[3]
    assert s.table().splitlines()[-1] == f"  why not met        {s.shortfall}"
    within = summarise(history, spent=10 / 1.95, totals=totals)  # 1.95x: within the 3% the contract allows
    assert within.shortfall == ""


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        ({"probe_steps": 3}, "probe windows took 25% of the fit: set fewer `probe_steps`, or train longer"),
        ({}, 'probe windows took 25% of the fit (sized by `probe_steps="auto"`, at least one step each): train longer'),
        ({"probe_steps": "auto"}, "probe windows took 25% of the fit (sized by `probe_steps=\"auto\"`, at least one"),
    ],
    ids=["set to 3", "the default", "auto"],
)
def test_fewer_probe_steps_are_advised_only_when_the_user_set_them(given: dict[str, Any], reason: str) -> None:
    """Under "auto" (the default) the user has no `probe_steps` to lower: the reason stays, the advice is what they
    can do. Before: "set fewer `probe_steps`" whatever they had set."""
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=1.0, spent=8.0, steps_done=10, full_samples=2)
    totals = {"probe_seconds": 2.0, "probe_steps": 2}
    s = fit_summary([record([False, True, True], (0.5,))], plan, totals, NAMES, NUMEL, 2.0, **given)
    assert s.fit_speedup == 1.25 and s.shortfall.startswith(reason)
    assert ("`probe_steps`, or" in s.shortfall) == (given.get("probe_steps", "auto") != "auto")


@pytest.mark.parametrize(("pinned", "cache_on"), [(False, True), (True, False)])
def test_the_pins_and_the_cache_are_advised_only_as_the_user_set_them(pinned: bool, cache_on: bool) -> None:
    """A starved fit is told to pin fewer `train_always` tensors only when it pinned some, and one whose profiling
    took its share is told the cache is off when it turned it off (before: the same words whatever was set)."""
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=1.0, spent=8.0, steps_done=10, full_samples=2)
    totals = {"profile_seconds": 2.0}
    starved = [record([False, True, True], (0.5,), starved=True)]
    s = fit_summary(starved, plan, totals, NAMES, NUMEL, 2.0, pinned=pinned, cache_on=cache_on)
    assert ("ask a lower `speedup` or pin fewer `train_always` tensors" in s.shortfall) == pinned
    assert "the plan's step target: ask a lower `speedup`" in s.shortfall
    cache = "(`cache_dir`, the default)" if cache_on else "(`cache_dir`, off in this fit: leave it unset)"
    assert f"with the profile cache on {cache} the next run on this device skips it" in s.shortfall


@pytest.mark.parametrize(("spent", "over"), [(4.0, "25%"), (4.5, "11%"), (4.6, "")])
def test_a_fit_well_above_its_asked_speedup_is_said_so(spent: float, over: str) -> None:
    """2.50x and 2.22x asked 2x are 25% and 11% over: more than the 10% the plan's noise explains; 2.17x is within
    it and says nothing. Without the contract: nothing either."""
    history, totals = [record([False, True, True], (0.4,))], {"probe_seconds": 0.0, "probe_steps": 0}
    s = summarise(history, spent=spent, totals=totals)
    assert s.headline().endswith("(asked 2x, met)")
    line = [row for row in s.table().splitlines() if row.startswith("  above the asked    ")]
    if over:
        assert s.overshoot().startswith(f"{over} faster than asked: the selections trained less than the budget")
        assert "the full steps this fit timed (1000.0 ms)" in s.overshoot() and line == [f"  above the asked    {s.overshoot()}"]
    else:
        assert s.overshoot() == "" and line == []
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=1.0, spent=spent, steps_done=10, full_samples=2)
    assert fit_summary(history, plan, totals, NAMES, NUMEL, 2.0, contract=False).overshoot() == ""


def test_a_fit_without_the_contract_gets_no_verdict_on_it() -> None:
    """`calibrate=False` plans each selected step at `1 / speedup` of the profile's step and keeps no account: the
    same 1.25x fit is "NOT met" with the contract and, without it, said to be asked per selected step."""
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=1.0, spent=8.0, steps_done=10, full_samples=2)
    history, totals = [record([False, True, True], (0.5,))], {"probe_seconds": 2.0, "probe_steps": 2}
    kept = fit_summary(history, plan, totals, NAMES, NUMEL, 2.0)
    assert kept.headline() == "1.25x (asked 2x, NOT met)" and kept.shortfall
    free = fit_summary(history, plan, totals, NAMES, NUMEL, 2.0, contract=False)
    assert free.headline() == "1.25x (asked 2x per selected step: `calibrate=False` keeps no whole-fit contract)"
    assert free.shortfall == "" and "why not met" not in free.table() and "contract" not in free.figures()
    assert free.fit_speedup == kept.fit_speedup and free.measured_speedup == kept.measured_speedup == 2.0


def test_no_fit_gives_not_a_number_and_no_verdict() -> None:
    s = fit_summary((), None, {}, (), (), target_speedup=2.0)
    assert s.selections == 0 and math.isnan(s.fit_speedup) and s.shortfall == "" and s.most_trained == ()


def test_top_importance_is_tagged_by_name_and_skips_not_a_number() -> None:
    rec = SelectionRecord(0, 0, Decision(Mask.of([True] * 7), (1, 7, 3, math.nan, 5, 6, 2), 0.1, 0.1), 0.2)
    names = [f"t{k}" for k in range(7)]
    assert list(top_importance(rec, names)) == [f"elastic/importance/t{k}" for k in (1, 5, 4, 2, 6)]


def test_start_message_names_the_profile_the_target_and_the_schedule() -> None:
    assert start_message(PROFILE, 1.5, 240, Schedule(20, "step", 4, probe_every=3, first_probe_steps=6)) == (
        "ElasticTensorSelection: 3 tensors profiled on cpu (full forward+backward 12.5 ms, forward 4.0 ms); target "
        "speedup 1.5 for the fit's 240 optimizer steps; 6 probe steps before the first selection, then 4 before one "
        "selection in 3 (one every 20 step(s))"
    )
    read = start_message(PROFILE, 1.5, 240, Schedule(20, "step", 1, first_probe_steps=0), timed=False)
    assert read.startswith("ElasticTensorSelection: 3 tensors profiled earlier (a profile read, not timed in this run) on cpu")
    assert "; 1 probe step before the first selection, then 1 before every selection (one every 20 step(s))" in read
    assert "for the fit's steps (length unknown: planned per interval);" in start_message(
        PROFILE, 2.0, None, Schedule(1, "epoch", 4)
    )


@pytest.mark.parametrize(("share", "said"), [(0.11, True), (0.056, True), (0.054, False), (0.03, False), (None, False)])
def test_start_message_says_when_the_callbacks_own_time_is_planned_over_its_share(
    share: float | None, said: bool
) -> None:
    """Over `OWN_SHARE` as the summary rounds it (5%), with the planned share; a fit of unknown length says nothing."""
    message = start_message(PROFILE, 2.0, 150, Schedule(30, "step", 4, first_probe_steps=6), own_share=share)
    clause = (
        f"; profiling and probe steps (full training steps that measure importance and the full step's time), "
        f"elastic's own time, are planned at {share or 0:.0%} of this fit, above the 5% it keeps to in longer fits "
        "with automatic `probe_steps`: they count toward the 2x, so the selected steps have less time"
    )
    assert message.endswith(clause) is said
    assert ("own time" in message) is said


@pytest.mark.parametrize(
    ("first", "window", "more"),
    [
        (warmup.first_window(), FirstWindow(cold=True), warmup.COLD_STEPS),
        (warmup.first_window(), FirstWindow(timed="measured"), warmup.WARM_STEPS),
        (warmup.PROFILED_WARMUP_STEPS + 1, FirstWindow(timed="measured"), 0),
        (warmup.WARMUP_STEPS, FirstWindow(cold=True), 0),
        (4, FirstWindow(cold=True, warm_step=0.5), warmup.COLD_STEPS + warmup.WARMUP_STEPS - 2),
    ],
    ids=("cold", "warm", "warm, one sample", "cold, warm-up steps only", "cold, its warm step known"),
)
def test_start_message_says_a_cold_process_may_run_its_first_window_on(
    first: int, window: FirstWindow, more: int
) -> None:
    """A cold process whose first window has steady steps to judge its warm-up by can run on; one that knows its
    warm step plans a shorter window and may run on by the warm-up steps it did not plan as well. A warm process runs
    on by WARM_STEPS at most, and only when it has two samples to compare."""
    run_on = window.run_on_limit(first)
    assert run_on == more
    message = start_message(PROFILE, 2.0, 240, Schedule(20, "step", 4, first_probe_steps=first), run_on)
    said = f"(up to {more} more while this process warms up)"
    assert (f"{first} probe steps before the first selection {said}" in message) is bool(more)
    assert ("more while this process warms up" in message) is bool(more)


def test_interval_metrics_compare_measured_with_predicted_and_measured_full_steps() -> None:
    rec = record([False, True, True], (0.25, 0.35), predicted=0.25)
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=0.9, spent=3.0, steps_done=6)
    unmeasured = interval_metrics(rec, plan, None)
    assert unmeasured == {
        "elastic/measured_step_ms": pytest.approx(300.0),
        "elastic/predicted_step_ms": 250.0,
        "elastic/planned_seconds": pytest.approx(2.7),
        "elastic/spent_seconds": 3.0,
        "elastic/fit_speedup": pytest.approx(1.8),
        "elastic/time_model_correction": 1.0,
        "elastic/pace": 1.0,
    }
    allreduce = SelectiveAllReduce()
    allreduce.last_step_bytes, allreduce.last_step_full_bytes = 30, 120
    measured = interval_metrics(rec, WallClockPlan(2.0, 10, 0.9, full_samples=4), allreduce)
    assert measured["elastic/measured_speedup"] == pytest.approx(3.0)
    slower = interval_metrics(rec, WallClockPlan(2.0, 10, 0.9, full_samples=4, pace=0.5), None)  # a full step now
    assert slower["elastic/measured_speedup"] == pytest.approx(1.5) and slower["elastic/pace"] == 0.5
    assert measured["elastic/allreduce_fraction"] == 0.25


def test_steps_of_0_s_on_a_coarse_clock_give_no_per_step_speedup_rather_than_a_crash() -> None:
    """A user's `clock` coarser than a step (`time.time` on Windows ticks every 15.6 ms) reads 0 s steps: the interval
    and the summary leave the per-step figure out (both divided by it: ZeroDivisionError at the interval's end)."""
    plan = WallClockPlan(2.0, 10, 0.9, full_samples=4)
    rec = record([False, True, True], (0.0, 0.0))
    assert "elastic/measured_speedup" not in interval_metrics(rec, plan, None)
    summary = fit_summary([rec], plan, {}, NAMES, NUMEL, target_speedup=2.0)
    assert math.isnan(summary.measured_speedup) and summary.selected_step_seconds == 0.0


def test_selection_metrics_are_the_record_in_milliseconds_and_shares() -> None:
    rec = record([False, True, True], ())
    plan = WallClockPlan(2.0, 10, 1.0)
    metrics = selection_metrics(rec, plan, NUMEL, select_seconds=0.002, optimizer_seconds=0.01, loop_seconds=0.05)
    assert {k: v for k, v in metrics.items() if "seconds" not in k and "speedup" not in k} == {
        "elastic/selected_fraction": pytest.approx(2 / 3),
        "elastic/selected_elements_fraction": 0.9,
        "elastic/predicted_step_ms": 500.0,
        "elastic/full_step_ms": 1000.0,
        "elastic/target_step_ms": 500.0,
        "elastic/optimizer_ms": 10.0,
        "elastic/loop_ms": 50.0,
        "elastic/select_ms": 2.0,
        "elastic/time_model_correction": 1.0,
        "elastic/pace": 1.0,
    }


def test_progress_shows_probe_windows_as_every_tensor_trained() -> None:
    mask = Mask.of([True, False, False, False])
    assert progress_metrics(True, mask) == {"elastic/probing": 1.0, "elastic/trained": 1.0}
    assert progress_metrics(False, None) == {"elastic/probing": 1.0, "elastic/trained": 1.0}
    assert progress_metrics(False, mask) == {"elastic/probing": 0.0, "elastic/trained": 0.25}


def test_starved_warning_gives_the_target_the_cheapest_step_and_what_the_whole_fit_reaches() -> None:
    model = StepTimeModel(t_dw=(0.01, 0.01), t_dy=(0.01, 0.01), t_fixed=0.02)  # cheapest: the last tensor, 30 ms
    decision = Decision(Mask.of([False, True]), (1.0, 2.0), predicted_seconds=0.03, target_seconds=0.025, starved=True)
    terms = StepTerms(model, 0.05, 0.0, 0.025)
    none_ahead = Schedule(interval=1000, unit="step", probe_steps=2, total_steps=100)  # no window after step 12
    firm = dict(full_samples=2, selected_samples=FORECAST_STEPS)  # `T` and the correction measured: no early figure
    plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=0.05, spent=1.5, **firm)
    text = starved_warning(12, decision, terms, plan, none_ahead, [False, False], [False, False])
    # the whole fit at the cheapest step from here: 100 x 50 ms of full fine-tuning in 1.5 s + 88 x 30 ms = 4.14 s
    assert text == (
        "ElasticTensorSelection: at step 12 the plan leaves 25.0 ms a step (full step 50.0 ms, 1.5 s spent of 2.5 s "
        "planned); the cheapest selection takes 30.0 ms, so this interval spends more than its share of `speedup` 2.0 "
        "(largest per-step speedup: 1.66x). With the cheapest selection at every step left, at the step times measured "
        "so far, this fit reaches about 1.20x: the `speedup` asked is out of its reach (ask at most that, or fit longer)."
    )
    # a fit that spent its time: no speedup below 1 is advised (one said "at most 0.92x ... ask at most that")
    spent = replace(plan, spent=4.5)  # 5 s of full fine-tuning in 4.5 s + 88 x 30 ms = 7.14 s
    assert starved_warning(12, decision, terms, spent, none_ahead, [False, False], [False, False]).endswith(
        "this fit reaches about 0.70x: the `speedup` asked is out of its reach (a `speedup` must be above 1: fit "
        "longer)."
    )
    # two probe steps ahead at the full step, and a plan that has learnt its steps measure 10% over the model
    plan.correction = 1.1
    two_ahead = Schedule(interval=50, unit="step", probe_steps=2, total_steps=100)  # steps 48 and 49
    text = starved_warning(12, decision, terms, plan, two_ahead, [False, False], [False, False])
    assert f"reaches about {at_most(5.0 / (1.5 + 2 * 0.05 + 86 * 0.033))}x:" in text
    # within the share the summary counts as met (3%): said so, not out of reach (3x asked; 100 full steps of 100 ms
    # in 0.73 s + 88 x 30 ms: 2.967x)
    edge = WallClockPlan(speedup=3.0, total_steps=100, full_step=0.1, spent=0.73, **firm)
    text = starved_warning(12, decision, terms, edge, none_ahead, [False, False], [False, False])
    assert text.endswith(
        "this fit reaches about 2.96x: within the 3% of the asked that the summary counts as met, with nothing to "
        "spare."
    ), text
    # a fit that has time in hand: the interval's overspend is paid back later
    ahead = WallClockPlan(speedup=1.5, total_steps=100, full_step=0.05, spent=0.2, **firm)
    text = starved_warning(12, decision, terms, ahead, none_ahead, [False, False], [False, False])
    assert text.endswith(
        "Later intervals can pay it back: at the cheapest selection, at the step times measured so far, this fit "
        f"reaches about {at_most(5.0 / 2.84)}x."
    )
    # a figure from fewer selected steps than FORECAST_STEPS is said to be an early one, the same figure
    firm_text = starved_warning(12, decision, terms, plan, two_ahead, [False] * 2, [False] * 2)
    early = starved_warning(12, decision, terms, replace(plan, selected_samples=4), two_ahead, [False] * 2, [False] * 2)
    assert early == firm_text.replace(
        "(ask at most that, or fit longer).",
        "(ask at most that, or fit longer). An early figure, from 4 selected steps (a fit's first ones can run far "
        "slower than its later ones): said again if the cheapest selection is still over the plan once 16 selected "
        "steps are measured.",
    )
    unlearnt = replace(plan, selected_samples=0)
    model_only = starved_warning(12, decision, terms, unlearnt, two_ahead, [False] * 2, [False] * 2)
    assert "An early figure, from the time model, before any selected step (a fit's" in model_only
    # `T` not measured yet (the profile's): no figure, it comes with a later warning
    unmeasured = WallClockPlan(speedup=2.0, total_steps=100, full_step=0.05, spent=1.5)
    text = starved_warning(12, decision, terms, unmeasured, none_ahead, [False, False], [False, False])
    assert text.endswith("what the whole fit can reach is said once a probe window has measured the full step.")
    # a fit of unknown length: no whole-fit figure
    endless = WallClockPlan(speedup=2.0, total_steps=None, full_step=0.05, spent=1.5, full_samples=2)
    text = starved_warning(12, decision, terms, endless, none_ahead, [False, False], [False, False])
    assert text.endswith("Later intervals pay it back if they can: the summary's `fit_speedup` is the outcome.")


class Writer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, method: str) -> Any:
        return lambda tag, *args, **kwargs: self.calls.append((method, tag))


def test_a_selection_goes_to_tensorboard_as_histogram_top_tensors_and_text() -> None:
    rec = record([False, True, True], ())
    writer = Writer()
    write_selection(writer, rec, NAMES, 4)
    tops = [("add_scalar", f"elastic/importance/{n}") for n in ("block.weight", "head.weight", "stem.weight")]
    assert writer.calls == [("add_histogram", "elastic/importance"), *tops, ("add_text", "elastic/selection")]


class Metrics:
    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, metrics))


def test_a_selection_is_logged_to_every_logger_and_its_map_drawn_once_for_every_tensorboard_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = record([False, True, True], ())
    plan = WallClockPlan(2.0, 10, 1.0)
    writers, loggers = [Writer(), Writer()], [Metrics(), Metrics()]
    monkeypatch.setattr(reporting, "tensorboard_writers", lambda trainer: writers)
    trainer = SimpleNamespace(loggers=loggers, global_step=4)
    log_selection(trainer, rec, plan, PROFILE, (0.002, 0.01, 0.0))  # type: ignore[arg-type]
    expected = selection_metrics(rec, plan, NUMEL, select_seconds=0.002, optimizer_seconds=0.01)
    finite = {k: v for k, v in expected.items() if math.isfinite(v)}  # what every logger is given
    assert all(logger.logged == [(4, finite)] for logger in loggers)
    assert all(("add_text", "elastic/selection") in w.calls and ("add_image", "elastic/selection") not in w.calls
               for w in writers)
    drawn: list[int] = []
    assert write_map(trainer, lambda: drawn.append(1) or object(), 4)  # type: ignore[arg-type]
    assert drawn == [1] and all(w.calls[-1] == ("add_image", "elastic/selection") for w in writers)
    assert not write_map(trainer, lambda: None, 4)  # type: ignore[arg-type]  # no selection yet: nothing written
    monkeypatch.setattr(reporting, "tensorboard_writers", lambda trainer: [])
    assert not write_map(trainer, lambda: drawn.append(1) or object(), 4) and drawn == [1]  # type: ignore[arg-type]


def test_the_table_of_a_fit_with_no_step_says_so_not_nan() -> None:
    assert fit_summary((), None, {}, (), (), 2.0).table() == "  no training step measured (asked 2x)"


def test_a_plan_that_spent_more_than_it_had_says_so_instead_of_a_negative_step_target() -> None:
    """A warning read "the plan leaves -9.8 ms a step", the loggers -9.79 ms, the TensorBoard text "a target of
    -9.8 ms"."""
    decision = Decision(Mask.of([False, True]), (1.0, 2.0), 0.03, -0.0098, starved=True)
    model = StepTimeModel(t_dw=(0.01, 0.01), t_dy=(0.0, 0.01), t_fixed=0.02)
    plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=0.05, spent=1.7, full_samples=2)
    none_ahead = Schedule(interval=1000, unit="step", probe_steps=2, total_steps=100)
    text = starved_warning(6, decision, StepTerms(model, 0.05, 0.0, -0.0098), plan, none_ahead, [False] * 2, [False] * 2)
    assert text.startswith("ElasticTensorSelection: at step 6 the plan leaves no time for the steps ahead (full step")
    record = SelectionRecord(6, 0, decision, 0.05)
    assert selection_metrics(record, plan, (4, 4), 0.0, 0.0)["elastic/target_step_ms"] == 0.0
    assert "predicted step 30.0 ms for a target of none (no time left) (full step 50.0 ms)" in reporting.selection_text(
        record, ["a", "b"]
    )
