"""Old home of the degrees of freedom from per-sample sums, the jackknife, the pooled dof
and the bias-reduced signals; they live in gns_kernels.stats since issue 42:
``stats.fourth_moments`` (per_sample_quartic_sums, sample_sums_moments,
dof_from_sample_sums, dof_from_samples_gaussian), ``stats.dof`` (gram_pair_moments,
dof_from_moments, dof_from_gram_pair, pooled_dof), ``stats.leave_one_out`` (loo_gram,
loo_sum_sq, jackknife) and ``stats.signal`` (l1_signal_debiased, l1_signal_folded,
nuclear_signal_debiased).

Importing this module warns (DeprecationWarning): it re-exports those names for one
release (CHANGELOG.md). Nothing in the package imports it, its name was that of the
function ``nuclear_dof`` (the dof model, now ``stats.dof.nuclear_dof``), and its contents
went to four modules.
"""
from __future__ import annotations

import warnings

from .stats.dof import dof_from_gram_pair, dof_from_moments, gram_pair_moments, pooled_dof
from .stats.fourth_moments import (
    dof_from_sample_sums,
    dof_from_samples_gaussian,
    per_sample_quartic_sums,
    sample_sums_moments,
)
from .stats.leave_one_out import jackknife, loo_gram, loo_sum_sq
from .stats.signal import l1_signal_debiased, l1_signal_folded, nuclear_signal_debiased

__all__ = [
    "per_sample_quartic_sums",
    "sample_sums_moments",
    "dof_from_sample_sums",
    "dof_from_samples_gaussian",
    "gram_pair_moments",
    "dof_from_moments",
    "dof_from_gram_pair",
    "loo_gram",
    "loo_sum_sq",
    "jackknife",
    "pooled_dof",
    "l1_signal_debiased",
    "l1_signal_folded",
    "nuclear_signal_debiased",
]

warnings.warn("gns_kernels.nuclear_dof is deprecated and will be removed in the next release: "
              "import from gns_kernels.stats.fourth_moments, .dof, .jackknife or .signal "
              "(CHANGELOG.md)", DeprecationWarning, stacklevel=2)
