"""Shared fixtures for the tests (the float64 references are in ``references.py``)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Every test starts from the same global torch RNG state, so failures reproduce."""
    torch.manual_seed(1234)
