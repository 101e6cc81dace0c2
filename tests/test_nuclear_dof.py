"""gns_kernels.nuclear_dof: hook-computable dof estimates, jackknife, bias-reduced signals.

Exact algebra in float64 against independent formulas; statistical checks on Gaussian /
heavy-tailed draws with known moments (fixed seeds, margins >= 4 standard errors).
"""
import math

import pytest
import torch

from gns_kernels import reference, stats

f64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ exact algebra


@pytest.mark.parametrize("shape", [(5, 11), (11, 5), (7, 7)])
def test_per_sample_quartic_sums_match_direct_formulas(shape):
    d = torch.randn(4, *shape, generator=_gen(1), dtype=f64)
    q, a = stats.per_sample_quartic_sums(d)
    for j in range(4):
        # the other Gram side gives the same Frobenius norm
        other = d[j].mT @ d[j]
        assert q[j].item() == pytest.approx(float((other * other).sum()), rel=1e-12)
        assert a[j].item() == pytest.approx(float((d[j] ** 2).sum()) ** 2, rel=1e-12)


def test_hook_sums_equal_all_samples_at_once():
    """Each sample forms its scalars from its own deviation; summed, with the Gram taken
    from the estimator's reduced covariance, they give the all-at-once result."""
    R, m, n, b = 5, 6, 13, 4
    B = R * b
    x = torch.randn(R, m, n, generator=_gen(2), dtype=f64) * torch.linspace(0.5, 2, n, dtype=f64)
    G = x.mean(0)
    sq, sa = 0.0, 0.0
    for j in range(R):  # what sample j computes once the mean is known
        q, a = stats.per_sample_quartic_sums(x[j] - G)
        sq, sa = sq + q, sa + a
    C = reference.row_covariance(list(x), B)  # B/(R-1) (mean_j G^j G^jT - G G^T)
    M = R * (R - 1) / B * C
    nu_hook = stats.dof_from_sample_sums(sq, sa, torch.trace(M), (M * M).sum(), R)
    nu_all = stats.dof_from_samples_gaussian(x[None])[0]
    assert nu_hook.item() == pytest.approx(nu_all.item(), rel=1e-10)
    # transposed input (m > n) uses the smaller side and gives the same value
    assert stats.dof_from_samples_gaussian(x.mT[None])[0].item() == pytest.approx(nu_all.item(), rel=1e-10)


def test_loo_gram_and_sum_sq_equal_recomputation():
    R, m, n = 6, 4, 9
    x = torch.randn(R, m, n, generator=_gen(3), dtype=f64)
    d = x - x.mean(0)
    M = (d @ d.mT).sum(0)
    ssq = (d * d).sum(0)
    for j in range(R):
        rest = torch.cat([x[:j], x[j + 1:]])
        e = rest - rest.mean(0)
        assert torch.allclose(stats.loo_gram(M, d[j], R), (e @ e.mT).sum(0), rtol=1e-12, atol=1e-12)
        assert torch.allclose(stats.loo_gram(M, d[j].mT, R), (e @ e.mT).sum(0), rtol=1e-12, atol=1e-12)
        assert torch.allclose(stats.loo_sum_sq(ssq, d[j], R), (e * e).sum(0), rtol=1e-12, atol=1e-12)


def test_gram_pair_moments_algebra():
    a = torch.randn(3, 5, 5, generator=_gen(4), dtype=f64)
    b = torch.randn(3, 5, 5, generator=_gen(5), dtype=f64)
    a, b = a @ a.mT, b @ b.mT
    num, var = stats.gram_pair_moments(a, b)
    for i in range(3):
        want_num = torch.trace(a[i]) * torch.trace(b[i]) + torch.trace(a[i] @ b[i])
        want_var = 0.5 * (torch.trace(a[i] @ a[i]) + torch.trace(b[i] @ b[i])) - torch.trace(a[i] @ b[i])
        assert num[i].item() == pytest.approx(want_num.item(), rel=1e-12)
        assert var[i].item() == pytest.approx(want_var.item(), rel=1e-10)
    nu = stats.dof_from_gram_pair(a, b)
    assert torch.allclose(nu, num / var, rtol=1e-12)
    assert stats.dof_from_gram_pair(a, a).isinf().all()  # identical estimates: no correction


