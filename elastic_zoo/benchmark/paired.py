"""Paired comparisons over seeds, and accuracy at equal wall clock read off each run's validation curve.

Every method runs on the same data split with the same seed, so for one seed the difference between two methods
is one paired observation. Over n seeds the mean difference and its Student t 95% confidence interval say
whether one method is ahead, behind, or cannot be told apart from the other ("tie": the interval contains 0).

"Accuracy at equal wall clock" is a run's best validation accuracy up to a common training time (validation
left out of the clock: every method validates the same images after every epoch, and a faster method validates
more often). The common times, per seed: each elastic run's end, and half of full fine-tuning's training time.

The functions below read runs as `readout.read_out` gives them (one value per curve point); `paired_report` takes
the runs as recorded and the metric to read out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from elastic_zoo.benchmark.cells import cell, mean_spread
from elastic_zoo.benchmark.methods import FULL_AGAIN
from elastic_zoo.benchmark.readout import LABELS, Metric, read_out

LEVEL = 0.95  # two-sided confidence of every interval
Runs = Mapping[str, Mapping[int, dict[str, Any]]]  # method name -> seed -> run record
Verdict = Literal["ahead", "behind", "tie", "n/a"]


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The two-sided Student t quantile with `df` degrees of freedom: half-width of a CI in standard errors.

    Example:
        >>> round(t_quantile(4), 4), round(t_quantile(1), 3)
        (2.7764, 12.706)
    """
    from scipy.stats import t

    if df < 1:
        raise ValueError(f"`df` must be an int >= 1. Found: {df!r}")
    return float(t.ppf((1 + level) / 2, df))


@dataclass(frozen=True)
class PairedDifference:
    """Mean of per-seed differences `a - b` and its confidence interval; NaN bounds below two pairs.

    Example:
        >>> d = paired_difference([0.80, 0.82, 0.84], [0.79, 0.80, 0.81])
        >>> d.text(), d.verdict
        ('+2.0 [-0.5, +4.5] tie', 'tie')
    """

    mean: float
    low: float
    high: float
    count: int

    @property
    def verdict(self) -> Verdict:
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            return "n/a"
        return "ahead" if self.low > 0 else "behind" if self.high < 0 else "tie"

    def text(self, scale: float = 100.0) -> str:
        """`mean [low, high] verdict` in points (x `scale`); the mean alone for one pair; "n/a" for none."""
        if self.count == 0:
            return "n/a"
        if self.count == 1:
            return f"{self.mean * scale:+.1f} (1 seed: no interval)"
        return f"{self.mean * scale:+.1f} [{self.low * scale:+.1f}, {self.high * scale:+.1f}] {self.verdict}"


