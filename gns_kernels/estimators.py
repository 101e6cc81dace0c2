"""Old home of the estimators; they live in gns_kernels.stats since issue 42: ``GNSEstimate``
and ``estimate_from_stats`` in ``stats.gns``, ``estimate`` (gk.estimate) in
``stats.offline``, ``critical_batch_size`` in ``stats.critical``.

This module re-exports the names it had, for one release (CHANGELOG.md), without a
DeprecationWarning: ``gns_kernels.estimators`` is the most imported module of the package
(``GNSEstimate`` in type annotations, docs/api.md), and the coordinator imports
``GNSEstimate`` from it; the top-level names (``gk.estimate``, ``gk.GNSEstimate``,
``gk.critical_batch_size``) are the ones to use.
"""
from __future__ import annotations

from .stats.critical import CBS_RULES, critical_batch_size
from .stats.gns import GEOMETRIES, SIGNALS, GNSEstimate, estimate_from_stats
from .stats.offline import estimate

__all__ = [
    "GEOMETRIES",
    "SIGNALS",
    "CBS_RULES",
    "GNSEstimate",
    "estimate",
    "estimate_from_stats",
    "critical_batch_size",
]
