"""`ProfileChoice`: which time model a fit profiles with, from what the fit can pay for."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from lightning_elastic.profiling import harness
from lightning_elastic.profiling.harness import ProfileChoice


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("speedup", [1.5, 2.0, 3.0])
def test_auto_measures_the_profile_where_it_costs_at_most_its_share_of_the_planned_fit(
    speedup: float, first_step: bool
) -> None:
    """The measured profile's steps (one fewer when the fit's first step is its first pass) against `PROFILE_SHARE`
    of the planned full steps `N / s`, by brute force."""
    steps, share = harness.PROFILE_STEPS["measured"] - first_step, harness.PROFILE_SHARE
    shortest = next(n for n in range(1, 10_000) if steps / (n / speedup) <= share + 1e-12)
    of = ProfileChoice.of
    assert of("auto", shortest, speedup, first_step) == ("measured", True, first_step)
    assert of("auto", shortest - 1, speedup, first_step) == ("flops", True, first_step)
    assert of("auto", None, speedup, first_step) == ("measured", True, first_step)  # unknown length: a long fit
    for asked in ("measured", "flops"):
        assert of(asked, 1, speedup, first_step) == (asked, False, first_step)  # explicit: held at any length
        assert of(asked, 10**6, speedup, first_step) == (asked, False, first_step)


def test_the_documented_boundary_holds() -> None:
    """docs/configuration.md and how_it_works.md: at 2x a fit of 240 steps or more measures when its first step is
    the profile's first pass (280 when profiling takes a pass of its own); 90 steps do not."""
    assert ProfileChoice.of("auto", 240, 2.0, first_step=True).method == "measured"
    assert ProfileChoice.of("auto", 239, 2.0, first_step=True).method == "flops"
    assert ProfileChoice.of("auto", 280, 2.0).method == "measured"
    assert ProfileChoice.of("auto", 279, 2.0).method == "flops"
    assert ProfileChoice.of("auto", 90, 2.0, first_step=True).method == "flops"


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
        ProfileChoice.of("auto", 90, 2.0, first_step=True).announce(module)
        ProfileChoice.of("measured", 90, 2.0, first_step=False).announce(module)
    said = [r.getMessage() for r in caplog.records]
    steps = harness.PROFILE_STEPS
    assert said[0].startswith("ElasticTensorSelection: profiling 3 tensors after the first training step's backward")
    assert f"analytic time model (op counts, one timed step) (about {steps['flops'] - 1} training steps" in said[0]
    assert f"time_model='auto': a measured profile (about {steps['measured'] - 1} training steps)" in said[0]
    assert f"measured (about {steps['measured']} training steps" in said[1] and "time_model='auto'" not in said[1]
