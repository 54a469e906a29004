import json
import math

import pytest

from lightning_elastic.planner import WallClockPlan
from lightning_elastic.records import Decision, Mask, SelectionRecord
from lightning_elastic.reporting import FitSummary, fit_summary, top_importance

NAMES = ("stem.weight", "block.weight", "head.weight")
NUMEL = (100, 300, 600)


def record(flags: list[bool], measured: tuple[float, ...], predicted: float = 0.5, starved: bool = False) -> SelectionRecord:
    decision = Decision(Mask.of(flags), (0.1, 0.3, 0.2), predicted, 0.5, starved)
    return SelectionRecord(0, 0, decision, full_seconds=1.0, measured_seconds=measured)


def summarise(history: list[SelectionRecord], spent: float, totals: dict[str, float]) -> FitSummary:
    plan = WallClockPlan(speedup=2.0, total_steps=10, full_step=1.0, spent=spent, steps_done=10, full_samples=2)
    return fit_summary(history, plan, totals, NAMES, NUMEL, target_speedup=2.0)


def test_summary_compares_the_fit_with_full_fine_tuning() -> None:
    history = [record([False, True, True], (0.5, 0.5)), record([False, False, True], (0.4, 0.6))]
    totals = {"profile_seconds": 0.0, "probe_seconds": 2.0, "select_seconds": 0.25, "apply_seconds": 0.05}
    s = summarise(history, spent=5.0, totals=totals)
    assert (s.fit_speedup, s.full_fit_seconds, s.planned_seconds, s.measured_speedup) == (2.0, 10.0, 5.0, 2.0)
    assert s.selected_fraction == pytest.approx(1 / 3) and s.selected_elements_fraction == 0.6
    assert s.most_trained == (("head.weight", 2), ("block.weight", 1)) and s.shortfall == ""
    lines = s.table().splitlines()
    assert lines[0] == (
        "  fit speedup        2.00x (asked 2x, met): 5.0 s spent against 10.0 s estimated for training every tensor "
        "(10 steps x 1000.0 ms); 5.0 s planned"
    )
    assert lines[2] == (
        "  elastic's own time 2.3 s (46% of the fit): profile 0.0 s, probes 2.0 s (2 full steps), selections 0.30 s (2)"
    )
    assert lines[4] == "  most often trained head.weight (2/2), block.weight (1/2)"
    assert len(lines) == 5  # no "why not met" line
    assert s.figures()["selections"] == 2.0 and "most_trained" not in s.figures()
    assert json.loads(json.dumps(s.to_dict()))["most_trained"] == [["head.weight", 2], ["block.weight", 1]]


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


def test_no_fit_gives_not_a_number_and_no_verdict() -> None:
    s = fit_summary((), None, {}, (), (), target_speedup=2.0)
    assert s.selections == 0 and math.isnan(s.fit_speedup) and s.shortfall == "" and s.most_trained == ()


def test_top_importance_is_tagged_by_name_and_skips_not_a_number() -> None:
    rec = SelectionRecord(0, 0, Decision(Mask.of([True] * 7), (1, 7, 3, math.nan, 5, 6, 2), 0.1, 0.1), 0.2)
    names = [f"t{k}" for k in range(7)]
    assert list(top_importance(rec, names)) == [f"elastic/importance/t{k}" for k in (1, 5, 4, 2, 6)]