def test_jackknife_combination():
    assert stats.jackknife(2.0, 3.0, 4) == pytest.approx(3 * 2.0 - 2 * 3.0)
    # an estimator with bias exactly a/(R-1) becomes unbiased
    theta, a, R = 1.7, -0.3, 5
    assert stats.jackknife(theta + a / (R - 1), theta + a / (R - 2), R) == pytest.approx(theta, rel=1e-14)


def test_nuclear_signal_debiased_closed_forms():
    g = torch.randn(1, 17, generator=_gen(6), dtype=f64)  # m = 1: sqrt(max(||g||^2 - C/B, 0))
    C = torch.tensor([[3.0]], dtype=f64)
    want = math.sqrt(max(float((g * g).sum()) - 3.0 / 8, 0.0))
    assert stats.nuclear_signal_debiased(g, C, 8).item() == pytest.approx(want, rel=1e-12)
    G = torch.randn(4, 9, generator=_gen(7), dtype=f64)
    Cs = torch.eye(4, dtype=f64) * 0.1
    A = G @ G.mT - Cs / 5
    assert torch.linalg.eigvalsh(A).min() > 0
    assert stats.nuclear_signal_debiased(G, Cs, 5).item() == pytest.approx(reference.sqrt_trace(A).item(), rel=1e-10)
    # m > n: the column side
    assert stats.nuclear_signal_debiased(G.mT, Cs, 5).item() == pytest.approx(reference.sqrt_trace(A).item(), rel=1e-10)
    # zero noise: the nuclear norm
    assert stats.nuclear_signal_debiased(G, torch.zeros(4, 4, dtype=f64), 5).item() == pytest.approx(
        reference.nuclear_norm(G).item(), rel=1e-10)


def test_l1_signals_closed_forms():
    g = torch.tensor([3.0, -0.1, 0.0, -2.0, 0.5], dtype=f64)
    s2 = torch.tensor([4.0, 4.0, 1.0, 0.0, 1.0], dtype=f64)
    B = 4
    want = sum(math.sqrt(max(gi * gi - vi / B, 0.0)) for gi, vi in zip(g.tolist(), s2.tolist()))
    assert stats.l1_signal_debiased(g, s2, B).item() == pytest.approx(want, rel=1e-14)
    # folded: F(mu_hat) = |g| above the threshold tau sqrt(2/pi), 0 below, |g| when tau = 0
    tau = (s2 / B).sqrt()
    parts = []
    for gi, ti in zip(g.abs().tolist(), tau.tolist()):
        parts.append(stats.l1_signal_folded(torch.tensor([gi], dtype=f64), torch.tensor([ti * ti * B], dtype=f64), B).item())
    for gi, ti, mu in zip(g.abs().tolist(), tau.tolist(), parts):
        if ti == 0:
            assert mu == gi
        elif gi <= ti * math.sqrt(2 / math.pi):
            assert mu == 0.0
        else:
            folded = ti * math.sqrt(2 / math.pi) * math.exp(-mu * mu / (2 * ti * ti)) + mu * math.erf(mu / (ti * math.sqrt(2)))
            assert folded == pytest.approx(gi, rel=1e-10)
            assert 0 < mu < gi
    assert stats.l1_signal_folded(g, s2, B).item() == pytest.approx(sum(parts), rel=1e-12)


def test_pooled_dof_ema_matches_empirical_variance():
    """K = (1 + beta)/(1 - beta): the variance of a long EMA of iid values is 1/K of one."""
    assert stats.pooled_dof(3.0, count=8) == 24.0
    beta, n = 0.8, 4000
    v = torch.randn(n, 2000, generator=_gen(14), dtype=f64)
    ema = v[0].clone()
    for t in range(1, 200):
        ema = beta * ema + (1 - beta) * v[t]
    K = stats.pooled_dof(1.0, beta=beta)
    # variance of the EMA over 2000 independent chains against 1/K (relative SE ~ sqrt(2/2000))
    assert abs(ema.var().item() * K - 1.0) < 4 * math.sqrt(2 / 2000)
    with pytest.raises(ValueError, match="exactly one"):
        stats.pooled_dof(1.0)
    with pytest.raises(ValueError, match="beta"):
        stats.pooled_dof(1.0, beta=1.0)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="num_samples"):
        stats.dof_from_sample_sums(1.0, 1.0, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match="num_samples"):
        stats.jackknife(1.0, 1.0, 2)
    with pytest.raises(ValueError, match="C_t, C_s"):
        stats.gram_pair_moments(torch.eye(3), torch.eye(4))
    with pytest.raises(ValueError, match="s2"):
        stats.l1_signal_debiased(torch.zeros(3), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="batch_size"):
        stats.l1_signal_folded(torch.zeros(3), torch.zeros(3), 0)
    with pytest.raises(ValueError, match="C"):
        stats.nuclear_signal_debiased(torch.zeros(3, 5), torch.zeros(5, 5), 2)
    with pytest.raises(ValueError, match="samples"):
        stats.dof_from_samples_gaussian(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="M"):
        stats.loo_gram(torch.zeros(3, 3), torch.zeros(4, 5), 4)


