"""Degrees of freedom nu of the nuclear covariance estimate from the samples' own fourth
moments: 'data' (no distributional assumption; needs cross-sample terms, so gk.estimate
only) and 'gauss-sums' (Gaussian rank means; per-sample sums a hook can form).

Notation as gns_kernels.stats.dof: R samples, d_j = x_j - mean_k x_k (m x n, smaller Gram
side as rows), M = sum_j d_j d_j^T, C = E y y^T, P1 = ||C||_F^2, T1 = (tr C)^2,
mu4 = E ||y y^T||_F^2, m4 = E (tr y y^T)^2. nu is matched in Frobenius norm,
E ||C_hat - C||_F^2 = (T1 + P1) / nu.

``nuclear_dof_from_samples`` (R >= 4; 'data')
    Var_F = E||C_hat - C||_F^2 estimated without bias from the four centred quartic sums of
    the samples (``nuclear_frobenius_variance``; exact linear combinations for iid samples,
    any distribution), and nu = ((tr C_hat)^2 + ||C_hat||_F^2 - Var_F) / Var_F.

``dof_from_sample_sums`` (R >= 3; one extra all-reduce of 2 floats per matrix)
    Each sample contributes q_j = ||d_j d_j^T||_F^2 and a_j = ||d_j||_F^4 (local, after the
    mean is known); Q = sum_j q_j, A = sum_j a_j. Assumption: Gaussian rank means. Then the
    R centred samples carry the same information as R - 1 iid copies of y, d_j is distributed
    as sqrt((R-1)/R) y, and
        E Q = (R-1)^2/R mu4,             E A = (R-1)^2/R m4,
        E ||M||_F^2 = (R-1) mu4 + (R-1)(R-2) P1,   E (tr M)^2 = (R-1) m4 + (R-1)(R-2) T1,
    so mu4, m4, P1, T1 have unbiased estimates, Var_F = (mu4 - P1)/(R-1) and
        nu = (R-1) (T1 + P1) / (mu4 - P1).
    Excess kurtosis of the rank means (rank-one per-example gradients averaged over b < m
    examples) is only partly seen by Q, so nu is then over-estimated (under-correction).
"""
from __future__ import annotations

import functools
import math

import torch

from .common import as_float64, check_loo_count, rows_side
from .dof import dof_from_moments

Tensor = torch.Tensor

__all__ = [
    "fourth_moment_system",
    "nuclear_frobenius_variance",
    "nuclear_dof_from_samples",
    "per_sample_quartic_sums",
    "sample_sums_moments",
    "dof_from_sample_sums",
    "dof_from_samples_gaussian",
]


@functools.lru_cache(maxsize=64)
def fourth_moment_system(R: int) -> tuple[Tensor, Tensor]:
    """Expectations of the four centred quartic sums in terms of (mu4, P1, P2, P3).

    With y_k iid (k < R), d_j = y_j - mean(y), Q(a, b, c, d) = tr(a b^T c d^T):
      S1 = sum_j Q(d_j, d_j, d_j, d_j)      S2 = sum_jk Q(d_j, d_j, d_k, d_k)
      S3 = sum_jk Q(d_j, d_k, d_j, d_k)     S4 = sum_jk Q(d_j, d_k, d_k, d_j)
    and mu4 = E Q(y,y,y,y), P1 = E Q(y1,y1,y2,y2) = tr(C^2), P2 = E Q(y1,y2,y1,y2),
    P3 = E Q(y1,y2,y2,y1) = tr(K^2) (K the column second moment). E[S] = A @ (mu4, P1, P2, P3).
    Returns (A, w) with w the weights of Var_F = E||C_hat - C||_F^2 = (mu4 - P1)/R +
    (P2 + P3)/(R (R-1)), C_hat = sum_j d_j d_j^T / (R-1).
    """
    c = torch.eye(R, dtype=torch.float64) - 1.0 / R

    def coef(pattern: str) -> list[float]:
        tot = [0.0, 0.0, 0.0, 0.0]
        pairs = [(j, k) for j in range(R) for k in range(R)] if "k" in pattern else [(j, j) for j in range(R)]
        for j, k in pairs:
            a, b, cc, d = (c[j] if p == "j" else c[k] for p in pattern)
            diag = float((a * b * cc * d).sum())
            tot[0] += diag
            tot[1] += float((a * b).sum() * (cc * d).sum()) - diag
            tot[2] += float((a * cc).sum() * (b * d).sum()) - diag
            tot[3] += float((a * d).sum() * (b * cc).sum()) - diag
        return tot

    A = torch.tensor([coef("jjjj"), coef("jjkk"), coef("jkjk"), coef("jkkj")], dtype=torch.float64)
    w = torch.tensor([1.0 / R, -1.0 / R, 1.0 / (R * (R - 1)), 1.0 / (R * (R - 1))], dtype=torch.float64)
    return A, w


