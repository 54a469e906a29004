"""The wall-clock contract's arithmetic with known step costs, and its feedback loop on a simulated device."""

from __future__ import annotations

import math

import pytest

from lightning_elastic import planner, warmup
from lightning_elastic.pace import PACE_BAND
from lightning_elastic.planner import WallClockPlan
from lightning_elastic.records import Decision, Mask
from lightning_elastic.schedule import Schedule
from lightning_elastic.selector import decide
from lightning_elastic.time_model import StepTimeModel
from lightning_elastic.windows import (
    FIRST_WINDOW_SHARE,
    OWN_SHARE,
    ProbePlan,
    ScheduleRefusal,
    after_profile,
    auto_probe_plan,
    late_first_window,
    plan_schedule,
)


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


def test_a_paused_probe_step_is_no_sample_of_the_full_step() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=None, full_step=9.0)
    plan.observe_full_steps([1.0, 1.2, 2.41])  # more than twice the window's median (1.2): paused
    assert plan.full_step == pytest.approx(1.1) and plan.full_samples == 2
    plan.observe_full_steps([1.0, 2.0])  # the lower median of two: 2.0 is not more than twice 1.0
    assert plan.full_step == pytest.approx(1.3) and plan.full_samples == 4


def test_correction_takes_the_first_ratio_then_moves_halfway_and_ignores_nonsense() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=1.0)
    plan.observe_selected_steps([0.65], predicted=0.5)
    assert plan.correction == pytest.approx(1.3)
    plan.observe_selected_steps([0.5], predicted=0.5)
    assert plan.correction == pytest.approx(1.15)
    plan.observe_selected_steps([math.nan], predicted=0.5)
    plan.observe_selected_steps([1.0], predicted=0.0)
    plan.observe_selected_steps([], predicted=0.5)
    assert plan.correction == pytest.approx(1.15)
    plan.observe_selected_steps([100.0], predicted=1.0)  # clipped to 4
    assert plan.correction == pytest.approx(1.15 + 0.5 * (4.0 - 1.15))


def test_paused_steps_of_an_interval_are_spent_but_do_not_move_the_correction() -> None:
    """Two steps hit by another process among four (72 and 34 ms against 9-10 ms) are no error of the time model:
    the interval's mean read as one 3.95x low, and every target after it starved the selections."""
    plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=0.02)
    steps = [0.009, 0.010, 0.072, 0.034]
    plan.spend(sum(steps), steps=4)
    plan.observe_selected_steps(steps, predicted=0.0095)
    assert plan.correction == pytest.approx(1.0)  # the mean of 9 and 10 ms against 9.5 ms
    assert plan.spent == pytest.approx(0.125)


def test_state_round_trip() -> None:
    plan = WallClockPlan(speedup=3.0, total_steps=10, full_step=0.2)
    plan.spend(1.5, steps=3)
    plan.observe_selected_steps([0.2], 0.1)
    assert WallClockPlan.from_state(plan.state_dict()) == plan


@pytest.mark.parametrize(
    ("steps", "selections", "speedup", "expected"),
    [
        (600, 10, 2.0, ProbePlan(4, 4, 6)),  # 15 probe steps allowed: the first window of 6, then 2 of 4
        (100, 5, 2.0, ProbePlan(2, 5, 6)),  # 2.5 allowed: the first window (it times `T`) and no other
        (150, 5, 2.0, ProbePlan(3, 5, 6)),
        (90, 2, 2.0, ProbePlan(2, 2, 6)),  # the text fit: 6 steps are 6.7% of it
        (90, 2, 3.0, ProbePlan(1, 1, 1)),  # ... at 3x 13%: a second window times `T`
        (10_000, 10, 1.5, ProbePlan(4, 1, 6)),
        (20, 2, 3.0, ProbePlan(1, 1, 1)),
        (None, None, 2.0, ProbePlan(4, 1, 6)),
    ],
)
def test_auto_probe_plan_keeps_the_own_share(
    steps: int | None, selections: int | None, speedup: float, expected: ProbePlan
) -> None:
    """Probe steps counted whole within `OWN_SHARE` of the `N / s` planned full steps, as many windows as fit; the
    first window of 6 runs wherever its extra cost is within `FIRST_WINDOW_SHARE`, even past the share; a shorter
    one (all warm-up steps) is followed by a second, even past the share, so that `T` is timed."""
    plan = auto_probe_plan(steps, selections, speedup)
    assert plan == expected
    if steps is not None and selections is not None:
        windows = math.ceil(selections / plan.every)
        probes = plan.first + (windows - 1) * plan.steps
        if plan.first > plan.steps:  # the first window measures steady steps
            assert plan.first == warmup.WARMUP_STEPS + 2 and plan.first * (speedup - 1) / steps <= FIRST_WINDOW_SHARE
        else:  # it does not: a second window does
            assert (plan.first <= warmup.WARMUP_STEPS and windows == min(2, selections)) or windows > 2
        assert probes * speedup / steps <= OWN_SHARE or windows <= (1 if plan.first > warmup.WARMUP_STEPS else 2)
        if windows < selections:  # one window more would not fit
            assert (probes + plan.steps) * speedup / steps > OWN_SHARE


