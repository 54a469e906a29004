"""Paired statistics over seeds and accuracy at equal wall clock (`elastic_zoo.benchmark.paired`), on known runs."""

from __future__ import annotations

import math
from typing import Any

import pytest
from scipy import stats

from elastic_zoo.benchmark.paired import (
    accuracy_at,
    best_static,
    by_method_and_seed,
    common_times,
    curve_band,
    paired_difference,
    paired_report,
    t_quantile,
)


@pytest.mark.parametrize(
    ("df", "quantile"),
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (10, 2.2281), (29, 2.0452), (30, 2.0423)],
)
def test_t_quantile_matches_the_printed_table(df: int, quantile: float) -> None:
    assert t_quantile(df) == pytest.approx(quantile, abs=1e-4)


def test_paired_interval_is_the_paired_t_test_interval() -> None:
    a, b = [0.76, 0.79, 0.75, 0.81, 0.70], [0.72, 0.74, 0.73, 0.78, 0.67]
    d = paired_difference(a, b)
    reference = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert (d.low, d.high) == pytest.approx((reference.low, reference.high), abs=1e-12)
    assert d.mean == pytest.approx(0.034) and d.count == 5
    # sd 0.0114, half-width 2.776 x 0.0114 / sqrt(5)
    assert d.verdict == "ahead" and d.text() == "+3.4 [+2.0, +4.8] ahead"
    assert paired_difference(b, a).verdict == "behind"


def test_pairs_with_a_missing_value_are_dropped_and_one_pair_has_no_interval() -> None:
    d = paired_difference([0.8, math.nan, 0.7], [0.6, 0.5, math.nan])
    assert d.count == 1 and d.mean == pytest.approx(0.2) and math.isnan(d.low) and d.verdict == "n/a"
    assert d.text() == "+20.0 (1 seed: no interval)"
    assert paired_difference([], []).text() == "n/a"
    with pytest.raises(ValueError, match="`a` and `b` must pair up"):
        paired_difference([1.0], [])


def test_accuracy_at_a_time_is_the_best_validation_up_to_it() -> None:
    curve = [
        {"train_seconds": 5.0, "value": 0.7},
        {"train_seconds": 10.0, "value": 0.9},
        {"train_seconds": 15.0, "value": 0.8},
    ]
    assert math.isnan(accuracy_at(curve, 4.9))
    assert [accuracy_at(curve, t) for t in (5.0, 9.9, 10.0, 15.0, 100.0)] == [0.7, 0.7, 0.9, 0.9, 0.9]
    # a run recorded before `train_seconds` existed is read on its whole-fit clock
    assert accuracy_at([{"seconds": 3.0, "value": 0.5}], 3.0) == 0.5


def _run(method: str, kind: str, seed: int, seconds: list[float], values: list[float]) -> dict[str, Any]:
    curve = [
        {"epoch": e, "seconds": t + 1.0, "train_seconds": t, "value": v}
        for e, (t, v) in enumerate(zip(seconds, values, strict=True))
    ]
    return {"method": method, "kind": kind, "seed": seed, "curve": curve, "final_accuracy": values[-1]}


FULL = {0: [0.60, 0.70, 0.80], 1: [0.62, 0.74, 0.82], 2: [0.58, 0.69, 0.78]}
ELASTIC = {0: [0.65, 0.72, 0.76], 1: [0.66, 0.70, 0.79], 2: [0.64, 0.73, 0.75]}
STATIC = {0: [0.70, 0.71, 0.72], 1: [0.69, 0.74, 0.73], 2: [0.66, 0.70, 0.74]}
RUNS = [
    run
    for seed in (0, 1, 2)
    for run in (
        _run("full", "full", seed, [10.0, 20.0, 40.0], FULL[seed]),
        _run("head_only", "head_only", seed, [4.0, 8.0, 12.0], [0.5, 0.55, 0.6]),
        _run("static_last_k", "static_last_k", seed, [5.0, 10.0, 15.0], STATIC[seed]),
        _run("elastic_2x", "elastic", seed, [6.0, 12.0, 18.0 + seed], ELASTIC[seed]),
    )
]


def test_common_times_are_each_elastic_end_and_half_of_full() -> None:
    times = common_times(by_method_and_seed(RUNS))
    assert times == {"end of elastic_2x": {0: 18.0, 1: 19.0, 2: 20.0}, "half of full": {0: 20.0, 1: 20.0, 2: 20.0}}
    assert best_static(by_method_and_seed(RUNS), times["end of elastic_2x"]) == "static_last_k"


