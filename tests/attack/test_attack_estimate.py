"""Attack suite: gk.estimate, estimate_from_stats, critical_batch_size and the bias helpers.

Rejected inputs raise errors naming the argument; accepted inputs agree with
gns_kernels.reference (float64); non-finite data never gives a valid, finite GNS.
"""
from __future__ import annotations

import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref, stats
from gns_kernels.stats import estimate_from_stats

GEOS = ["l2", "l1", "nuclear"]


def _rg(gen, R=3, shapes=((4, 6), (5,)), scale=1.0, dtype=torch.float64):
    base = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return [[((b + 0.5 * torch.randn(s, generator=gen, dtype=torch.float64)) * scale).to(dtype)
             for b, s in zip(base, shapes)] for _ in range(R)]


def _ok(gen):
    return _rg(gen)


_BAD_RANK_GRADS = [
    ("none", lambda rg: None, ValueError, "rank_grads: expected a list"),
    ("tensor", lambda rg: torch.zeros(3, 4), ValueError, "rank_grads: expected a list"),
    ("empty", lambda rg: [], ValueError, "rank_grads: empty"),
    ("one_sample", lambda rg: rg[:1], ValueError, "at least 2 samples"),
    ("no_params", lambda rg: [[], [], []], ValueError, r"rank_grads\[0\]: empty"),
    ("not_tensor", lambda rg: [rg[0], [1.0, rg[1][1]], rg[2]], ValueError, r"rank_grads\[1\]\[0\]: expected a tensor"),
    ("ragged", lambda rg: [rg[0], rg[1][:1], rg[2]], ValueError, r"rank_grads\[1\]: has 1 tensors"),
    ("shape", lambda rg: [rg[0], [rg[1][0].T, rg[1][1]], rg[2]], ValueError, r"rank_grads\[1\]\[0\]: shape"),
    ("meta", lambda rg: [[t.to("meta") for t in r] for r in rg], ValueError, r"rank_grads\[0\]\[0\]: .*meta"),
    ("mixed_meta", lambda rg: [rg[0], [rg[1][0].to("meta"), rg[1][1]], rg[2]], ValueError, r"rank_grads\[1\]\[0\]"),
    ("complex", lambda rg: [[t.to(torch.complex128) for t in r] for r in rg], TypeError, r"rank_grads\[0\]\[0\]: .*dtype"),
    ("bool", lambda rg: [[t > 0 for t in r] for r in rg], TypeError, r"rank_grads\[0\]\[0\]: .*dtype"),
    ("all_empty", lambda rg: [[torch.zeros(0, 3)] for _ in rg], ValueError, "hold no elements"),
]


@pytest.mark.parametrize("geometry", GEOS)
@pytest.mark.parametrize("case,mutate,exc,pat", _BAD_RANK_GRADS, ids=[c[0] for c in _BAD_RANK_GRADS])
def test_bad_rank_grads(case, mutate, exc, pat, geometry, gen):
    with pytest.raises(exc, match=pat):
        gk.estimate(mutate(_ok(gen)), 6, geometry)


_BAD_ARGS = [
    ("batch_size", 0, ValueError, "batch_size"),
    ("batch_size", -6, ValueError, "batch_size"),
    ("batch_size", 7, ValueError, "batch_size: expected a multiple"),
    ("batch_size", 6.5, ValueError, "batch_size"),
    ("batch_size", float("nan"), ValueError, "batch_size"),
    ("batch_size", float("inf"), ValueError, "batch_size"),
    ("batch_size", "six", ValueError, "batch_size"),
    ("batch_size", None, ValueError, "batch_size"),
    ("geometry", "L2", ValueError, "geometry"),
    ("geometry", None, ValueError, "geometry"),
    ("bias_correction", 1, ValueError, "bias_correction"),
    ("bias_correction", "yes", ValueError, "bias_correction"),
    ("dtype", torch.int32, ValueError, "dtype"),
    ("dtype", "float64", ValueError, "dtype"),
    ("shift", [torch.zeros(4, 6)], ValueError, "shift: expected 2 tensors"),
    ("shift", [torch.zeros(6, 4), None], ValueError, r"shift\[0\]"),
    ("shift", [1.0, None], ValueError, r"shift\[0\]"),
    ("shift", [torch.zeros(4, 6, dtype=torch.complex64), None], TypeError, r"shift\[0\]"),
    ("nuclear_dof", "many", ValueError, "nuclear_dof"),
]


