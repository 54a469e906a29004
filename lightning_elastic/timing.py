"""Wall-clock measurement on the device that runs the work: one clock for training steps and for profiling.

On CPU a monotonic clock is exact. On CUDA, kernels run asynchronously: host clock readings are taken only after
the device has finished the queued work, and CUDA events are recorded in the stream and read later, so that timing
a step never stalls the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class DeviceClock:
    """Timestamps on ``device``: CUDA events on GPU, else a host clock (read after synchronising the device).

    Args:
        device: where the timed work runs.
        clock: host seconds from a monotonic clock (injectable for tests); ``time.perf_counter`` when None.
        cuda_events: on CUDA, stamp with events even when ``clock`` is given (the host clock then times CPU only).
            By default events are used only when no clock is injected.

    Example:
        >>> ticks = iter([1.0, 1.5])
        >>> clock = DeviceClock(torch.device("cpu"), clock=lambda: next(ticks))
        >>> start = clock.stamp(); clock.seconds(start, clock.stamp())
        0.5
    """

    def __init__(
        self, device: torch.device, clock: Callable[[], float] | None = None, *, cuda_events: bool | None = None
    ) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._events = self._cuda and (clock is None if cuda_events is None else cuda_events)
        self._read = clock if clock is not None else time.perf_counter

    def now(self) -> float:
        """Host seconds, after the device has finished the work queued so far."""
        self.sync()
        return self._read()

    def stamp(self) -> Any:
        """A mark of "now" that works inside hooks without synchronising (a CUDA event on GPU)."""
        if self._events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.now()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two stamps (waits for the device when they are CUDA events)."""
        if self._events:
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)

    def sync(self) -> None:
        """Wait for the work queued on the device (nothing to wait for on CPU)."""
        if self._cuda:
            torch.cuda.synchronize(self._device)


class StepTimer:
    """Measures intervals between `start()` and `stop()` calls on `device` with a `DeviceClock`.

    Args:
        device: where the timed work runs.
        clock: seconds from a monotonic clock, for CPU timing (injectable for tests); CUDA steps are timed with
            events.

    Example:
        >>> ticks = iter([1.0, 1.5])
        >>> timer = StepTimer(torch.device("cpu"), clock=lambda: next(ticks))
        >>> timer.start(); timer.stop(); timer.pop()
        [0.5]
    """

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = DeviceClock(device, clock, cuda_events=True)
        self._start: Any = None
        self._pending: list[tuple[Any, Any]] = []

    def start(self) -> None:
        """Mark the start of an interval."""
        self._start = self._clock.stamp()

    def stop(self) -> None:
        """Close the interval opened by `start()`; ignored when none is open."""
        if self._start is None:
            return
        self._pending.append((self._start, self._clock.stamp()))
        self._start = None

    def cancel(self) -> None:
        """Drop the interval opened by `start()`, if any: it is not measured."""
        self._start = None

    def pop(self) -> list[float]:
        """Seconds of every interval closed since the last `pop()`, in order (waits for CUDA events)."""
        done = [self._clock.seconds(begin, end) for begin, end in self._pending]
        self._pending.clear()
        return done
