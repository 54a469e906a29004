import itertools
import math
import random

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


def walked_selections(lengths: tuple[int, ...], interval: int, horizon: int) -> list[int]:
    """The steps of the selections after the first, by walking the epochs one by one (the definition)."""
    steps, start = [], 0
    for epoch in range(horizon):
        if epoch and epoch % interval == 0:
            steps.append(start)
        start += lengths[min(epoch, len(lengths) - 1)]
    return steps


@pytest.mark.parametrize("seed", range(40))
def test_epoch_arithmetic_matches_walking_the_epochs(seed: int) -> None:
    rng = random.Random(seed)
    lengths = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
    interval = rng.randint(1, 3)
    period = Schedule(interval, "epoch", 1, lengths).period
    probe = rng.randint(1, max(1, int(period) - 1))  # windows that fit between two selections, as planned
    schedule = Schedule(interval, "epoch", probe, lengths, probe_every=rng.randint(1, 2), total_steps=150)
    walked = walked_selections(lengths, interval, 200)
    for step in range(-1, 120):
        assert schedule.selections_until(step) == sum(s <= step for s in walked)
        ahead = [s for s in walked if s > step][:3]
        assert list(itertools.islice(schedule._selections_after(step), 3)) == ahead
    # and what the callback asks: the probe steps of a whole fit, one window at a time
    in_windows = sum(schedule.window_end(step) is not None for step in range(150))
    assert schedule.probe_steps_between(0, 150) == in_windows


def test_a_fit_of_lightnings_default_1000_epochs_is_planned_without_walking_them() -> None:
    # each selection plans the whole fit: walking 1000 epochs for every selection's window took 0.2 s a selection
    schedule = Schedule(1, "epoch", 2, (8,), total_steps=8000)
    assert schedule.selections_until(7999) == 999 and schedule.selections == 1000
    assert schedule.probe_steps_between(0, 8000) == 2 * 1000
    assert next(schedule._selections_after(7990)) == 7992  # epoch 999 starts at 999 x 8


@pytest.mark.parametrize("lengths", [0, (), (3, 0)])
def test_epochs_without_optimizer_steps_are_refused(lengths: int | tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"`steps_per_epoch` must be a positive number .* Found: "):
        Schedule(1, "epoch", 2, lengths)


def test_no_selection_comes_at_the_fits_end() -> None:
    # step intervals of 10 in a fit of 40 steps: selections before steps 10, 20 and 30, none after the last step
    schedule = Schedule(10, "step", 2, total_steps=40, probe_every=3)
    assert [step for step in range(41) if schedule.selects_at(step)] == [10, 20]  # 30 follows a window
    assert schedule.window_end(38) is None  # and no window opens for one at 40
