"""The step-time model the selector optimises, and the budget a speedup target gives it.

A training step under a selection costs the profiled forward and backward time (see `profiler.TimingProfile`)
plus the optimizer's update of the selected tensors (proportional to their elements) plus loop overhead that
no selection changes. This module folds the three into the selector's form:
`predict(m) = t_fixed + sum_k m_k * t_dw[k] + sum_{i > d(m)} t_dy[i]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_elastic.profiler import TimingProfile
from lightning_elastic.selector import selection_cost


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one training step as a function of the selection mask (forward order).

    Example:
        >>> model = StepTimeModel(t_dw=(2.0, 1.0), t_dy=(1.0, 1.0), t_fixed=3.0)
        >>> model.full, model.predict([False, True]), model.budget(speedup=1.5)
        (8.0, 4.0, 2.3333333333333335)
    """

    t_dw: tuple[float, ...]
    t_dy: tuple[float, ...]
    t_fixed: float

    def predict(self, mask: Sequence[bool]) -> float:
        """Predicted seconds of a step that trains the tensors in `mask`."""
        return self.t_fixed + selection_cost(mask, self.t_dw, self.t_dy)

    @property
    def full(self) -> float:
        """Predicted seconds of a step that trains every tensor."""
        return self.predict([True] * len(self.t_dw))

    def budget(self, speedup: float, full: float | None = None) -> float:
        """Seconds left for the selected tensors when a step must take `full / speedup` (full: `self.full`)."""
        return (self.full if full is None else full) / speedup - self.t_fixed

    def max_speedup(self, required: Sequence[bool], forbidden: Sequence[bool], full: float | None = None) -> float:
        """The largest speedup any non-empty selection that includes `required` reaches."""
        if any(required):
            cheapest = self.predict(required)
        else:
            singles = [
                self.predict([i == k for i in range(len(self.t_dw))]) for k in range(len(self.t_dw)) if not forbidden[k]
            ]
            cheapest = min(singles, default=math.inf)
        return (self.full if full is None else full) / cheapest


def step_time_model(profile: TimingProfile, optimizer_seconds: float = 0.0, loop_seconds: float = 0.0) -> StepTimeModel:
    """Combine a timing profile with the measured optimizer update and loop overhead of a full step.

    `optimizer_seconds` (the update of every tensor) is shared among tensors in proportion to their elements;
    `loop_seconds` (the rest of a step that no selection changes) is added to the fixed part.

    Example:
        >>> from lightning_elastic.profiler import TimingProfile
        >>> p = TimingProfile(names=("a", "b"), t_dw=(2.0, 1.0), t_dy=(1.0, 1.0), t_fw=3.0, t_full=8.0,
        ...     device="cpu", fingerprint="x", unused=(), method="measured", numel=(30, 10))
        >>> step_time_model(p, optimizer_seconds=0.4, loop_seconds=0.1).t_dw
        (2.3, 1.1)
    """
    for name, value in (("optimizer_seconds", optimizer_seconds), ("loop_seconds", loop_seconds)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"`{name}` must be a non-negative finite number of seconds. Found: {value!r}")
    total = sum(profile.numel) or 1
    t_dw = tuple(t + optimizer_seconds * n / total for t, n in zip(profile.t_dw, profile.numel, strict=True))
    return StepTimeModel(t_dw=t_dw, t_dy=tuple(profile.t_dy), t_fixed=profile.t_fixed + loop_seconds)
