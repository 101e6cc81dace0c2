"""The statistics: from rank (or micro-batch) samples to a gradient noise scale.

One responsibility per module; every name another module uses is public:

- ``gns``: ``GNSEstimate`` and ``estimate_from_stats`` (the estimate from reduced sums)
- ``offline``: ``estimate`` (gk.estimate, from sample gradients held in memory)
- ``critical``: ``critical_batch_size`` (Appendix C)
- ``bias``: the small-sample corrections of the noise (c4, the nuclear Wishart correction)
- ``dof``: the nuclear correction's degrees of freedom (modes, models, pair moments)
- ``fourth_moments``: the degrees of freedom from the samples' fourth moments
  ('data', 'gauss-sums')
- ``leave_one_out``: leave-one-out statistics (the jackknife)
- ``signal``: the bias-reduced signals (signal='debiased')
- ``pool``, ``pool_state``: the noise pool (``NoisePool``) and its state / saved format
- ``pooled``: the pool's part of the nuclear solves (fold, correct; the solve of the
  pooled matrices is gns_kernels.spectral.pooled_sqrt_traces)
- ``common``: sample-count checks and small tensor helpers (``smaller_side``,
  ``scatter_cols``) that gns_kernels.spectral uses too

The package sits below gns_kernels.spectral, which imports the corrections from here: its
modules import torch, gns_kernels._validation, each other and (``offline.estimate``, for
the eager l1 / l2 sums) gns_kernels.ops, never spectral. What needs a solver lives in
spectral: the deviation sums of the 'gauss-sums' dof (``spectral.deviation_sums``) and the
solve of the pooled matrices (``spectral.pooled_sqrt_traces``).
The modules gns_kernels.estimators, bias, nuclear_dof and pooling re-export these names
from before issue 42 (CHANGELOG.md).

Every public name of these modules is also a name of the package (``from gns_kernels import
stats; stats.c4(4)``), resolved on first access.
"""
from __future__ import annotations

import importlib

# public name -> the module of this package that defines it (imported on first access, so
# that gns_kernels.spectral can import stats.bias while stats.pooled imports spectral)
_HOME: dict[str, str] = {}
for _module, _names in {
    "bias": ("c4", "l1_noise_factor", "c4_tensor", "pair_sum", "corrected_sqrt_trace",
             "nuclear_sqrt_trace_corrected", "nuclear_sqrt_trace_corrected_from_sums"),
    "critical": ("CBS_RULES", "critical_batch_size"),
    "dof": ("NUCLEAR_DOF_MODES", "GAUSS_SUMS_MIN_SAMPLES", "resolve_nuclear_dof", "nuclear_dof",
            "gram_pair_moments", "dof_from_moments", "dof_from_gram_pair", "pooled_dof"),
    "fourth_moments": ("fourth_moment_system", "nuclear_frobenius_variance", "nuclear_dof_from_samples",
                       "per_sample_quartic_sums", "sample_sums_moments", "dof_from_sample_sums",
                       "dof_from_samples_gaussian"),
    "gns": ("GEOMETRIES", "SIGNALS", "GNSEstimate", "estimate_from_stats"),
    "leave_one_out": ("loo_gram", "loo_sum_sq", "jackknife"),
    "offline": ("estimate",),
    "pool": ("NoisePool", "NU_S_MIN"),
    "pool_state": ("check_pool_beta", "check_pool_state_dict"),
    "pooled": ("pool_folder", "pooled_sums", "pool_nu", "pooled_correct", "pooled_values"),
    "signal": ("l1_signal_debiased", "l1_signal_folded", "nuclear_signal_debiased"),
}.items():
    for _name in _names:
        _HOME[_name] = _module
del _module, _names, _name

_MODULES = ("bias", "common", "critical", "dof", "fourth_moments", "gns", "leave_one_out",
            "offline", "pool", "pool_state", "pooled", "signal")

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_HOME) | set(_MODULES))
