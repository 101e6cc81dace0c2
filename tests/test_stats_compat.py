"""The statistics' old modules (before issue 42) re-export the same objects as
gns_kernels.stats, for one release; gns_kernels.nuclear_dof warns when imported."""
from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from gns_kernels import stats

OLD = {
    "gns_kernels.bias": ["c4", "c4_tensor", "l1_noise_factor", "nuclear_sqrt_trace_corrected",
                         "nuclear_sqrt_trace_corrected_from_sums", "nuclear_dof", "resolve_nuclear_dof",
                         "NUCLEAR_DOF_MODES", "GAUSS_SUMS_MIN_SAMPLES", "nuclear_dof_from_samples",
                         "nuclear_frobenius_variance"],
    "gns_kernels.estimators": ["GEOMETRIES", "SIGNALS", "CBS_RULES", "GNSEstimate", "estimate",
                               "estimate_from_stats", "critical_batch_size"],
    "gns_kernels.pooling": ["NoisePool", "check_pool_beta", "NU_S_MIN"],
    "gns_kernels.nuclear_dof": ["per_sample_quartic_sums", "sample_sums_moments", "dof_from_sample_sums",
                                "dof_from_samples_gaussian", "gram_pair_moments", "dof_from_moments",
                                "dof_from_gram_pair", "loo_gram", "loo_sum_sq", "jackknife", "pooled_dof",
                                "l1_signal_debiased", "l1_signal_folded", "nuclear_signal_debiased"],
}


@pytest.mark.parametrize("module", sorted(OLD))
def test_old_modules_reexport_the_same_objects(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module(module)
    for name in OLD[module]:
        assert getattr(old, name) is getattr(stats, name), f"{module}.{name}"


def test_the_top_level_names_are_the_stats_ones():
    import gns_kernels as gk

    assert gk.estimate is stats.estimate and gk.GNSEstimate is stats.GNSEstimate
    assert gk.critical_batch_size is stats.critical_batch_size


def test_nuclear_dof_module_import_warns():
    sys.modules.pop("gns_kernels.nuclear_dof", None)
    with pytest.warns(DeprecationWarning, match="gns_kernels.nuclear_dof is deprecated"):
        importlib.import_module("gns_kernels.nuclear_dof")


def test_stats_names_resolve_to_their_modules():
    found = set()
    for module in ("bias", "critical", "dof", "fourth_moments", "gns", "leave_one_out",
                   "offline", "pool", "pool_state", "pooled", "signal"):
        home = importlib.import_module(f"gns_kernels.stats.{module}")
        for name in set(home.__all__) & set(stats.__all__):
            assert getattr(stats, name) is getattr(home, name), name
            found.add(name)
    assert found == set(stats.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        stats.nope  # noqa: B018
