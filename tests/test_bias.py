"""Bias corrections: closed forms of c4 and of the nuclear correction, and statistical
tests of the corrected estimators against closed-form truths.

Statistical tests: fixed seeds; every assertion keeps a margin of 4 standard errors computed
from the draws. Problems (gns_kernels.demo.synthetic): Gaussian matrix noise and least
squares (rank-one per-example gradients r x^T), (m, n, local batch b) = (12, 32, 24).
"""
from __future__ import annotations

import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels import stats
from gns_kernels.demo.synthetic import GaussianMatrixNoise, LeastSquares

M, N, LOCAL_B = 12, 32, 24
DRAWS = 2000


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: intra-op threads only add contention on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------- closed forms


def test_c4_closed_forms():
    assert stats.c4(2) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-14)
    assert stats.c4(3) == pytest.approx(math.sqrt(math.pi) / 2, rel=1e-14)
    assert stats.c4(4) == pytest.approx(math.sqrt(2 / 3) * 2 / math.sqrt(math.pi), rel=1e-14)
    # asymptotic expansion 1 - 1/(4N) - 7/(32 N^2) + O(N^-3)
    n = 400
    assert stats.c4(n) == pytest.approx(1 - 1 / (4 * n) - 7 / (32 * n * n), abs=1e-7)
    assert stats.l1_noise_factor(2) ** 2 == pytest.approx(math.pi / 2, rel=1e-14)
    t = stats.c4_tensor(torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64))
    assert torch.allclose(t, torch.tensor([stats.c4(2), stats.c4(3), stats.c4(4)], dtype=torch.float64))


def test_c4_monte_carlo():
    # E[sample std] of R Gaussians = c4(R) sigma: a direct check independent of the Gamma formula
    g = torch.Generator().manual_seed(0)
    for R in (2, 5):
        x = torch.randn(200_000, R, generator=g, dtype=torch.float64) * 3.0
        sd = x.std(dim=1)
        mean, se = float(sd.mean()), float(sd.std() / math.sqrt(sd.numel()))
        assert abs(mean - 3.0 * stats.c4(R)) < 4 * se


@pytest.mark.parametrize("R", [2, 3, 9])
def test_bad_R(R):
    with pytest.raises(ValueError, match="R"):
        stats.c4(1)
    with pytest.raises(ValueError, match="R"):
        stats.l1_noise_factor(1.5)
    with pytest.raises(ValueError, match="num_samples"):
        stats.nuclear_sqrt_trace_corrected(torch.ones(3), 1)
    assert stats.l1_noise_factor(R) == pytest.approx(1 / stats.c4(R))


def _beta_loop(lam, nu):
    # the second-order bias, written as the explicit double sum of the derivation
    s = [math.sqrt(max(float(v), 0.0)) for v in lam]
    tot = 0.0
    for i in range(len(s)):
        tot += s[i] / 4.0  # i == j: E[D_ii^2] f''/2 = 2 lam^2/nu * lam^{-3/2}/8
        for j in range(len(s)):
            if i != j and s[i] + s[j] > 0:  # divided difference of f' = 1/(2 sqrt)
                tot += s[i] * s[j] / (4.0 * (s[i] + s[j]))
    return tot / nu


def test_nuclear_correction_formula():
    g = torch.Generator().manual_seed(1)
    lam = torch.rand(7, generator=g, dtype=torch.float64) * torch.tensor([5, 1, 1, 0.1, 0.01, 0, 2.0], dtype=torch.float64)
    R, other = 3, 11
    nu = (R - 1) * other
    raw = float(lam.sqrt().sum())
    k = 4 * nu * _beta_loop(lam.tolist(), nu) / raw
    expect = raw / stats.c4(nu / k + 1)
    got = stats.nuclear_sqrt_trace_corrected(lam, R, other_dim=other)
    assert float(got) == pytest.approx(expect, rel=1e-12)
    # 'rank_one' model: d = n b / (n + b)
    B = 3 * 5
    d = other * 5 / (other + 5)
    nu = (R - 1) * d
    k = 4 * nu * _beta_loop(lam.tolist(), nu) / raw
    got = stats.nuclear_sqrt_trace_corrected(lam, R, B, other_dim=other, dof_model="rank_one")
    assert float(got) == pytest.approx(raw / stats.c4(nu / k + 1), rel=1e-12)