def _reference(a: list[float], b: list[float]) -> str:
    """A paired difference as the report writes it, from scipy's paired t test."""
    ci = stats.ttest_rel(a, b).confidence_interval(0.95)
    mean = 100 * (sum(a) - sum(b)) / len(a)
    verdict = "ahead" if ci.low > 0 else "behind" if ci.high < 0 else "tie"
    return f"{mean:+.1f} [{100 * ci.low:+.1f}, {100 * ci.high:+.1f}] {verdict}"


def test_report_tabulates_accuracy_at_equal_wall_clock_and_every_paired_difference() -> None:
    report = paired_report(RUNS)
    assert "| method | end of elastic_2x (19 s) | half of full (20 s) |" in report
    # by the elastic ends (18, 19, 20 s) full has validated once in seeds 0 and 1, twice in seed 2
    assert "| full | 63.7 ± 4.7 | 71.0 ± 2.6 |" in report
    assert "| static_last_k | 73.3 ± 1.2 | 73.3 ± 1.2 |" in report
    elastic = [0.76, 0.79, 0.75]
    final_full, full_at_end, full_at_half = [0.80, 0.82, 0.78], [0.60, 0.62, 0.69], [0.70, 0.74, 0.69]
    static_best, static_final = [0.72, 0.74, 0.74], [0.72, 0.73, 0.74]
    full_row = [_reference(elastic, final_full), _reference(elastic, full_at_end), _reference(elastic, full_at_half)]
    assert full_row == ["-3.3 [-4.8, -1.9] behind", "+13.0 [-2.1, +28.1] tie", "+5.7 [+4.2, +7.1] ahead"]
    assert f"| full | {' | '.join(full_row)} |" in report
    at_end = _reference(elastic, static_best)
    assert f"| static_last_k | {_reference(elastic, static_final)} | {at_end} | {at_end} |" in report
    assert f"| head_only | {_reference(elastic, [0.6] * 3)} |" in report
    assert (
        f"- best static baseline at the end of elastic_2x: static_last_k; elastic_2x minus it: {at_end} (target, interval not below 0: met)"
        in report
    )


def test_band_averages_the_same_seeds_at_every_time() -> None:
    runs = [r for r in RUNS if r["method"] == "static_last_k"]
    band = curve_band(runs, [4.0, 5.0, 10.0])
    assert [t for t, _, _ in band] == [5.0, 10.0]  # at 4 s no seed has validated
    assert band[1][1] == pytest.approx((0.71 + 0.74 + 0.70) / 3)
    assert band[1][2] == pytest.approx(stats.tstd([0.71, 0.74, 0.70]))


def _both(run: dict[str, Any]) -> dict[str, Any]:
    """`run` as runs.json holds it now: its values become balanced accuracy, and half of them plain accuracy."""
    curve = [
        {**{k: v for k, v in p.items() if k != "value"}, "values": {"val/acc": p["value"] / 2, "val/balanced_acc": p["value"]}}
        for p in run["curve"]
    ]  # fmt: skip
    old = {k: v for k, v in run.items() if k != "final_accuracy"}
    return {**old, "curve": curve, "test": {"test/acc": 0.0, "test/balanced_acc": 0.0}}


def _halved(run: dict[str, Any]) -> dict[str, Any]:
    """`run` recorded before balanced accuracy was, with half its values."""
    curve = [{**p, "value": p["value"] / 2} for p in run["curve"]]
    return {**run, "curve": curve, "final_accuracy": run["final_accuracy"] / 2}


def test_report_reads_out_the_chosen_metric_of_runs_that_recorded_both() -> None:
    both = [_both(r) for r in RUNS]
    balanced = paired_report(both, "balanced_acc")
    # the old runs' figures (their values are the balanced ones), the metric named in the text
    named = (
        paired_report(RUNS).replace(" accuracy", " balanced accuracy").replace("## Accuracy", "## Balanced accuracy")
    )
    assert balanced == named
    assert "## Balanced accuracy at equal wall clock" in balanced
    assert "| other method | final balanced accuracy |" in balanced
    assert "| static_last_k | 73.3 ± 1.2 | 73.3 ± 1.2 |" in balanced
    plain = paired_report(both, "acc")
    assert "| static_last_k | 36.7 ± 0.6 | 36.7 ± 0.6 |" in plain  # half of 0.72, 0.74, 0.74
    assert plain == paired_report([_halved(r) for r in RUNS])
    with pytest.raises(ValueError, match=r"`metric` 'balanced_acc' needs runs that recorded it; full seed 0 was "):
        paired_report(RUNS, "balanced_acc")