def test_a_period_too_short_for_the_long_first_window_keeps_the_windows_the_share_allows() -> None:
    # 160 steps at 1.5x, a selection every 4 steps: 5.3 probe steps allowed, windows of 3 (the period's limit) and
    # no 6-step first window (it would leave its selection 2 steps of 4): the first window, all warm-up steps, and
    # one that times `T` before the 21st selection
    assert auto_probe_plan(160, 40, 1.5, period=4) == ProbePlan(3, 20, 3)
    assert auto_probe_plan(160, 4, 1.5, period=40) == ProbePlan(4, 4, 6)
    assert auto_probe_plan(None, None, 2.0, period=10) == ProbePlan(4, 1, 4)


def test_the_first_profile_comes_out_of_the_later_windows_and_the_first_window_keeps_its_length() -> None:
    """Fashion-MNIST's fit, 400 steps of 4 epochs at 2x: 10 probe steps counted whole (5% of 200), a 6-step first
    window and one of 4 before the third selection. What profiling cost comes out of the later windows, never out of
    the first (it may be under way); a cached profile (nothing spent) leaves the plan as it was."""
    planned = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(100,), total_steps=400)
    assert isinstance(planned, Schedule)
    assert (planned.first_window_end, planned.probe_steps, planned.probe_every) == (6, 4, 2)
    assert planned.probe_steps_between(0, 400) == 10
    assert after_profile(planned, 2.0, spent=0.0) == planned
    for spent in (0.5, 2.5, 12.0):  # any profiling leaves less than the second window's 4 steps
        after = after_profile(planned, 2.0, spent)
        assert after.first_window_end == 6 and after.probe_steps_between(0, 400) == 6
    # 1,000 steps of 10 epochs: 25 steps, the first window and 4 of 4 (22); a measured profile of 7 leaves 18: 3 of 4
    long = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(100,), total_steps=1000)
    assert isinstance(long, Schedule) and long.probe_steps_between(0, 1000) == 22
    assert after_profile(long, 2.0, spent=7.0).probe_steps_between(0, 1000) == 18
    # a process that timed its measured profile warms up for its first step only: a first window of 3, and the 15
    # steps the profile leaves after it give 3 windows of 4 (a fourth would need 16)
    one = warmup.PROFILED_WARMUP_STEPS
    warm = after_profile(long, 2.0, spent=7.0, warmup_steps=one)
    assert (warm.first_window_end, warm.probe_steps_between(0, 1000)) == (3, 15)
    fashion = after_profile(planned, 2.0, spent=6.0, warmup_steps=one)
    assert (fashion.first_window_end, fashion.probe_steps_between(0, 400)) == (3, 3)  # 6 + 3 of 10
    # a user's short fit, 150 steps of 5 epochs at 2x, cached (the key's pass, half a step): 3.75 steps of share; a
    # cold process that knows its warm step warms up for 2 steps: 4 probe steps, where 6 took 8% of the fit
    user = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(30,), total_steps=150)
    assert isinstance(user, Schedule) and user.probe_steps_between(0, 150) == 6
    cached = after_profile(user, 2.0, spent=0.5, warmup_steps=warmup.KNOWN_WARMUP_STEPS)
    assert (cached.first_window_end, cached.probe_steps_between(0, 150)) == (4, 4)
    # a first window as long as the others (no room for 6 steps before a selection every 5): it keeps its length
    short = plan_schedule(1, "epoch", "auto", 1.5, steps_per_epoch=(5,), total_steps=100)
    assert isinstance(short, Schedule) and (short.first_window_end, short.probe_steps, short.first_probe_steps) == (3, 3, 0)
    assert after_profile(short, 1.5, spent=2.0) == short == after_profile(short, 1.5, spent=2.0, warmup_steps=one)
    # unknown length: a window before every selection, whatever profiling cost
    unknown = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=math.inf, total_steps=None)
    assert isinstance(unknown, Schedule) and after_profile(unknown, 2.0, spent=50.0) == unknown


