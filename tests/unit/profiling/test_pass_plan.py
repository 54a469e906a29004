"""What a first profile costs: every pass counted on a simulated device, so a test fails if the plan grows."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_elastic.profiling import TimingProfile, profile
from lightning_elastic.profiling.calibration import SEGMENTS, calibration_knots
from tests.unit.profiling.fakes import FakeClock, FakeLayer, simulated_step

LAYERS = 8
FORWARD, DX, DW = 1.0, 1.0, 1.0  # simulated seconds of each layer
FULL = LAYERS * (FORWARD + DX + DW) - DX  # nothing below the first layer needs an input gradient
EMPTY = LAYERS * FORWARD


class Bump(nn.Module):
    """Adds ``seconds`` to the forward pass of the ``call``-th call only: one disturbed timing."""

    def __init__(self, clock: FakeClock, call: int, seconds: float) -> None:
        super().__init__()
        self.clock, self.call, self.seconds, self.calls = clock, call, seconds, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.call:
            self.clock.advance(self.seconds)
        return x


def _counted(bump_call: int = 0, **kwargs: int) -> tuple[TimingProfile, int, Callable[[int], float]]:
    """The profile of a simulated chain, how many times it called `compute_loss`, and a suffix step's time."""
    clock = FakeClock()
    net = nn.Sequential(Bump(clock, bump_call, 10.0), *[FakeLayer(clock, (FORWARD, DX, DW)) for _ in range(LAYERS)])
    x = torch.randn(2, 3)
    calls = 0

    def loss_fn() -> Tensor:
        nonlocal calls
        calls += 1
        return net(x).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # steady timings: no noise warning
        prof = profile(net, loss_fn, clock=clock, **kwargs)
    counted = calls

    def suffix_step(d: int) -> float:
        return simulated_step(net, loss_fn, clock, [i >= d for i in range(LAYERS)], prof.names)

    return prof, counted, suffix_step


def test_default_plan_costs_one_pass_of_each_kind_and_one_round_of_plain_timings() -> None:
    prof, calls, suffix_step = _counted()
    knots = calibration_knots(prof.t_dw, prof.t_dy, SEGMENTS)
    assert len(knots) == SEGMENTS + 1
    # The fingerprint's pass (also the warmup); one instrumented pass with input gradients only, one full, one
    # forward only; one round of plain steps at the knots, bracketed by two plain forward passes.
    assert calls == 1 + 3 + len(knots) + 2
    # The hooked passes make the first layer's input a leaf that requires grad, so that layer's dx runs too.
    instrumented = (EMPTY + LAYERS * DX) + (FULL + DX) + EMPTY
    expected = FULL + instrumented + sum(suffix_step(d) for d in knots) + 2 * EMPTY
    assert prof.profile_seconds == pytest.approx(expected)
    assert prof.profile_seconds / prof.t_full < 7.5  # issue #11: far below the earlier ~20 full steps


def test_earlier_default_plan_for_comparison() -> None:
    prof, calls, _ = _counted(warmup=1, repeats=3)
    assert calls == 1 + 1 + 3 * 3 + 3 * (SEGMENTS + 1) + 4
    assert prof.profile_seconds / prof.t_full > 20


def test_a_disturbed_witness_buys_another_round() -> None:
    # Call 5 is the plain forward pass before the first round: 10 s slower than the one after it.
    prof, calls, _ = _counted(bump_call=5)
    assert calls == 1 + 3 + 2 * (SEGMENTS + 1) + 3
    assert prof.t_fw == pytest.approx(EMPTY)  # the median of three witnesses leaves the disturbed one out
    assert prof.t_full == pytest.approx(FULL)


def test_flops_plan() -> None:
    clock = FakeClock()
    net = nn.Sequential(*[FakeLayer(clock, (FORWARD, DX, DW)) for _ in range(LAYERS)])
    calls = 0

    def loss_fn() -> Tensor:
        nonlocal calls
        calls += 1
        return net(torch.ones(2, 3)).sum()

    prof = profile(net, loss_fn, method="flops", clock=clock)
    # Fingerprint, the recorded forward pass, and one plain full step bracketed by two plain forward passes.
    assert calls == 5
    assert prof.profile_seconds == pytest.approx(FULL + EMPTY + EMPTY + FULL + EMPTY)


def test_flops_plan_re_times_on_a_disturbed_machine() -> None:
    # Call 3 is the witness before the plain full step (after the fingerprint and the recorded forward pass): 10 s
    # slower than the one after it. One more round, and the medians leave the disturbed timing out; a single pair
    # of timings would have put the forward pass above the full step and the backward pass at nothing.
    prof, calls, _ = _counted(bump_call=3, method="flops")  # type: ignore[arg-type]
    assert calls == 5 + 2
    assert prof.t_full == pytest.approx(FULL) and prof.t_fw == pytest.approx(EMPTY)
