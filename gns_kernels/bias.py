"""Old home of the small-sample bias corrections and the nuclear degrees of freedom; they
live in gns_kernels.stats since issue 42: the corrections in ``stats.bias``, the dof modes
and models in ``stats.dof``, the fourth-moment estimates in ``stats.fourth_moments``.

This module re-exports the names it had, for one release (CHANGELOG.md), without a
DeprecationWarning: ``gns_kernels.bias`` is documented (docs/estimators.md,
docs/spectral.md), reachable as ``gk.bias``, and code beside this package's spectral ops
imports ``_pair_sum`` from it; import from ``gns_kernels.stats`` instead.
"""
from __future__ import annotations

from .stats.bias import (
    corrected_sqrt_trace,
    pair_sum,
    c4,
    c4_tensor,
    l1_noise_factor,
    nuclear_sqrt_trace_corrected,
    nuclear_sqrt_trace_corrected_from_sums,
)
from .stats.dof import GAUSS_SUMS_MIN_SAMPLES  # noqa: F401  (imported from here before)
from .stats.dof import NUCLEAR_DOF_MODES, nuclear_dof, resolve_nuclear_dof
from .stats.fourth_moments import nuclear_dof_from_samples, nuclear_frobenius_variance

__all__ = [
    "c4",
    "l1_noise_factor",
    "c4_tensor",
    "nuclear_dof",
    "nuclear_dof_from_samples",
    "nuclear_frobenius_variance",
    "nuclear_sqrt_trace_corrected",
    "nuclear_sqrt_trace_corrected_from_sums",
    "NUCLEAR_DOF_MODES",
    "resolve_nuclear_dof",
]

# the private names spectral.nuclear and distributed._share imported from here before
_pair_sum = pair_sum
_corrected = corrected_sqrt_trace
