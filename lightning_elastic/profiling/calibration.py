"""The plain, hook-free timings a profile is calibrated to (`suffix_times`: its full step, between forward passes that
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


def suffix_times(
    plain: Callable[[list[bool]], tuple[float, float]],
    n: int,
    order: Sequence[int],
    knots: Sequence[int],
    repeats: int,
) -> tuple[float, list[float]]:
    """Plain forward time with nothing selected, and step times with tensors ``d..n-1`` selected for each knot.

    ``plain(mask)`` times one hook-free step with ``mask`` (``n`` flags) selected: (forward, forward + backward)
    seconds; ``order`` lists the tensors the step uses (indices of the mask) in forward order. Rounds interleave
    the selections so that a slow drift of the machine hits them all alike. The forward pass with nothing selected,
    timed before the first round and after every round, is the witness of a quiet machine: a round counts when the
    witnesses around it are near the fastest one (`quiet_rounds`). Rounds run until ``repeats`` of them count and
    agree with each other (at most ``NOISE_ROUNDS * repeats``), and only those are kept (the median of each
    selection over them): a disturbed round costs one more round, not more rounds until every selection's timings
    agree with its disturbed ones.
    """
    masks = []
    for d in knots:
        mask = [d == 0] * n  # the full step trains every tensor, also one the walked graph did not show (`hidden`)
        for c in order[d:]:
            mask[c] = True
        masks.append(mask)
    nothing = [False] * n
    empty = [plain(nothing)[0]]
    rounds: list[list[float]] = []
    forwards: list[float] = []  # the forward part of each round's first selection's step
    quiet: list[int] = []
    for _ in range(NOISE_ROUNDS * repeats):
        timed = [plain(mask) for mask in masks]
        rounds.append([step for _, step in timed])
        forwards.append(timed[0][0])
        empty.append(plain(nothing)[0])
        quiet = quiet_rounds(empty)
        columns = list(zip(*(rounds[r] for r in quiet), strict=True))
        if len(quiet) >= repeats and all(noise_of(column) <= NOISE_LIMIT for column in columns):
            break
    else:
        warnings.warn(
            f"Profiling: repeated timings of the same step differ too much ({len(quiet)} of the rounds between "
            f"quiet forward passes, after {len(rounds)} rounds): something else is using this device, and the "
            "time model may be off. Profile on a quiet machine (or give `profile()` more `repeats`).",
            stacklevel=4,
        )
    kept = quiet or list(range(len(rounds)))
    witnesses = sorted({w for r in kept for w in (r, r + 1)})
    steps = [statistics.median(rounds[r][k] for r in kept) for k in range(len(knots))]
    # The forward pass is part of every step: on a busy machine the witnesses' median came out 13.7x the full step's
    # (a tiny model, steps of 1 ms), and the profile floored every selection at 100% of a full step. The forward part
    # of the first selection's kept steps bounds it: their median is at most that step's (`steps[0]`).
    return min(statistics.median(empty[w] for w in witnesses), statistics.median(forwards[r] for r in kept)), steps
