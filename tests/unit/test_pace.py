"""The device's pace from forward passes (`pace.pace_of`), against values worked out by hand."""

from __future__ import annotations

import pytest

from lightning_elastic.pace import PACE_BAND, PACE_BOUNDS, PACE_SAMPLES, pace_of


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (1.0, 1.0),
        (1 - PACE_BAND, 1.0),  # the band's edges: the same pace, no jump beyond them
        (1 + PACE_BAND, 1.0),
        (0.93, 1.0),  # MiniLM's forward pass with 10 of 103 tensors trained against all of them: the same pace
        (0.45, 0.5),  # 0.45 / 0.9
        (0.6, 0.6 / 0.9),
        (1.65, 1.5),  # 1.65 / 1.1
        (0.2, PACE_BOUNDS[0]),  # 0.22 would be read: bounded
        (3.0, PACE_BOUNDS[1]),
    ],
)
def test_the_pace_is_the_forward_ratio_softened_by_the_band_and_bounded(ratio: float, expected: float) -> None:
    assert pace_of([0.3 * ratio] * 3, reference=0.3) == pytest.approx(expected)


def test_the_pace_reads_the_median_of_the_latest_forward_passes_only() -> None:
    old = [0.1] * 20  # long before: left out
    latest = [0.5, 0.5, 0.5, 0.5, 0.5, 0.2, 0.2, 9.0]  # one paused step and three fast ones move no median
    assert len(latest) == PACE_SAMPLES
    assert pace_of(old + latest, reference=1.0) == pytest.approx(0.5 / 0.9)


def test_no_pace_is_read_without_a_reference_or_a_timed_forward_pass() -> None:
    assert pace_of([0.5] * 8, reference=0.0) == 1.0  # the window's forward passes were not timed
    assert pace_of([0.0] * 8, reference=0.3) == 1.0  # nor these (a device whose clock the forward did not move)
    assert pace_of([], reference=0.3) == 1.0
