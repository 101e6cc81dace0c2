"""gk.estimate / estimate_from_stats / critical_batch_size against reference.py and closed
forms: raw path = the paper's equations, corrections, shift, validity and bad input."""
from __future__ import annotations

import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference, stats
from gns_kernels.stats import estimate_from_stats


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: intra-op threads only add contention on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rank_grads(R, shapes, seed, dtype=torch.float64, offset=0.5):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g, dtype=torch.float64) + offset for s in shapes]
    return [[(b + 0.7 * torch.randn(b.shape, generator=g, dtype=torch.float64)).to(dtype) for b in base]
            for _ in range(R)]


SHAPES = [(5, 7), (9, 4), (3,), (2, 3, 5), (1, 6)]


@pytest.mark.parametrize("R", [2, 3, 5])
@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
def test_raw_equals_reference(R, geometry, seed):
    rg = _rank_grads(R, SHAPES, seed)
    B = 7 * R
    est = gk.estimate(rg, B, geometry, bias_correction=False)
    noise, signal = reference.raw_gns(rg, B, geometry)
    tol = 1e-6 if geometry == "nuclear" else 1e-10
    assert est.valid
    assert est.noise == pytest.approx(noise, rel=tol), f"seed {seed}"
    assert est.signal == pytest.approx(signal, rel=tol), f"seed {seed}"
    assert est.gns == pytest.approx(noise / signal, rel=2 * tol)
    assert est.gns == est.noise / est.signal
    assert est.noise_raw == est.noise
    assert (est.geometry, est.num_samples, est.batch_size, est.bias_corrected) == (geometry, R, B, False)


def gauss_sums_dof_reference(x: torch.Tensor) -> float:
    """nu of the Gaussian per-sample-sums model, float64, loop by loop: x (R, m, n) on the
    Gram side. Q = sum_j ||d_j d_j^T||_F^2, A = sum_j ||d_j||_F^4, M = sum_j d_j d_j^T;
    mu4 = R Q / (R-1)^2, m4 = R A / (R-1)^2, P1 = (||M||^2 - (R-1) mu4) / ((R-1)(R-2)),
    T1 = ((tr M)^2 - (R-1) m4) / ((R-1)(R-2)), nu = (R-1) (T1 + P1) / (mu4 - P1)."""
    x = x.to(torch.float64)
    R = x.shape[0]
    mean = sum(x[j] for j in range(R)) / R
    Q = A = 0.0
    M = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
    for j in range(R):
        d = x[j] - mean
        G = d @ d.T
        Q += float((G * G).sum())
        A += float(torch.trace(G)) ** 2
        M += G
    mu4, m4 = R * Q / (R - 1) ** 2, R * A / (R - 1) ** 2
    P1 = (float((M * M).sum()) - (R - 1) * mu4) / ((R - 1) * (R - 2))
    T1 = (float(torch.trace(M)) ** 2 - (R - 1) * m4) / ((R - 1) * (R - 2))
    var = (mu4 - P1) / (R - 1)
    return math.inf if var <= 0 else max(T1 + P1, 0.0) / var


