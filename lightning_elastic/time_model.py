"""The one answer to "what does a training step with this trainable set cost".

Tensors are indexed in forward order (index 0 nearest the input). A step that trains the tensors of mask ``m``
costs

    predict(m) = t_fixed + sum_k m_k * t_dw[k] + sum_{i > d(m)} t_dy[i],    d(m) = lowest selected index,

and a step that trains nothing costs ``t_fixed - t_tail`` (the forward pass alone). ``t_dw[k]`` is tensor ``k``'s
own gradient (and its share of the optimizer update); ``t_dy[i]`` propagates the gradient through the op that owns
tensor ``i``; backward runs from the loss down to the deepest trained tensor and no further, so every op above
``d`` is charged and the deepest tensor's own ``t_dy`` is not. ``t_fixed`` is what every training step pays: the
forward pass, the backward of the loss and the ops after the last tensor (``t_tail``), and the loop around them.

Everything that needs a step's cost asks this module: the profiler (scaling its costs to a plain full step), the
selector (it receives these costs and never recomputes them), the callback, the planner and the baselines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_elastic.profiling import TimingProfile


def backward_cost(mask: Sequence[bool], t_dw: Sequence[float], t_dy: Sequence[float]) -> float:
    """Seconds that training the tensors of ``mask`` adds to a step: their ``t_dw`` and the ``t_dy`` above the deepest.

    The sum is correctly rounded (``math.fsum``), so a selection whose exact cost fits a budget never reads as over it.

    Raises:
        ValueError: If the three sequences differ in length.

    Example:
        >>> backward_cost([False, True, True], t_dw=[1.0, 2.0, 3.0], t_dy=[10.0, 20.0, 30.0])
        35.0
    """
    if not len(mask) == len(t_dw) == len(t_dy):
        raise ValueError(
            f"`mask`, `t_dw` and `t_dy` must have the same length. Found: {len(mask)}, {len(t_dw)} and {len(t_dy)}"
        )
    selected = [k for k, flag in enumerate(mask) if flag]
    if not selected:
        return 0.0
    return math.fsum([float(t_dw[k]) for k in selected] + [float(t) for t in t_dy[selected[0] + 1 :]])


def suffix_costs(t_dw: Sequence[float], t_dy: Sequence[float]) -> list[float]:
    """``backward_cost`` of every "tensors ``d`` to ``n - 1``" selection, for ``d = 0 .. n - 1``, in O(n).

    Example:
        >>> suffix_costs([1.0, 2.0, 3.0], [10.0, 20.0, 30.0])
        [56.0, 35.0, 3.0]
    """
    n = len(t_dw)
    costs = [0.0] * n
    dy_above = 0.0
    dw_from = 0.0
    for d in range(n - 1, -1, -1):
        dw_from += t_dw[d]
        costs[d] = dw_from + dy_above
        dy_above += t_dy[d]
    return costs


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one training step as a function of the trainable set (forward order).

    Attributes:
        t_dw: each tensor's own gradient and optimizer update.
        t_dy: each tensor's op's input gradient (and the parameter-free ops below it).
        t_fixed: what every step that trains anything pays (forward, loss backward, loop).
        t_tail: the part of ``t_fixed`` that a step training nothing does not pay.

    Example:
        >>> model = StepTimeModel(t_dw=(2.0, 1.0), t_dy=(1.0, 1.0), t_fixed=3.0)
        >>> model.full, model.predict([False, True]), model.budget(speedup=1.5)
        (7.0, 4.0, 1.666666666666667)
    """

    t_dw: tuple[float, ...]
    t_dy: tuple[float, ...]
    t_fixed: float
    t_tail: float = 0.0

    @classmethod
    def from_profile(
        cls, profile: TimingProfile, optimizer_seconds: float = 0.0, loop_seconds: float = 0.0
    ) -> StepTimeModel:
        """A profile's forward and backward times, plus the optimizer update and the loop of a real step.

        `optimizer_seconds` (the update of every tensor) is shared among tensors in proportion to their elements;
        `loop_seconds` (the rest of a step that no selection changes) is added to the fixed part.

        Example:
            >>> from lightning_elastic.profiling import TimingProfile
            >>> p = TimingProfile(names=("a", "b"), t_dw=(2.0, 1.0), t_dy=(1.0, 1.0), t_fw=3.0, t_full=8.0,
            ...     device="cpu", fingerprint="x", unused=(), method="measured", numel=(30, 10))
            >>> StepTimeModel.from_profile(p, optimizer_seconds=0.4, loop_seconds=0.1).t_dw
            (2.3, 1.1)
        """
        for name, value in (("optimizer_seconds", optimizer_seconds), ("loop_seconds", loop_seconds)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"`{name}` must be a non-negative finite number of seconds. Found: {value!r}")
        total = sum(profile.numel) or 1
        t_dw = tuple(t + optimizer_seconds * n / total for t, n in zip(profile.t_dw, profile.numel, strict=True))
        return cls(
            t_dw=t_dw,
            t_dy=tuple(profile.t_dy),
            t_fixed=profile.t_fw + profile.t_tail + loop_seconds,
            t_tail=profile.t_tail,
        )

    @classmethod
    def calibrated(
        cls, profile: TimingProfile, full_step: float, optimizer_seconds: float, loop_seconds: float = 0.0
    ) -> StepTimeModel:
        """The profile's model, made to predict a measured full training step.

        The measured optimizer update is shared by elements; the measured `loop_seconds` between two steps (loading
        the batch, the loop and other callbacks: nothing a selection changes) and whatever else the real step takes
        beyond the profiled forward and backward are charged to every step. A profile whose pass took longer than the
        measured one (step less update and loop) was timed while the process was still warming up: its backward is
        scaled down to fit, and its forward pass, timed as the quietest of several plain forwards, is kept; only a
        measured pass no longer than that forward scales every term alike (docs/how_it_works.md). Scaled alike, a
        warming profile's forward shrank with its backward: on Fashion-MNIST at 3x, a pass profiled at 738 ms for
        a 470 ms step put the cheapest selection at 92 ms where it took 150 ms, and every selection then looked too
        dear to the plan's correction, which left the head alone trained. A loop that leaves the step no time is
        not a measurement of this step, and is left out.

        Example:
            >>> from lightning_elastic.profiling import TimingProfile
            >>> p = TimingProfile(names=("a",), t_dw=(2.0,), t_dy=(0.0,), t_fw=3.0, t_full=5.0,
            ...     device="cpu", fingerprint="x", unused=(), method="measured", numel=(1,))
            >>> StepTimeModel.calibrated(p, full_step=6.5, optimizer_seconds=0.5).full
            6.5
            >>> slow = StepTimeModel.calibrated(p, full_step=4.0, optimizer_seconds=0.5)  # the backward timed slow
            >>> slow.full, slow.t_fixed, slow.t_dw
            (4.0, 3.0, (1.0,))
            >>> looped = StepTimeModel.calibrated(p, full_step=4.0, optimizer_seconds=0.5, loop_seconds=0.25)
            >>> looped.full, looped.t_fixed, looped.t_dw  # the loop stays whole in what every step pays
            (4.0, 3.25, (0.75,))
            >>> fast = StepTimeModel.calibrated(p, full_step=2.0, optimizer_seconds=0.5)  # even the forward was slow
            >>> fast.full, round(fast.t_fixed, 9), fast.t_dw
            (2.0, 0.9, (1.1,))
        """
        step = full_step - optimizer_seconds - loop_seconds
        if step <= 0.0:
            step, loop_seconds = full_step - optimizer_seconds, 0.0
        if 0.0 < step < profile.t_full:
            backward = profile.t_full - profile.t_fw
            if profile.t_fw < step and backward > 0.0:
                profile = profile.scaled((step - profile.t_fw) / backward, forward=1.0)
            else:
                profile = profile.scaled(step / profile.t_full)
            profile = replace(profile, t_full=step)  # exactly, unrounded
        loop_seconds += max(0.0, step - profile.t_full)
        return cls.from_profile(profile, optimizer_seconds=optimizer_seconds, loop_seconds=loop_seconds)

    def predict(self, mask: Sequence[bool]) -> float:
        """Predicted seconds of a step that trains the tensors in `mask`."""
        if not any(mask):
            if len(mask) != len(self.t_dw):
                raise ValueError(f"`mask` must have one entry per tensor ({len(self.t_dw)}). Found: {len(mask)}")
            return self.t_fixed - self.t_tail
        return self.t_fixed + backward_cost(mask, self.t_dw, self.t_dy)

    @property
    def full(self) -> float:
        """Predicted seconds of a step that trains every tensor."""
        return self.t_fixed + (suffix_costs(self.t_dw, self.t_dy)[0] if self.t_dw else 0.0)

    def budget(self, speedup: float, full: float | None = None) -> float:
        """Seconds left for the selected tensors when a step must take `full / speedup` (full: `self.full`)."""
        return (self.full if full is None else full) / speedup - self.t_fixed

    def cheapest(self, required: Sequence[bool], forbidden: Sequence[bool]) -> float:
        """Seconds of the cheapest non-empty step that trains every `required` tensor and no `forbidden` one."""
        if any(required):
            return self.predict(required)
        n = len(self.t_dw)
        allowed = [k for k in range(n) if not forbidden[k]]
        return min((self.predict([i == k for i in range(n)]) for k in allowed), default=math.inf)

    def max_speedup(self, required: Sequence[bool], forbidden: Sequence[bool], full: float | None = None) -> float:
        """The largest speedup any non-empty selection that includes `required` reaches."""
        return (self.full if full is None else full) / self.cheapest(required, forbidden)

