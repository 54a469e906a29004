"""Every test profiles into its own cache: the per-user default cache of the callback is never touched. Tests that
profile for real take the profiler's ticking clock (`ticking_profiler`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lightning_elastic.profiling import first_step, runner
from lightning_elastic.timing import DeviceClock


@pytest.fixture(autouse=True)
def _private_profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path_factory.mktemp("elastic-cache")
    monkeypatch.setenv("LIGHTNING_ELASTIC_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def ticking_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler's clock advances 1 ms a reading: its timings follow the step's ops, not this machine's load.

    For tests about what profiling runs on, not about timings; with real ones, a busy machine can time a millisecond
    forward pass longer than the full step, and then refuse even a speedup of 1.001 as out of reach.
    """
    ticks = itertools.count()
    ticking = lambda device, clock: DeviceClock(device, lambda: next(ticks) * 1e-3)  # noqa: E731
    monkeypatch.setattr(runner, "DeviceClock", ticking)
    monkeypatch.setattr(first_step, "DeviceClock", ticking)  # the fit's first backward pass, when it is the profile's