@pytest.mark.parametrize("R", [2, 3, 4])
def test_corrections_relative_to_raw(R, seed):
    rg = _rank_grads(R, SHAPES, seed)
    B = 3 * R
    raw = {g: gk.estimate(rg, B, g, bias_correction=False) for g in ("l2", "l1", "nuclear")}
    cor = {g: gk.estimate(rg, B, g, nuclear_dof="auto") for g in ("l2", "l1", "nuclear")}
    # l2 is unbiased: unchanged
    assert cor["l2"].noise == raw["l2"].noise and cor["l2"].signal == raw["l2"].signal
    # l1: noise x 1/c4(R)^2, signal unchanged
    assert cor["l1"].noise == pytest.approx(raw["l1"].noise / stats.c4(R) ** 2, rel=1e-12)
    assert cor["l1"].noise_raw == pytest.approx(raw["l1"].noise, rel=1e-12)
    assert cor["l1"].signal == raw["l1"].signal
    # nuclear: per-matrix corrected sqrt-traces, summed, squared. nuclear_dof='auto':
    # 'columns' (other_dim = the longer side) for R = 2, 'gauss-sums' for R >= 3
    mats = [p for p, s in enumerate(SHAPES) if len(s) == 2]
    tot, tot_col, tot_data = 0.0, 0.0, 0.0
    for p in mats:
        cov = reference.row_covariance([r[p] for r in rg], B)
        ev = torch.linalg.eigvalsh(cov)
        col = float(stats.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=max(SHAPES[p])))
        tot_col += col
        x = torch.stack([r[p] for r in rg])
        x = x if SHAPES[p][0] <= SHAPES[p][1] else x.mT
        if R >= 3:
            nu = gauss_sums_dof_reference(x)
            tot += float(stats.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu / (R - 1)))
        else:
            tot += col
        if R >= 4:
            nu_d = stats.nuclear_dof_from_samples(x)
            tot_data += float(stats.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu_d / (R - 1)))
    assert cor["nuclear"].noise == pytest.approx(tot**2, rel=1e-9)
    assert cor["nuclear"].nuclear_dof == ("gauss-sums" if R >= 3 else "columns")
    assert gk.estimate(rg, B, "nuclear", nuclear_dof="columns").noise == pytest.approx(tot_col**2, rel=1e-9)
    # the default is 'auto' (what the DDP hook computes)
    assert gk.estimate(rg, B, "nuclear").noise == pytest.approx(tot**2, rel=1e-9)
    if R >= 3:
        assert gk.estimate(rg, B, "nuclear", nuclear_dof="gauss-sums").noise == pytest.approx(tot**2, rel=1e-9)
    else:
        with pytest.raises(ValueError, match="nuclear_dof: 'gauss-sums' needs at least 3"):
            gk.estimate(rg, B, "nuclear", nuclear_dof="gauss-sums")
    if R >= 4:
        assert gk.estimate(rg, B, "nuclear", nuclear_dof="data").noise == pytest.approx(tot_data**2, rel=1e-9)
    assert cor["nuclear"].noise > raw["nuclear"].noise
    assert cor["nuclear"].noise_raw == pytest.approx(raw["nuclear"].noise, rel=1e-12)
    assert cor["nuclear"].signal == raw["nuclear"].signal


def test_signal_unbiased(seed):
    rg = _rank_grads(4, SHAPES, seed)
    e = gk.estimate(rg, 16, "l2")
    assert e.signal_unbiased == pytest.approx(e.signal - e.noise / 16, rel=1e-14)
    assert e.gns_unbiased_signal == pytest.approx(e.noise / e.signal_unbiased, rel=1e-14)
    assert gk.estimate(rg, 16, "l1").signal_unbiased is None
    assert gk.estimate(rg, 16, "nuclear").signal_unbiased is None


