"""`ProfileChoice`: which time model a fit profiles with, from what the fit can pay for."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from lightning_elastic.profiling import harness
from lightning_elastic.profiling.harness import ProfileChoice


@pytest.mark.parametrize("speedup", [1.5, 2.0, 3.0])
def test_auto_measures_the_profile_where_it_costs_at_most_its_share_of_the_planned_fit(speedup: float) -> None:
    """The measured profile's steps against `PROFILE_SHARE` of the planned full steps `N / s`, by brute force."""
    steps, share = harness.PROFILE_STEPS["measured"], harness.PROFILE_SHARE
    shortest = next(n for n in range(1, 10_000) if steps / (n / speedup) <= share + 1e-12)
    assert ProfileChoice.of("auto", shortest, speedup) == ("measured", True)
    assert ProfileChoice.of("auto", shortest - 1, speedup) == ("flops", True)
    assert ProfileChoice.of("auto", None, speedup) == ("measured", True)  # unknown length: a long fit
    for asked in ("measured", "flops"):
        assert ProfileChoice.of(asked, 1, speedup) == (asked, False)  # an explicit choice holds at any length
        assert ProfileChoice.of(asked, 10**6, speedup) == (asked, False)


def test_the_documented_boundary_holds() -> None:
    """docs/configuration.md and how_it_works.md: a fit of 280 steps or more at 2x measures; 90 steps do not."""
    assert ProfileChoice.of("auto", 280, 2.0).method == "measured"
    assert ProfileChoice.of("auto", 279, 2.0).method == "flops"
    assert ProfileChoice.of("auto", 90, 2.0).method == "flops"


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
        ProfileChoice.of("auto", 90, 2.0).announce(module, first_step=True)
        ProfileChoice.of("measured", 90, 2.0).announce(module, first_step=False)
    said = [r.getMessage() for r in caplog.records]
    steps = harness.PROFILE_STEPS
    assert said[0].startswith("ElasticTensorSelection: profiling 3 tensors after the first training step's backward")
    assert f"analytic time model (op counts, one timed step) (about {steps['flops'] - 1} training steps" in said[0]
    assert f"time_model='auto': a measured profile (about {steps['measured']} training steps)" in said[0]
    assert f"measured (about {steps['measured']} training steps" in said[1] and "time_model='auto'" not in said[1]
