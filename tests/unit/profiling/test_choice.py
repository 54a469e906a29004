"""`ProfileChoice`: which time model a fit profiles with, from what the fit can pay for."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_elastic import windows
from lightning_elastic.profiling import harness
from lightning_elastic.profiling.harness import ProfileChoice


@pytest.mark.parametrize(("first_step", "first_backward"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("speedup", [1.5, 2.0, 2.25, 2.5, 2.8])
def test_auto_measures_the_profile_where_it_costs_at_most_the_own_share_of_the_planned_fit(
    speedup: float, first_step: bool, first_backward: bool
) -> None:
    """The measured profile's steps and the first probe window's against `OWN_SHARE` of the planned full steps
    `N / s`, scaled above 2x by the room a selected step has above the forward pass (`1 / s - FORWARD_SHARE`) against
    that room at 2x, by brute force."""
    steps = ProfileChoice("measured", True, first_step, first_backward).steps + harness.FIRST_WINDOW
    room = min(1.0, (1 / speedup - harness.FORWARD_SHARE) / (1 / 2 - harness.FORWARD_SHARE))
    shortest = next(n for n in range(1, 100_000) if steps <= windows.OWN_SHARE * room * n / speedup + 1e-9)
    of = ProfileChoice.of
    flags = (first_step, first_backward)
    assert of("auto", shortest, speedup, *flags) == ("measured", True, *flags)
    assert of("auto", shortest - 1, speedup, *flags) == ("flops", True, *flags)
    assert of("auto", None, speedup, *flags) == ("measured", True, *flags)  # unknown length: a long fit
    for asked in ("measured", "flops"):
        assert of(asked, 1, speedup, *flags) == (asked, False, *flags)  # explicit: held at any length
        assert of(asked, 10**6, speedup, *flags) == (asked, False, *flags)


@pytest.mark.parametrize("speedup", [3.0, 4.0, 10.0])
def test_auto_takes_the_analytic_profile_at_3x_and_above_however_long_the_fit(speedup: float) -> None:
    """From 3x a selected step has no room above the forward pass (a third of a full step) to pay a measured profile
    from; an unknown length still measures (a long fit), and an explicit `measured` is held."""
    for first_step in (False, True):
        assert ProfileChoice.of("auto", 10**7, speedup, first_step).method == "flops"
        assert ProfileChoice.of("auto", None, speedup, first_step).method == "measured"
        assert ProfileChoice.of("measured", 10**7, speedup, first_step).method == "measured"


def test_the_documented_boundary_holds() -> None:
    """docs/configuration.md: at 2x a fit of 214 steps or more measures on CPU when its first step is the profile's
    first pass (267 on a GPU, 307 when profiling takes a pass of its own); at 1.5x 160, 200 and 230; 667 at 2.5x."""
    assert harness.FIRST_WINDOW == 3
    cpu, gpu = {"first_step": True, "first_backward": True}, {"first_step": True}
    for speedup, shortest, flags in (
        (2.0, 214, cpu), (2.0, 267, gpu), (2.0, 307, {}), (1.5, 160, cpu), (1.5, 200, gpu), (1.5, 230, {}),
        (2.5, 667, cpu),
    ):  # fmt: skip
        assert ProfileChoice.of("auto", shortest, speedup, **flags).method == "measured"
        assert ProfileChoice.of("auto", shortest - 1, speedup, **flags).method == "flops"
    assert ProfileChoice.of("auto", 90, 2.0, **cpu).method == "flops"  # MiniLM's 90-step fit at 2x
    assert ProfileChoice.of("auto", 150, 2.0, **cpu).method == "flops"  # ELPV's short fit at 2x
    assert ProfileChoice.of("auto", 150, 1.5, **cpu).method == "flops"  # ... and at 1.5x
    assert ProfileChoice.of("auto", 200, 2.0, **cpu).method == "flops"  # few-shot ELPV at 2x
    assert ProfileChoice.of("auto", 200, 1.5, **cpu).method == "measured"  # ... and at 1.5x
    assert ProfileChoice.of("auto", 240, 2.0, **cpu).method == "measured"  # the published ELPV run
    assert ProfileChoice.of("auto", 400, 3.0, **cpu).method == "flops"  # Fashion-MNIST's fit at 3x


def test_the_opening_line_says_what_profiling_costs_and_why_auto_took_the_analytic_model() -> None:
    class Module(nn.Module):  # the opening reads the module's trainable tensors only
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    module = Module()
    module.b.bias.requires_grad_(False)
    said = [
        ProfileChoice.of("auto", 90, 2.0, first_step=True, first_backward=True).opening(module, 2.0, cache_on=True),
        ProfileChoice.of("measured", 90, 2.0, first_step=False).opening(module, 2.0, cache_on=False),
        ProfileChoice.of("auto", 400, 2.5, first_step=True).opening(module, 2.5, cache_on=True),
        ProfileChoice.of("auto", 400, 3.0, first_step=True).opening(module, 3.0, cache_on=True),
        ProfileChoice.of("auto", 128, 2.97, first_step=True).opening(module, 2.97, cache_on=True),  # little room left
    ]
    assert said[0].startswith("ElasticTensorSelection: profiling 3 tensors after the first training step's backward")
    assert "analytic time model (op counts, scaled to this step's backward pass) (less than one training step," in said[0]
    assert "time_model='auto': a measured profile (about 2 training steps)" in said[0]  # 2.33: `ProfileChoice.steps`
    assert (
        "and the first probe window after it (3 full steps) would be more than 5% of this fit; time_model='measured' "
        "measures anyway"
    ) in said[0]
    assert "measured (about 5 training steps" in said[1] and "time_model='auto'" not in said[1]  # 4.67
    assert "; kept in the cache for later fits that profile this model on this device the same way;" in said[0]
    assert "cache" not in said[1]  # `cache_dir=False`: no cache is read nor written
    assert "would be more than 2% of this fit (5%, scaled to the room a selected step has above the forward" in said[2]
    assert "would eat the little room a selected step has above the forward pass at 3x" in said[3]
    assert "would be more than 0.1% of this fit (5%, scaled to the room" in said[4]  # it read "more than 0%"


def test_a_profile_costs_a_plain_forward_pass_less_where_the_fits_first_step_is_its_first_pass_and_times_it() -> None:
    """On CPU the fit's first step is the profile's fingerprint and its timed backward pass (and the analytic one's op
    count): a plain forward pass (`FORWARD_SHARE` of a step) is left of the plain full step between two forwards;
    elsewhere (a GPU: `FirstStep.backward_applies`) the fingerprint (and the count) are the step's, the full step is
    timed; profiling on its own, every pass. The measured profile's instrumented passes run in every case
    (`test_pass_plan` checks these figures against the passes a simulated device runs)."""
    assert harness.INSTRUMENTED_STEPS == 2 and harness.FORWARD_SHARE == 1 / 3
    for method, own in (("flops", 1 / 3), ("measured", 2)):  # the counting forward pass; the instrumented passes
        cpu = ProfileChoice.of(method, 100, 2.0, first_step=True, first_backward=True)
        gpu = ProfileChoice.of(method, 100, 2.0, first_step=True, first_backward=False)
        alone = ProfileChoice.of(method, 100, 2.0, first_step=False, first_backward=True)  # no step: no backward
        assert not alone.first_backward
        counted = 0 if method == "flops" else own  # the first step counted the analytic profile's ops
        assert cpu.steps == pytest.approx(counted + 1 / 3)
        assert gpu.steps == pytest.approx(counted + 1 + 2 / 3)
        assert alone.steps == pytest.approx(1 + own + 1 + 2 / 3)
    cpu = ProfileChoice.of("flops", 100, 2.0, first_step=True, first_backward=True)
    assert ProfileChoice.of("auto", 100, 2.0, first_step=True, first_backward=True) == cpu._replace(auto=True)
    assert ProfileChoice.of("auto", 240, 2.0, first_step=True, first_backward=True) == cpu._replace(
        method="measured", auto=True
    )