def test_l2_signal_unbiased_statistically():
    # E||g||^2 = ||mu||^2 + tr(Sigma)/B: the raw signal is biased up, signal_unbiased is not
    gen = torch.Generator().manual_seed(5)
    mu = torch.randn(40, generator=gen, dtype=torch.float64) * 0.2
    sd = torch.rand(40, generator=gen, dtype=torch.float64) + 0.5
    R, b, draws = 4, 8, 4000
    x = mu + sd * torch.randn(draws, R, 40, generator=gen, dtype=torch.float64) / math.sqrt(b)
    raw, unb = [], []
    for t in range(0, draws):
        e = gk.estimate([[x[t, j]] for j in range(R)], R * b, "l2")
        raw.append(e.signal)
        unb.append(e.signal_unbiased)
    truth = float((mu * mu).sum())
    for vals, biased in ((raw, True), (unb, False)):
        v = torch.tensor(vals)
        m, se = float(v.mean()), float(v.std() / math.sqrt(draws))
        if biased:
            assert m - 4 * se > truth
        else:
            assert abs(m - truth) < 4 * se


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
def test_float32_inputs_and_dtype(geometry, seed):
    rg64 = _rank_grads(3, SHAPES, seed)
    rg32 = [[t.float() for t in r] for r in rg64]
    noise, signal = reference.raw_gns(rg32, 9, geometry)
    e64 = gk.estimate(rg32, 9, geometry, bias_correction=False)
    assert e64.noise == pytest.approx(noise, rel=1e-6 if geometry == "nuclear" else 1e-10)
    e32 = gk.estimate(rg32, 9, geometry, bias_correction=False, dtype=torch.float32)
    assert e32.noise == pytest.approx(noise, rel=1e-4)
    assert e32.signal == pytest.approx(signal, rel=1e-4)


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
def test_shift_changes_only_rounding_in_float64(geometry, seed):
    rg = _rank_grads(4, SHAPES, seed)
    g = torch.Generator().manual_seed(3)
    shift = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    shift[1] = None
    a = gk.estimate(rg, 12, geometry)
    b = gk.estimate(rg, 12, geometry, shift=shift)
    assert b.noise == pytest.approx(a.noise, rel=1e-9)
    assert b.signal == pytest.approx(a.signal, rel=1e-12)


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
def test_float32_accuracy_with_and_without_shift(geometry):
    # per-coordinate noise std 1e-4 of the signal (the subtraction formula mean(x^2) - mean(x)^2
    # would lose about 8 of float32's 7 digits here); shift within 1e-3 relative of the mean
    # gradient (like a momentum buffer). The centered two-pass form keeps both within 1e-5 of
    # the float64 oracle on the same float32 data.
    R, B = 4, 64
    gen = torch.Generator().manual_seed(11)
    shapes = [(24, 40), (40, 24), (100,)]
    errs_plain, errs_shift = [], []
    for trial in range(4):
        mean = [1.0 + torch.rand(s, generator=gen, dtype=torch.float64) for s in shapes]
        rg64 = [[mu + 1e-4 * mu * torch.randn(s, generator=gen, dtype=torch.float64) for mu, s in zip(mean, shapes)]
                for _ in range(R)]
        rg = [[t.float() for t in r] for r in rg64]
        gbar = [torch.stack([r[p] for r in rg]).double().mean(0) for p in range(len(shapes))]
        shift = [(g * (1 + 1e-3 * torch.randn(g.shape, generator=gen, dtype=torch.float64))).float() for g in gbar]
        truth, _ = reference.raw_gns(rg, B, geometry)  # float64 oracle on the same float32 data
        plain = gk.estimate(rg, B, geometry, bias_correction=False, dtype=torch.float32)
        shifted = gk.estimate(rg, B, geometry, bias_correction=False, shift=shift, dtype=torch.float32)
        errs_plain.append(abs(plain.noise / truth - 1) if plain.valid else math.inf)
        errs_shift.append(abs(shifted.noise / truth - 1) if shifted.valid else math.inf)
    assert max(errs_plain) < 1e-5 and max(errs_shift) < 1e-5, (errs_plain, errs_shift)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
@pytest.mark.parametrize("shift", [False, True])
def test_non_finite_is_invalid(bad, geometry, shift):
    rg = _rank_grads(3, SHAPES, 1)
    rg[2][0][1, 2] = float(bad)
    sh = [torch.zeros(s, dtype=torch.float64) for s in SHAPES] if shift else None
    for corr in (True, False):
        e = gk.estimate(rg, 6, geometry, bias_correction=corr, shift=sh)
        assert e.valid is False
        assert math.isnan(e.gns) and math.isnan(e.noise) and math.isnan(e.signal)
        if geometry == "l2":
            assert math.isnan(e.signal_unbiased)
            assert math.isnan(e.gns_unbiased_signal)


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
def test_zero_signal_is_invalid(geometry):
    rg = [[torch.ones(3, 4, dtype=torch.float64)], [-torch.ones(3, 4, dtype=torch.float64)]]
    e = gk.estimate(rg, 4, geometry)
    assert not e.valid and math.isnan(e.gns)
    # identical samples: zero noise, valid, gns 0
    for R in (2, 4):  # R = 4: the data-driven nuclear dof sees zero variance (no correction)
        e = gk.estimate([[torch.ones(3, 4)]] * R, 2 * R, geometry)
        assert e.valid and e.gns == 0.0 and e.noise == 0.0


