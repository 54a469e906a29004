"""Every test profiles into its own cache: the per-user default cache of the callback is never touched."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path_factory.mktemp("elastic-cache")
    monkeypatch.setenv("LIGHTNING_ELASTIC_CACHE_DIR", str(cache))
    return cache
