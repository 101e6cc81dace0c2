"""Fixtures shared by every test directory.

Random data is fresh every run: the seed is drawn from os.urandom unless the environment
variable GNS_TEST_SEED is set, printed (pytest shows it with a failure) and recorded in
the test's report; rerun a failure with ``GNS_TEST_SEED=<seed> pytest ...``.
"""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def seed(request) -> int:
    """This test's seed: int(GNS_TEST_SEED) when set, else 31 fresh random bits."""
    env = os.environ.get("GNS_TEST_SEED")
    s = int(env) if env else int.from_bytes(os.urandom(4), "little") >> 1
    request.node.user_properties.append(("seed", s))
    print(f"GNS_TEST_SEED={s}")
    return s


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU torch.Generator seeded with the ``seed`` fixture."""
    return torch.Generator().manual_seed(seed)