def test_bad_input():
    ok = _rank_grads(3, [(4, 5), (3,)], 0)
    with pytest.raises(ValueError, match="rank_grads: empty"):
        gk.estimate([], 8, "l1")
    with pytest.raises(ValueError, match="at least 2 samples"):
        gk.estimate(ok[:1], 8, "l1")
    with pytest.raises(ValueError, match=r"rank_grads\[0\]: empty"):
        gk.estimate([[], []], 8, "l1")
    with pytest.raises(ValueError, match="no elements"):
        gk.estimate([[torch.ones(0)], [torch.ones(0)]], 8, "l1")
    with pytest.raises(ValueError, match=r"rank_grads\[1\]\[0\]: shape"):
        gk.estimate([ok[0], [torch.ones(5, 4), ok[1][1]], ok[2]], 9, "l1")
    with pytest.raises(ValueError, match=r"rank_grads\[2\]: has 1 tensors"):
        gk.estimate([ok[0], ok[1], ok[2][:1]], 9, "l1")
    with pytest.raises(ValueError, match=r"rank_grads\[1\]\[1\]: expected a tensor"):
        gk.estimate([ok[0], [ok[1][0], 3.0], ok[2]], 9, "l1")
    with pytest.raises(ValueError, match="rank_grads: expected a list"):
        gk.estimate(torch.ones(3, 4), 9, "l1")
    with pytest.raises(ValueError, match="geometry"):
        gk.estimate(ok, 9, "l3")
    with pytest.raises(ValueError, match="batch_size: expected at least the number of samples"):
        gk.estimate(ok, 2, "l1")
    with pytest.raises(ValueError, match="batch_size: expected a multiple"):
        gk.estimate(ok, 10, "l1")
    with pytest.raises(ValueError, match="batch_size"):
        gk.estimate(ok, float("nan"), "l1")
    with pytest.raises(ValueError, match="batch_size"):
        gk.estimate(ok, "many", "l1")
    with pytest.raises(ValueError, match="dtype"):
        gk.estimate(ok, 9, "l1", dtype=torch.int32)
    with pytest.raises(ValueError, match="bias_correction"):
        gk.estimate(ok, 9, "l1", bias_correction="yes")
    with pytest.raises(ValueError, match="shift: expected 2 tensors"):
        gk.estimate(ok, 9, "l1", shift=[torch.zeros(4, 5)])
    with pytest.raises(ValueError, match=r"shift\[0\]: expected None or a tensor of shape \(4, 5\)"):
        gk.estimate(ok, 9, "l1", shift=[torch.zeros(5, 4), None])
    with pytest.raises(ValueError, match="nuclear"):
        gk.estimate([[torch.ones(3)], [torch.zeros(3)]], 4, "nuclear")
    with pytest.raises(ValueError, match="nuclear_dof"):
        gk.estimate(ok, 9, "nuclear", nuclear_dof="wishart")
    with pytest.raises(ValueError, match="nuclear_dof: 'data' needs at least 4"):
        gk.estimate(ok, 9, "nuclear", nuclear_dof="data")
    # a bare tensor per sample is a one-parameter list
    e = gk.estimate([torch.ones(3, 4), torch.zeros(3, 4)], 4, "nuclear")
    assert e.valid


