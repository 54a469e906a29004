"""The exact tensor selector against brute force over every mask, and its argument checks."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from lightning_elastic.selector import Selection, decide, select
from lightning_elastic.time_model import StepTimeModel, backward_cost


def all_masks(n: int) -> np.ndarray:
    """Every mask of ``n`` tensors, one per row (row 0 is the empty selection)."""
    return np.array(list(itertools.product([False, True], repeat=n)), dtype=bool).reshape(-1, n)


def mask_costs(masks: np.ndarray, t_dw: np.ndarray, t_dy: np.ndarray) -> np.ndarray:
    """The cost model, written directly: weight grads of the selected + t_dy of every op above the deepest."""
    n = masks.shape[1]
    above = np.concatenate([np.cumsum(t_dy[::-1])[::-1][1:], [0.0]])  # above[d] = sum_{i > d} t_dy[i]
    deepest = np.argmax(masks, axis=1)
    return masks @ t_dw + np.where(masks.any(axis=1), above[deepest], 0.0) if n else np.zeros(len(masks))


def brute_force(
    costs: np.ndarray,
    capacity: float,
    masks: np.ndarray,
    importance: np.ndarray,
    required: np.ndarray,
    forbidden: np.ndarray,
) -> tuple[float, float] | None:
    """(best value, lowest cost among the best) over the feasible masks; None when none is feasible."""
    feasible = (costs <= capacity) & (masks[:, required].all(axis=1)) & ~(masks[:, forbidden].any(axis=1))
    if not feasible.any():
        return None
    values = masks[feasible] @ importance
    best = values.max()
    return float(best), float(costs[feasible][values == best].min())


def random_integer_instance(
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """Small integer times (zeros included), importances with ties and negatives, optional pins and bans."""
    n = int(rng.integers(1, 13))
    t_dw = rng.integers(0, 6, n).astype(float)
    t_dy = rng.integers(0, 6, n).astype(float)
    kind = rng.integers(4)
    if kind == 0:  # small integers: many ties
        importance = rng.integers(-2, 4, n).astype(float)
    elif kind == 1:  # all negative: the empty selection is optimal
        importance = -rng.integers(1, 5, n).astype(float)
    else:  # eighths: exact in float, so sums compare exactly
        importance = rng.integers(-16, 64, n) / 8.0
    budget = int(rng.integers(1, int(t_dw.sum() + t_dy.sum()) + 2))
    required = np.zeros(n, dtype=bool)
    forbidden = np.zeros(n, dtype=bool)
    if rng.random() < 0.3:
        required[rng.choice(n, size=min(n, int(rng.integers(1, 3))), replace=False)] = True
    if rng.random() < 0.3:
        forbidden = (rng.random(n) < 0.3) & ~required
    return t_dw, t_dy, importance, budget, required, forbidden


def exact_units(amount: float | Fraction, budget: float, resolution: int) -> int:
    return math.ceil(Fraction(amount) * resolution / Fraction(budget))


def quantised_costs(
    masks: np.ndarray, t_dw: np.ndarray, t_dy: np.ndarray, budget: float, resolution: int
) -> np.ndarray:
    """The cost model on the grid, in exact rational arithmetic: ceil per t_dw, ceil of each t_dy suffix."""
    n = masks.shape[1]
    q_dw = np.array([exact_units(t, budget, resolution) for t in t_dw], dtype=float)
    charge = np.array(
        [exact_units(sum((Fraction(t) for t in t_dy[d + 1 :]), Fraction(0)), budget, resolution) for d in range(n)],
        dtype=float,
    )
    deepest = np.argmax(masks, axis=1)
    return masks @ q_dw + np.where(masks.any(axis=1), charge[deepest], 0.0)


def test_integer_instances_match_brute_force() -> None:
    """Unit 1 (resolution == budget): the optimum value, and the cheapest of the optima."""
    rng = np.random.default_rng(0)
    checked = infeasible = 0
    for case in range(1000):
        t_dw, t_dy, importance, budget, required, forbidden = random_integer_instance(rng)
        masks = all_masks(len(t_dw))
        costs = mask_costs(masks, t_dw, t_dy)
        expected = brute_force(costs, budget, masks, importance, required, forbidden)
        args = (t_dw.tolist(), t_dy.tolist(), importance.tolist(), float(budget), budget)
        if expected is None:
            with pytest.raises(ValueError, match="`required` tensors alone cost"):
                select(*args, required=required.tolist(), forbidden=forbidden.tolist())
            infeasible += 1
            continue
        s = select(*args, required=required.tolist(), forbidden=forbidden.tolist())
        context = f"case {case}: {args}, required={required.tolist()}, forbidden={forbidden.tolist()} -> {s}"
        assert s.importance == expected[0], context
        assert s.cost == expected[1], context
        assert s.cost <= budget, context
        assert s.cost == backward_cost(s.mask, t_dw.tolist(), t_dy.tolist()), context
        assert s.importance == sum(v for v, m in zip(importance, s.mask, strict=True) if m), context
        assert all(s.mask[k] for k in np.flatnonzero(required)), context
        assert not any(s.mask[k] for k in np.flatnonzero(forbidden)), context
        checked += 1
    # The generator must exercise both branches.
    assert checked > 800 and infeasible > 0


def test_float_instances_are_optimal_on_the_grid_and_within_budget() -> None:
    """resolution < budget: never over budget on the real times, optimal once times are rounded up, and optimal
    outright when every tensor worth training fits."""
    rng = np.random.default_rng(1)
    fits_all = 0
    for case in range(500):
        n = int(rng.integers(1, 11))
        t_dw = rng.uniform(0, 1, n) * (rng.random(n) > 0.15)
        t_dy = rng.uniform(0, 1, n) * (rng.random(n) > 0.15)
        importance = rng.normal(1.0, 1.0, n)
        budget = float(rng.uniform(0.1, 1.0) * (t_dw.sum() + t_dy.sum() + 0.1))
        resolution = int(rng.choice([3, 10, 37, 200]))
        masks = all_masks(n)
        none = np.zeros(n, dtype=bool)
        on_grid = brute_force(
            quantised_costs(masks, t_dw, t_dy, budget, resolution), resolution, masks, importance, none, none
        )
        true = brute_force(mask_costs(masks, t_dw, t_dy), budget, masks, importance, none, none)
        assert on_grid is not None and true is not None
        s = select(t_dw.tolist(), t_dy.tolist(), importance.tolist(), budget, resolution)
        context = f"case {case}: resolution={resolution} -> {s}"
        assert s.cost <= budget, context
        assert backward_cost(s.mask, t_dw.tolist(), t_dy.tolist()) <= budget, context
        assert s.importance <= true[0] + 1e-9, context
        worth = importance > 0
        if backward_cost(worth.tolist(), t_dw.tolist(), t_dy.tolist()) <= budget:  # every tensor worth it fits
            assert s.mask == tuple(worth.tolist()), context
            fits_all += 1
        else:
            assert s.importance == pytest.approx(on_grid[0], abs=1e-9), context
    assert 0 < fits_all < 400  # both branches exercised


def test_a_budget_that_holds_every_tensor_worth_training_selects_them_all() -> None:
    """On the grid, 40 tensors each just over a unit round up to 2 units: the exact total fits, the rounded does not."""
    n, resolution = 40, 50
    t_dw = [1.01] * n
    budget = sum(t_dw)  # 40.4 exactly the cost of training all: 40 * 2 = 80 units rounded up on a grid of 50
    s = select(t_dw, [0.0] * n, [1.0] * n, budget, resolution)
    assert s.mask == (True,) * n
    assert s.cost == pytest.approx(budget)
    some_worthless = select(t_dw, [0.0] * n, [1.0, -1.0, 0.0] + [1.0] * (n - 3), budget, resolution)
    assert some_worthless.mask == (True, False, False) + (True,) * (n - 3)
    over = select(t_dw, [0.0] * n, [1.0] * n, budget * 0.99, resolution)  # one must go: the grid decides
    assert 0 < sum(over.mask) < n and over.cost <= budget * 0.99


def test_matches_per_depth_knapsacks_on_larger_instances() -> None:
    """N = 60: an independent O(N^2 R) reference that solves a fresh knapsack for every deepest tensor."""
    rng = np.random.default_rng(2)
    for case in range(10):
        n, resolution = 60, 150
        t_dw = rng.integers(0, 12, n).astype(float)
        t_dy = rng.integers(0, 6, n).astype(float)
        importance = rng.normal(0.5, 1.0, n)
        best = 0.0
        for d in range(n):
            room = resolution - int(t_dy[d + 1 :].sum()) - int(t_dw[d])
            if room < 0:
                continue
            knap = np.zeros(room + 1)
            for k in range(d + 1, n):
                w = int(t_dw[k])
                if w <= room:
                    knap[w:] = np.maximum(knap[w:], knap[: room + 1 - w] + importance[k])
            best = max(best, importance[d] + knap[room])
        s = select(t_dw.tolist(), t_dy.tolist(), importance.tolist(), float(resolution), resolution)
        assert s.importance == pytest.approx(best, abs=1e-9), f"case {case}"
        assert s.cost <= resolution


def test_method_counterexample() -> None:
    # METHOD.md's instance, given in backprop order (index 0 = output side); we index from the input.
    t_dy = [0.0, 3.0, 0.0, 2.0][::-1]
    t_dw = [3.0, 0.0, 1.0, 1.0][::-1]
    importance = [5.0, 4.0, 4.0, 2.0][::-1]
    s = select(t_dw, t_dy, importance, budget=5.0, resolution=5)
    # The reference DP answers {0} in backprop order (forward index 3, value 5): suboptimal under its own
    # cost model (optimum 8) and under ours, where the deepest tensor's own t_dy is not charged and
    # {1, 2, 3} in backprop order (forward 0, 1, 2) costs 1 + 1 + 0 + 3 = 5 for a value of 10.
    assert s == Selection(mask=(True, True, True, False), importance=10.0, cost=5.0)
    masks = all_masks(4)
    none = np.zeros(4, dtype=bool)
    expected = brute_force(
        mask_costs(masks, np.array(t_dw), np.array(t_dy)), 5.0, masks, np.array(importance), none, none
    )
    assert expected == (10.0, 5.0)
    reference_answer = (False, False, False, True)
    assert sum(v for v, m in zip(importance, reference_answer, strict=True) if m) == 5.0


def test_negative_importance_gives_the_empty_selection() -> None:
    s = select([0.0, 1.0], [1.0, 0.0], [-1.0, -0.5], budget=10.0)
    assert s == Selection(mask=(False, False), importance=0.0, cost=0.0)


def test_ties_go_to_the_cheaper_selection() -> None:
    # Tensor 1 alone and tensor 0 alone are worth 3 each; tensor 0 also pays tensor 1's t_dy.
    s = select(t_dw=[1.0, 1.0], t_dy=[0.0, 2.0], importance=[3.0, 3.0], budget=3.0, resolution=3)
    assert s == Selection(mask=(False, True), importance=3.0, cost=1.0)
    # A zero-importance tensor is not added, even for free.
    s = select(t_dw=[0.0, 1.0], t_dy=[0.0, 0.0], importance=[0.0, 1.0], budget=1.0, resolution=1)
    assert s.mask == (False, True)


def test_zero_cost_tensors_are_all_taken() -> None:
    s = select(t_dw=[0.0] * 5, t_dy=[0.0] * 5, importance=[1.0, 2.0, -1.0, 3.0, 0.5], budget=1.0)
    assert s == Selection(mask=(True, True, False, True, True), importance=6.5, cost=0.0)


def test_required_tensor_is_kept_even_when_worthless() -> None:
    pinned = [False, False, True]
    s = select([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [5.0, 1.0, -2.0], budget=3.0, resolution=3, required=pinned)
    assert s == Selection(mask=(False, True, True), importance=-1.0, cost=3.0)


def test_forbidden_tensor_is_still_charged_for_its_t_dy() -> None:
    banned = [False, True, False]
    s = select([1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [5.0, 9.0, 1.0], budget=4.0, resolution=4, forbidden=banned)
    assert s == Selection(mask=(True, False, True), importance=6.0, cost=4.0)


def test_suffix_rounding_never_lets_the_budget_be_exceeded() -> None:
    # In float, 1 + 2**53 + 1 sums to 2**53 (each addition rounds to even); exactly it is 2**53 + 2, over
    # the budget, so tensor 0 must not be the deepest.
    s = select([0.0] * 4, [0.0, 1.0, 2.0**53, 1.0], [5.0, 1.0, 1.0, 1.0], budget=2.0**53, resolution=1)
    assert s == Selection(mask=(False, False, True, True), importance=2.0, cost=1.0)


def test_suffix_that_is_an_integer_quantises_to_it() -> None:
    # In float, 2**53 + 2 + 1 + 3 sums to 2**53 + 8; exactly it is 2**53 + 6, the budget: everything fits.
    budget = 2.0**53 + 6
    s = select([0.0] * 4, [0.0, 3.0, 1.0, 2.0**53 + 2], [5.0, 1.0, 1.0, 1.0], budget=budget, resolution=1)
    assert s == Selection(mask=(True, True, True, True), importance=8.0, cost=budget)


def test_time_that_is_a_whole_number_of_units_quantises_to_it() -> None:
    # A tensor that costs exactly the budget: in float, t * 1000 / t is 1000.0000000000001 for this t.
    t = 0.644105056137355
    assert t * 1000 / t > 1000
    s = select([t], [0.0], [1.0], budget=t, resolution=1000)
    assert s == Selection(mask=(True,), importance=1.0, cost=t)


def test_empty_problem() -> None:
    assert select([], [], [], budget=1.0) == Selection(mask=(), importance=0.0, cost=0.0)


def test_backward_cost_by_hand() -> None:
    t_dw, t_dy = [1.0, 2.0, 4.0, 8.0], [16.0, 32.0, 64.0, 128.0]
    # Deepest selected is 1: t_dw[1] + t_dw[3] + t_dy[2] + t_dy[3].
    assert backward_cost([False, True, False, True], t_dw, t_dy) == 2.0 + 8.0 + 64.0 + 128.0
    assert backward_cost([True, False, False, False], t_dw, t_dy) == 1.0 + 32.0 + 64.0 + 128.0
    assert backward_cost([False] * 4, t_dw, t_dy) == 0.0
    with pytest.raises(ValueError, match=r"`mask`, `t_dw` and `t_dy` must have the same length. Found: 3, 4 and 4"):
        backward_cost([True] * 3, t_dw, t_dy)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"t_dw": [1.0]}, r"`t_dw`, `t_dy` and `importance` must have the same length .* Found: 1, 2 and 2"),
        ({"importance": [1.0, 2.0, 3.0]}, r"must have the same length .* Found: 2, 2 and 3"),
        ({"t_dw": [1.0, math.nan]}, r"`t_dw` must hold finite numbers. Found: nan at index 1"),
        ({"t_dy": [math.inf, 1.0]}, r"`t_dy` must hold finite numbers. Found: inf at index 0"),
        ({"importance": [1.0, -math.inf]}, r"`importance` must hold finite numbers. Found: -inf at index 1"),
        ({"t_dw": [1.0, -0.5]}, r"`t_dw` must hold non-negative times. Found: -0.5 at index 1"),
        ({"t_dy": [-1.0, 0.5]}, r"`t_dy` must hold non-negative times. Found: -1.0 at index 0"),
        ({"t_dw": [[1.0, 2.0]]}, r"`t_dw` must be a 1-D sequence of numbers. Found: an array of shape \(1, 2\)"),
        ({"t_dy": ["a", "b"]}, r"`t_dy` must be a 1-D sequence of numbers. Found: \['a', 'b'\]"),
        ({"budget": 0.0}, r"`budget` must be a positive finite number. Found: 0.0"),
        ({"budget": -1.0}, r"`budget` must be a positive finite number. Found: -1.0"),
        ({"budget": math.inf}, r"`budget` must be a positive finite number. Found: inf"),
        ({"budget": math.nan}, r"`budget` must be a positive finite number. Found: nan"),
        ({"budget": "5"}, r"`budget` must be a positive finite number. Found: '5'"),
        ({"resolution": 0}, r"`resolution` must be an int >= 1. Found: 0"),
        ({"resolution": 10.0}, r"`resolution` must be an int >= 1. Found: 10.0"),
        ({"resolution": True}, r"`resolution` must be an int >= 1. Found: True"),
        ({"required": [True]}, r"`required` must hold one flag per tensor \(2\). Found: 1 flags of shape \(1,\)"),
        ({"forbidden": [True] * 3}, r"`forbidden` must hold one flag per tensor \(2\). Found: 3 flags"),
        (
            {"required": [True, True], "forbidden": [False, True]},
            r"A tensor cannot be both `required` and `forbidden`. Found: both at indices \[1\]",
        ),
        (
            {"required": [True, False]},
            r"The `required` tensors alone cost 6, more than the `budget` of 5. Found: `required` at indices \[0\]",
        ),
        (
            {"required": [True, False], "budget": 6.5, "resolution": 2},
            r"The `required` tensors alone cost 6, within the `budget` of 6.5 but 3 grid units once rounded up, "
            r"more than the `resolution` of 2: use a larger `resolution`",
        ),
    ],
)
def test_invalid_arguments(kwargs: dict, message: str) -> None:
    # Valid defaults: tensor 0 alone costs t_dw[0] + t_dy[1] = 1 + 5 = 6.
    args: dict = {"t_dw": [1.0, 1.0], "t_dy": [1.0, 5.0], "importance": [1.0, 1.0], "budget": 5.0} | kwargs
    with pytest.raises(ValueError, match=message):
        select(**args)


def test_when_the_dynamic_program_selects_nothing_the_fallback_is_the_best_single_tensor_by_brute_force() -> None:
    """Nothing selected (nothing fits, or only tensors of negative importance do): one tensor must train. The most
    important single tensor whose step fits the target, else the cheapest single step. Before: the tensor nearest
    the output, whatever it cost (2.5 s where 1.5 s fitted, and the warning then called 2.5 s the cheapest)."""
    model = StepTimeModel(t_dw=(0.5, 1.5), t_dy=(0.0, 0.0), t_fixed=1.0)
    free = [False, False]
    fits = decide(model, [-1.0, 0.5], 1.9, required=free, forbidden=free)
    assert (fits.mask.flags, fits.predicted_seconds, fits.starved) == ((True, False), 1.5, False)
    starved = decide(model, [1.0, 2.0], 1.2, required=free, forbidden=free)
    assert (starved.mask.flags, starved.predicted_seconds, starved.starved) == ((True, False), 1.5, True)
    rng = np.random.default_rng(5)
    fallbacks = 0
    for _ in range(300):
        n = int(rng.integers(2, 7))
        model = StepTimeModel(t_dw=tuple(rng.uniform(0, 2, n)), t_dy=tuple(rng.uniform(0, 2, n)), t_fixed=1.0)
        importance = list(rng.uniform(-1, 0.3, n))
        forbidden = [bool(f) for f in rng.random(n) < 0.3]
        if all(forbidden):
            continue
        target = float(rng.uniform(1.0, model.full))
        decision = decide(model, importance, target, required=[False] * n, forbidden=forbidden)
        singles = {k: model.predict([j == k for j in range(n)]) for k in range(n) if not forbidden[k]}
        best_set = max(
            (sum(importance[k] for k in range(n) if m[k]), m)
            for m in itertools.product([False, True], repeat=n)
            if any(m) and not any(m[k] and forbidden[k] for k in range(n)) and model.predict(m) <= target
        ) if any(t <= target for t in singles.values()) else None
        if best_set is not None and best_set[0] > 0:
            continue  # the dynamic program's own answer (tested above against brute force)
        fallbacks += 1
        fitting = [k for k, t in singles.items() if t <= target]
        expected = max(fitting, key=lambda k: importance[k]) if fitting else min(singles, key=lambda k: singles[k])
        assert decision.mask.flags == tuple(k == expected for k in range(n))
        assert decision.starved == (not fitting)
    assert fallbacks > 100


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask": 3}, r"`mask` must be a tuple of bools, one per tensor. Found: 3$"),
        ({"mask": [True, False]}, r"Found: \[True, False\]$"),
        ({"mask": (1, 0)}, r"Found: \(1, 0\)$"),
        ({"importance": "high"}, r"`importance` must be a finite number. Found: 'high'$"),
        ({"importance": -math.inf}, r"`importance` must be a finite number. Found: -inf$"),
        ({"cost": -1.0}, r"`cost` must be a finite number >= 0. Found: -1.0$"),
        ({"cost": math.nan}, r"`cost` must be a finite number >= 0. Found: nan$"),
    ],
)
def test_a_selection_built_by_hand_names_what_is_wrong(kwargs: dict[str, Any], match: str) -> None:
    given: dict[str, Any] = {"mask": (True, False), "importance": 1.0, "cost": 0.5, **kwargs}
    with pytest.raises(TypeError, match=match) as raised:
        Selection(**given)
    assert str(raised.value).startswith("Invalid `Selection`: ")
