"""Wall-clock measurement of training steps on the device that runs them.

On CPU a monotonic clock is exact. On CUDA, kernels run asynchronously: CUDA events are recorded in the
stream and read one step later, so timing never stalls the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StepTimer:
    """Measures intervals between `start()` and `stop()` calls on `device`.

    Args:
        device: where the timed work runs.
        clock: seconds from a monotonic clock, for CPU timing (injectable for tests).

    Example:
        >>> ticks = iter([1.0, 1.5])
        >>> timer = StepTimer(torch.device("cpu"), clock=lambda: next(ticks))
        >>> timer.start(); timer.stop(); timer.pop()
        [0.5]
    """

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self._cuda = device.type == "cuda"
        self._clock = clock
        self._start: float | torch.cuda.Event | None = None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._done: list[float] = []

    def start(self) -> None:
        """Mark the start of an interval."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._start = event
        else:
            self._start = self._clock()

    def stop(self) -> None:
        """Close the interval opened by `start()`; ignored when none is open."""
        if self._start is None:
            return
        if isinstance(self._start, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start, end))
        else:
            self._done.append(self._clock() - self._start)
        self._start = None

    def pop(self) -> list[float]:
        """Seconds of every interval closed since the last `pop()`, in order (waits for CUDA events)."""
        for begin, end in self._pending:
            end.synchronize()
            self._done.append(begin.elapsed_time(end) / 1000.0)
        self._pending.clear()
        done, self._done = self._done, []
        return done