def test_estimate_from_stats():
    e = estimate_from_stats("l1", torch.tensor(3.0), 2.0, 4, 16, True)
    assert e.noise == pytest.approx((3.0 / stats.c4(4)) ** 2, rel=1e-14)
    assert e.signal == 4.0 and e.noise_raw == 9.0 and e.valid
    e = estimate_from_stats("l1", 3.0, 2.0, 4, 16, False)
    assert e.noise == 9.0 and e.gns == 9.0 / 4.0
    e = estimate_from_stats("l2", 3.0, 2.0, 4, 16)
    assert (e.noise, e.signal, e.signal_unbiased) == (3.0, 2.0, 2.0 - 3.0 / 16)
    e = estimate_from_stats("nuclear", 3.0, 2.0, 4, 16, True, noise_uncorrected_sum=2.5)
    assert (e.noise, e.signal, e.noise_raw) == (9.0, 4.0, 6.25)
    for n, s in ((float("nan"), 1.0), (1.0, float("inf")), (1.0, 0.0), (1.0, -1.0), (-1.0, 1.0),
                 (torch.tensor(float("nan")), 1.0)):
        e = estimate_from_stats("l2", n, s, 2, 4)
        assert not e.valid and math.isnan(e.gns) and math.isnan(e.noise) and math.isnan(e.signal)
    with pytest.raises(ValueError, match="num_samples"):
        estimate_from_stats("l1", 1.0, 1.0, 1, 4)
    with pytest.raises(ValueError, match="geometry"):
        estimate_from_stats("l0", 1.0, 1.0, 2, 4)
    with pytest.raises(ValueError, match="scalar"):
        estimate_from_stats("l1", torch.ones(2), 1.0, 2, 4)


def test_critical_batch_size_closed_forms():
    cbs = gk.critical_batch_size
    assert cbs(100.0, "l2") == pytest.approx(100.0)  # kappa = 1/2: B = GNS
    assert cbs(100.0, "l2", kappa=0.8) == pytest.approx(400.0)
    assert cbs(100.0, "l1", kappa=0.25) == pytest.approx(400.0)  # (1/(1-1/2))^2 = 4
    assert cbs(100.0, "nuclear") == pytest.approx(100.0 / (1 - math.sqrt(0.5)) ** 2)
    theta = 0.6  # kappa = (1 - theta)^2 recovers B = GNS / theta^2
    assert cbs(50.0, "l1", kappa=(1 - theta) ** 2) == pytest.approx(50.0 / theta**2)
    assert cbs(90.0, "l1", "inflection") == pytest.approx(160.0)
    assert cbs(90.0, "nuclear", "efficiency") == pytest.approx(360.0)
    # the rules are the stated points of f(B) = (1 - sqrt(GNS/B))^2
    G = 7.0
    f = lambda B: (1 - math.sqrt(G / B)) ** 2  # noqa: E731
    assert f(cbs(G, "l1", kappa=0.3)) == pytest.approx(0.3)
    Bi, h = cbs(G, "l1", "inflection"), 1e-3
    assert (f(Bi + h) - 2 * f(Bi) + f(Bi - h)) / h**2 == pytest.approx(0.0, abs=1e-6)
    Be = cbs(G, "l1", "efficiency")
    assert f(Be) / Be > max(f(Be * 1.01) / (Be * 1.01), f(Be * 0.99) / (Be * 0.99))
    est = gk.estimate([[torch.ones(3)], [torch.ones(3) * 2]], 4, "l1")
    assert cbs(est, "l1", "efficiency") == pytest.approx(4 * est.gns)
    with pytest.raises(ValueError, match="undefined for geometry 'l2'"):
        cbs(1.0, "l2", "inflection")
    with pytest.raises(ValueError, match="undefined for geometry 'l2'"):
        cbs(1.0, "l2", "efficiency")
    with pytest.raises(ValueError, match="kappa"):
        cbs(1.0, "l1", kappa=1.0)
    with pytest.raises(ValueError, match="rule"):
        cbs(1.0, "l1", "median")
    with pytest.raises(ValueError, match="gns"):
        cbs(-1.0, "l1")
    with pytest.raises(ValueError, match="geometry"):
        cbs(1.0, "linf")
    assert math.isnan(cbs(float("nan"), "l1"))


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
@pytest.mark.parametrize("far", [1e8, 1e10])
def test_far_shift_keeps_float64_accuracy(geometry, far, seed):
    # unit-scale gradients, a shift 1e8 / 1e10 away: the centered two-pass variance loses
    # only about eps * |g - S| / sigma (<= 1e-5 relative here), not (|g - S| / sigma)^2 * eps
    rg = _rank_grads(4, SHAPES, seed)
    shift = [torch.full(s, far, dtype=torch.float64) for s in SHAPES]
    a = gk.estimate(rg, 12, geometry, bias_correction=False)
    b = gk.estimate(rg, 12, geometry, bias_correction=False, shift=shift)
    noise, signal = reference.raw_gns(rg, 12, geometry)
    assert a.noise == pytest.approx(noise, rel=1e-6 if geometry == "nuclear" else 1e-12)
    assert b.valid and b.noise == pytest.approx(noise, rel=1e-4 * far / 1e10 + 1e-6)
    assert b.signal == pytest.approx(signal, rel=1e-4 * far / 1e10 + 1e-6)


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
def test_same_bits_for_one_and_two_threads(geometry, seed):
    # sizes past torch's parallel grain (32768 elements), where a plain .sum() splits its
    # work by the thread count and changes its last bits
    g = torch.Generator().manual_seed(seed)
    shapes = [(300001,), (64, 200)]
    rg = [[torch.randn(s, generator=g, dtype=torch.float64) + 0.3 for s in shapes] for _ in range(4)]
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            e = gk.estimate(rg, 8, geometry)
            got.append((e.noise, e.signal, e.noise_raw))
    finally:
        torch.set_num_threads(before)
    assert got[0] == got[1]