def test_a_fit_of_unknown_epoch_length_gets_the_long_first_window_only_where_it_can_pay_for_it() -> None:
    # the fit's length known, the epoch's not: a 4-step window before every selection, the first 6 long only within
    # its 10% share and when the fit has room for it
    assert auto_probe_plan(600, None, 2.0) == ProbePlan(4, 1, 6)
    assert auto_probe_plan(40, None, 3.0) == ProbePlan(4, 1, 4)  # 6 steps would be 30% of the planned fit
    assert auto_probe_plan(5, None, 1.05) == ProbePlan(4, 1, 4)  # ... or the whole fit
    assert auto_probe_plan(None, None, 2.0) == ProbePlan(4, 1, 6)


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
                    plan.observe_selected_steps(record[1], record[0])
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
            plan.observe_selected_steps(record[1], record[0])
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


def test_plan_schedule_sizes_auto_windows_within_the_period() -> None:
    # 10 steps an epoch, 100 steps, 10 selections: the share allows floor(0.05 * 100 / 2) = 2 probe steps in all;
    # the first window is all warm-up steps, so a second one, before the sixth selection, times `T`
    auto = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(10,), total_steps=100)
    assert auto == Schedule(1, "epoch", 2, (10,), probe_every=5, total_steps=100)
    # a window of 4 steps (the default) would fill a 4-step period: cut to one step fewer than the period
    short = plan_schedule(4, "step", "auto", 1.1, steps_per_epoch=math.inf, total_steps=1000)
    assert isinstance(short, Schedule) and short.probe_steps == 3
    asked = plan_schedule(2, "epoch", 5, 2.0, steps_per_epoch=(10,), total_steps=None)
    assert asked == Schedule(2, "epoch", 5, (10,), probe_every=1, total_steps=math.inf)
    unknown = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=math.inf, total_steps=None)
    assert isinstance(unknown, Schedule) and (unknown.probe_steps, unknown.probe_every) == (4, 1)
    assert unknown.first_window_end == warmup.WARMUP_STEPS + 2
    # 30 steps an epoch, 150 steps: the first window measures 2 steady steps (6 of 150 at 2x: 4% of the fit), the
    # selection closing it comes at once, not at the next epoch; the 3.75 probe steps allowed leave no other window
    user = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(30,), total_steps=150)
    assert user == Schedule(1, "epoch", 3, (30,), probe_every=5, total_steps=150, first_probe_steps=6)
    assert [s for s in range(150) if user.window_end(s) is not None] == [0, 1, 2, 3, 4, 5]
    assert not user.selects_at_epoch_start(6) and user.selects_at_epoch_start(30 * 5)
    assert user.probe_steps_between(0, 150) == 6 and user.probe_steps_between(3, 150) == 3
    assert not user.selects_at(6) and [s for s in range(150) if user.selects_at(s)] == [30, 60, 90, 120]


