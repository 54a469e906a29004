"""`ProfileChoice`: which time model a fit profiles with, from what the fit can pay for."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from lightning_elastic import windows
from lightning_elastic.profiling import harness
from lightning_elastic.profiling.harness import ProfileChoice


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("speedup", [1.5, 2.0, 2.25, 2.5, 2.8])
def test_auto_measures_the_profile_where_it_costs_at_most_the_own_share_of_the_planned_fit(
    speedup: float, first_step: bool
) -> None:
    """The measured profile's steps (one fewer when the fit's first step is its first pass) against `OWN_SHARE` of
    the planned full steps `N / s`, scaled above 2x by the room a selected step has above the forward pass
    (`1 / s - FORWARD_SHARE`) against that room at 2x, by brute force."""
    steps = harness.PROFILE_STEPS["measured"] - first_step
    room = min(1.0, (1 / speedup - harness.FORWARD_SHARE) / (1 / 2 - harness.FORWARD_SHARE))
    shortest = next(n for n in range(1, 100_000) if steps <= windows.OWN_SHARE * room * n / speedup + 1e-9)
    of = ProfileChoice.of
    assert of("auto", shortest, speedup, first_step) == ("measured", True, first_step, False)
    assert of("auto", shortest - 1, speedup, first_step) == ("flops", True, first_step, False)
    assert of("auto", None, speedup, first_step) == ("measured", True, first_step, False)  # unknown length: a long fit
    for asked in ("measured", "flops"):
        assert of(asked, 1, speedup, first_step) == (asked, False, first_step, False)  # explicit: held at any length
        assert of(asked, 10**6, speedup, first_step) == (asked, False, first_step, False)


@pytest.mark.parametrize("speedup", [3.0, 4.0, 10.0])
def test_auto_takes_the_analytic_profile_at_3x_and_above_however_long_the_fit(speedup: float) -> None:
    """From 3x a selected step has no room above the forward pass (a third of a full step) to pay a measured profile
    from; an unknown length still measures (a long fit), and an explicit `measured` is held."""
    for first_step in (False, True):
        assert ProfileChoice.of("auto", 10**7, speedup, first_step).method == "flops"
        assert ProfileChoice.of("auto", None, speedup, first_step).method == "measured"
        assert ProfileChoice.of("measured", 10**7, speedup, first_step).method == "measured"


def test_the_documented_boundary_holds() -> None:
    """docs/configuration.md and how_it_works.md: at 2x a fit of 240 steps or more measures when its first step is
    the profile's first pass (280 when profiling takes a pass of its own); 90 steps do not."""
    assert ProfileChoice.of("auto", 240, 2.0, first_step=True).method == "measured"
    assert ProfileChoice.of("auto", 239, 2.0, first_step=True).method == "flops"
    assert ProfileChoice.of("auto", 280, 2.0).method == "measured"
    assert ProfileChoice.of("auto", 279, 2.0).method == "flops"
    assert ProfileChoice.of("auto", 90, 2.0, first_step=True).method == "flops"
    assert ProfileChoice.of("auto", 400, 2.0, first_step=True).method == "measured"  # Fashion-MNIST's fit at 2x
    assert ProfileChoice.of("auto", 750, 2.5, first_step=True).method == "measured"  # 6 <= 0.05 x 0.4 x 300
    assert ProfileChoice.of("auto", 749, 2.5, first_step=True).method == "flops"
    assert ProfileChoice.of("auto", 400, 3.0, first_step=True).method == "flops"  # Fashion-MNIST's fit at 3x


def test_the_announcement_says_what_profiling_costs_and_why_auto_took_the_analytic_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Module(nn.Module):  # announce reads the module's trainable tensors only
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    module = Module()
    module.b.bias.requires_grad_(False)
    with caplog.at_level(logging.INFO):
        ProfileChoice.of("auto", 90, 2.0, first_step=True, first_backward=True).announce(module, 2.0, cache_on=True)
        ProfileChoice.of("measured", 90, 2.0, first_step=False).announce(module, 2.0, cache_on=False)
        ProfileChoice.of("auto", 400, 2.5, first_step=True).announce(module, 2.5, cache_on=True)
        ProfileChoice.of("auto", 400, 3.0, first_step=True).announce(module, 3.0, cache_on=True)
        ProfileChoice.of("auto", 128, 2.97, first_step=True).announce(module, 2.97, cache_on=True)  # little room left
    said = [r.getMessage() for r in caplog.records]
    steps = harness.PROFILE_STEPS
    assert said[0].startswith("ElasticTensorSelection: profiling 3 tensors after the first training step's backward")
    assert "analytic time model (op counts, scaled to this step's backward pass) (less than one training step," in said[0]
    assert f"time_model='auto': a measured profile (about {steps['measured'] - 1} training steps)" in said[0]
    assert "would be more than 5% of this fit; time_model='measured' measures anyway" in said[0]
    assert f"measured (about {steps['measured']} training steps" in said[1] and "time_model='auto'" not in said[1]
    assert "a cached profile of this model on this device is used instead" in said[0]
    assert "cached profile" not in said[1]  # `cache_dir=False`: no cache is read
    assert "would be more than 2% of this fit (5%, scaled to the room a selected step has above the forward" in said[2]
    assert "would eat the little room a selected step has above the forward pass at 3x" in said[3]
    assert "would be more than 0.1% of this fit (5%, scaled to the room" in said[4]  # it read "more than 0%"


def test_the_analytic_profile_costs_a_plain_forward_pass_where_the_fits_first_step_counts_its_ops_and_times_it() -> None:
    """On CPU the fit's first step is the analytic profile's fingerprint, its op count and its timed backward pass: a
    plain forward pass (`FORWARD_SHARE` of a step) is left of `PROFILE_STEPS`' 3; elsewhere (a GPU:
    `FirstStep.backward_applies`) the fingerprint and the op count, so 1 (a timed full step) is left; profiling on
    its own, 3. The measured profile times its own passes in every case."""
    assert harness.PROFILE_STEPS == {"measured": 7, "flops": 3} and harness.FORWARD_SHARE == 1 / 3
    cpu = ProfileChoice.of("flops", 100, 2.0, first_step=True, first_backward=True)
    gpu = ProfileChoice.of("flops", 100, 2.0, first_step=True, first_backward=False)
    alone = ProfileChoice.of("flops", 100, 2.0, first_step=False, first_backward=True)  # no step: no backward either
    assert (cpu.steps, gpu.steps, alone.steps) == (1 / 3, 1, 3) and not alone.first_backward
    assert ProfileChoice.of("measured", 100, 2.0, first_step=True, first_backward=True).steps == 6
    assert ProfileChoice.of("auto", 100, 2.0, first_step=True, first_backward=True) == cpu._replace(auto=True)
