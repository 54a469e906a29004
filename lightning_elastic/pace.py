"""The device's pace: how fast it runs now against the steps that measured `T`, read from the forward pass.

`T`, the seconds of a full step, is measured in probe windows only: a fit of 90 steps has one window of 2-4 steady
steps at its start. A device that ran those steps slowly (another process, a warming cache) leaves `T` too high for
the whole fit, and the contract's budget `N * T / s` too: MiniLM, seed 2 (docs/results.md), full steps of 1.45-1.61 s
in the window against 0.87-0.95 s in the same fit without the callback, a fit of 1.49x at 2x asked, its own account
2.20x. The selected steps that follow cannot tell: the time model is calibrated to `T`, so they run under its
prediction either way, whether the device sped up or the time model is off (which the plan's correction is for).

Every step runs the same forward pass, whatever it trains: its seconds, against those of the window's steps, are the
device's pace. A forward pass with fewer tensors to train records less for autograd: MiniLM's took 0.215-0.22 s with
10 of 103 tensors trained against 0.23-0.24 s with all of them, so a pace within PACE_BAND of 1 is read as 1, and a
pace beyond it counts only what lies beyond (a soft threshold, with no jump at the band's edge). On Lite0 at 96 px
the same effect ranged from 0.77-0.82 (one process) to 0.93-0.95 (another), so the band is a compromise, measured
over 64 benchmarked fits (docs/results.md, 2026-12-07): the plan's estimate of full fine-tuning's time came out
0.96 +- 0.11 of the full runs' with the pace, 1.00 +- 0.15 without it; a band of 0.15-0.30 on the quicker side
only took the bias away with the spread coming back (0.98 +- 0.12 to 0.99 +- 0.14), no nearer on the whole.

Pure arithmetic: the callback times the forward passes (`timing.StepClock.forward`), the plan keeps the pace.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# A forward pass within this share of the window's is the same pace (fewer trained tensors: up to 0.93x on MiniLM).
PACE_BAND = 0.10
# The pace is the median over the latest PACE_SAMPLES steps' forward passes (one step paused moves no median of 8).
PACE_SAMPLES = 8
# Never read a pace beyond these bounds: a forward that moved more than that was paused or mismeasured.
PACE_BOUNDS = (0.5, 2.0)


def pace_of(forwards: Sequence[float], reference: float) -> float:
    """The device's pace: the median of the latest `forwards` (seconds) over `reference` (the forward of the steps that
    measured `T`), softened by PACE_BAND and bounded by PACE_BOUNDS; 1 when either is unknown (not positive).

    Example:
        >>> pace_of([0.6] * 8, reference=1.0)  # 0.6 is 0.1 below the band: 0.6 / 0.9
        0.6666666666666666
        >>> pace_of([0.93, 0.95, 0.94], reference=1.0), pace_of([], reference=1.0), pace_of([0.5], reference=0.0)
        (1.0, 1.0, 1.0)
        >>> round(pace_of([1.32, 1.32, 9.0], reference=1.0), 6)  # slower now: 1.32 / 1.1
        1.2
    """
    latest = [f for f in forwards[-PACE_SAMPLES:] if f > 0]
    if reference <= 0 or not latest:
        return 1.0
    ratio = statistics.median(latest) / reference
    low, high = PACE_BOUNDS
    if ratio < 1 - PACE_BAND:
        return max(ratio / (1 - PACE_BAND), low)
    if ratio > 1 + PACE_BAND:
        return min(ratio / (1 + PACE_BAND), high)
    return 1.0