@pytest.mark.parametrize(
    ("interval", "unit", "probe_steps", "lengths", "expected"),
    [
        (2, "step", 3, math.inf, "(2 = `interval` 2 x 1 step). Found: 3"),
        (1, "epoch", 8, (8,), "(8 = `interval` 1 x steps per epoch). Found: 8"),
    ],
)
def test_plan_schedule_refuses_windows_that_fill_the_period(
    interval: int, unit: str, probe_steps: int | str, lengths: float | tuple[int, ...], expected: str
) -> None:
    refusal = plan_schedule(interval, unit, probe_steps, 2.0, lengths, total_steps=100)  # type: ignore[arg-type]
    assert refusal == ScheduleRefusal(
        f"`probe_steps` must be fewer than the optimizer steps between two selections {expected}"
    )


def test_a_step_interval_of_1_with_auto_windows_is_refused_by_its_interval() -> None:
    """It said "`probe_steps` must be fewer than ... Found: auto", of a setting the user had not set."""
    refusal = plan_schedule(1, "step", "auto", 2.0, math.inf, total_steps=100)
    assert refusal == ScheduleRefusal(
        "`interval` must leave at least 2 optimizer steps between two selections, a probe step and one to train (an "
        "`interval` of 2 or more, or longer epochs). Found: `interval` 1 x 1 step = 1"
    )


def test_late_first_window_says_where_the_first_selection_comes() -> None:
    late = Schedule(interval=3, unit="step", probe_steps=2)
    assert late.first_window_end == 3
    assert late_first_window(late) == (
        "ElasticTensorSelection: `probe_steps` 2 leave the first selection no step to train before the next window "
        "opens (3 optimizer steps between selections), so the first window runs on until step 3 and the first "
        "selection comes there. Fewer than 1.5 `probe_steps` select earlier."
    )
    assert late_first_window(Schedule(interval=5, unit="step", probe_steps=2)) is None


@pytest.mark.parametrize(
    ("ratio", "mask", "forbidden", "predicted", "starved", "due"),
    [
        (1.2, (True, False, False), (False,) * 3, 1.0, False, True),  # slower than planned, a larger set was free
        (0.8, (True, False, False), (False,) * 3, 1.0, False, True),  # faster, and time bound the choice
        (1.0 + planner.REPLAN_TOLERANCE * 0.99, (True, False, False), (False,) * 3, 1.0, False, False),  # within
        (1.0 - planner.REPLAN_TOLERANCE * 1.01, (True, False, False), (False,) * 3, 1.0, False, True),  # just over
        (1.5, (True, False, False), (False,) * 3, 1.2, True, False),  # the cheapest set running slow: nothing smaller
        (0.5, (True, True, False), (False, False, True), 1.0, False, False),  # faster, but every allowed tensor trains
        (0.5, (True, False, False), (False,) * 3, 0.85, False, False),  # faster, but time did not bind (unhurried)
        (1.5, (True, False, False), (False,) * 3, 0.85, False, True),  # slower: the set may have to shrink
    ],
)
def test_a_selection_is_replanned_when_it_runs_off_plan_and_a_new_one_could_differ(
    ratio: float, mask: tuple[bool, ...], forbidden: tuple[bool, ...], predicted: float, starved: bool, due: bool
) -> None:
    """`replan_due` against the rule written out: off by more than REPLAN_TOLERANCE, and not a slow cheapest set,
    nor a fast one that every allowed tensor, or a target it did not reach, limited (target 1.0 s)."""
    decision = Decision(Mask.of(mask), (1.0,) * 3, predicted_seconds=predicted, target_seconds=1.0, starved=starved)
    assert planner.replan_due(ratio, decision, Mask.of(forbidden)) is due


def test_the_plan_adds_full_fine_tunings_warm_up_to_what_it_allows() -> None:
    """`warmup`: the seconds the same fit without the callback spends on its first, slower steps beyond `T` each."""
    plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=0.5, warmup=3.0)
    assert plan.full_fit() == 53.0 and plan.planned() == 26.5
    plan.spend(10.0, steps=10)  # ten probe steps, the warm-up ones among them
    assert plan.target(step=10, horizon=100, probe_steps_ahead=0) == pytest.approx(16.5 / 90)
    assert plan.speedup_so_far == pytest.approx((10 * 0.5 + 3.0) / 10.0)
    assert WallClockPlan.from_state(plan.state_dict()) == plan
    assert WallClockPlan.from_state({k: v for k, v in plan.state_dict().items() if k != "warmup"}).warmup == 0.0


