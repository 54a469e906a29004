"""The plain, hook-free timings a profile is scaled to (`full_step_times`: its full step, between forward passes that
witness a quiet machine), and how they tell a disturbed timing (`quiet_rounds`, `noise_of`)."""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Sequence

NOISE_LIMIT = 0.1  # repeated timings whose median is this far above their fastest disagree ...
NOISE_ROUNDS = 3  # ... and rounds run, up to this many times `repeats`, until `repeats` quiet ones agree


def noise_of(seconds: Sequence[float]) -> float:
    """How far the median of repeated timings lies above the fastest: other work on the device only adds time."""
    fastest = min(seconds)
    return statistics.median(seconds) / fastest - 1.0 if fastest > 0 else 0.0


def quiet_rounds(witnesses: Sequence[float]) -> list[int]:
    """The rounds of timings that ran on a quiet machine: round ``r`` lies between ``witnesses[r]`` and ``[r + 1]``.

    The fastest witness is the quiet one; a round counts when neither witness around it is more than
    ``2 * NOISE_LIMIT`` above it (a pair of timings that far apart has its median ``NOISE_LIMIT`` above the faster).

    Example:
        >>> quiet_rounds([1.0, 1.5, 1.1, 1.0])  # the second witness was disturbed: rounds 0 and 1 do not count
        [2]
    """
    fastest = min(witnesses)
    limit = (1 + 2 * NOISE_LIMIT) * fastest
    return [r for r in range(len(witnesses) - 1) if max(witnesses[r], witnesses[r + 1]) <= limit]


def full_step_times(plain: Callable[[list[bool]], tuple[float, float]], n: int, repeats: int) -> tuple[float, float]:
    """Plain forward time with nothing selected, and the time of a full step (every one of the ``n`` tensors trained).

    ``plain(mask)`` times one hook-free step with ``mask`` (``n`` flags) selected: (forward, forward + backward)
    seconds. The forward pass with nothing selected, timed before the first full step and after every one, is the
    witness of a quiet machine: a full step counts when the witnesses around it are near the fastest one
    (`quiet_rounds`). Full steps run until ``repeats`` of them count and agree with each other (at most
    ``NOISE_ROUNDS * repeats``), and only those are kept (their median): a disturbed step costs one more step, not
    more steps until every timing agrees with the disturbed one. (Until 2026-12-07 the profile also timed four
    shorter suffixes of the forward order here, one round each, to rescale each quarter of the backward pass:
    docs/time_model.md.)
    """
    full = [True] * n  # every tensor, also one the walked graph did not show (`Runner.hidden`)
    nothing = [False] * n
    empty = [plain(nothing)[0]]
    steps: list[float] = []
    forwards: list[float] = []  # the forward part of each full step
    quiet: list[int] = []
    for _ in range(NOISE_ROUNDS * repeats):
        forward, step = plain(full)
        steps.append(step)
        forwards.append(forward)
        empty.append(plain(nothing)[0])
        quiet = quiet_rounds(empty)
        if len(quiet) >= repeats and noise_of([steps[r] for r in quiet]) <= NOISE_LIMIT:
            break
    else:
        warnings.warn(
            f"Profiling: repeated timings of the same step differ too much ({len(quiet)} of the rounds between "
            f"quiet forward passes, after {len(steps)} rounds): something else is using this device, and the "
            "time model may be off. Profile on a quiet machine (or give `profile()` more `repeats`).",
            stacklevel=4,
        )
    kept = quiet or list(range(len(steps)))
    witnesses = sorted({w for r in kept for w in (r, r + 1)})
    # The forward pass is part of every step: on a busy machine the witnesses' median came out 13.7x the full step's
    # (a tiny model, steps of 1 ms), and the profile floored every selection at 100% of a full step. The forward part
    # of the kept full steps bounds it: their median is at most the full step's.
    forward = min(statistics.median(empty[w] for w in witnesses), statistics.median(forwards[r] for r in kept))
    return forward, statistics.median(steps[r] for r in kept)
