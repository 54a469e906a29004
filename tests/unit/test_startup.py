"""What the callback reads from the Trainer as a fit starts, on stand-ins that carry only what it reads."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch.callbacks import GradientAccumulationScheduler, StochasticWeightAveraging

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.schedule import Schedule
from lightning_elastic.startup import epoch_lengths, fit_schedule


def trainer(batches: float = 8, estimated: float = 24, callbacks: tuple[Any, ...] = (), **kwargs: Any) -> Any:
    fields = dict(max_epochs=3, max_steps=-1, accumulate_grad_batches=1, fast_dev_run=False)
    fields.update(kwargs)
    return SimpleNamespace(
        num_training_batches=batches, estimated_stepping_batches=estimated, callbacks=list(callbacks), **fields
    )


def test_epoch_lengths_count_optimizer_steps_under_accumulation() -> None:
    assert epoch_lengths(trainer(batches=10, estimated=12, accumulate_grad_batches=3)) == ((4,), 12)
    assert epoch_lengths(trainer(batches=math.inf, estimated=math.inf)) == (math.inf, None)


def test_an_accumulation_schedule_changes_each_epochs_steps_and_the_fits() -> None:
    scheduler = GradientAccumulationScheduler(scheduling={0: 4, 2: 1})
    # the Trainer's estimate (8 batches x 4 epochs / 4) sees only the first epochs' accumulation
    assert epoch_lengths(trainer(estimated=8, callbacks=(scheduler,), max_epochs=4)) == ((2, 2, 8), 2 + 2 + 8 + 8)
    assert epoch_lengths(trainer(callbacks=(scheduler,), max_epochs=4, max_steps=10)) == ((2, 2, 8), 10)


def test_the_epoch_swa_adds_for_batchnorm_statistics_has_no_steps() -> None:
    swa = StochasticWeightAveraging(swa_lrs=0.1)
    swa._model_contains_batch_norm, swa._max_epochs = True, 3  # as its `setup` leaves them, one epoch added
    assert epoch_lengths(trainer(estimated=32, callbacks=(swa,), max_epochs=4)) == ((8,), 24)
    swa._model_contains_batch_norm = False
    assert epoch_lengths(trainer(estimated=32, callbacks=(swa,), max_epochs=4)) == ((8,), 32)


def test_fit_schedule_refuses_windows_that_do_not_fit_unless_under_fast_dev_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ElasticConfigError, match=r"^`probe_steps` must be fewer .* \(2 = `interval` 2 x 1 step\)"):
        fit_schedule(trainer(), 2, "step", 3, 2.0)
    with caplog.at_level(logging.INFO):
        assert fit_schedule(trainer(fast_dev_run=2), 2, "step", 3, 2.0) == (None, 24)
    assert "ElasticTensorSelection: off under `fast_dev_run`, every tensor trains (`probe_steps` must" in caplog.text


def test_fit_schedule_warns_when_the_first_window_runs_late() -> None:
    with pytest.warns(UserWarning, match=r"`probe_steps` 2 leave the first selection .* runs on until step 3"):
        schedule, total = fit_schedule(trainer(estimated=30), 3, "step", 2, 2.0)
    assert (schedule, total) == (Schedule(3, "step", 2, (8,), probe_every=1, total_steps=30), 30)