def test_fixed_order_sum_is_the_sum(seed):
    from gns_kernels.ops import fixed_order_sum
    g = torch.Generator().manual_seed(seed)
    for n in (0, 1, 4095, 4096, 4097, 3 * 4096 * 4096 + 5):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        want = math.fsum(x.tolist()) if n < 10**6 else float(x.sum())
        assert float(fixed_order_sum(x)) == pytest.approx(want, rel=1e-12, abs=1e-9)


def test_estimate_step_field():
    rg = _rank_grads(3, SHAPES, 1)
    assert gk.estimate(rg, 6, "l2").step is None
    e = estimate_from_stats("l2", 2.0, 1.0, 3, 6, step=7)
    assert e.step == 7 and e.gns == 2.0
    assert estimate_from_stats("l2", float("nan"), 1.0, 3, 6, step=7).step == 7
    with pytest.raises(TypeError, match="step"):
        estimate_from_stats("l2", 2.0, 1.0, 3, 6, step=1.5)


def test_overflowing_gns_is_invalid():
    e = estimate_from_stats("l2", 1e300, 1e-300, 2, 2)
    assert e.valid is False and math.isnan(e.gns)


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
def test_empty_matrices_are_skipped(geometry, seed):
    # a 0 x n parameter holds nothing: the estimate equals the one without it
    rg = _rank_grads(3, SHAPES, seed)
    with_empty = [[torch.zeros(0, 5, dtype=torch.float64), *r, torch.zeros(4, 0, dtype=torch.float64)] for r in rg]
    a, b = gk.estimate(rg, 9, geometry), gk.estimate(with_empty, 9, geometry)
    assert b.valid and b.noise == pytest.approx(a.noise, rel=1e-12) and b.signal == pytest.approx(a.signal, rel=1e-12)


