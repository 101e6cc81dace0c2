"""gns_kernels.spectral.newton: the Newton-Schulz sqrt-trace, against float64 eigvalsh.

The result is defined as the eigenvalue path's: tr(A_+^{1/2}) = sum_i sqrt(max(lambda_i, 0)).
Bound: within 1e-3 of float64 eigvalsh relative to tr(|A|^{1/2}) (for PSD A: to the result).
"""
from __future__ import annotations

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref
from gns_kernels import spectral as sp
from _spectral_data import TOL, rand_psd, randn, rank_deficient, rel_err, with_eigenvalues


def newton_op(A, iters, project=True, eps=sp.NEWTON_EPS):
    return torch.ops.gns_kernels.newton_sqrt_trace(A, iters, eps, None, project)


def abs_sqrt_trace(A):
    """tr(|A|^{1/2}) in float64: the scale the indefinite bound is relative to."""
    return torch.linalg.eigvalsh(A.double()).abs().sqrt().sum(-1)


def test_iteration_counts():
    # newton_min_iters: the product p = y z of an eigenvalue eps/2 reaches 1 - 1e-7;
    # sign_iters: s = eps/2 reaches 1 - 1e-7; both with the scaled steps (about half the
    # plain iteration's 22 and 40 at eps = 1e-6)
    assert sp.newton_min_iters() == 12
    assert sp.sign_iters() == 21
    assert sp.newton_min_iters(1e-12) == 21
    assert sp.newton_min_iters(1e-2) < sp.newton_min_iters(1e-4) < sp.newton_min_iters(1e-6)
    assert sp.sign_iters(1e-2) < sp.sign_iters(1e-4) < sp.sign_iters(1e-6)


@pytest.mark.parametrize("lo", [1e-9, 7.07e-4, 0.1, 0.9])
def test_scaled_schedule_is_the_minimax_cubic(lo):
    """Each a_k is Chen-Chow's equioscillation factor (both ends of [l_k, 1] map to the same
    value) or the cap (the top maps to 1/2, not lower), keeps [l_k, 1] inside
    [l_{k+1}, 1] on a dense grid, and decreases to 1."""
    import math
    from gns_kernels.spectral.newton import scaled_schedule

    sched = scaled_schedule(lo)
    assert all(1.0 < a <= 1.5321 for a in sched)
    assert all(x >= y for x, y in zip(sched, sched[1:]))
    l = lo
    for a in sched:
        f = lambda s: 0.5 * a * s * (3.0 - a * a * s * s)  # noqa: E731
        capped = abs(a - 2.0 * math.cos(math.radians(40.0))) < 1e-12
        if capped:
            assert abs(f(1.0) - 0.5) < 1e-12
        else:
            assert abs(f(l) - f(1.0)) <= 1e-12
        new_l = min(f(l), f(1.0))
        grid = [l + (1.0 - l) * i / 2000 for i in range(2001)]
        vals = [f(s) for s in grid]
        assert min(vals) >= new_l - 1e-12 and max(vals) <= 1.0 + 1e-12
        assert new_l > 0.5 * l * (3.0 - l * l)  # the small end grows faster than the plain step
        l = new_l
    with pytest.raises(ValueError, match="lo"):
        scaled_schedule(0.0)