def test_non_finite_gives_nan_not_a_finite_dof():
    assert stats.dof_from_sample_sums(float("nan"), 1.0, 2.0, 3.0, 4).isnan()
    assert stats.dof_from_moments(torch.tensor(1.0), torch.tensor(float("inf"))).isnan()
    x = torch.randn(1, 4, 3, 5, generator=_gen(8), dtype=f64)
    x[0, 1, 0, 0] = float("inf")
    assert stats.dof_from_samples_gaussian(x).isnan().all()


# ------------------------------------------------------------------ statistics


def _matrix_normal(draws, R, U_half, V_half, gen):
    m, n = U_half.shape[0], V_half.shape[0]
    Z = torch.randn(draws, R, m, n, generator=gen, dtype=f64)
    return U_half @ Z @ V_half.mT


def test_sample_sums_moments_unbiased_for_gaussian_with_correlated_columns():
    """numerator and var_f against the closed-form moments of matrix-normal samples
    y = A Z B^T (row cov U = A A^T, column cov V = B B^T): C1 = tr(V) U,
    Var_F(one sample) = mu4 - P1 = tr(U^2) tr(V^2) + tr(U)^2 tr(V^2)."""
    m, n, R, draws = 4, 9, 5, 20000
    A = torch.diag(torch.tensor([2.0, 1.0, 0.6, 0.3], dtype=f64))
    Bh = torch.linalg.cholesky(0.6 * torch.ones(n, n, dtype=f64) + 0.4 * torch.eye(n, dtype=f64))
    U, V = A @ A.mT, Bh @ Bh.mT
    x = _matrix_normal(draws, R, A, Bh, _gen(9))
    d = x - x.mean(1, keepdim=True)
    q, a = stats.per_sample_quartic_sums(d)
    M = (d @ d.mT).sum(1)
    num, var = stats.sample_sums_moments(q.sum(1), a.sum(1), torch.diagonal(M, dim1=-2, dim2=-1).sum(-1),
                                      (M * M).sum((-2, -1)), R)
    trU, trU2 = torch.trace(U).item(), torch.trace(U @ U).item()
    trV, trV2 = torch.trace(V).item(), torch.trace(V @ V).item()
    want_num = (trV * trU) ** 2 + trV**2 * trU2
    want_var = (trU2 * trV2 + trU**2 * trV2) / (R - 1)
    for est, want in ((num, want_num), (var, want_var)):
        se = est.std().item() / math.sqrt(draws)
        assert abs(est.mean().item() - want) < 4 * se, (est.mean().item(), want, se)
    # and var_f matches the empirical Frobenius error of M / (R-1)
    C1 = trV * U
    emp = ((M / (R - 1) - C1) ** 2).sum((-2, -1))
    se = math.sqrt(emp.var().item() / draws + var.var().item() / draws)
    assert abs(emp.mean().item() - var.mean().item()) < 4 * se
    # correlated columns: the true dof is far below the 'columns' model n
    nu_true = want_num / want_var
    assert nu_true < 0.5 * (R - 1) * n


def test_gram_pair_var_f_unbiased_heavy_tailed():
    """1/2 ||C_t - C_s||^2 is unbiased for E||C_hat - C||^2 for any distribution:
    rank-one per-example gradients r x^T with Student-t(5) x, averaged over b = 3."""
    m, n, R, b, draws = 3, 6, 4, 3, 40000
    gen = _gen(10)
    r = torch.randn(2, draws, R, b, m, 1, generator=gen, dtype=f64)
    t = torch.distributions.StudentT(5.0)
    torch.manual_seed(11)
    xx = t.sample((2, draws, R, b, 1, n)).to(f64)
    y = (r * xx).mean(3)  # (2, draws, R, m, n) rank means
    d = y - y.mean(2, keepdim=True)
    C = b * (d @ d.mT).sum(2) / (R - 1)  # single-example units; E C = E[r r^T] E[x^T x] = (n * 5/3) I
    C_true = n * 5.0 / 3.0 * torch.eye(m, dtype=f64)
    num, var = stats.gram_pair_moments(C[0], C[1])
    emp = 0.5 * (((C[0] - C_true) ** 2).sum((-2, -1)) + ((C[1] - C_true) ** 2).sum((-2, -1)))
    se = math.sqrt(var.var().item() / draws + emp.var().item() / draws)
    assert abs(var.mean().item() - emp.mean().item()) < 4 * se
    want_num = torch.trace(C_true).item() ** 2 + (C_true * C_true).sum().item()
    se = num.std().item() / math.sqrt(draws)
    assert abs(num.mean().item() - want_num) < 4 * se


