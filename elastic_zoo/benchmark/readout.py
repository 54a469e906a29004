"""Which metric the benchmark's read-outs use: plain accuracy, or balanced accuracy (the mean recall of the classes).

A run records both, under the names the module logs: every point of its validation curve holds `values`
({"val/acc": ..., "val/balanced_acc": ...}) and its test `test` ({"test/acc": ..., "test/balanced_acc": ...}).
`read_out` gives the runs as the tables, the paired comparisons and the plots read them: one `value` per curve
point, and `best_accuracy`, `final_accuracy`, `test_accuracy`, all of the chosen metric. Runs recorded before both
were (one `value` per point: `val/acc`) read out as they are, with plain accuracy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

Metric = Literal["acc", "balanced_acc"]
METRICS: tuple[Metric, ...] = ("acc", "balanced_acc")
# How the read-outs name each metric in their text, and what it is.
LABELS: dict[str, str] = {"acc": "accuracy", "balanced_acc": "balanced accuracy"}
MEANINGS: dict[str, str] = {
    "acc": "the share of samples classified right",
    "balanced_acc": "the mean over classes of each class's recall, a class absent from the split left out",
}


def read_out(runs: Sequence[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The runs with their curves and accuracies of `metric` ("acc" or "balanced_acc").

    Example:
        >>> run = {"method": "full", "seed": 0, "test": {"test/acc": 0.8, "test/balanced_acc": 0.6},
        ...        "curve": [{"epoch": 0, "seconds": 2.0, "train_seconds": 1.0,
        ...                   "values": {"val/acc": 0.7, "val/balanced_acc": 0.5}}]}
        >>> [balanced] = read_out([run], "balanced_acc")
        >>> balanced["curve"], balanced["final_accuracy"], balanced["test_accuracy"]
        ([{'epoch': 0, 'seconds': 2.0, 'train_seconds': 1.0, 'value': 0.5}], 0.5, 0.6)
    """
    if metric not in METRICS:
        raise ValueError(f"`metric` must be one of {METRICS}. Found: {metric!r}")
    return [_read_out(run, metric) for run in runs]


def _read_out(run: dict[str, Any], metric: str) -> dict[str, Any]:
    if "test" not in run:  # recorded before both metrics were: its figures are plain accuracy's
        if metric != "acc":
            raise ValueError(
                f"`metric` {metric!r} needs runs that recorded it; {run['method']} seed {run['seed']} was recorded "
                "before balanced accuracy was and has plain accuracy only: read it out with `metric` 'acc'"
            )
        return run
    curve = [
        {**{key: v for key, v in point.items() if key != "values"}, "value": point["values"][f"val/{metric}"]}
        for point in run["curve"]
    ]
    values = [point["value"] for point in curve]
    return {
        **run,
        "curve": curve,
        "best_accuracy": max((v for v in values if math.isfinite(v)), default=math.nan),
        "final_accuracy": values[-1] if values else math.nan,
        "test_accuracy": run["test"][f"test/{metric}"],
    }
