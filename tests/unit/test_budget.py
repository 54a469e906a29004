import itertools

import pytest

from lightning_elastic.budget import StepTimeModel, step_time_model
from lightning_elastic.profiler import TimingProfile
from lightning_elastic.selector import select


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
    model = step_time_model(profile, optimizer_seconds=0.8, loop_seconds=0.25)
    assert model.t_dw == pytest.approx((1.6, 1.2))
    assert model.t_fixed == pytest.approx(profile.t_fixed + 0.25)
    assert model.full == pytest.approx(profile.t_full + 0.8 + 0.25)
    with pytest.raises(
        ValueError, match=r"`optimizer_seconds` must be a non-negative finite number of seconds. Found: -1"
    ):
        step_time_model(profile, optimizer_seconds=-1)


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


def test_a_budget_equal_to_the_pinned_cost_survives_rounding_to_the_grid() -> None:
    """The callback's floor: required tensors costing exactly the budget must still fit once rounded up."""
    from lightning_elastic.callback import _with_grid_slack

    t_dw, t_dy = [0.01, 0.0135888, 0.002], [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="grid units once rounded up"):
        select(t_dw, t_dy, [1.0, 1.0, 1.0], 0.0235888, 1000, required=[True, True, False])
    budget = _with_grid_slack(0.0235888, tensors=2, resolution=1000)
    assert select(t_dw, t_dy, [1.0, 1.0, 1.0], budget, 1000, required=[True, True, False]).mask == (True, True, False)
