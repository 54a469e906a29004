import math

import pytest

from lightning_elastic.schedule import Schedule


def reference_windows(period: int, probe: int, horizon: int) -> dict[int, int]:
    """Step -> window end, built from the definition: [0, P) and [kT - P, kT) for k >= 1."""
    ends = {step: probe for step in range(probe)}
    for k in range(1, horizon // period + 2):
        for step in range(k * period - probe, k * period):
            ends.setdefault(step, k * period)
    return {s: e for s, e in ends.items() if s < horizon}


@pytest.mark.parametrize(
    ("interval", "unit", "probe", "steps_per_epoch"),
    [(1, "epoch", 3, 10), (2, "epoch", 3, 10), (3, "epoch", 1, 7), (5, "step", 2, math.inf), (50, "step", 10, 4)],
)
def test_windows_match_definition(interval: int, unit: str, probe: int, steps_per_epoch: float) -> None:
    schedule = Schedule(interval, unit, probe, steps_per_epoch)  # type: ignore[arg-type]
    period = interval * steps_per_epoch if unit == "epoch" else interval
    expected = reference_windows(int(period), probe, 200)
    found = {step: end for step in range(200) if (end := schedule.window_end(step)) is not None}
    assert found == expected


def test_epoch_selection_waits_for_epoch_start_except_the_first() -> None:
    schedule = Schedule(2, "epoch", 3, 10)
    assert not schedule.selects_at_epoch_start(3)  # first window: select as soon as it closes
    assert schedule.selects_at_epoch_start(20)
    assert not Schedule(5, "step", 2).selects_at_epoch_start(10)


def test_unknown_epoch_length_opens_windows_at_selection_epochs() -> None:
    schedule = Schedule(2, "epoch", 4)
    assert [schedule.window_end(s) for s in range(6)] == [4, 4, 4, 4, None, None]
    assert [e for e in range(7) if schedule.opens_at_epoch_start(e)] == [2, 4, 6]
    assert not schedule.selects_at_epoch_start(40)
    assert not Schedule(2, "epoch", 4, 10).opens_at_epoch_start(2)


@pytest.mark.parametrize(("interval", "unit", "probe", "steps_per_epoch", "every"), [(1, "epoch", 3, 10, 2), (4, "step", 2, math.inf, 3), (2, "epoch", 1, 7, 1)])
def test_sparse_windows_and_their_count_match_the_definition(
    interval: int, unit: str, probe: int, steps_per_epoch: float, every: int
) -> None:
    """Windows precede the first selection and every `every`-th after it; the others select without a window."""
    schedule = Schedule(interval, unit, probe, steps_per_epoch, probe_every=every)  # type: ignore[arg-type]
    period = int(interval * steps_per_epoch if unit == "epoch" else interval)
    expected = {s: e for s, e in reference_windows(period, probe, 200).items() if e == probe or (e // period) % every == 0}
    found = {step: end for step in range(200) if (end := schedule.window_end(step)) is not None}
    assert found == expected
    unprobed = [k * period for k in range(1, 200 // period + 1) if k % every and k * period < 200]
    assert [s for s in range(200) if schedule.selects_at(s)] == unprobed
    for start, end in [(0, 200), (5, 77), (probe, 150), (33, 34)]:
        assert schedule.probe_steps_between(start, end) == sum(1 for s in found if start <= s < end), (start, end)
