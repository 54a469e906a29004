"""Recipe tests import the recipes' shared helpers as `_common`, the way `python recipes/train.py` finds them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Each test composes afresh, and a recipe's `device.threads` does not outlive its test."""
    GlobalHydra.instance().clear()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