def test_jackknife_l1_matches_closed_form_for_gaussian():
    """E[jackknife of ||s||_1] / ||sigma||_1 = (R-1) c4(R) - (R-2) c4(R-1) for Gaussian
    samples (each term exact), much closer to 1 than c4(R)."""
    R, b, P, draws = 4, 1, 50, 20000
    sigma = torch.linspace(0.2, 3.0, P, dtype=f64)
    x = torch.randn(draws, R, P, generator=_gen(12), dtype=f64) * sigma
    d = x - x.mean(1, keepdim=True)
    ssq = (d * d).sum(1)
    full = (b * ssq / (R - 1)).sqrt().sum(1)
    loo = torch.stack([(b * stats.loo_sum_sq(ssq, d[:, j], R).clamp_min(0) / (R - 2)).sqrt().sum(1)
                       for j in range(R)], 1).mean(1)
    jk = stats.jackknife(full, loo, R) / sigma.sum()
    want = (R - 1) * stats.c4(R) - (R - 2) * stats.c4(R - 1)
    se = jk.std().item() / math.sqrt(draws)
    assert abs(jk.mean().item() - want) < 4 * se
    assert abs(want - 1) < 0.25 * (1 - stats.c4(R))


def test_debiased_signals_reduce_the_bias():
    """g ~ N(mu, tau^2) per coordinate with tau known (s2 exact): both l1 signals and the
    nuclear signal are closer to the truth than the raw ones, and the folded estimate is
    unbiased to 4 SE where |mu| >= 4 tau (the folded mean is then |mu|)."""
    P, draws, B = 40, 4000, 16
    gen = _gen(13)
    mu = torch.linspace(-1.0, 1.0, P, dtype=f64)
    s2 = torch.full((P,), 4.0, dtype=f64)  # tau = 0.5
    g = mu + torch.randn(draws, P, generator=gen, dtype=f64) * 0.5
    raw = g.abs().sum(1).mean().item()
    # the signals sum over all elements: the mean over draws of per-draw sums is sum / draws
    deb = stats.l1_signal_debiased(g, s2.expand_as(g), B).item() / draws
    fold = stats.l1_signal_folded(g, s2.expand_as(g), B).item() / draws
    truth = mu.abs().sum().item()
    # the raw bias is 4.8 here; both reduce it (debiased over-corrects near mu ~ tau)
    assert abs(deb - truth) < 0.8 * abs(raw - truth)
    assert abs(fold - truth) < 0.5 * abs(raw - truth)
    big = torch.full((P,), 3.0, dtype=f64)
    gb = big + torch.randn(1000, P, generator=gen, dtype=f64) * 0.5
    fb = torch.stack([stats.l1_signal_folded(gb[i], s2, B) for i in range(1000)])
    se = fb.std().item() / math.sqrt(1000)
    assert abs(fb.mean().item() - 3.0 * P) < 4 * se
    # nuclear: G = mu + noise with row covariance C/B (C = c I, noise columns iid)
    m, n = 3, 8
    Mu = torch.zeros(m, n, dtype=f64)
    Mu[0, 0], Mu[1, 1] = 2.0, 1.0
    c = 0.5 * n
    Gs = Mu + torch.randn(draws, m, n, generator=gen, dtype=f64) * math.sqrt(c / n / B)
    Cm = c * torch.eye(m, dtype=f64)
    raw_n = torch.linalg.svdvals(Gs).sum(-1).mean().item()
    deb_n = stats.nuclear_signal_debiased(Gs, Cm.expand(draws, m, m), B).mean().item()
    assert abs(deb_n - 3.0) < 0.5 * abs(raw_n - 3.0)