def paired_difference(a: Sequence[float], b: Sequence[float]) -> PairedDifference:
    """Mean and Student t CI of `a[i] - b[i]` over the pairs where both are finite."""
    if len(a) != len(b):
        raise ValueError(f"`a` and `b` must pair up. Found lengths {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)]
    mean, spread, count = mean_spread(diffs)
    if count < 2:
        return PairedDifference(mean, math.nan, math.nan, count)
    half = t_quantile(count - 1) * spread / math.sqrt(count)
    return PairedDifference(mean, mean - half, mean + half, count)


def train_seconds(point: Mapping[str, float]) -> float:
    """Training seconds at a validation point (runs recorded before `train_seconds` existed: all seconds)."""
    return float(point["train_seconds"] if "train_seconds" in point else point["seconds"])


def accuracy_at(curve: Sequence[Mapping[str, float]], seconds: float) -> float:
    """The best validation value reached within `seconds` of training; NaN before the first validation.

    Example:
        >>> curve = [{"train_seconds": 10.0, "value": 0.7}, {"train_seconds": 20.0, "value": 0.6}]
        >>> accuracy_at(curve, 5.0), accuracy_at(curve, 15.0), accuracy_at(curve, 99.0)
        (nan, 0.7, 0.7)
    """
    reached = [p["value"] for p in curve if train_seconds(p) <= seconds and math.isfinite(p["value"])]
    return max(reached, default=math.nan)


def training_end(run: Mapping[str, Any]) -> float:
    """Training seconds at the run's last validation: where its curve ends."""
    return train_seconds(run["curve"][-1]) if run["curve"] else math.nan


def by_method_and_seed(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """The runs as method name -> seed -> run."""
    grouped: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        grouped.setdefault(r["method"], {})[int(r["seed"])] = r
    return grouped


def common_times(runs: Runs) -> dict[str, dict[int, float]]:
    """The times methods are compared at, per seed: each elastic run's end, and half of full's training time."""
    times = {
        f"end of {name}": {seed: training_end(r) for seed, r in by_seed.items()}
        for name, by_seed in runs.items()
        if _kind(by_seed) == "elastic"
    }
    if "full" in runs:
        times["half of full"] = {seed: training_end(r) / 2 for seed, r in runs["full"].items()}
    return times


def accuracies_at(by_seed: Mapping[int, dict[str, Any]], times: Mapping[int, float]) -> dict[int, float]:
    """Each seed's accuracy at that seed's common time."""
    return {seed: accuracy_at(r["curve"], times[seed]) for seed, r in by_seed.items() if seed in times}


def _kind(by_seed: Mapping[int, dict[str, Any]]) -> str:
    return str(next(iter(by_seed.values()))["kind"])


def _paired(ours: Mapping[int, float], theirs: Mapping[int, float]) -> PairedDifference:
    seeds = sorted(set(ours) & set(theirs))
    return paired_difference([ours[s] for s in seeds], [theirs[s] for s in seeds])


def _finals(by_seed: Mapping[int, dict[str, Any]]) -> dict[int, float]:
    return {seed: float(r["final_accuracy"]) for seed, r in by_seed.items()}


def best_static(runs: Runs, times: Mapping[int, float]) -> str | None:
    """The baseline (neither full nor elastic) with the highest mean accuracy at `times`; None without one."""
    means = {
        name: mean_spread(list(accuracies_at(by_seed, times).values()))[0]
        for name, by_seed in runs.items()
        if _kind(by_seed) not in ("full", "elastic")
    }
    finite = {name: m for name, m in means.items() if math.isfinite(m)}
    return max(finite, key=lambda name: finite[name]) if finite else None


def paired_report(runs: Sequence[dict[str, Any]], metric: Metric = "acc") -> str:
    """Markdown: `metric` at equal wall clock for every method, and each elastic run against every other method.

    `runs` as recorded (runs.json): `metric` chooses the read-out, "acc" or "balanced_acc" (see `readout`).
    """
    grouped = by_method_and_seed(read_out(runs, metric))
    grouped.pop(FULL_AGAIN, None)  # full fine-tuning again: full's accuracy, at another speed of the machine
    times = common_times(grouped)
    if not times:
        return ""
    labels = list(times)
    label = LABELS[metric]
    lines = [
        "",
        f"## {label.capitalize()} at equal wall clock",
        "",
        f"Each run's best validation {label} (%) within a common training time (validation left out of the clock), "
        "per seed: the end of each elastic run, and half of full fine-tuning's training time. Mean ± sample "
        "standard deviation over seeds; n/a: no validation yet by then.",
        "",
        "| method | "
        + " | ".join(f"{label} ({statistics.fmean(times[label].values()):.0f} s)" for label in labels)
        + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for name, by_seed in grouped.items():
        cells = [cell(list(accuracies_at(by_seed, times[label]).values()), 100) for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name in grouped:
        if f"end of {name}" in times:
            lines += _against_others(name, grouped, times, label)
    return "\n".join(lines) + "\n"


def _against_others(name: str, grouped: Runs, times: Mapping[str, Mapping[int, float]], label: str) -> list[str]:
    """One elastic method minus every other method, paired by seed: final `label` and at every common time."""
    own_end = f"end of {name}"
    labels = [own_end, *(["half of full"] if "half of full" in times else [])]
    ours = grouped[name]
    lines = [
        "",
        f"### {name} minus each other method, paired by seed",
        "",
        f"Points of {label}, mean [{LEVEL:.0%} CI, Student t over the seeds both ran]; ahead / behind: the "
        f"interval excludes 0; tie: it contains 0.",
        "",
        f"| other method | final {label} | " + " | ".join(f"at {label}" for label in labels) + " |",
        "|---|---:|" + "---:|" * len(labels),
    ]
    for other, theirs in grouped.items():
        if other == name:
            continue
        cells = [_paired(_finals(ours), _finals(theirs)).text()]
        cells += [
            _paired(accuracies_at(ours, times[label]), accuracies_at(theirs, times[label])).text() for label in labels
        ]
        lines.append(f"| {other} | " + " | ".join(cells) + " |")
    best = best_static(grouped, times[own_end])
    if best is not None:
        at_end = _paired(accuracies_at(ours, times[own_end]), accuracies_at(grouped[best], times[own_end]))
        met = "met" if at_end.count > 1 and at_end.high >= 0 else "**missed**" if at_end.count > 1 else "not checked"
        lines += [
            "",
            f"- best static baseline at the {own_end}: {best}; {name} minus it: {at_end.text()} "
            f"(target, interval not below 0: {met})",
        ]
    return lines


def curve_band(runs: Sequence[dict[str, Any]], grid: Sequence[float]) -> list[tuple[float, float, float]]:
    """Mean and sample standard deviation over `runs` of accuracy at each time of `grid`, as (time, mean, spread).

    Times at which some run has no validation yet are left out, so every point averages the same seeds.
    """
    band = []
    for seconds in grid:
        values = [accuracy_at(r["curve"], seconds) for r in runs]
        if all(math.isfinite(v) for v in values):
            mean, spread, _ = mean_spread(values)
            band.append((seconds, mean, spread if math.isfinite(spread) else 0.0))
    return band
