"""Units of selection: the grouping of a module's tensors, the units' time model against the tensor model, and
`decide` over units against brute force over every union of whole units."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from torch import nn

from lightning_elastic.selector import decide
from lightning_elastic.time_model import StepTimeModel
from lightning_elastic.units import Units, layer_units


def names_of(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters()]


def test_layer_units_join_a_normalisation_layer_to_the_module_before_it() -> None:
    block = nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False),  # 0.weight
        nn.BatchNorm2d(8),  # 1.weight, 1.bias: with the convolution
        nn.ReLU(),
        nn.Conv2d(8, 8, 1),  # 3.weight, 3.bias
        nn.GroupNorm(2, 8),  # 4.weight, 4.bias: with it
        nn.LayerNorm(8),  # 5.weight, 5.bias: a norm after a norm stays apart
        nn.Linear(8, 2),  # 6.weight, 6.bias
    )
    units = layer_units(block, names_of(block))
    assert units.groups == ((0, 1, 2), (3, 4, 5, 6), (7, 8), (9, 10))
    assert Units.of("tensor", block, names_of(block)).groups == tuple((k,) for k in range(11))


def test_a_leading_normalisation_layer_is_a_unit_of_its_own() -> None:
    net = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert layer_units(net, names_of(net)).groups == ((0, 1), (2, 3, 4, 5))


@pytest.mark.parametrize("groups", [((1,), (0,)), ((0,), (2,)), ((0, 1), ()), ((0, 2), (1,))])
def test_units_must_split_the_tensors_into_contiguous_runs(groups: tuple[tuple[int, ...], ...]) -> None:
    with pytest.raises(ValueError, match=r"`groups` must split 0\.\.N-1 into contiguous non-empty runs, in order"):
        Units(groups)


def random_units(rng: np.random.Generator, n: int) -> Units:
    cuts = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(0, n)), replace=False).tolist()) if n > 1 else []
    bounds = [0, *cuts, n]
    return Units(tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds)))


def test_the_units_model_prices_every_union_of_units_as_the_tensor_model_does() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        model = StepTimeModel(t_dw=tuple(rng.uniform(0, 2, n)), t_dy=tuple(rng.uniform(0, 2, n)), t_fixed=1.5)
        units = random_units(rng, n)
        unit_model = units.model(model)
        assert unit_model.full == pytest.approx(model.full)
        for chosen in itertools.product([False, True], repeat=len(units.groups)):
            tensors = units.expand(chosen, [False] * n)
            assert unit_model.predict([*chosen, False]) == pytest.approx(model.predict(tensors))


def test_decide_over_units_is_the_best_union_of_whole_units_by_brute_force() -> None:
    rng = np.random.default_rng(1)
    solved = 0
    for _ in range(300):
        n = int(rng.integers(2, 9))
        model = StepTimeModel(t_dw=tuple(rng.uniform(0, 2, n)), t_dy=tuple(rng.uniform(0, 2, n)), t_fixed=1.0)
        units = random_units(rng, n)
        importance = list(rng.uniform(-0.2, 1.0, n))
        required = [False] * n
        if rng.random() < 0.4:
            required[n - 1] = True  # a pinned head: its whole unit trains
        target = float(rng.uniform(1.0, model.full * 0.97))
        decision = decide(model, importance, target, required=required, forbidden=[False] * n, resolution=100_000)
        best = None
        for chosen in itertools.product([False, True], repeat=len(units.groups)):
            flags = units.expand(chosen, [False] * n)
            if not any(flags) or any(r and not f for r, f in zip(required, flags, strict=True)):
                continue
            if model.predict(flags) <= target:
                value = sum(v for v, f in zip(importance, flags, strict=True) if f)
                best = value if best is None else max(best, value)
        if best is None or best <= 0 or decision.starved:
            continue
        decision = decide(
            model, importance, target, required=required, forbidden=[False] * n, resolution=100_000, units=units
        )
        got = sum(v for v, f in zip(importance, decision.mask, strict=True) if f)
        assert decision.predicted_seconds <= target
        assert got == pytest.approx(best, abs=1e-6)
        assert all(len({decision.mask[k] for k in group}) == 1 for group in units.groups)  # whole units only
        solved += 1
    assert solved > 100


def test_forbidden_tensors_stay_frozen_inside_a_chosen_unit_and_a_required_one_brings_its_unit() -> None:
    model = StepTimeModel(t_dw=(1.0, 0.1, 0.1, 1.0), t_dy=(1.0, 0.1, 0.1, 0.0), t_fixed=1.0)
    units = Units(((0, 1, 2), (3,)))
    decision = decide(
        model, [1.0, 0.1, 0.1, 0.0], 10.0, required=[False, True, False, False],
        forbidden=[False, False, True, False], units=units,
    )  # fmt: skip
    assert decision.mask.flags == (True, True, False, False)  # tensor 3 is worth nothing
    assert decision.predicted_seconds == pytest.approx(model.predict(decision.mask))


def test_units_that_do_not_cover_the_tensors_are_refused() -> None:
    model = StepTimeModel(t_dw=(1.0, 1.0), t_dy=(1.0, 1.0), t_fixed=1.0)
    with pytest.raises(ValueError, match=r"`units` must cover the 2 tensors\. Found: 3"):
        decide(model, [1.0, 1.0], 3.0, required=[False] * 2, forbidden=[False] * 2, units=Units.tensors(3))


def test_a_target_at_or_over_the_full_step_trains_every_unit_worth_training_whatever_the_grid() -> None:
    """30 units on a grid of 50: each rounded up alone, they would not all fit a budget that holds them exactly."""
    rng = np.random.default_rng(3)
    n = 60
    model = StepTimeModel(t_dw=tuple(rng.uniform(0.5, 1.5, n)), t_dy=tuple(rng.uniform(0.5, 1.5, n)), t_fixed=1.0)
    importance = list(rng.uniform(0.1, 1.0, n))
    importance[7] = -5.0  # the unit of tensors 6 and 7 is worth less than nothing
    units = Units(tuple((2 * k, 2 * k + 1) for k in range(n // 2)))
    free = [False] * n
    for target in (model.full, model.full * 1.5):
        decision = decide(model, importance, target, required=free, forbidden=free, resolution=50, units=units)
        assert decision.mask.flags == tuple(k not in (6, 7) for k in range(n))
        assert decision.predicted_seconds <= target and not decision.starved