def test_nuclear_correction_blocked(monkeypatch):
    g = torch.Generator().manual_seed(4)
    lam = torch.rand(3, 50, generator=g, dtype=torch.float64)
    whole = stats.nuclear_sqrt_trace_corrected(lam, 5, other_dim=60)
    monkeypatch.setattr(stats.bias, "_PAIR_BLOCK_ELEMS", 7 * 3 * 50)  # 7-row blocks
    blocked = stats.nuclear_sqrt_trace_corrected(lam, 5, other_dim=60)
    assert torch.allclose(blocked, whole, rtol=1e-13, atol=0)
    loop = [lam[b].sqrt().sum() / stats.c4(4 * 60 / (_beta_loop(lam[b].tolist(), 1.0) * 4 / float(lam[b].sqrt().sum())) + 1)
            for b in range(3)]
    assert torch.allclose(blocked, torch.stack(loop), rtol=1e-12)


def test_nuclear_correction_m1_is_c4():
    # one eigen-direction: exactly the c4 correction with nu = (R-1) d degrees of freedom
    for R, d in [(2, 1), (4, 3), (8, 32)]:
        got = stats.nuclear_sqrt_trace_corrected(torch.tensor([9.0], dtype=torch.float64), R, dof_per_sample=d)
        assert float(got) == pytest.approx(3.0 / stats.c4((R - 1) * d + 1), rel=1e-12)


def test_nuclear_correction_properties():
    g = torch.Generator().manual_seed(2)
    lam = torch.rand(4, 3, 9, generator=g, dtype=torch.float64)
    out = stats.nuclear_sqrt_trace_corrected(lam, 4, 64, other_dim=20)
    assert out.shape == (4, 3)
    loop = torch.stack([torch.stack([stats.nuclear_sqrt_trace_corrected(lam[i, j], 4, 64, other_dim=20)
                                     for j in range(3)]) for i in range(4)])
    assert torch.allclose(out, loop, rtol=1e-13, atol=0)
    raw = lam.sqrt().sum(-1)
    assert bool((out > raw).all())
    # homogeneous of degree 1/2 in the eigenvalues
    assert torch.allclose(stats.nuclear_sqrt_trace_corrected(4.0 * lam, 4, 64, other_dim=20), 2.0 * out, rtol=1e-12)
    # many degrees of freedom: no correction
    big = stats.nuclear_sqrt_trace_corrected(lam, 4, dof_per_sample=1e12)
    assert torch.allclose(big, raw, rtol=1e-9)
    # float32 in, float32 out, close to the float64 result
    o32 = stats.nuclear_sqrt_trace_corrected(lam.float(), 4, 64, other_dim=20)
    assert o32.dtype == torch.float32 and torch.allclose(o32.double(), out, rtol=1e-5)
    # negative rounding eigenvalues are clamped; zero matrix -> 0; NaN propagates
    neg = lam[0, 0].clone()
    neg[0] = -1e-9
    pos = neg.clamp_min(0)
    assert float(stats.nuclear_sqrt_trace_corrected(neg, 3)) == float(stats.nuclear_sqrt_trace_corrected(pos, 3))
    assert float(stats.nuclear_sqrt_trace_corrected(torch.zeros(5), 3)) == 0.0
    bad = lam[0, 0].clone()
    bad[2] = float("nan")
    assert math.isnan(float(stats.nuclear_sqrt_trace_corrected(bad, 3)))
    with pytest.raises(ValueError, match="dof_model"):
        stats.nuclear_sqrt_trace_corrected(lam, 3, dof_model="magic")
    with pytest.raises(ValueError, match="batch_size"):
        stats.nuclear_sqrt_trace_corrected(lam, 3, dof_model="rank_one")
    with pytest.raises(ValueError, match="dof_per_sample"):
        stats.nuclear_sqrt_trace_corrected(lam, 3, dof_per_sample=0)