def test_full_fine_tuning_counts_each_step_at_the_pace_it_ran_and_those_ahead_at_todays() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=100, full_step=1.2)
    plan.observe_full_steps([1.2, 1.2, 1.2], forwards=[0.6, 0.6, 0.6])  # the window: the reference pace
    assert plan.reference_forward == pytest.approx(0.6) and plan.pace == 1.0
    plan.spend(3.6, steps=3)
    plan.observe_pace([0.36] * 8)  # the device runs at 0.6 of the window's forward: a pace of 0.6 / 0.9
    pace = 0.6 / (1 - PACE_BAND)
    assert plan.pace == pytest.approx(pace) and plan.full_step_now == pytest.approx(1.2 * pace)
    plan.spend(2.0, steps=5)
    assert plan.full_fit(8) == pytest.approx(1.2 * (3 + 5 * pace))
    assert plan.full_fit() == pytest.approx(1.2 * (3 + 97 * pace))
    assert plan.full_fit(4) == pytest.approx(1.2 * (3 + 5 * pace) * 4 / 8)  # the steps done, pro rata
    # 92 steps ahead, 4 of them probe steps at today's full step, share what is left of the plan
    left = plan.planned() - plan.spent - 4 * 1.2 * pace
    assert plan.target(step=8, horizon=100, probe_steps_ahead=4) == pytest.approx(left / 88)
    assert plan.speedup_so_far == pytest.approx(1.2 * (3 + 5 * pace) / 5.6)


def test_a_later_window_counts_at_its_own_forward_pace_against_the_first() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=None, full_step=9.0)
    plan.observe_full_steps([1.6, 1.6], forwards=[0.8, 0.8])  # a slow first window sets the reference
    plan.observe_full_steps([1.0, 1.0], forwards=[0.5, 0.5])  # the device at 0.625 of it: 1.6 s at the reference
    assert plan.full_step == pytest.approx(1.6) and plan.full_samples == 4
    plan.observe_full_steps([2.0], forwards=[0.0])  # not timed: taken at the reference pace
    assert plan.full_step == pytest.approx(1.68)


def test_a_checkpoint_from_before_the_pace_counts_its_steps_at_t() -> None:
    plan = WallClockPlan(speedup=2.0, total_steps=50, full_step=1.0)
    plan.spend(6.0, steps=10)
    state = {k: v for k, v in plan.state_dict().items() if k not in ("pace", "paced_beyond", "reference_forward")}
    restored = WallClockPlan.from_state(state)
    assert restored == plan and restored.full_fit() == pytest.approx(50.0) and restored.full_fit(10) == 10.0


@pytest.mark.parametrize("pace", [1.0, 0.8])
def test_the_reachable_speedup_is_what_the_fit_lands_on_at_the_cheapest_step(pace: float) -> None:
    """`reachable` against the fit run out: 10 steps spent, then every step to the end at the cheapest selection but
    the probe steps ahead at `T` (at the device's pace, which the steps ahead and their full-fit estimate share)."""
    plan = WallClockPlan(speedup=3.0, total_steps=60, full_step=0.5, warmup=0.7)
    plan.spend(1.0, steps=0)  # profiling
    plan.spend(6.0, steps=10)
    plan.pace = pace
    schedule = Schedule(interval=20, unit="step", probe_steps=2, total_steps=60)
    probes = schedule.probe_steps_between(10, 60)
    assert probes == 4  # steps 18, 19, 38, 39
    cheapest = 0.2
    predicted = plan.reachable(10, probes, cheapest)
    for step in range(10, 60):
        plan.spend(plan.full_step_now if schedule.window_end(step) is not None else cheapest, steps=1)
    assert predicted == pytest.approx(plan.speedup_so_far, rel=1e-12)
    assert WallClockPlan(speedup=3.0, total_steps=None, full_step=0.5).reachable(0, 0, cheapest) is None