def test_only_empty_matrices_nuclear_error():
    rg = [[torch.zeros(0, 5), torch.ones(3)], [torch.zeros(0, 5), torch.zeros(3)]]
    with pytest.raises(ValueError, match="non-empty 2-D tensor"):
        gk.estimate(rg, 2, "nuclear")


# ----------------------------------------------------------------------------- signal='debiased'
@pytest.mark.parametrize("R", [2, 3, 5])
def test_debiased_signals_against_float64_references(R, seed):
    rg = _rank_grads(R, SHAPES, seed, offset=0.2)
    B = 4 * R
    scale = B / (R - 1)
    # l1: sum_i sqrt(max(g_i^2 - s2_i / B, 0)), coordinate by coordinate
    deb = 0.0
    for p in range(len(SHAPES)):
        x = torch.stack([r[p] for r in rg]).reshape(R, -1)
        for i in range(x.shape[1]):
            col = [float(v) for v in x[:, i]]
            g = sum(col) / R
            s2 = scale * sum((v - g) ** 2 for v in col) / R
            deb += math.sqrt(max(g * g - s2 / B, 0.0))
    e1 = gk.estimate(rg, B, "l1", signal="debiased")
    r1 = gk.estimate(rg, B, "l1")
    assert e1.signal_kind == "debiased" and r1.signal_kind == "raw"
    assert e1.signal == pytest.approx(deb**2, rel=1e-10)
    assert e1.signal_raw == pytest.approx(r1.signal, rel=1e-12) and e1.noise == r1.noise
    assert e1.gns == pytest.approx(e1.noise / deb**2, rel=1e-10)
    # l2: ||g||^2 - sum s2 / B (the unbiased signal)
    e2 = gk.estimate(rg, B, "l2", signal="debiased")
    r2 = gk.estimate(rg, B, "l2")
    if r2.signal_unbiased > 0:
        assert e2.valid and e2.signal == pytest.approx(r2.signal - r2.noise / B, rel=1e-10)
    else:
        assert not e2.valid and math.isnan(e2.gns)
    # nuclear: tr((G G^T - C / B)_+^{1/2}) per matrix on the smaller side, float64 eigvalsh
    tot = 0.0
    for p, s in enumerate(SHAPES):
        if len(s) != 2:
            continue
        x = torch.stack([r[p] for r in rg]).to(torch.float64)
        if s[0] > s[1]:
            x = x.mT
        g = x.mean(0)
        C = scale * sum((x[j] - g) @ (x[j] - g).T for j in range(R)) / R
        ev = torch.linalg.eigvalsh(g @ g.T - C / B)
        tot += float(ev.clamp_min(0).sqrt().sum())
    en = gk.estimate(rg, B, "nuclear", signal="debiased")
    rn = gk.estimate(rg, B, "nuclear")
    assert en.signal == pytest.approx(tot**2, rel=1e-9)
    assert en.noise == rn.noise and en.signal_raw == pytest.approx(rn.signal, rel=1e-12)
    assert en.signal < rn.signal  # the noise is taken out


def test_signal_argument_checked():
    ok = [[torch.randn(4, 5)], [torch.randn(4, 5)]]
    with pytest.raises(ValueError, match="signal: expected 'raw'.*'debiased', got 'unbiased'"):
        gk.estimate(ok, 8, "l1", signal="unbiased")
    with pytest.raises(ValueError, match="signal_debiased_sum"):
        estimate_from_stats("l1", 1.0, 2.0, 2, 8, signal="debiased")


@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
@pytest.mark.parametrize("signal", ["raw", "debiased"])
def test_non_finite_never_a_finite_gns_with_gauss_sums(geometry, signal):
    rg = _rank_grads(4, SHAPES, 7)
    rg[2][0] = rg[2][0].clone()
    rg[2][0][1, 1] = float("nan")
    e = gk.estimate(rg, 8, geometry, signal=signal)
    assert not e.valid and math.isnan(e.gns) and math.isnan(e.noise) and math.isnan(e.signal)

