"""When to measure importance and when to re-select, counted in optimizer steps.

Every selection is preceded by a probe window: `probe_steps` ordinary training steps with every candidate
tensor trainable, during which importance is measured. The first selection follows the probe window that opens
training. Later selections come every `interval` optimizer steps, or every `interval` epochs: then the probe
window is the end of the epoch before, and the selection happens as the selection epoch starts. When the epoch
length is unknown (an iterable data set), the window opens as the selection epoch starts instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

IntervalUnit = Literal["epoch", "step"]


@dataclass(frozen=True)
class Schedule:
    """Positions of probe windows and selections, in global optimizer steps (0-based).

    Args:
        interval: re-select every `interval` epochs or optimizer steps.
        unit: "epoch" or "step".
        probe_steps: length of the probe window before each selection.
        steps_per_epoch: optimizer steps in one epoch; `math.inf` when unknown.

    Example:
        >>> schedule = Schedule(interval=2, unit="epoch", probe_steps=3, steps_per_epoch=10)
        >>> [step for step in range(40) if schedule.window_end(step) is not None]
        [0, 1, 2, 17, 18, 19, 37, 38, 39]
        >>> schedule.window_end(17)
        20
    """

    interval: int
    unit: IntervalUnit
    probe_steps: int
    steps_per_epoch: float = math.inf

    @property
    def period(self) -> float:
        """Optimizer steps between two selections after the first (`math.inf` when the epoch length is unknown)."""
        return self.interval * self.steps_per_epoch if self.unit == "epoch" else self.interval

    def window_end(self, step: int) -> int | None:
        """If optimizer step `step` lies in a scheduled probe window, the step before which the selection happens."""
        if step < self.probe_steps:
            return self.probe_steps
        if math.isinf(self.period):
            return None
        period = int(self.period)
        end = (step // period + 1) * period
        return end if end - step <= self.probe_steps else None

    def opens_at_epoch_start(self, epoch: int) -> bool:
        """Epoch length unknown: whether a probe window opens as `epoch` starts."""
        return self.unit == "epoch" and math.isinf(self.period) and epoch > 0 and epoch % self.interval == 0

    def selects_at_epoch_start(self, window_end: int) -> bool:
        """Whether the selection closing a window ending at `window_end` waits for the next epoch's start."""
        return self.unit == "epoch" and window_end != self.probe_steps and not math.isinf(self.period)