# --------------------------------------------------------------------- statistical tests


@pytest.mark.parametrize("name", ["gaussian", "least_squares"])
def test_frobenius_variance_unbiased(name):
    # nuclear_frobenius_variance is unbiased for E||C_hat - C||_F^2 for any iid samples:
    # compare with the empirical mean of ||C_hat - C||_F^2 over the same draws (C known).
    problem = PROBLEMS[name]()
    R, b, draws = 5, 4, 4000
    G = problem.draw(R, b, draws, torch.Generator().manual_seed(7))
    dev = G - G.mean(dim=1, keepdim=True)
    C_hat = (dev @ dev.mT).sum(dim=1) / (R - 1)
    C = problem.C / b  # second moment of one sample's noise (a mean of b examples)
    direct = ((C_hat - C) ** 2).sum(dim=(-2, -1))
    est = stats.nuclear_frobenius_variance(G)
    diff = est - direct
    m, se = _mean_se(diff)
    assert abs(m) <= 4 * se, (m, se, float(direct.mean()))
    assert se < 0.1 * float(direct.mean())  # the test has power
    if name == "gaussian":  # Wishart with n dof: Var_F = ((tr C)^2 + tr C^2) / ((R-1) n)
        exact = (float(torch.trace(C)) ** 2 + float((C * C).sum())) / ((R - 1) * problem.n)
        me, see = _mean_se(est)
        assert abs(me - exact) <= 4 * see
    # shift invariance, batching and the R >= 4 requirement
    assert torch.allclose(stats.nuclear_frobenius_variance(G[:3] + 5.0), est[:3], rtol=1e-9)
    with pytest.raises(ValueError, match="R >= 4"):
        stats.nuclear_dof_from_samples(G[:, :3])
    nan = G[:2].clone()
    nan[0, 1, 0, 0] = float("nan")
    assert torch.isnan(stats.nuclear_dof_from_samples(nan)[0])
    assert torch.isfinite(stats.nuclear_dof_from_samples(nan)[1])


def _measure(problem, R: int, b: int, draws: int, seed: int) -> dict[str, torch.Tensor]:
    """Per draw: ||s||_1 raw / corrected, tr(C^1/2) raw / corrected, sum s2.

    Vectorised over draws: the covariances are formed here (two-pass, float64) and the
    corrections applied with the bias functions; test_estimate_applies_corrections checks
    that gk.estimate computes exactly these numbers draw by draw.
    """
    g = torch.Generator().manual_seed(seed)
    G = problem.draw(R, b, draws, g)  # (draws, R, m, n)
    B = R * b
    dev = G - G.mean(dim=1, keepdim=True)
    s2 = B / (R * (R - 1)) * (dev * dev).sum(dim=1)
    l1_raw = s2.sqrt().sum(dim=(-2, -1))
    C = B / (R * (R - 1)) * (dev @ dev.mT).sum(dim=1)
    ev = torch.linalg.eigvalsh(C)
    columns = stats.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=problem.n)
    if R >= 4:  # nuclear_dof='data': the data's own fourth moments
        nuc = stats.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=stats.nuclear_dof_from_samples(G) / (R - 1))
    else:
        nuc = columns
    return {
        "l1_raw": l1_raw,
        "l1": l1_raw * stats.l1_noise_factor(R),
        "nuc_raw": ev.clamp_min(0).sqrt().sum(-1),
        "nuc": nuc,
        "nuc_columns": columns,
        "l2": s2.sum(dim=(-2, -1)),
    }