def nuclear_frobenius_variance(samples: Tensor) -> Tensor:
    """Unbiased estimate of Var_F = E||C_hat - C||_F^2, C_hat = sum_j d_j d_j^T / (R-1).

    samples: (..., R, m, n) sample gradients (a common shift cancels), R >= 4; d_j = x_j -
    mean_j x_j. Var_F = (mu4 - P1)/R + (P2 + P3)/(R (R-1)) (see fourth_moment_system) with
    the four moments solved from the centred quartic sums S1..S4 (their expectations are
    exact linear combinations for iid samples, any distribution). Returns (...) float64;
    it can come out negative by chance. Cost O(R^2 m^2 n).
    """
    if samples.dim() < 3:
        raise ValueError(f"samples: expected (..., R, m, n), got shape {tuple(samples.shape)}")
    R = samples.shape[-3]
    if R < 4:
        raise ValueError(f"samples: a fourth-moment estimate needs R >= 4 samples, got {R}")
    x = samples.detach().to(torch.float64)
    d = x - x.mean(dim=-3, keepdim=True)
    grams = d @ d.mT  # (..., R, m, m)
    S1 = (grams * grams).sum(dim=(-3, -2, -1))
    tot = grams.sum(dim=-3)
    S2 = (tot * tot).sum(dim=(-2, -1))
    S3 = torch.zeros_like(S1)
    for j in range(R):
        Mj = d[..., j : j + 1, :, :] @ d.mT  # (..., R, m, m): d_j d_k^T
        S3 = S3 + (Mj * Mj.mT).sum(dim=(-3, -2, -1))
    col = (d.mT @ d).sum(dim=-3)
    S4 = (col * col).sum(dim=(-2, -1))
    A, w = fourth_moment_system(R)
    coef = torch.linalg.solve(A, torch.eye(4, dtype=torch.float64)).mT @ w  # w^T A^{-1}
    coef = coef.to(S1.device)
    return coef[0] * S1 + coef[1] * S2 + coef[2] * S3 + coef[3] * S4


def nuclear_dof_from_samples(samples: Tensor) -> Tensor:
    """Data-driven degrees of freedom nu of C_hat = sum_j d_j d_j^T / (R-1) (row Gram side).

    samples: (..., R, m, n), R >= 4. The Wishart model's nu is matched in Frobenius norm,
    E||C_hat - C||_F^2 = ((tr C)^2 + tr(C^2)) / nu, with Var_F from
    nuclear_frobenius_variance (unbiased) and the numerator (tr C_hat)^2 + ||C_hat||_F^2 -
    Var_F. So nu reflects the data's own fourth moments (heavy tails, rank-one per-example
    gradients, correlated columns) instead of a model. Returns (...) float64: inf where the
    estimated Var_F <= 0 (no correction), nan for non-finite input. Pass nu / (R-1) as
    dof_per_sample to nuclear_sqrt_trace_corrected.
    """
    var_f = nuclear_frobenius_variance(samples)
    x = samples.detach().to(torch.float64)
    d = x - x.mean(dim=-3, keepdim=True)
    C = (d @ d.mT).sum(dim=-3) / (samples.shape[-3] - 1)
    num = torch.diagonal(C, dim1=-2, dim2=-1).sum(-1) ** 2 + (C * C).sum(dim=(-2, -1)) - var_f
    nu = num.clamp_min(0) / var_f
    nu = torch.where(var_f <= 0, torch.full_like(nu, math.inf), nu)
    return torch.where(torch.isfinite(var_f) & torch.isfinite(num), nu, torch.full_like(nu, math.nan))


