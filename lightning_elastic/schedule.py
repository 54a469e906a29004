"""When to measure importance and when to re-select, counted in optimizer steps.

The first selection follows a probe window that opens training: `first_probe_steps` (by default `probe_steps`)
ordinary training steps with every candidate tensor trainable, during which the importance of every tensor is
measured. Later selections come every `interval` optimizer steps, or every `interval` epochs (then as the selection
epoch starts). Every `probe_every`-th of them is preceded by a probe window of `probe_steps` (in epoch mode, the end
of the epoch before); the others re-use the importance that the selected tensors' own updates measure at every step.
When the epoch length is unknown (an iterable data set), the window opens as the selection epoch starts instead.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
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
        steps_per_epoch: optimizer steps in one epoch; `math.inf` when unknown; or of each epoch, the last repeating
            (a gradient accumulation schedule changes them).
        probe_every: a probe window precedes every `probe_every`-th selection after the first.
        total_steps: optimizer steps of the fit (`math.inf` when unknown): no window opens for a selection that
            would come at its end.
        first_probe_steps: length of the first window (0: `probe_steps`); longer, so that it measures steady full
            steps after the process's warm-up steps.

    Example:
        >>> schedule = Schedule(interval=2, unit="epoch", probe_steps=3, steps_per_epoch=10)
        >>> [step for step in range(40) if schedule.window_end(step) is not None]
        [0, 1, 2, 17, 18, 19, 37, 38, 39]
        >>> schedule.window_end(17)
        20
        >>> sparse = Schedule(interval=4, unit="step", probe_steps=2, probe_every=2)
        >>> [step for step in range(20) if sparse.window_end(step) is not None], sparse.probe_steps_between(0, 20)
        ([0, 1, 6, 7, 14, 15], 6)
        >>> [step for step in range(20) if sparse.selects_at(step)]
        [4, 12]
        >>> accumulating = Schedule(interval=1, unit="epoch", probe_steps=2, steps_per_epoch=(8, 4), total_steps=20)
        >>> [step for step in range(20) if accumulating.window_end(step) is not None]
        [0, 1, 6, 7, 10, 11, 14, 15]
    """

    interval: int
    unit: IntervalUnit
    probe_steps: int
    steps_per_epoch: float | tuple[int, ...] = math.inf
    probe_every: int = 1
    total_steps: float = math.inf
    first_probe_steps: int = 0

    def __post_init__(self) -> None:
        lengths = self._epoch_lengths()
        if lengths is not None and (not lengths or min(lengths) < 1):
            raise ValueError(
                f"`steps_per_epoch` must be a positive number of optimizer steps (or a tuple of them, the last "
                f"repeating). Found: {self.steps_per_epoch!r}"
            )

    @property
    def first_steps(self) -> int:
        """Length of the first probe window as asked (before it runs on, see `first_window_end`)."""
        return self.first_probe_steps or self.probe_steps

    @property
    def period(self) -> float:
        """Fewest optimizer steps between two selections after the first (`math.inf`: epoch length unknown)."""
        if self.unit == "step":
            return self.interval
        lengths = self._epoch_lengths()
        if lengths is None:
            return math.inf
        return min(sum(self._epoch_length(e) for e in range(k, k + self.interval)) for k in range(len(lengths)))

    def window_end(self, step: int) -> int | None:
        """If optimizer step `step` lies in a scheduled probe window, the step before which the selection happens."""
        if step < self.first_window_end:
            return self.first_window_end
        end = next(self._selections_after(step), None)
        if end is None:
            return None
        return end if end - step <= self.probe_steps and self.probed(end) and end < self.total_steps else None

    def probed(self, selection_step: int) -> bool:
        """Whether the selection at optimizer step `selection_step` follows a probe window."""
        if selection_step <= self.first_steps or math.isinf(self.period):
            return True
        return self.selections_until(selection_step) % self.probe_every == 0

    def selects_at(self, step: int) -> bool:
        """Whether a selection without a probe window comes into force before optimizer step `step` (none at the fit's
        end, where no step would train it)."""
        if math.isinf(self.period) or step <= self.first_steps or step >= self.total_steps:
            return False
        if next(self._selections_after(step - 1)) != step:
            return False
        return not self.probed(step)

    def probe_steps_between(self, start: int, end: int) -> int:
        """How many optimizer steps in `[start, end)` lie in probe windows (windows still to open, as planned)."""
        count = max(0, min(end, self.first_window_end) - start)
        for selection in self._selections_after(start):
            if selection >= end + self.probe_steps or selection >= self.total_steps:
                break
            if self.probed(selection):
                window = range(max(selection - self.probe_steps, self.first_window_end), selection)
                count += len(range(max(window.start, start), min(window.stop, end)))
        return count

    def steps_to_next_change(self, step: int) -> float:
        """Optimizer steps from `step` until the trainable set changes as scheduled: a probe window opens, a
        selection comes into force, or the fit ends (`math.inf` when none is known).

        Example:
            >>> schedule = Schedule(interval=10, unit="step", probe_steps=2, probe_every=2, total_steps=35)
            >>> schedule.steps_to_next_change(4), schedule.steps_to_next_change(12), schedule.steps_to_next_change(31)
            (6, 6, 4)
        """
        end = self.total_steps - step
        for selection in self._selections_after(step):
            if selection >= self.total_steps:
                break
            opens = selection - self.probe_steps if self.probed(selection) else selection
            if opens > step:
                return min(opens - step, end)
        return end

    def opens_at_epoch_start(self, epoch: int) -> bool:
        """Epoch length unknown: whether a probe window opens as `epoch` starts."""
        return self.unit == "epoch" and math.isinf(self.period) and epoch > 0 and epoch % self.interval == 0

    def selects_at_epoch_start(self, window_end: int) -> bool:
        """Whether the selection closing a window ending at `window_end` waits for the next epoch's start."""
        return self.unit == "epoch" and window_end != self.first_steps and not math.isinf(self.period)

    @property
    def first_window_end(self) -> int:
        """Where the first window ends: after `first_steps`, unless the next window would open before the first
        selection trained a step; then the first window runs on until that window's selection (nothing wasted)."""
        first = self.first_steps
        following = next(self._selections_after(first - 1), None)
        if following is None or following == first or following >= self.total_steps:
            return first
        overwritten = following - first <= self.probe_steps and self.probed(following)
        return following if overwritten else first

    @property
    def selections(self) -> int | None:
        """Selections in the fit, the first included (None: its length or its epochs' length unknown)."""
        if math.isinf(self.total_steps) or math.isinf(self.period):
            return None
        return 1 + self.selections_until(int(self.total_steps) - 1)

    def selections_until(self, step: int) -> int:
        """How many selections after the first come into force at or before optimizer step `step`."""
        if self.unit == "step":
            return step // self.interval
        if step < 0 or self._epoch_lengths() is None:
            return 0
        # the selection epochs (multiples of `interval`) that start at or before `step`, less any that start at 0
        return self._epoch_at(step) // self.interval - self._epoch_at(0) // self.interval

    def _epoch_lengths(self) -> tuple[int, ...] | None:
        """Optimizer steps of each epoch (the last repeating), or None when unknown."""
        if isinstance(self.steps_per_epoch, tuple):
            return self.steps_per_epoch
        return None if math.isinf(self.steps_per_epoch) else (int(self.steps_per_epoch),)

    def _epoch_length(self, epoch: int) -> int:
        lengths = self._epoch_lengths()
        assert lengths is not None
        return lengths[min(epoch, len(lengths) - 1)]

    def _epoch_start(self, epoch: int) -> int:
        """The optimizer step at which `epoch` starts (epoch lengths known), in closed form: a fit of Lightning's
        default 1000 epochs is planned at every selection, and walking its epochs each time cost 0.2 s a selection."""
        lengths = self._epoch_lengths()
        assert lengths is not None
        if epoch <= len(lengths):
            return sum(lengths[:epoch])
        return sum(lengths) + (epoch - len(lengths)) * lengths[-1]

    def _epoch_at(self, step: int) -> int:
        """The last epoch that starts at or before optimizer step `step` >= 0 (epoch lengths known), in closed form."""
        lengths = self._epoch_lengths()
        assert lengths is not None
        start = 0
        for epoch, length in enumerate(lengths[:-1]):
            if start + length > step:
                return epoch
            start += length
        return len(lengths) - 1 + (step - start) // lengths[-1]

    def _selections_after(self, step: int) -> Iterator[int]:
        """The steps of the selections after the first that come after `step`, in order (none if unknown)."""
        if self.unit == "step":
            yield from itertools.count((step // self.interval + 1) * self.interval, self.interval)
            return
        if self._epoch_lengths() is None:
            return
        first = 0 if step < 0 else self._epoch_at(step) + 1  # the first epoch that starts after `step`
        epoch = max(self.interval, -(-first // self.interval) * self.interval)
        while True:
            yield self._epoch_start(epoch)
            epoch += self.interval


def counted_from(
    steps_per_epoch: float | tuple[int, ...], total_steps: int | None, origin: int
) -> tuple[float | tuple[int, ...], int | None]:
    """The epochs and the length of a fit counted from global optimizer step `origin`: what is left of the epoch it
    lies in, then the epochs after it (the last repeating); the fit's steps less `origin`. A fit that does not start
    at step 0 (`Trainer.fit` called again to train longer, or `ckpt_path` of a fit without the callback) plans,
    probes and selects over its own steps, as a fit from step 0 does.

    Example:
        >>> counted_from((8,), 32, origin=16)  # two epochs done of four
        ((8,), 16)
        >>> counted_from((8, 4), 40, origin=11)  # 3 steps into the second epoch; epochs of 4 steps after it
        ((1, 4), 29)
        >>> counted_from(math.inf, None, origin=5)
        (inf, None)
    """
    total = None if total_steps is None else max(total_steps - origin, 0)
    if origin <= 0 or not isinstance(steps_per_epoch, tuple):
        return steps_per_epoch, total
    shape = Schedule(1, "epoch", 1, steps_per_epoch)
    epoch = shape._epoch_at(origin)
    ahead = steps_per_epoch[min(epoch, len(steps_per_epoch) - 1) :]
    left = shape._epoch_start(epoch + 1) - origin  # of the epoch `origin` lies in: at least 1
    return (left, *ahead[1:]) if left == ahead[0] or len(ahead) > 1 else (left, ahead[0]), total