@pytest.mark.parametrize("arg,value,exc,pat", _BAD_ARGS, ids=[f"{a}-{v!r}" for a, v, _, _ in _BAD_ARGS])
def test_bad_arguments(arg, value, exc, pat, gen):
    kw = {"batch_size": 6, "geometry": "nuclear" if arg == "nuclear_dof" else "l1"}
    kw[arg] = value
    with pytest.raises(exc, match=pat):
        gk.estimate(_ok(gen), **kw)


@pytest.mark.parametrize("geometry", GEOS)
@pytest.mark.parametrize("scale", [1e-150, 1e-5, 1.0, 1e5, 1e150])
@pytest.mark.parametrize("R", [2, 5])
def test_scales_against_reference(geometry, scale, R, gen):
    rg = _rg(gen, R=R, scale=scale)
    e = gk.estimate(rg, 4 * R, geometry, bias_correction=False)
    noise, signal = ref.raw_gns(rg, 4 * R, geometry)
    if not (math.isfinite(noise) and math.isfinite(signal) and signal > 0):
        assert not e.valid and math.isnan(e.gns)
        return
    tol = 1e-6 if geometry == "nuclear" else 1e-10
    assert e.valid
    assert e.noise == pytest.approx(noise, rel=tol) and e.signal == pytest.approx(signal, rel=tol)


@pytest.mark.parametrize("geometry", GEOS)
@pytest.mark.parametrize("scale", [1e-200, 1e200])
def test_out_of_range_scales_are_invalid_or_exact(geometry, scale, gen):
    # squares underflow to 0 (1e-200) or overflow to inf (1e200): never a finite wrong GNS
    rg = _rg(gen, scale=scale)
    e = gk.estimate(rg, 6, geometry, bias_correction=False)
    if e.valid:
        want = gk.estimate(_rg(torch.Generator().manual_seed(0), scale=1.0), 6, geometry)  # noqa: F841
        noise, signal = ref.raw_gns(rg, 6, geometry)
        assert math.isfinite(noise) and signal > 0
        assert e.gns == pytest.approx(noise / signal, rel=1e-6)
    else:
        assert math.isnan(e.gns) and math.isnan(e.noise) and math.isnan(e.signal)


@pytest.mark.parametrize("geometry", GEOS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["sample", "shift"])
def test_non_finite_is_invalid(geometry, bad, where, gen):
    rg = _ok(gen)
    shift = [torch.zeros(4, 6, dtype=torch.float64), None]
    if where == "sample":
        rg[1][0][2, 3] = bad
    else:
        shift[0][1, 1] = bad
    for corr in (False, True):
        e = gk.estimate(rg, 6, geometry, bias_correction=corr, shift=shift)
        assert e.valid is False and math.isnan(e.gns)