@pytest.mark.parametrize("eps", [1e-6, 1e-4, 1e-2])
def test_newton_converges_at_min_iters_on_the_extreme_eigenvalue(eps):
    """A float64 diagonal matrix with ||A||_F = 1 whose smallest eigenvalue is -eps/2 (a
    rounding-level negative eigenvalue: after the shift, M = A + eps I has eps/2, the
    bound the schedule is built for) and whose largest is near 1: at newton_min_iters the
    coupled iteration gives sqrt(lambda + eps) and its inverse within 1e-6 for each
    eigenvalue; at half that count it has not converged."""
    d = torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    d = d / d.norm()
    d[-1] = -eps / 2.0
    A = torch.diag(d).unsqueeze(0)
    from gns_kernels.spectral.newton import newton_iterate

    def sqrt_diag(k):
        Y, Z, e, c, eye = newton_iterate(A, k, eps, None, False, "float64")
        return torch.diagonal(Y[0]), torch.diagonal(Z[0]), c.reshape(()), e.reshape(())
    y, z, c, e = sqrt_diag(sp.newton_min_iters(eps))
    # the iteration runs on A / c + e I, c ~ 1 + eps (Frobenius normalization and the
    # shifted top), e = eps / (1 + eps)
    assert abs(float(c) - (1 + eps)) < 1e-4 and abs(float(e) - eps / (1 + eps)) < 1e-15
    want = (d / c + e).sqrt()
    assert ((y - want).abs() / want).max() < 1e-6
    assert ((z - 1 / want).abs() * want).max() < 1e-6
    y_early, *_ = sqrt_diag(sp.newton_min_iters(eps) // 2)
    assert ((y_early - want).abs() / want).max() > 1e-3


def _iteration_count_cases(gen):
    mats = [rand_psd(gen, 24, 1e6), rand_psd(gen, 24, 1e10), rank_deficient(gen, 24, 1),
            rank_deficient(gen, 24, 5), rand_psd(gen, 24, 1.0), torch.zeros(24, 24, dtype=torch.float64)]
    A = torch.stack(mats)
    return A, ref.sqrt_trace(A)


@pytest.mark.slow
def test_newton_every_allowed_iteration_count_is_finite_and_accurate(gen):
    """Every count in [newton_min_iters, 200] stays finite and within 1e-3."""
    A, want = _iteration_count_cases(gen)
    for k in range(sp.newton_min_iters(), sp.NEWTON_MAX_ITERS + 1):
        got = gk.sqrt_trace(A, "newton", iters=k).double()
        assert torch.isfinite(got).all(), k
        err = ((got - want).abs() / want.clamp_min(1e-300)).where(want > 0, got.abs())
        assert err.max() < TOL, (k, err)


def test_newton_iteration_counts_finite_accurate_and_bounded(gen):
    """A sample of the allowed counts (the slow test above sweeps all of them), the limits."""
    A, want = _iteration_count_cases(gen)
    kmin = sp.newton_min_iters()
    for k in (kmin, kmin + 1, kmin + 3, 50, 77, 128, sp.NEWTON_MAX_ITERS):
        got = gk.sqrt_trace(A, "newton", iters=k).double()
        assert torch.isfinite(got).all(), k
        err = ((got - want).abs() / want.clamp_min(1e-300)).where(want > 0, got.abs())
        assert err.max() < TOL, (k, err)
    for k in (kmin, 77):  # deterministic: the same bits twice
        assert torch.equal(gk.sqrt_trace(A, "newton", iters=k), gk.sqrt_trace(A, "newton", iters=k))
    # well below kmin the iteration has not converged for eigenvalues near eps: not allowed
    early = newton_op(A, kmin // 2 + 1).double()
    assert ((early - want).abs() / want.clamp_min(1e-300)).where(want > 0, early.abs()).max() > TOL
    with pytest.raises(ValueError, match="iters"):
        gk.sqrt_trace(A, "newton", iters=kmin - 1)
    with pytest.raises(ValueError, match="iters"):
        gk.sqrt_trace(A, "newton", iters=sp.NEWTON_MAX_ITERS + 1)
    with pytest.raises(ValueError, match="eps"):
        gk.sqrt_trace(A, "newton", eps=1e-9)


def test_newton_guard_keeps_indefinite_input_finite_without_projection(gen):
    """Without the positive-part step, negative eigenvalues far below -eps (not PSD even up
    to rounding) make the plain coupled iteration diverge; the guard freezes it: finite for
    every count."""
    A = rand_psd(gen, 16, 10.0) - 0.2 * torch.eye(16, dtype=torch.float64)
    for k in range(1, 61):
        assert torch.isfinite(newton_op(A, k, project=False)).all(), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_newton_indefinite_small_cases_match_eigh(gen, dtype):
    # eigenvalues {4, -4}: 2; {1, -0.5}: 1; {1, 1, -0.9}: 2 (negatives clamped)
    for lam, want in (([4.0, -4.0], 2.0), ([1.0, -0.5], 1.0), ([1.0, 1.0, -0.9], 2.0),
                      ([-1.0, -2.0], 0.0), ([-3.0], 0.0), ([2.0], 2.0 ** 0.5)):
        A = with_eigenvalues(gen, lam, dtype)
        for method in ("newton", "eigh"):
            got = gk.sqrt_trace(A, method)
            assert got.dtype == dtype
            scale = abs_sqrt_trace(A).item()
            assert abs(got.item() - want) <= TOL * scale, (lam, method, got.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", [1, 7, 33, 128])
def test_newton_random_indefinite_matches_float64_eigh(gen, dtype, m):
    # symmetric Gaussian (about half the eigenvalues negative), and PSD minus a multiple of I
    X = randn(gen, 3, m, m)
    A = torch.cat([(X + X.mT) / 2,
                   torch.stack([rand_psd(gen, m, 1e3) - 0.3 * torch.eye(m, dtype=torch.float64)])]).to(dtype)
    want = ref.sqrt_trace(A)  # float64 eigvalsh, negatives clamped
    got = gk.sqrt_trace(A, "newton")
    assert got.dtype == dtype
    err = (got.double() - want).abs() / abs_sqrt_trace(A)
    assert err.max() < TOL, err
    pos = want > 0.1 * abs_sqrt_trace(A)  # a substantial positive part: relative to the result too
    assert rel_err(got[pos], want[pos]) < 2 * TOL


def test_newton_indefinite_with_batch_and_nonfinite(gen):
    A = torch.stack([with_eigenvalues(gen, [4.0, -4.0, 1.0]), rand_psd(gen, 3, 10.0),
                     with_eigenvalues(gen, [-1.0, -1.0, -1.0])])
    bad = A.clone()
    bad[1, 0, 0] = float("nan")
    got = gk.sqrt_trace(bad, "newton")
    assert torch.isnan(got[1])
    want = ref.sqrt_trace(A)
    assert abs(got[0] - want[0]) < TOL * want[0] and abs(got[2]) < TOL


@pytest.mark.parametrize("scale", [1e-300, 1e-200, 1e-40, 1e40, 1e300])
def test_newton_float64_extreme_scales_not_zero(gen, scale):
    A = with_eigenvalues(gen, [3.0, 1.0, -2.0, 0.5]) * scale
    got = gk.sqrt_trace(A, "newton")
    assert got.dtype == torch.float64 and got.item() != 0.0 and torch.isfinite(got)
    want = ref.sqrt_trace(A)
    assert abs(got.item() - want.item()) <= TOL * abs_sqrt_trace(A).item()


def test_newton_projection_keeps_psd_results(gen):
    # PSD input: the positive-part step changes nothing beyond the budget
    A = torch.stack([rand_psd(gen, 40, 1e6), rank_deficient(gen, 40, 3)]).float()
    with_p, without = newton_op(A, 25, project=True), newton_op(A, 25, project=False)
    assert rel_err(with_p, without) < TOL
    assert rel_err(with_p, ref.sqrt_trace(A.double())) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_newton_without_projection_bounded_when_eigenvalues_fall_below_the_shift(gen, dtype):
    """project=False on input whose negative eigenvalues exceed the shift (1.5-5x eps of
    ||A||_F, outside the contract): the scaled steps must not let them blow up (a guard that
    froze only at r > 2 sqrt(m) returned 5118 for an exact 3.5); the result stays finite
    and within 20% of the clamped value, which the projection then makes exact."""
    m = 31
    Q, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    norm = (3 * 1.0 + 5 * 1e-4) ** 0.5
    for mult in (1.5, 2.3, 5.0):
        ev = torch.tensor([1.0] * 3 + [1e-2] * 5 + [-mult * 1e-6 * norm] * (m - 8), dtype=torch.float64)
        A = ((Q * ev) @ Q.T).to(dtype)
        exact = ev.clamp_min(0).sqrt().sum().item()
        got = newton_op(A.unsqueeze(0), sp.newton_min_iters() + 3, project=False).double()
        assert torch.isfinite(got).all() and abs(got.item() - exact) < 0.2 * exact, (mult, got.item())
        projected = newton_op(A.unsqueeze(0), sp.newton_min_iters() + 3, project=True).double()
        assert abs(projected.item() - exact) < TOL * exact, (mult, projected.item())
