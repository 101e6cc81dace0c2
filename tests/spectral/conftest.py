"""Fixtures for the spectral tests: a seeded torch.Generator per test."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def gen(request):
    """A torch.Generator seeded from GNS_TEST_SEED when set, else a fresh seed every run
    (printed, and kept in the report, so a failure can be replayed)."""
    env = os.environ.get("GNS_TEST_SEED", "")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
