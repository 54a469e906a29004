"""The first probe window of a process that did not profile runs on while it is warming up, alike on every rank."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_elastic import ElasticTensorSelection, resume, warmup
from lightning_elastic.distributed import any_rank
from lightning_elastic.planner import WallClockPlan
from lightning_elastic.schedule import Schedule
from lightning_elastic.session import FitSession
from tests.integration.tiny import TinyNet, synthetic_profile


class OtherRanks:
    """`strategy.reduce` of a 2-rank run whose other rank voted `other` (a sum over ranks)."""

    def __init__(self, other: float) -> None:
        self.other = other

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "sum"
        return tensor + self.other


def cold_session(samples: list[float]) -> FitSession:
    module = TinyNet()
    prof = synthetic_profile(module)
    schedule = Schedule(30, "step", 4, first_probe_steps=6, total_steps=96)
    plan = WallClockPlan(speedup=1.5, total_steps=96, full_step=prof.t_full)
    fit = FitSession.start(module, prof, schedule, plan, ElasticTensorSelection(clock=lambda: 0.0)._settings)
    fit.warmup.cold, fit.probe_end, fit.probe_full = True, 6, [s * prof.t_full for s in samples]
    return fit


@pytest.mark.parametrize(
    ("mine", "other", "runs_on"),
    [
        ([1.45, 1.45], 0.0, True),  # this rank is warming up: every rank runs on
        ([1.0, 1.02], 1.0, True),  # the other rank is: this one runs on with it, though warm
        ([1.0, 1.02], 0.0, False),  # no rank is
    ],
)
def test_every_rank_runs_on_when_any_rank_is_warming_up(mine: list[float], other: float, runs_on: bool) -> None:
    fit = cold_session(mine)
    trainer: Any = SimpleNamespace(strategy=OtherRanks(other))
    assert fit.runs_on(trainer, 6) is runs_on
    assert (fit.probe_end, fit.warmup.ran_on) == ((7, 1) if runs_on else (6, 0))


@pytest.mark.parametrize(("mine", "other", "expected"), [(False, 0.0, False), (True, 0.0, True), (False, 1.0, True)])
def test_a_flag_holds_on_any_rank_when_one_rank_votes_for_it(mine: bool, other: float, expected: bool) -> None:
    """The vote that runs a first window on, and that makes a profile count as timed only where every rank timed
    it (`harness.measure_profile`: the first window's length follows from it, and every rank must end it alike)."""
    strategy: Any = OtherRanks(other)
    assert any_rank(strategy, mine, torch.device("cpu")) is expected


class NoCollective:
    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        raise AssertionError("only the first window votes")


@pytest.mark.parametrize("other", [0.0, 1.0])
def test_a_warm_process_votes_and_runs_on_only_with_a_warming_rank(other: float) -> None:
    trainer: Any = SimpleNamespace(strategy=OtherRanks(other))
    warm = cold_session([1.45, 1.45])  # slow steps, but alike and it timed the profile: it does not vote to run on
    warm.warmup.cold = False
    assert warm.runs_on(trainer, 6) is bool(other)


def test_no_window_after_the_first_votes_or_runs_on() -> None:
    trainer: Any = SimpleNamespace(strategy=NoCollective())
    later = cold_session([1.45, 1.45])
    later.history.append(SimpleNamespace(step=6))  # the first selection came: this is a later window
    assert not later.runs_on(trainer, 36)


def test_the_window_that_ran_on_gives_its_steady_steps_and_its_scheduled_end() -> None:
    trainer: Any = SimpleNamespace(strategy=OtherRanks(0.0))
    fit = cold_session([1.45, 1.45])
    for step, sample in ((6, 1.0), (7, 1.1)):
        assert fit.runs_on(trainer, step)
        fit.probe_full.append(sample * fit.plan.full_step)
    profile_step = fit.plan.full_step
    assert not fit.runs_on(trainer, 8)  # two steady steps within the ceiling: warm
    assert fit.close_probe() == 6 and fit.warmup.ran_on == 2
    assert fit.plan.full_step == pytest.approx(1.05 * profile_step) and fit.plan.full_samples == 2
    assert warmup.COLD_SAMPLES == 2


def test_a_first_window_whose_selection_waits_for_an_epoch_start_ends_there() -> None:
    """With windows of 8 steps in 16-step epochs the first window runs to step 16 and its selection comes at the
    next epoch's start: running on past step 16 would skip that start and leave the selection to the epoch after."""
    module = TinyNet()
    prof = synthetic_profile(module)
    schedule = Schedule(1, "epoch", 8, steps_per_epoch=16, total_steps=64)
    assert schedule.first_window_end == 16 and schedule.selects_at_epoch_start(16)
    plan = WallClockPlan(speedup=1.5, total_steps=64, full_step=prof.t_full)
    fit = FitSession.start(module, prof, schedule, plan, ElasticTensorSelection(clock=lambda: 0.0)._settings)
    fit.warmup.cold, fit.probe_end, fit.probe_full = True, 16, [1.45 * prof.t_full] * 8
    trainer: Any = SimpleNamespace(strategy=OtherRanks(0.0))
    assert not fit.runs_on(trainer, 16)
    assert fit.close_probe() == 16


def test_a_checkpoint_inside_the_first_window_keeps_its_samples_of_t() -> None:
    """A fit resumed inside its first window is cold and its first steps are warm-up steps again: the window's samples
    from before the checkpoint are what it has to decide on, and what `T` is taken from."""
    trainer: Any = SimpleNamespace(strategy=OtherRanks(0.0))
    fit = cold_session([1.45, 1.45])
    assert fit.runs_on(trainer, 6)
    fit.probe_full.append(1.0 * fit.plan.full_step)
    resumed = cold_session([])
    resume.restore(resumed, resume.fit_state(fit))
    assert resumed.probe_full == fit.probe_full and (resumed.probe_end, resumed.warmup.ran_on) == (7, 1)
    assert resumed.runs_on(trainer, 7)  # one steady step of the two it needs
    resumed.probe_full.append(1.1 * fit.plan.full_step)
    assert not resumed.runs_on(trainer, 8)
    assert resumed.close_probe() == 6 and resumed.plan.full_step == pytest.approx(1.05 * fit.plan.full_step)
