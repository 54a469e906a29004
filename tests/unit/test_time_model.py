import itertools
import random
from dataclasses import replace

import pytest

from lightning_elastic.profiling import TimingProfile
from lightning_elastic.selector import decide, select
from lightning_elastic.time_model import StepTimeModel, backward_cost, suffix_costs


def make_profile(
    t_dw: tuple[float, ...], t_dy: tuple[float, ...], t_fw: float, numel: tuple[int, ...]
) -> TimingProfile:
    return TimingProfile(
        names=tuple(f"t{k}" for k in range(len(t_dw))),
        t_dw=t_dw,
        t_dy=t_dy,
        t_fw=t_fw,
        t_full=t_fw + sum(t_dw) + sum(t_dy[1:]),
        device="cpu",
        fingerprint="test",
        unused=(),
        method="measured",
        numel=numel,
    )


def test_predict_matches_the_cost_model_for_every_mask() -> None:
    model = StepTimeModel(t_dw=(1.0, 2.0, 4.0), t_dy=(8.0, 16.0, 32.0), t_fixed=100.0)
    for mask in itertools.product([False, True], repeat=3):
        selected = [k for k in range(3) if mask[k]]
        expected = 100.0 + sum(model.t_dw[k] for k in selected)
        if selected:
            expected += sum(model.t_dy[i] for i in range(min(selected) + 1, 3))
        assert model.predict(mask) == expected
    assert model.full == 100.0 + 7.0 + 48.0


def test_optimizer_time_is_shared_by_elements_and_loop_time_is_fixed() -> None:
    profile = make_profile((1.0, 1.0), (0.5, 0.5), t_fw=2.0, numel=(300, 100))
    model = StepTimeModel.from_profile(profile, optimizer_seconds=0.8, loop_seconds=0.25)
    assert model.t_dw == pytest.approx((1.6, 1.2))
    assert model.t_fixed == pytest.approx(profile.t_fixed + 0.25)
    assert model.full == pytest.approx(profile.t_full + 0.8 + 0.25)
    with pytest.raises(
        ValueError, match=r"`optimizer_seconds` must be a non-negative finite number of seconds. Found: -1"
    ):
        StepTimeModel.from_profile(profile, optimizer_seconds=-1)


# Less the update (0.5) and the loop: below the profile's forward (1.0), between it and its pass (6.0), at, above.
@pytest.mark.parametrize(("full_step", "loop"), [(1.2, 0.0), (4.0, 0.0), (4.0, 0.5), (6.5, 0.0), (9.0, 0.0), (9.0, 1.0)])
def test_the_calibrated_model_predicts_the_measured_full_step_from_either_side(full_step: float, loop: float) -> None:
    """A profile timed slower than the fit's steady pass (a process still warming up) has its backward scaled down to
    it and keeps its forward, unless the pass measured no longer than that forward (then every term alike); one timed
    faster keeps its terms and charges the rest of the step to every step. The measured loop is charged to every step
    whole."""
    plain = make_profile((1.0, 1.0, 0.5), (0.5, 1.0, 1.0), t_fw=1.0, numel=(100, 300, 100))
    profile = replace(plain, t_tail=0.5, t_full=plain.t_full + 0.5)  # the loss's backward, paid by every selection
    assert (profile.t_fw, profile.t_full) == (1.0, 6.0)
    optimizer = 0.5
    model = StepTimeModel.calibrated(profile, full_step=full_step, optimizer_seconds=optimizer, loop_seconds=loop)
    assert model.full == pytest.approx(full_step)
    base = StepTimeModel.from_profile(profile)
    step = full_step - optimizer - loop
    if step >= 6.0:
        forward, backward, fixed = 1.0, 1.0, loop + step - 6.0
    elif step > 1.0:
        forward, backward, fixed = 1.0, (step - 1.0) / 5.0, loop
    else:
        forward = backward = step / 6.0
        fixed = loop
    for mask in itertools.product([False, True], repeat=3):
        update = optimizer * sum(n for n, m in zip(profile.numel, mask, strict=True) if m) / 500
        expected = forward * 1.0 + backward * (base.predict(mask) - 1.0) + fixed + update
        assert model.predict(mask) == pytest.approx(expected), mask


def test_budget_selection_meets_the_speedup_target() -> None:
    model = StepTimeModel(t_dw=(3.0, 2.0, 2.0, 1.0), t_dy=(0.0, 3.0, 2.0, 1.0), t_fixed=4.0)
    for speedup in (1.2, 1.5, 2.0):
        budget = model.budget(speedup)
        choice = select(model.t_dw, model.t_dy, [1.0, 1.0, 1.0, 1.0], budget, resolution=10_000)
        assert model.predict(choice.mask) <= model.full / speedup + 1e-12