@pytest.mark.parametrize("name", ["gaussian", "least_squares"])
def test_estimate_applies_corrections(name):
    problem = PROBLEMS[name]()
    for R in (2, 3, 5):
        d = _measure(problem, R, 6, 3, seed=R)
        G = problem.draw(R, 6, 3, torch.Generator().manual_seed(R))
        for t in range(3):
            rg = [[G[t, j]] for j in range(R)]
            e1, e2 = (gk.estimate(rg, 6 * R, geo) for geo in ("l1", "l2"))
            en = gk.estimate(rg, 6 * R, "nuclear", nuclear_dof="data" if R >= 4 else "columns")
            assert math.sqrt(e1.noise) == pytest.approx(float(d["l1"][t]), rel=1e-12)
            assert math.sqrt(e1.noise_raw) == pytest.approx(float(d["l1_raw"][t]), rel=1e-12)
            assert math.sqrt(en.noise) == pytest.approx(float(d["nuc"][t]), rel=1e-9)
            assert math.sqrt(en.noise_raw) == pytest.approx(float(d["nuc_raw"][t]), rel=1e-9)
            assert e2.noise == pytest.approx(float(d["l2"][t]), rel=1e-12)
            ec = gk.estimate(rg, 6 * R, "nuclear", nuclear_dof="columns")
            assert math.sqrt(ec.noise) == pytest.approx(float(d["nuc_columns"][t]), rel=1e-9)


def _mean_se(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std() / math.sqrt(x.numel()))


PROBLEMS = {
    "gaussian": lambda: GaussianMatrixNoise(M, N, seed=3),
    "least_squares": lambda: LeastSquares(M, N, seed=4, noise_std=1.0, delta_scale=1.0),
}


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("R", [2, 4, 8])
def test_corrected_noise_unbiased(name, R):
    problem = PROBLEMS[name]()
    d = _measure(problem, R, LOCAL_B, DRAWS, seed=10 * R + len(name))

    # l1: corrected ||s||_1 within 3% of ||sigma||_1 (4 standard errors inside the band)
    truth = problem.sigma_l1()
    mean, se = _mean_se(d["l1"])
    assert abs(mean / truth - 1) + 4 * se / truth <= 0.03, (mean / truth, se / truth)
    # ... while the raw one is biased by c4(R) (checks the test can fail)
    mean_raw, se_raw = _mean_se(d["l1_raw"])
    assert abs(mean_raw / truth - stats.c4(R)) + 4 * se_raw / truth <= 0.03

    # l2: unbiased, no correction
    truth2 = problem.trace()
    mean2, se2 = _mean_se(d["l2"])
    assert abs(mean2 - truth2) <= 4 * se2 + 1e-12 * truth2

    # nuclear: the corrected sqrt-trace removes at least a third of the raw bias at R = 2, 4
    # and is within 5% at R = 8.
    T = problem.sqrt_trace()
    mr, sr = _mean_se(d["nuc_raw"])
    mc, sc = _mean_se(d["nuc"])
    assert mr + 4 * sr < T, "raw nuclear noise is expected to be biased low"
    # the 'columns' model alone (what eigenvalue-only callers use) also removes a third
    dcm, dcs = _mean_se(d["nuc_columns"] - d["nuc_raw"])
    assert dcm - 4 * dcs >= (T - mr + 4 * sr) / 3.0, (mr / T, float(d["nuc_columns"].mean()) / T)
    if R in (2, 4):
        # removed = E[corr - raw] (paired draws: small standard error) is at least a third
        # of the raw bias T - E[raw], and the correction does not overshoot T by more than
        # two thirds of it; every expectation pushed 4 standard errors the bad way.
        dm, ds = _mean_se(d["nuc"] - d["nuc_raw"])
        assert dm - 4 * ds >= (T - mr + 4 * sr) / 3.0, (mr / T, mc / T)
        assert mc + 4 * sc - T <= (2.0 / 3.0) * (T - mr - 4 * sr), (mr / T, mc / T)
    else:
        assert abs(mc / T - 1) + 4 * sc / T <= 0.05, (mr / T, mc / T)
