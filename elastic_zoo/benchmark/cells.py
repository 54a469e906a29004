"""Figures over seeds as the benchmark's tables show them: mean and spread (`mean_spread`, `cell`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def mean_spread(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean and sample standard deviation of the finite values, and how many there are (spread NaN below 2).

    Example:
        >>> mean_spread([1.0, 3.0, math.nan])
        (2.0, 1.4142135623730951, 2)
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, 0
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else math.nan, len(finite)


def cell(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> str:
    """`mean ± spread` of `values` x `scale`; the count of finite values when some are missing; "n/a" for none.

    Example:
        >>> cell([0.81, 0.83], scale=100), cell([2.0, math.nan]), cell([math.nan])
        ('82.0 ± 1.4', '2.0 (1/2)', 'n/a')
    """
    mean, spread, count = mean_spread(values)
    if count == 0:
        return "n/a"
    text = f"{mean * scale:.{digits}f}"
    if math.isfinite(spread):
        text += f" ± {spread * scale:.{digits}f}"
    if count < len(values):
        text += f" ({count}/{len(values)})"
    return text


def mean_or_nan(values: Sequence[float]) -> float:
    """The mean of `values`; NaN for none."""
    return statistics.fmean(values) if values else math.nan