def test_max_speedup_is_that_of_the_cheapest_admissible_selection() -> None:
    model = StepTimeModel(t_dw=(3.0, 2.0, 2.0, 1.0), t_dy=(0.0, 3.0, 2.0, 1.0), t_fixed=4.0)
    none = (False,) * 4
    # cheapest single tensor: the last one (4 + 1) -> full / 5
    assert model.max_speedup(none, none) == pytest.approx(model.full / 5.0)
    # the last tensor forbidden: the third costs 4 + 2 + 1 = 7
    assert model.max_speedup(none, (False, False, False, True)) == pytest.approx(model.full / 7.0)
    # a required input-side tensor pays the whole dy chain
    assert model.max_speedup((True, False, False, False), none) == pytest.approx(model.full / (4 + 3 + 6))
    assert model.max_speedup(none, none, full=20.0) == pytest.approx(4.0)


def test_a_target_equal_to_the_pinned_cost_survives_rounding_to_the_grid() -> None:
    """`decide`'s floor: required tensors costing exactly the budget must still fit once rounded up."""
    t_dw, t_dy = (0.01, 0.0135888, 0.002), (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="grid units once rounded up"):
        select(t_dw, t_dy, [1.0, 1.0, 1.0], 0.0235888, 1000, required=[True, True, False])
    model = StepTimeModel(t_dw=t_dw, t_dy=t_dy, t_fixed=1.0)
    decision = decide(model, [1.0, 1.0, 1.0], 1.0235888, required=[True, True, False], forbidden=[False] * 3)
    assert decision.mask.flags == (True, True, False)


def test_predict_of_an_empty_selection_leaves_out_the_tail() -> None:
    model = StepTimeModel(t_dw=(1.0, 2.0), t_dy=(0.0, 4.0), t_fixed=10.0, t_tail=3.0)
    assert model.predict([False, False]) == 7.0
    assert model.predict([False, True]) == 12.0
    assert model.full == 10.0 + 3.0 + 4.0


def test_suffix_costs_match_the_formula_for_every_depth() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 12)
        t_dw = [rng.random() for _ in range(n)]
        t_dy = [rng.random() for _ in range(n)]
        suffix = suffix_costs(t_dw, t_dy)
        for d in range(n):
            assert suffix[d] == pytest.approx(backward_cost([i >= d for i in range(n)], t_dw, t_dy), rel=1e-12)


def test_decide_is_the_best_selection_within_the_target_by_brute_force() -> None:
    rng = random.Random(7)
    for trial in range(200):
        n = rng.randint(1, 7)
        model = StepTimeModel(
            t_dw=tuple(float(rng.randint(0, 5)) for _ in range(n)),
            t_dy=tuple(float(rng.randint(0, 5)) for _ in range(n)),
            t_fixed=float(rng.randint(1, 4)),
        )
        importance = [float(rng.randint(-2, 9)) for _ in range(n)]
        forbidden = [rng.random() < 0.2 for _ in range(n)]
        forbidden[rng.randrange(n)] = False
        target = model.t_fixed + float(rng.randint(0, 20))
        # Integer times on a grid of one unit per second: the quantised optimum is the exact one.
        resolution = max(int(min(target, model.full) - model.t_fixed), 1)
        decision = decide(model, importance, target, required=[False] * n, forbidden=forbidden, resolution=resolution)
        masks = [m for m in itertools.product([False, True], repeat=n) if not any(a and b for a, b in zip(m, forbidden, strict=True))]
        fitting = [m for m in masks if any(m) and model.predict(m) <= target]
        context = f"trial {trial}: {model}, {importance}, {forbidden}, {target}"
        if not fitting or max(sum(v for v, f in zip(importance, m, strict=True) if f) for m in fitting) <= 0:
            # nothing worth training fits: one tensor, the most important whose step fits, else the cheapest step
            [one] = [k for k in range(n) if decision.mask[k]]
            singles = {k: model.predict([j == k for j in range(n)]) for k in range(n) if not forbidden[k]}
            fits = [k for k, seconds in singles.items() if seconds <= target]
            if fits:
                assert one in fits and importance[one] == max(importance[k] for k in fits), context
            else:
                assert singles[one] == min(singles.values()), context
            assert decision.starved == (not fits) == (model.predict(decision.mask) > target), context
            continue
        best = max(sum(v for v, f in zip(importance, m, strict=True) if f) for m in fitting)
        value = sum(v for v, f in zip(importance, decision.mask, strict=True) if f)
        assert value == best, context
        assert decision.predicted_seconds == model.predict(decision.mask) <= target, context
        assert not decision.starved and decision.target_seconds == target, context
