"""Fixtures of the tests that need CUDA (tests/cuda/runs.py holds the runs they share)."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from tests.cuda.runs import release


@pytest.fixture
def cuda() -> Iterator[torch.device]:
    """The CUDA device, with its memory handed back after the test."""
    yield torch.device("cuda", 0)
    release()
