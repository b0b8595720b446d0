"""Fixtures shared by the test modules (pytest finds them here; test modules never import each other)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, whatever ran before it (the tests use no numpy)."""
    torch.manual_seed(0)
    random.seed(0)


def _alive_roundpipe_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-"))


@pytest.fixture
def roundpipe_threads() -> Callable[[], list[str]]:
    """Call it to get the names of the engine's threads still alive (all are named ``roundpipe-...``), sorted:
    ``assert roundpipe_threads() == []`` after an engine closed."""
    return _alive_roundpipe_threads
