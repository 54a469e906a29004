"""The wall-clock contract's arithmetic with known step costs, and its feedback loop on a simulated device."""

from __future__ import annotations

import math

import pytest

from lightning_elastic.planner import ProbePlan, WallClockPlan, auto_probe_plan, reachable_speedup
from lightning_elastic.schedule import Schedule
from lightning_elastic.selector import decide
from lightning_elastic.time_model import StepTimeModel


def test_target_shares_what_is_left_among_the_selected_steps_ahead() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=200, full_step=0.5)
    plan.spend_overhead(3.0)  # profiling
    plan.spend(4 * 0.5, steps=4)  # a probe window
    # 200 * 0.5 / 2 = 50 s planned; 5 s spent; 8 more probe steps at 0.5 s; 188 selected steps share 41 s.
    assert plan.target(step=4, horizon=200, probe_steps_ahead=8) == pytest.approx(41.0 / 188)
    assert plan.planned() == 50.0 and plan.planned(100) == 25.0
    assert plan.target(step=196, horizon=200, probe_steps_ahead=4) == math.inf


def test_full_step_is_the_mean_of_every_probe_step() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=None, full_step=9.0)  # the profile's guess, replaced
    plan.observe_full_steps([1.0, 2.0])
    plan.observe_full_steps([3.0])
    assert plan.full_step == pytest.approx(2.0) and plan.full_samples == 3
    plan.observe_full_steps([])
    assert plan.full_step == pytest.approx(2.0)


def test_correction_takes_the_first_ratio_then_moves_halfway_and_ignores_nonsense() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=1.0)
    plan.observe_selected_steps(measured=0.65, predicted=0.5)
    assert plan.correction == pytest.approx(1.3)
    plan.observe_selected_steps(measured=0.5, predicted=0.5)
    assert plan.correction == pytest.approx(1.15)
    plan.observe_selected_steps(measured=math.nan, predicted=0.5)
    plan.observe_selected_steps(measured=1.0, predicted=0.0)
    assert plan.correction == pytest.approx(1.15)
    plan.observe_selected_steps(measured=100.0, predicted=1.0)  # clipped to 4
    assert plan.correction == pytest.approx(1.15 + 0.5 * (4.0 - 1.15))


def test_state_round_trip() -> None:
    plan = WallClockPlan(speedup=3.0, total_steps=10, full_step=0.2)
    plan.spend(1.5, steps=3)
    plan.observe_selected_steps(0.2, 0.1)
    assert WallClockPlan.from_state(plan.state_dict()) == plan


@pytest.mark.parametrize(
    ("steps", "selections", "speedup", "expected"),
    [
        (600, 10, 2.0, ProbePlan(4, 3)),
        (100, 5, 2.0, ProbePlan(3, 5)),
        (150, 5, 2.0, ProbePlan(4, 5)),
        (10_000, 10, 1.5, ProbePlan(4, 1)),
        (20, 2, 3.0, ProbePlan(1, 2)),
        (None, None, 2.0, ProbePlan(4, 1)),
    ],
)
def test_auto_probe_plan_keeps_the_probe_share(
    steps: int | None, selections: int | None, speedup: float, expected: ProbePlan
) -> None:
    plan = auto_probe_plan(steps, selections, speedup)
    assert plan == expected
    if steps is not None and selections is not None:
        windows = math.ceil(selections / plan.every)
        share = windows * plan.steps * (speedup - 1) / steps
        assert share <= 0.03 or (plan.steps == 1 and windows == 1)


def test_reachable_speedup_by_hand() -> None:
    # 100 steps: 10 probe steps at 1, 90 at 0.3, plus 5 steps' worth of profiling -> 42 full steps.
    assert reachable_speedup(100, 10, 5.0, 0.3) == pytest.approx(100 / 42)


class SimulatedDevice:
    """A device whose real step time is `error` times what the time model predicts, plus a probe's full step."""

    def __init__(self, model: StepTimeModel, error: float) -> None:
        self.model, self.error = model, error

    def step(self, mask: tuple[bool, ...] | None) -> float:
        return self.error * (self.model.full if mask is None else self.model.predict(mask))


@pytest.mark.parametrize("error", [0.7, 1.0, 1.3])
def test_a_fit_lands_on_the_contract_when_the_time_model_is_off(error: float) -> None:
    """A model that predicts 30% too much or too little: the whole fit still takes about `full / speedup`."""
    n = 40
    model = StepTimeModel(t_dw=tuple([0.01] * n), t_dy=tuple([0.01] * n), t_fixed=0.2)
    device = SimulatedDevice(model, error)
    total, speedup = 400, 2.0
    schedule = Schedule(interval=40, unit="step", probe_steps=4, probe_every=2)
    plan = WallClockPlan(speedup, total, full_step=model.full)  # the profile's guess of T, before any probe
    plan.spend_overhead(2 * model.full)  # profiling
    importance = [1.0] * n
    mask: tuple[bool, ...] | None = None
    record: tuple[float, list[float]] | None = None
    probe: list[float] = []
    for step in range(total):
        if (end := schedule.window_end(step)) is not None:
            seconds = device.step(None)
            probe.append(seconds)
            plan.spend(seconds, steps=1)
            if step + 1 == end:
                plan.observe_full_steps(probe)
                probe = []
                mask = None
                if record:
                    plan.observe_selected_steps(sum(record[1]) / len(record[1]), record[0])
                decision = decide(
                    model,
                    importance,
                    plan.target(end, total, schedule.probe_steps_between(end, total)),
                    required=[False] * n,
                    forbidden=[False] * n,
                )
                mask, record = decision.mask.flags, (decision.predicted_seconds, [])
            continue
        if schedule.selects_at(step) and record:
            plan.observe_selected_steps(sum(record[1]) / len(record[1]), record[0])
            decision = decide(
                model,
                importance,
                plan.target(step, total, schedule.probe_steps_between(step, total)),
                required=[False] * n,
                forbidden=[False] * n,
            )
            mask, record = decision.mask.flags, (decision.predicted_seconds, [])
        assert mask is not None and record is not None
        seconds = device.step(mask)
        record[1].append(seconds)
        plan.spend(seconds, steps=1)
    full_fit = total * device.step(None)
    assert plan.steps_done == total
    # On the contract within 2%: one grid unit of the selector and the first interval's error, made up later.
    assert full_fit / plan.spent == pytest.approx(speedup, rel=0.02), (error, plan.spent, full_fit)
