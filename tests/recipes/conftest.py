"""Recipe tests compose afresh; they import the recipes' helpers from `elastic_zoo.recipe` and a recipe as `recipes.<name>`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Each test composes afresh, and a recipe's `device.threads` does not outlive its test."""
    GlobalHydra.instance().clear()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
