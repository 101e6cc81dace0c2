"""Old home of the noise pool; it lives in gns_kernels.stats since issue 42: ``NoisePool``
and ``NU_S_MIN`` in ``stats.pool``, ``check_pool_beta`` in ``stats.pool_state`` (with the
pool's state and saved format, unchanged).

This module re-exports the names it had, for one release (CHANGELOG.md), without a
DeprecationWarning: the coordinator imports ``check_pool_beta`` from it, and docs name
``gns_kernels.pooling``; import from ``gns_kernels.stats`` instead.
"""
from __future__ import annotations

from .stats.pool import NU_S_MIN, NoisePool
from .stats.pool_state import check_pool_beta

__all__ = ["NoisePool", "check_pool_beta", "NU_S_MIN"]
