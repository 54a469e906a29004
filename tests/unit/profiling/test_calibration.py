"""The plain timings a profile is calibrated to, and how a disturbed one is told."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import pytest

from lightning_elastic.profiling.calibration import full_step_times, quiet_rounds


def fake_plain(seconds: list[float]) -> tuple[list[list[bool]], Callable[[list[bool]], tuple[float, float]]]:
    """A plain step that takes 1 s per selected tensor plus a forward of 1 s; the forward's time comes from
    `seconds` in turn (the witness of a quiet machine). Returns the masks timed, in order, and the step."""
    timed: list[list[bool]] = []
    witness = iter(seconds)

    def plain(mask: list[bool]) -> tuple[float, float]:
        timed.append(list(mask))
        forward = next(witness) if not any(mask) else 1.0
        return forward, forward + sum(mask)

    return timed, plain


def test_full_step_times_times_every_tensor_trained_between_two_witnesses() -> None:
    timed, plain = fake_plain([1.0] * 10)
    # every tensor is trained, also one the walked graph did not show (a hidden one then gets its gradient,
    # `Runner.hidden`; an unused one costs a real step nothing, the fake charges 1 s a flag)
    assert full_step_times(plain, 4, repeats=1) == (1.0, 5.0)
    assert timed == [[False] * 4, [True] * 4, [False] * 4]


def test_a_full_step_beside_a_disturbed_witness_is_timed_again_and_left_out() -> None:
    witnesses, steps = iter([1.0, 1.5, 1.0, 1.0]), iter([9.0, 7.0, 5.0])

    def plain(mask: list[bool]) -> tuple[float, float]:
        return (next(witnesses), 0.0) if not any(mask) else (1.0, next(steps))

    # the first two steps each have the slow witness (1.5, over 1.2x the fastest) beside them; the third is kept
    assert full_step_times(plain, 2, repeats=1) == (1.0, 5.0)


def test_full_step_times_adds_rounds_while_the_machine_is_disturbed_then_warns() -> None:
    timed, plain = fake_plain([1.0] + [2.0] * 6)  # the witness stays far above its fastest
    with pytest.warns(UserWarning, match=r"repeated timings of the same step differ too much .* after 6 rounds"):
        t_fw, _ = full_step_times(plain, 2, repeats=2)
    assert len(timed) == 1 + 6 * 2  # NOISE_ROUNDS * repeats rounds, each a step and a witness
    assert t_fw == 1.0  # the disturbed witnesses (2 s) are bounded by the forward part of the full steps (1 s)


def test_the_forward_pass_never_comes_out_longer_than_the_full_step_that_contains_it() -> None:
    """A busy machine's witnesses (forward passes with nothing selected) took 13.7x the full step on a tiny model,
    and the profile floored every selection at 100% of a full step ("`speedup` must be at most 1.00")."""
    rng = random.Random(0)

    def plain(mask: list[bool]) -> tuple[float, float]:
        if not any(mask):  # a witness, disturbed at random
            return rng.choice([0.001, 0.0137]), 0.0
        forward = rng.uniform(0.0003, 0.0005)
        return forward, forward + rng.uniform(0.0003, 0.0006) * sum(mask)

    for _ in range(20):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it may say the rounds differ too much: beside the point here
            t_fw, t_full = full_step_times(plain, 3, repeats=2)
        assert 0 < t_fw <= t_full


def test_quiet_rounds_need_both_witnesses_near_the_fastest() -> None:
    assert quiet_rounds([1.0, 1.19]) == [0]
    assert quiet_rounds([1.0, 1.21]) == []
    assert quiet_rounds([1.3, 1.0, 1.1, 1.5, 1.05]) == [1]  # a slow witness discounts the rounds on both sides
    assert quiet_rounds([2.0, 2.0, 1.0, 1.0]) == [2]  # a machine slowed throughout is caught by a faster witness
