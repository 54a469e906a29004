"""Exact selection of the tensors to train under a time budget, and the decision made with it at each re-selection.

The costs come from `lightning_elastic.time_model`: training the set ``m`` adds
``backward_cost(m) = sum_k m_k * t_dw[k] + sum_{i > d(m)} t_dy[i]`` to a step, ``d(m)`` the lowest selected index.
:func:`select` maximises the total importance under ``backward_cost(m) <= budget`` with an exact dynamic program,
O(N * resolution) time: for each candidate deepest tensor ``d`` the ``t_dy`` charge is fixed, and the rest
is a 0/1 knapsack over the tensors above ``d``, built incrementally as ``d`` moves towards the input.

:func:`decide` is what happens at a re-selection, as a pure function: a step-time target and the importance in,
a typed `Decision` out (the mask to apply, what it is predicted to cost, and whether anything fitted at all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_elastic.records import Decision, Mask
from lightning_elastic.time_model import StepTimeModel, backward_cost
from lightning_elastic.units import Units

# Relative error of one correctly rounded float64 operation, doubled for a safety margin.
_ROUNDING = 2.0**-52


@dataclass(frozen=True)
class Selection:
    """The tensors to train, with their total importance and cost.

    Attributes:
        mask: One flag per tensor in forward order (index 0 = tensor nearest the input).
        importance: Sum of the importance of the selected tensors.
        cost: ``backward_cost(mask, t_dw, t_dy)`` on the exact, unquantised times.

    Example:
        >>> Selection(mask=(False, True), importance=2.0, cost=1.5).mask
        (False, True)
    """

    mask: tuple[bool, ...]
    importance: float
    cost: float

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.mask, tuple) or not all(isinstance(flag, bool) for flag in self.mask):
            shown = repr(self.mask) if len(repr(self.mask)) <= 60 else f"a {type(self.mask).__name__}"
            problems.append(f"`mask` must be a tuple of bools, one per tensor. Found: {shown}")
        for name, low in (("importance", -math.inf), ("cost", 0.0)):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value < low:
                bound = "a finite number" if low == -math.inf else "a finite number >= 0"
                problems.append(f"`{name}` must be {bound}. Found: {value!r}")
        if problems:
            raise TypeError("Invalid `Selection`: " + "; ".join(problems))


def select(
    t_dw: Sequence[float],
    t_dy: Sequence[float],
    importance: Sequence[float],
    budget: float,
    resolution: int = 1000,
    *,
    required: Sequence[bool] | None = None,
    forbidden: Sequence[bool] | None = None,
) -> Selection:
    """Choose the tensors to train: most total importance with ``backward_cost <= budget``.

    Times are quantised to ``resolution`` units of ``budget`` and rounded up (each ``t_dw`` on its own,
    the ``t_dy`` charge as the ceiling of the exact suffix sum), so the selection never exceeds
    ``budget`` on the unquantised times. The result is optimal for the quantised times; it is optimal outright
    when times and budget are integers and ``resolution == budget``, and when every tensor of positive
    importance fits the budget together with the required ones (that set is then the selection, and no
    tensor is rounded out of a budget that holds it). Among selections of equal
    total importance the one with the lowest cost on the grid wins, the empty selection first. Time and
    memory are O(N * resolution) (one byte per tensor and grid unit).

    Args:
        t_dw: Weight-gradient time of each tensor, forward order (index 0 nearest the input).
        t_dy: Gradient-propagation time of each tensor's op, same order and unit.
        importance: Value of training each tensor; tensors of negative value are only selected when
            ``required``.
        budget: The backward time allowed, in the unit of the times.
        resolution: Number of grid units the budget is split into.
        required: Tensors that must be selected (e.g. a freshly initialised classifier head).
        forbidden: Tensors that must not be selected; their ``t_dy`` is still charged when a deeper tensor
            is selected.

    Returns:
        The best :class:`Selection`.

    Raises:
        ValueError: On invalid arguments, or when the ``required`` tensors alone do not fit the budget.

    Example:
        >>> s = select(t_dw=[2.0, 1.0, 1.0], t_dy=[4.0, 2.0, 1.0], importance=[5.0, 3.0, 1.0], budget=4.0)
        >>> s.mask, s.importance, s.cost
        ((False, True, True), 4.0, 3.0)
    """
    dw, dy, value = _check_inputs(t_dw, t_dy, importance, budget, resolution)
    budget, resolution = float(budget), int(resolution)
    n = len(value)
    pinned = _check_mask(required, "required", n)
    banned = _check_mask(forbidden, "forbidden", n)
    clash = np.flatnonzero(pinned & banned)
    if clash.size:
        raise ValueError(
            f"A tensor cannot be both `required` and `forbidden`. Found: both at indices {clash.tolist()}"
        )
    times = (dw.tolist(), dy.tolist())
    worth = pinned | ((value > 0) & ~banned)  # the best set of all, and the cheapest of the best, with no budget
    mask = tuple(bool(flag) for flag in worth)
    cost = backward_cost(mask, *times)
    if cost > budget:  # else it fits: optimal outright, where the grid could round a tensor out
        units_dw = _units_up(dw, budget, resolution)
        units_dy = _suffix_units_up(dy, budget, resolution)
        if pinned.any():
            _check_required_fit(pinned, dw, dy, units_dw, units_dy, budget, resolution)
        mask = _solve(units_dw, units_dy, value, pinned, banned, resolution)
        cost = backward_cost(mask, *times)
    return Selection(
        mask=mask, importance=math.fsum(float(v) for v, flag in zip(value, mask, strict=True) if flag), cost=cost
    )


def decide(
    model: StepTimeModel,
    importance: Sequence[float],
    target_seconds: float,
    *,
    required: Sequence[bool],
    forbidden: Sequence[bool],
    resolution: int = 1000,
    units: Units | None = None,
) -> Decision:
    """The trainable set for the next interval: the most important units whose step fits `target_seconds`.

    `units` (default: every tensor its own) are the groups of tensors selected whole (`units.Units`); a unit's
    importance is the sum of its tensors', and a unit with a required tensor is required. When nothing fits (the
    target is at or below the cheapest step that trains the `required` units, or any unit), the decision is that
    cheapest step and says so with `starved`: required units alone, else the single unit whose step is cheapest.
    When units fit but none is worth training (importance at most 0), the most important single unit whose step
    fits trains. Forbidden tensors never train, whatever unit they are in.

    Example:
        >>> model = StepTimeModel(t_dw=(2.0, 1.0, 1.0), t_dy=(4.0, 2.0, 1.0), t_fixed=3.0)
        >>> decision = decide(model, [5.0, 3.0, 1.0], 7.0, required=[False] * 3, forbidden=[False] * 3)
        >>> decision.mask.flags, decision.predicted_seconds, decision.starved
        ((False, True, True), 6.0, False)
        >>> paired = decide(model, [5.0, 3.0, 1.0], 7.0, required=[False] * 3, forbidden=[False] * 3,
        ...     units=Units(((0,), (1, 2))))
        >>> paired.mask.flags, paired.predicted_seconds
        ((False, True, True), 6.0)
    """
    units = units or Units.tensors(len(importance))
    if units.size != len(importance):
        raise ValueError(f"`units` must cover the {len(importance)} tensors. Found: {units.size}")
    unit_model, values = units.model(model), units.values(importance)
    pinned, banned = Mask.of(units.required(required)), Mask.of(units.forbidden(forbidden, required))
    budget = min(target_seconds, unit_model.full) - unit_model.t_fixed  # over the full step: all worth training
    floor = unit_model.predict(pinned) - unit_model.t_fixed if any(pinned) else 0.0
    # Slack so that the pinned units still fit once each cost is rounded up to the grid.
    grid_floor = floor * resolution / max(resolution - sum(pinned) - 2, 1)
    solved = select(
        unit_model.t_dw,
        unit_model.t_dy,
        values,
        max(budget, grid_floor, 1e-12),
        resolution,
        required=pinned,
        forbidden=banned,
    )
    chosen = Mask.of(solved.mask)
    if not any(chosen):  # one unit must train: the most important single one whose step fits, else the cheapest
        n = len(banned)
        singles = {k: unit_model.predict([j == k for j in range(n)]) for k in range(n) if not banned[k]}
        fitting = [k for k, seconds in singles.items() if seconds <= target_seconds]
        one = max(fitting, key=lambda k: values[k]) if fitting else min(singles, key=singles.__getitem__)
        chosen = Mask.of([k == one for k in range(n)])
    mask = units.expand(chosen, forbidden)
    predicted = model.predict(mask)
    return Decision(
        mask=mask,
        importance=tuple(float(v) for v in importance),
        predicted_seconds=predicted,
        target_seconds=target_seconds,
        starved=predicted > target_seconds,
    )


def _check_inputs(
    t_dw: Sequence[float], t_dy: Sequence[float], importance: Sequence[float], budget: float, resolution: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    named = (("t_dw", t_dw), ("t_dy", t_dy), ("importance", importance))
    arrays = {name: _as_vector(x, name) for name, x in named}
    lengths = [len(a) for a in arrays.values()]
    if len(set(lengths)) > 1:
        raise ValueError(
            "`t_dw`, `t_dy` and `importance` must have the same length (one entry per tensor). "
            f"Found: {lengths[0]}, {lengths[1]} and {lengths[2]}"
        )
    for name, a in arrays.items():
        bad = np.flatnonzero(~np.isfinite(a))
        if bad.size:
            raise ValueError(f"`{name}` must hold finite numbers. Found: {a[bad[0]]} at index {bad[0]}")
    for name in ("t_dw", "t_dy"):
        bad = np.flatnonzero(arrays[name] < 0)
        if bad.size:
            raise ValueError(
                f"`{name}` must hold non-negative times. Found: {arrays[name][bad[0]]} at index {bad[0]}"
            )
    is_number = isinstance(budget, (int, float, np.integer, np.floating)) and not isinstance(budget, bool)
    if not (is_number and math.isfinite(budget) and budget > 0):
        raise ValueError(f"`budget` must be a positive finite number. Found: {budget!r}")
    if isinstance(resolution, bool) or not isinstance(resolution, (int, np.integer)) or resolution < 1:
        raise ValueError(f"`resolution` must be an int >= 1. Found: {resolution!r}")
    return arrays["t_dw"], arrays["t_dy"], arrays["importance"]


def _as_vector(x: Sequence[float], name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`{name}` must be a 1-D sequence of numbers. Found: {x!r}") from err
    if a.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D sequence of numbers. Found: an array of shape {a.shape}")
    return a


def _check_mask(mask: Sequence[bool] | None, name: str, n: int) -> np.ndarray:
    if mask is None:
        return np.zeros(n, dtype=bool)
    a = np.asarray(mask, dtype=bool)
    if a.ndim != 1 or len(a) != n:
        raise ValueError(
            f"`{name}` must hold one flag per tensor ({n}). Found: {a.size} flags of shape {a.shape}"
        )
    return a


def _exact_ceil(numerator: int, denominator: int, budget: float, resolution: int) -> int:
    """``ceil(numerator / denominator * resolution / budget)`` in exact integer arithmetic."""
    b_num, b_den = float(budget).as_integer_ratio()
    return -((-numerator * resolution * b_den) // (denominator * b_num))


def _grid_units(
    amount: np.ndarray,
    tolerance: float | np.ndarray,
    budget: float,
    resolution: int,
    exact: Callable[[np.ndarray], list[int]],
) -> np.ndarray:
    """``ceil(amount / (budget / resolution))``, clipped to ``resolution + 1`` (anything past the budget).

    ``amount`` carries a relative error of at most ``tolerance``; a grid position that close to an integer
    may be that integer in exact arithmetic (rounded to either side of it), so it is taken from
    ``exact(indices)``, which computes it in integer arithmetic. A zero amount is exactly zero units.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        x = amount * resolution / budget
        near = (amount > 0) & (np.abs(x - np.rint(x)) <= tolerance * x)
    units = np.minimum(np.ceil(x), resolution + 1)
    indices = np.flatnonzero(near)
    if indices.size:
        units[indices] = [min(u, resolution + 1) for u in exact(indices)]
    return units.astype(np.int64)


