"""Wall-clock measurement on the device that runs the work: one clock for training steps and for profiling, and the
clocks of a fit's steps (`StepClock`).

On CPU a monotonic clock is exact. On CUDA, kernels run asynchronously: host clock readings are taken only after
the device has finished the queued work, and CUDA events are recorded in the stream and read later, so that timing
a step never stalls the pipeline.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while profiling runs, as `timeit` holds it off while it times: no
    collection runs inside a timed pass nor in the callback's account; one the process owes runs later, where the
    collector's allocation count next crosses its threshold (a training step, where it is charged as the same fit
    without the callback charges its own, or a validation). A Lightning fit of Lite0 runs gen-2 collections of
    0.2-0.3 s after its first steps, with the callback or without: in one few-shot ELPV first run a 0.32 s collection
    fell inside profiling, 2.5 steps of its 0.13 s step; held off, it fell in a validation step (docs/results.md,
    2026-12-07 04:01). The collector is left as found: a process that turned it off keeps it off.

    Example:
        >>> with collector_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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


# The seconds between two steps are measured at every step; their median over the latest LOOP_SAMPLES is the loop.
LOOP_SAMPLES = 32


class StepSeconds(NamedTuple):
    """One optimizer step as `StepClock.step_ended` measured it: `whole` from the end of the step before (its batch
    loaded, forward, backward, update, hooks), of which the callback's own work (`overhead`), the update
    (`optimizer`) and the forward pass up to the loss (`forward`: 0 when not timed)."""

    whole: float
    overhead: float
    optimizer: float
    forward: float = 0.0


class StepClock:
    """The clocks of a fit's optimizer steps, on `device` (`StepTimer`s, so CUDA steps are timed with events).

    Attributes:
        step: from the end of one optimizer step to the end of the next; restarted after what is not a step's
            (validation, a selection).
        optimizer: the optimizer's update.
        overhead: the callback's own work inside a step.
        loop: from the end of one step to the start of the next one's first batch (loading it, the loop, other
            callbacks: nothing a selection changes); `loops` keeps the latest LOOP_SAMPLES.
        forward: from a batch's start to its backward pass (`training_step`: the same work whatever is trained, so
            it reads the device's pace, `pace.pace_of`).

    Example:
        >>> ticks = iter([0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 1.0, 1.25, 1.5, 1.5, 1.5])
        >>> clock = StepClock(torch.device("cpu"), clock=lambda: next(ticks))
        >>> clock.restart()  # 0.0: a step and its loop start
        >>> clock.loop.stop(); clock.forward.start()  # 0.25: its batch is loaded, the forward pass starts
        >>> clock.forward.stop()  # 0.5: the loss is computed
        >>> clock.overhead.start(); clock.overhead.stop()  # 0.5-0.75: the callback's own work
        >>> clock.optimizer.start(); clock.optimizer.stop()  # 1.0-1.25: the update
        >>> clock.step_ended(), clock.loop_seconds()  # 1.5: the next step and its loop start
        (StepSeconds(whole=1.5, overhead=0.25, optimizer=0.25, forward=0.25), 0.25)
    """

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.step = StepTimer(device, clock)
        self.optimizer = StepTimer(device, clock)
        self.overhead = StepTimer(device, clock)
        self.loop = StepTimer(device, clock)
        self.forward = StepTimer(device, clock)
        self.loops: list[float] = []

    def restart(self) -> None:
        """A step starts now, and the wait for its batch (after a selection, which is not a step's time)."""
        self.step.start()
        self.loop.start()

    def step_ended(self) -> StepSeconds:
        """The step that just ended, as measured; the next one, and its loop, start now."""
        self.step.stop()
        self.step.start()
        seconds = StepSeconds(
            math.fsum(self.step.pop()),
            math.fsum(self.overhead.pop()),
            math.fsum(self.optimizer.pop()),
            math.fsum(self.forward.pop()),
        )
        self.loops = (self.loops + self.loop.pop())[-LOOP_SAMPLES:]
        self.loop.start()
        return seconds

    def loop_seconds(self) -> float:
        """The median of the latest loops measured (0 before any)."""
        return statistics.median(self.loops) if self.loops else 0.0