def per_sample_quartic_sums(d: Tensor) -> tuple[Tensor, Tensor]:
    """One sample's contribution to the extra all-reduce: (q, a).

    d: (..., m, n) the sample's deviation from the mean of all samples (G^j - G).
    q = ||d d^T||_F^2 (smaller Gram side; both sides give the same value), a = ||d||_F^4.
    Returns two (...) float64 tensors. Cost: one Gram (m^2 n) per matrix.
    """
    if not isinstance(d, Tensor) or d.dim() < 2:
        raise ValueError("d: expected a tensor (..., m, n) of one sample's deviation")
    x = rows_side(d.detach().to(torch.float64))
    g = x @ x.mT
    q = (g * g).sum(dim=(-2, -1))
    a = torch.diagonal(g, dim1=-2, dim2=-1).sum(-1) ** 2
    return q, a


def sample_sums_moments(
    sum_q: Tensor | float,
    sum_a: Tensor | float,
    gram_trace: Tensor | float,
    gram_fro2: Tensor | float,
    num_samples: int,
) -> tuple[Tensor, Tensor]:
    """(numerator, var_f) from the per-sample sums, Gaussian rank means (module docstring).

    sum_q = sum_j ||d_j d_j^T||_F^2, sum_a = sum_j ||d_j||_F^4 (per_sample_quartic_sums
    summed over samples), gram_trace = tr M, gram_fro2 = ||M||_F^2 with M = sum_j d_j d_j^T
    in the same units as d_j (from the estimator's C_hat: M = R (R-1) / B * C_hat).
    num_samples: R >= 3. In the units of C1 = E[y y^T] (one sample's covariance):
    numerator estimates (tr C1)^2 + ||C1||_F^2 and var_f estimates E||M/(R-1) - C1||_F^2
    = (mu4 - P1)/(R-1), both unbiased for Gaussian samples. float64, broadcast shape.
    """
    R = float(check_loo_count(num_samples))  # a float scalar: an int one costs 4 more aten ops per use
    Q, A, t, F = as_float64(sum_q), as_float64(sum_a), as_float64(gram_trace), as_float64(gram_fro2)
    mu4 = R * Q / (R - 1) ** 2
    m4 = R * A / (R - 1) ** 2
    P1 = (F - (R - 1) * mu4) / ((R - 1) * (R - 2))
    T1 = (t * t - (R - 1) * m4) / ((R - 1) * (R - 2))
    return T1 + P1, (mu4 - P1) / (R - 1)


def dof_from_sample_sums(
    sum_q: Tensor | float,
    sum_a: Tensor | float,
    gram_trace: Tensor | float,
    gram_fro2: Tensor | float,
    num_samples: int,
) -> Tensor:
    """nu of C_hat from the per-sample sums (Gaussian rank means; see module docstring):
    nu = numerator / var_f of sample_sums_moments (same arguments). Returns float64: inf
    where var_f <= 0 (no correction), 0 where the numerator is <= 0 (full correction), nan
    for non-finite input. Pass nu / (R - 1) as dof_per_sample.
    """
    return dof_from_moments(*sample_sums_moments(sum_q, sum_a, gram_trace, gram_fro2, num_samples))


def dof_from_samples_gaussian(samples: Tensor) -> Tensor:
    """dof_from_sample_sums computed from all samples at once: samples (..., R, m, n).

    What a hook computes with one sum per statistic; here for analysis and tests.
    """
    if samples.dim() < 3:
        raise ValueError(f"samples: expected (..., R, m, n), got shape {tuple(samples.shape)}")
    R = samples.shape[-3]
    x = rows_side(samples.detach().to(torch.float64))
    d = x - x.mean(dim=-3, keepdim=True)
    q, a = per_sample_quartic_sums(d)
    M = (d @ d.mT).sum(dim=-3)
    return dof_from_sample_sums(q.sum(-1), a.sum(-1), torch.diagonal(M, dim1=-2, dim2=-1).sum(-1),
                                (M * M).sum(dim=(-2, -1)), R)