def _units_up(t: np.ndarray, budget: float, resolution: int) -> np.ndarray:
    """Each time in grid units, rounded up."""

    def exact(indices: np.ndarray) -> list[int]:
        return [_exact_ceil(*float(t[i]).as_integer_ratio(), budget, resolution) for i in indices]

    # Two roundings: the product and the quotient.
    return _grid_units(t, 4 * _ROUNDING, budget, resolution, exact)


def _suffix_units_up(t_dy: np.ndarray, budget: float, resolution: int) -> np.ndarray:
    """``P[d]``: the ceiling of ``sum_{i > d} t_dy[i]`` in grid units, the charge of depth ``d``."""
    n = len(t_dy)
    suffix = np.zeros(n)
    suffix[:-1] = np.cumsum(t_dy[:0:-1])[::-1]

    def exact(indices: np.ndarray) -> list[int]:
        # Floats are dyadic: over the largest denominator every t_dy is an integer numerator.
        ratios = [float(t).as_integer_ratio() for t in t_dy]
        common = max(den for _, den in ratios)
        charges = [0] * n
        running = 0
        for d in range(n - 1, -1, -1):
            charges[d] = _exact_ceil(running, common, budget, resolution)
            running += ratios[d][0] * (common // ratios[d][1])
        return [charges[i] for i in indices]

    # Sequential summation of m non-negative terms errs by at most about m roundings (relative).
    return _grid_units(suffix, (np.arange(n, 0, -1) + 4) * _ROUNDING, budget, resolution, exact)


def _check_required_fit(
    pinned: np.ndarray,
    dw: np.ndarray,
    dy: np.ndarray,
    units_dw: np.ndarray,
    units_dy: np.ndarray,
    budget: float,
    resolution: int,
) -> None:
    indices = np.flatnonzero(pinned)
    cost = backward_cost(pinned.tolist(), dw.tolist(), dy.tolist())
    if cost > budget:
        raise ValueError(
            f"The `required` tensors alone cost {cost:.6g}, more than the `budget` of {budget:.6g}. "
            f"Found: `required` at indices {indices.tolist()}"
        )
    units = int(units_dy[indices[0]]) + int(units_dw[indices].sum())
    if units > resolution:
        raise ValueError(
            f"The `required` tensors alone cost {cost:.6g}, within the `budget` of {budget:.6g} but "
            f"{units} grid units once rounded up, more than the `resolution` of {resolution}: "
            f"use a larger `resolution`. Found: `required` at indices {indices.tolist()}"
        )


def _solve(
    units_dw: np.ndarray,
    units_dy: np.ndarray,
    value: np.ndarray,
    pinned: np.ndarray,
    banned: np.ndarray,
    resolution: int,
) -> tuple[bool, ...]:
    """The dynamic program on grid units; returns the best mask.

    ``knap[c]`` is the best value of the tensors above the current depth that fit in ``c`` units (``-inf``
    when the pinned ones do not fit); it is non-decreasing in ``c``, so the cheapest way to reach
    ``knap[c]`` weighs the first ``c'`` with ``knap[c'] == knap[c]``. ``take[k, c]`` records whether tensor
    ``k`` is in the best set of capacity ``c`` right after ``k`` joined, which is all backtracking needs.
    """
    n = len(value)
    q = units_dw.tolist()
    charge = units_dy.tolist()
    gain = value.tolist()
    is_pinned = pinned.tolist()
    is_banned = banned.tolist()
    pinned_indices = np.flatnonzero(pinned)
    deepest_allowed = int(pinned_indices[0]) if pinned_indices.size else n - 1

    knap = np.zeros(resolution + 1)
    scratch = np.empty(resolution + 1)
    take = np.zeros((n, resolution + 1), dtype=bool)  # rows of tensors that never join stay False
    # The empty selection (value 0, no units, no depth), unless something is pinned.
    best_value = -math.inf if pinned_indices.size else 0.0
    best_units, best_depth, best_fill = 0, -1, 0

    for d in range(n - 1, -1, -1):
        if charge[d] > resolution:
            break  # the charge only grows towards the input: nothing deeper fits
        if d <= deepest_allowed and not is_banned[d]:
            cap = resolution - charge[d] - q[d]
            fill_value = knap.item(cap) if cap >= 0 else -math.inf
            if fill_value > -math.inf:
                v = gain[d] + fill_value
                if v >= best_value:
                    fill = int(knap[: cap + 1].searchsorted(fill_value))
                    units = charge[d] + q[d] + fill
                    if v > best_value or units < best_units:
                        best_value, best_units, best_depth, best_fill = v, units, d, fill
        if d == 0:
            break
        # Deeper candidates have a charge of at least charge[d - 1]: no capacity above `limit` is read again.
        limit = resolution - charge[d - 1]
        w = q[d]
        if limit < 0 or is_banned[d] or (w > limit and not is_pinned[d]):
            continue
        if is_pinned[d]:
            # Forced in: every capacity holds it (numpy buffers the overlapping right-hand side).
            if w <= limit:
                knap[w : limit + 1] = knap[: limit + 1 - w] + gain[d]
            knap[: min(w, limit + 1)] = -math.inf
            take[d, : limit + 1] = True
        elif gain[d] > 0:
            cand = scratch[: limit + 1 - w]
            np.add(knap[: limit + 1 - w], gain[d], out=cand)
            np.greater(cand, knap[w : limit + 1], out=take[d, w : limit + 1])
            np.maximum(knap[w : limit + 1], cand, out=knap[w : limit + 1])

    mask = [False] * n
    if best_depth >= 0:
        mask[best_depth] = True
        c = best_fill
        for k in range(best_depth + 1, n):
            if take[k, c]:
                mask[k] = True
                c -= q[k]
    return tuple(mask)
