"""Fixtures of the inspect tests."""

from __future__ import annotations

import pytest
import torch

from tests._inspect_helpers import Stack


@pytest.fixture
def stack():
    """A float64 two-layer residual attention stack (causal MHA, then GQA), in eval mode."""
    torch.manual_seed(3)
    return Stack().double().eval()