@pytest.mark.parametrize("geometry", GEOS)
def test_identical_samples(geometry, gen):
    # the same tensor object in every sample (aliasing): zero noise, finite signal
    t = [torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
    e = gk.estimate([t, t, t], 6, geometry)
    # zero up to the rounding of mean_j x = (x + x + x) / 3
    assert e.valid and 0.0 <= e.noise <= 1e-26 * e.signal and 0.0 <= e.gns <= 1e-26
    assert t[0].dtype == torch.float64  # inputs untouched


@pytest.mark.parametrize("geometry", GEOS)
def test_float16_and_int_inputs(geometry, gen):
    rg = _rg(gen)
    half = [[t.half() for t in r] for r in rg]
    e = gk.estimate(half, 6, geometry, bias_correction=False)
    noise, signal = ref.raw_gns(half, 6, geometry)
    assert e.noise == pytest.approx(noise, rel=1e-6) and e.signal == pytest.approx(signal, rel=1e-6)
    ints = [[(t * 10).round().to(torch.int64) for t in r] for r in rg]
    e = gk.estimate(ints, 6, geometry, bias_correction=False)
    noise, signal = ref.raw_gns([[t.double() for t in r] for r in ints], 6, geometry)
    assert e.noise == pytest.approx(noise, rel=1e-6)


_BAD_STATS = [
    (dict(geometry="l4"), ValueError, "geometry"),
    (dict(num_samples=1), ValueError, "num_samples"),
    (dict(num_samples=2.5), ValueError, "num_samples"),
    (dict(num_samples=True), ValueError, "num_samples"),
    (dict(batch_size=3), ValueError, "batch_size"),
    (dict(bias_correction=None), ValueError, "bias_correction"),
    (dict(noise_raw_sum=torch.ones(2)), ValueError, "scalar"),
    (dict(step=-1), ValueError, "step"),
    (dict(step="3"), TypeError, "step"),
]


@pytest.mark.parametrize("kw,exc,pat", _BAD_STATS, ids=[str(k) for k, _, _ in _BAD_STATS])
def test_estimate_from_stats_bad(kw, exc, pat):
    args = dict(geometry="l1", noise_raw_sum=1.0, signal_raw_sum=2.0, num_samples=2, batch_size=4)
    args.update(kw)
    with pytest.raises(exc, match=pat):
        estimate_from_stats(**args)


@pytest.mark.parametrize("geometry", GEOS)
@pytest.mark.parametrize("noise,signal", [(math.nan, 1.0), (1.0, math.nan), (math.inf, 1.0), (1.0, math.inf),
                                           (1.0, 0.0), (1.0, -1.0), (-1.0, 1.0), (1e300, 1e-300), (1.0, 5e-324)])
def test_estimate_from_stats_invalid(geometry, noise, signal):
    e = estimate_from_stats(geometry, noise, signal, 2, 4, bias_correction=False)
    assert not e.valid and math.isnan(e.gns) and math.isnan(e.noise) and math.isnan(e.signal)


@pytest.mark.parametrize("bad,exc", [(-1.0, ValueError), ("x", ValueError)])
def test_critical_batch_size_bad(bad, exc):
    with pytest.raises(exc, match="^gns: expected"):
        gk.critical_batch_size(bad, "l1")
    # an invalid estimate's nan GNS gives nan, never a number
    assert math.isnan(gk.critical_batch_size(math.nan, "l1"))
    with pytest.raises(ValueError, match="kappa"):
        gk.critical_batch_size(10.0, "l1", kappa=1.0)
    with pytest.raises(ValueError, match="rule"):
        gk.critical_batch_size(10.0, "l2", rule="inflection")


# ----------------------------------------------------------------------------------------
# bias helpers
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("R", [1, 0, -3, 2.5, math.nan, math.inf, "4", None, True])
def test_sample_counts_rejected(R):
    with pytest.raises(ValueError, match="R: expected"):
        stats.l1_noise_factor(R)
    with pytest.raises(ValueError, match="num_samples: expected"):
        stats.nuclear_dof(R, 4)


@pytest.mark.parametrize("R", [1, 0.5, math.nan, math.inf, "4", None])
def test_c4_rejected(R):
    with pytest.raises((TypeError, ValueError), match="^R: expected"):
        stats.c4(R)


def test_c4_closed_forms():
    assert stats.c4(2) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-15)
    assert stats.c4(3) == pytest.approx(math.sqrt(math.pi) / 2, rel=1e-15)
    assert stats.l1_noise_factor(4.0) == stats.l1_noise_factor(4)


def test_nuclear_correction_edge_inputs():
    empty = torch.zeros(3, 0, dtype=torch.float64)
    assert torch.equal(stats.nuclear_sqrt_trace_corrected(empty, 4, 8), torch.zeros(3, dtype=torch.float64))
    zero = torch.zeros(5, dtype=torch.float64)
    assert float(stats.nuclear_sqrt_trace_corrected(zero, 4, 8)) == 0.0
    nan = torch.tensor([1.0, math.nan], dtype=torch.float64)
    assert math.isnan(float(stats.nuclear_sqrt_trace_corrected(nan, 4, 8)))
    with pytest.raises(ValueError, match="eigvals"):
        stats.nuclear_sqrt_trace_corrected([1.0, 2.0], 4, 8)
    with pytest.raises(ValueError, match="dof_model"):
        stats.nuclear_sqrt_trace_corrected(zero, 4, 8, dof_model="many")
    with pytest.raises(ValueError, match="dof_per_sample"):
        stats.nuclear_sqrt_trace_corrected(zero, 4, 8, dof_per_sample=0.0)


def test_nuclear_zero_by_n_matrix_is_skipped(gen):
    rg = _rg(gen, shapes=((0, 7), (3, 4)))
    e = gk.estimate(rg, 6, "nuclear", bias_correction=False)
    noise, signal = ref.raw_gns([[r[1]] for r in rg], 6, "nuclear")
    assert e.valid and e.noise == pytest.approx(noise, rel=1e-6) and e.signal == pytest.approx(signal, rel=1e-6)
