"""The largest speedup a fit can reach, by hand and by brute force, and the refusal and warnings that say so."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from lightning_elastic import reach as reach_module
from lightning_elastic.errors import ElasticConfigError, SpeedupOutOfReach
from lightning_elastic.reach import Reach, at_most, reach, reach_shortening, reachable_speedup
from lightning_elastic.schedule import Schedule
from lightning_elastic.summary import MET_WITHIN
from lightning_elastic.time_model import StepTimeModel
from lightning_elastic.windows import plan_schedule


def test_a_long_first_window_that_alone_puts_the_speedup_out_of_reach_is_cut_back() -> None:
    # 90 steps at 2x with a 2-step window: reachable while the cheapest step is <= 0.489 of a full step; with the
    # 6-step first window only while it is <= 0.464. A floor of 0.475 in between: the first window is cut back.
    model = StepTimeModel(t_dw=(1.0, 0.0), t_dy=(0.0, 0.0), t_fixed=0.475 / 0.525)  # floor: t_fixed / (t_fixed + 1)
    auto = plan_schedule(1, "epoch", "auto", 2.0, steps_per_epoch=(45,), total_steps=90)
    assert isinstance(auto, Schedule) and (auto.first_window_end, auto.probe_steps) == (6, 2)

    def reach_of(schedule: Schedule) -> Reach:
        return reach(model, [False] * 2, [False] * 2, schedule, 90, 0.0, model.full)

    kept, fit = reach_shortening(auto, 2.0, reach_of)
    assert kept.first_window_end == 2 and kept.probe_steps == 2
    assert fit.this_fit == pytest.approx(90 / (2 + 88 * 0.475)) and fit.this_fit >= 2.0
    assert reach(model, [False] * 2, [False] * 2, auto, 90, 0.0, model.full).this_fit < 2.0
    # at 1.9x the long window fits: it stays
    kept, _ = reach_shortening(auto, 1.9, reach_of)
    assert kept is auto


def test_reachable_speedup_by_hand() -> None:
    # 100 steps: 10 probe steps at 1, 90 at 0.3, plus 5 steps' worth of profiling -> 42 full steps.
    assert reachable_speedup(100, 10, 5.0, 0.3) == pytest.approx(100 / 42)


def test_a_ceiling_is_never_shown_rounded_up() -> None:
    assert [at_most(v) for v in (1.0549, 1.0499, 2.0, 3.3399)] == ["1.05", "1.04", "2.00", "3.33"]


MODEL = StepTimeModel(t_dw=(1.0, 1.0, 1.0), t_dy=(1.0, 1.0, 1.0), t_fixed=2.0)  # full step 2 + 3 + 2 = 7
NONE = [False, False, False]


def test_reach_counts_probe_steps_at_full_cost_and_the_rest_at_the_cheapest_step() -> None:
    schedule = Schedule(interval=10, unit="step", probe_steps=2, total_steps=40)
    cheapest = min(MODEL.predict([k == d for k in range(3)]) for d in range(3))  # brute force: 3.0 (the last)
    floor = cheapest / MODEL.full
    fit = reach(MODEL, NONE, NONE, schedule, 40, profile_seconds=14.0, full_step=7.0)
    probes = sum(schedule.window_end(step) is not None for step in range(40))  # 0, 1, 8, 9, 18, 19, 28, 29
    assert probes == 8 and fit.floor == pytest.approx(floor)
    assert fit.reachable == pytest.approx(40 / (probes + 32 * floor))
    assert fit.this_fit == pytest.approx(40 / (2.0 + probes + 32 * floor))  # 14 s of profiling: two full steps
    assert fit.profile_steps == pytest.approx(2.0)
    assert fit.scope == "in a fit of 40 steps with 8 probe steps at full cost"
    assert fit.own_share(2.0) == pytest.approx((2.0 + probes) / (40 / 2.0))  # 10 full steps of a 20-step plan
    per_step = reach(MODEL, [False, True, False], NONE, schedule, None, profile_seconds=14.0, full_step=7.0)
    assert per_step.reachable == per_step.this_fit == pytest.approx(7.0 / 4.0) and per_step.scope == "(per step)"
    assert per_step.own_share(2.0) is None  # no length, no share of it


def test_reach_refuses_what_it_cannot_reach_and_warns_about_what_profiling_alone_costs() -> None:
    fit = reach(MODEL, NONE, NONE, Schedule(10, "step", 2, total_steps=40), 40, profile_seconds=14.0, full_step=7.0)
    assert fit.check(1.0) is None  # reachable with this run's profiling too
    with pytest.raises(ElasticConfigError) as refused:
        fit.check(3.0)
    assert isinstance(refused.value, SpeedupOutOfReach) and refused.value.reachable == float(at_most(fit.reachable))
    again = pickle.loads(pickle.dumps(refused.value))  # whole across processes: message and figure
    assert (str(again), again.reachable) == (str(refused.value), refused.value.reachable)
    assert str(refused.value) == (
        f"`speedup` must be at most {at_most(fit.reachable)} for this model on this device in a fit of 40 steps with "
        "8 probe steps at full cost: the forward pass and the parts of a step that every selection pays (at least "
        "the `train_always` tensors, or one tensor) take 43% of a full step. Train fewer tensors always, use fewer "
        "`probe_steps`, fit longer, or ask less. Found: 3.0"
    )
    between = (fit.this_fit + fit.reachable) / 2
    assert fit.check(between) == (
        f"ElasticTensorSelection: profiling took 14.0 s (2.0 full steps) of this fit's budget, so this fit reaches "
        f"at most {at_most(fit.this_fit)}x of the `speedup` {between!r} asked; without it (a later fit on this device "
        f"that reads the profile from the cache) {at_most(fit.reachable)}x."
    )
    # a fit that keeps no profile says so: the later fit it points to reads one only with the cache on
    assert dataclasses.replace(fit, cache_on=False).check(between) == (
        f"ElasticTensorSelection: profiling took 14.0 s (2.0 full steps) of this fit's budget, so this fit reaches "
        f"at most {at_most(fit.this_fit)}x of the `speedup` {between!r} asked; without it (a later fit on this device "
        f"that reads the profile from the cache; `cache_dir=False` in this fit keeps none: leave it unset) "
        f"{at_most(fit.reachable)}x."
    )
    # a fit that read its profile was not told to read it from the cache: its pass is what every such fit pays
    assert dataclasses.replace(fit, measured=False).check(between) == (
        f"ElasticTensorSelection: checking the profile it read against this step took 14.0 s (2.0 full steps) of this "
        f"fit's budget, so this fit reaches at most {at_most(fit.this_fit)}x of the `speedup` {between!r} asked "
        "(every fit that reads a profile pays that pass: a longer fit spreads it)."
    )
    # a fraction of a step can tip a speedup at the edge: said as such (it read "1 full steps" for 0.6)
    small = reach(MODEL, NONE, NONE, Schedule(10, "step", 2, total_steps=40), 40, profile_seconds=4.2, full_step=7.0)
    edge = (small.this_fit + small.reachable) / 2
    assert str(small.check(edge)).startswith("ElasticTensorSelection: profiling took 4.2 s (0.6 full steps) of this")


def test_a_speedup_that_leaves_the_selected_steps_little_above_the_cheapest_selection_is_warned_about() -> None:
    """The room is what the fit's budget leaves a selected step above the cheapest one, by hand: 40 steps at 7 s,
    8 of them probes at full cost, 14 s of profiling."""
    fit = reach(MODEL, NONE, NONE, Schedule(10, "step", 2, total_steps=40), 40, profile_seconds=14.0, full_step=7.0)
    for speedup in (1.2, fit.this_fit * 0.97, fit.this_fit):
        selected_budget = (40 / speedup - 2.0 - 8) / 32  # in full steps: the fit's, less profiling and probes
        assert fit.room(speedup) == pytest.approx(selected_budget - fit.floor)
    assert fit.room(fit.leaving(reach_module.NARROW_ROOM)) == pytest.approx(reach_module.NARROW_ROOM)
    assert fit.check(fit.leaving(reach_module.NARROW_ROOM) * 0.99) is None  # room above NARROW_ROOM: nothing to say
    narrow = fit.leaving(reach_module.NARROW_ROOM) * 1.01
    assert fit.check(narrow) == (
        f"ElasticTensorSelection: `speedup` {narrow!r} leaves this fit's selected steps "
        f"{fit.room(narrow):.1%} of a full step above the cheapest selection (43% of a full step: the forward pass and "
        "what every selection trains), in a fit of 40 steps with 8 probe steps at full cost and 14.0 s of profiling: "
        "its selections can train little more than the cheapest set, and accuracy may fall toward training that set "
        f"alone. At most {at_most(fit.leaving(reach_module.NARROW_ROOM))}x leaves 5%; a longer fit, or a later fit that "
        "reads the profile from the cache (the default), leaves more."
    )
    read = dataclasses.replace(fit, measured=False).check(narrow)  # a fit that read its profile: no later fit helps
    assert read is not None and read.endswith("x leaves 5%; a longer fit leaves more.")


def test_a_speedup_out_of_reach_by_less_than_the_summarys_tolerance_is_warned_about_not_refused() -> None:
    """Refused at the figure itself, MiniLM at 2x ran or stopped ("at most 1.98") by timing noise. The band is
    `MET_WITHIN` of the asked: within it a warning with this fit's figure (and a later fit's, when this one profiled),
    beyond it the refusal as before."""
    fit = reach(MODEL, NONE, NONE, Schedule(10, "step", 2, total_steps=40), 40, profile_seconds=14.0, full_step=7.0)
    inside, beyond = fit.reachable / (1 - MET_WITHIN * 0.9), fit.reachable / (1 - MET_WITHIN * 1.1)
    assert fit.refusal(inside) is None and fit.refusal(beyond) is not None
    with pytest.raises(SpeedupOutOfReach) as refused:
        fit.check(beyond)
    assert refused.value.reachable == float(at_most(fit.reachable))
    expected = (
        f"ElasticTensorSelection: `speedup` {inside!r} is just out of this fit's reach: with the cheapest selection "
        f"at every selected step (43% of a full step: the forward pass and what every selection trains) it reaches "
        f"at most {at_most(fit.this_fit)}x in a fit of 40 steps with 8 probe steps at full cost{{later}}. The reach is "
        "within the 3% of the asked that the summary counts as met, so the fit trains instead of being refused; it "
        "lands at or below that figure, its selections train the cheapest set, and accuracy may fall toward training "
        f"that set alone. At most {at_most(fit.leaving(reach_module.NARROW_ROOM))}x leaves them 5% of a full step "
        "above it; a longer fit "
        "leaves more."
    )
    later = f" (a later fit that reads the profile from the cache: {at_most(fit.reachable)}x)"
    assert fit.this_fit < fit.reachable and fit.check(inside) == expected.format(later=later)
    # a fit that read its profile is that later fit: one figure
    assert dataclasses.replace(fit, measured=False).check(inside) == expected.format(later="")
    no_cache = dataclasses.replace(fit, cache_on=False).check(inside)
    assert no_cache is not None and "cache; `cache_dir=False` in this fit keeps none: leave it unset: " in no_cache


@pytest.mark.parametrize(
    ("pinned", "fixed_windows", "advice"),
    [
        (True, True, "Train fewer tensors always, use fewer `probe_steps`, fit longer, or ask less."),
        (False, True, "Use fewer `probe_steps`, fit longer, or ask less."),
        (False, False, "Fit longer, or ask less."),
    ],
)
def test_the_refusal_advises_only_the_settings_the_user_chose(pinned: bool, fixed_windows: bool, advice: str) -> None:
    fit = reach(MODEL, NONE, NONE, Schedule(10, "step", 2, total_steps=40), 40, profile_seconds=14.0, full_step=7.0)
    refusal = dataclasses.replace(fit, pinned=pinned, fixed_windows=fixed_windows).refusal(3.0)
    assert refusal is not None and refusal.endswith(f"take 43% of a full step. {advice} Found: 3.0")


def test_a_refusal_where_no_speedup_is_in_reach_does_not_advise_asking_less() -> None:
    """At "at most 1.00" the refusal advised "a lower speedup", which the constructor refuses (it must be above 1)."""
    fit = reach(MODEL, NONE, NONE, Schedule(10, "step", 2, total_steps=40), 40, 0.0, 7.0)
    refusal = dataclasses.replace(fit, reachable=1.004, pinned=False).refusal(1.5)
    assert refusal is not None and refusal.startswith("`speedup` must be at most 1.00 ")
    assert refusal.endswith(
        "take 43% of a full step, so no speedup is within reach. Use fewer `probe_steps`, or fit longer. Found: 1.5"
    )


def test_a_first_window_cut_to_its_warm_up_steps_keeps_a_later_window_that_times_the_full_step() -> None:
    """A cached short fit near its edge had its first window cut to one step, all warm-up, and its later windows
    planned one in four selections of a fit with three: no full step was ever timed (the plan kept the profile's pass,
    which leaves the update and the loop out, and said 0.79x of a fit that ran 1.46x)."""
    model = StepTimeModel(t_dw=(1.0, 1.0), t_dy=(1.0, 1.0), t_fixed=2.0)

    def reach_of(schedule: Schedule) -> Reach:
        return reach(model, [False] * 2, [False] * 2, schedule, 100, 0.0, 5.0)

    sparse = Schedule(25, "step", 1, probe_every=4, total_steps=100, first_probe_steps=6)
    assert [s for s in range(100) if sparse.window_end(s) is not None] == [0, 1, 2, 3, 4, 5]
    warm, _ = reach_shortening(sparse, 1.62, reach_of, warmup_steps=1)  # its 1-step window: warm-up only
    assert [s for s in range(100) if warm.window_end(s) is not None] == [0, 74]  # a window before the selection at 75
    timed, _ = reach_shortening(sparse, 1.62, reach_of, warmup_steps=0)  # a window that times a steady step
    assert [s for s in range(100) if timed.window_end(s) is not None] == [0]


@pytest.mark.parametrize("floor", [0.2, 0.25, 0.31, 0.45, 0.6])
@pytest.mark.parametrize(("total_steps", "interval"), [(60, 8), (150, 8), (400, 8), (300, 5)])
def test_the_largest_reachable_speedup_is_the_largest_hundredth_a_fit_planned_at_it_reaches(
    floor: float, total_steps: int, interval: int
) -> None:
    """Against every hundredth from 1.01 up, each planned with its own auto windows (more probe steps at a lower
    speedup): the largest that reaches itself. Not a bisection's: at a floor of 0.25, 300 steps and selections every
    5, 3.65-3.70 reach themselves (8 probe steps), 3.71-3.75 do not, 3.76-3.77 do again (6)."""
    model = StepTimeModel(t_dw=(1.0, 0.0), t_dy=(0.0, 0.0), t_fixed=floor / (1.0 - floor))

    def reach_at(speedup: float) -> Reach | None:
        planned = plan_schedule(
            interval, "step", "auto", speedup, steps_per_epoch=(total_steps,), total_steps=total_steps
        )
        assert isinstance(planned, Schedule)
        return reach(model, [False] * 2, [False] * 2, planned, total_steps, 0.0, model.full)

    asked = reach_at(50.0)
    assert asked is not None
    brute = max(k for k in range(101, 1000) if (at := reach_at(k / 100)) is not None and at.reachable >= k / 100)
    found = reach_module.largest_reachable(reach_at, asked)
    assert at_most(found.reachable) == f"{brute / 100:.2f}"
    assert found.scope == reach_at(brute / 100).scope  # the probe steps of the fit planned at that speedup


def test_a_refusal_where_the_cheapest_selection_is_a_full_step_does_not_advise_fitting_longer() -> None:
    """One trainable tensor (a bias-free Linear): every selection trains it, so no fit of any length is faster."""
    whole = StepTimeModel(t_dw=(1.0,), t_dy=(0.0,), t_fixed=2.0)
    fit = reach(whole, [False], [False], Schedule(10, "step", 2, total_steps=40), 40, 0.0, whole.full)
    refusal = dataclasses.replace(fit, pinned=False).refusal(2.0)
    assert fit.floor == 1.0 and refusal is not None
    assert refusal.endswith("so no speedup is within reach. Train this model without the callback. Found: 2.0")


def test_a_per_step_refusal_advises_neither_fewer_probe_steps_nor_a_longer_fit() -> None:
    """Without `calibrate` (or a fit of unknown length) the limit is each step's: it read "Use fewer `probe_steps`,
    fit longer, or ask less"."""
    fit = reach(MODEL, NONE, NONE, Schedule(10, "step", 2), None, 0.0, 7.0)
    refusal = fit.refusal(50.0)
    assert refusal is not None and "(per step)" in refusal
    assert refusal.endswith("of a full step. Train fewer tensors always, or ask less. Found: 50.0")
