"""Degrees of freedom of the nuclear covariance estimate from statistics a hook can hold,
and bias-reduced l1 / nuclear signals.

Pure torch functions (float64 results), no torch.distributed. They feed
``gns_kernels.bias.nuclear_sqrt_trace_corrected(..., dof_per_sample=nu / (R - 1))``.

Notation. R samples (ranks, or ranks x micro-batches) of one matrix parameter, each the mean
gradient over b examples; the smaller Gram side is the row side (transpose first when
m > n). d_j = x_j - mean_k x_k (m x n), the deviation sample j can form once the mean is
known. M = sum_j d_j d_j^T (m x m; the estimator's covariance is C_hat = B M / (R (R-1))).
For iid samples y (centred rank means) let X = y y^T and

    C = E X,  P1 = ||C||_F^2,  T1 = (tr C)^2,  mu4 = E ||X||_F^2,  m4 = E (tr X)^2.

The nuclear correction models C_hat as a Wishart mean with nu degrees of freedom, matched in
Frobenius norm: E ||C_hat - C||_F^2 = (T1 + P1) / nu (as bias.nuclear_dof_from_samples).

Two estimates of nu that need no cross-sample terms:

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

``dof_from_gram_pair`` (any R >= 2; no extra collective)
    C_t and C_s: the covariance estimates of two independent measurements of the same
    distribution (same R and b; e.g. consecutive measurements of a run). Distribution-free:
        E <C_t, C_s> = P1,   E tr C_t tr C_s = T1,   E 1/2 ||C_t - C_s||_F^2 = Var_F,
    so nu = (tr C_t tr C_s + <C_t, C_s>) / (1/2 ||C_t - C_s||_F^2) (ratio of unbiased terms).
    Assumption: stationarity between the two measurements (a drifting C adds
    1/2 ||C - C'||_F^2 to the denominator: more correction). The hook keeps its last m x m
    covariance. Moments can be averaged over several pairs before the ratio
    (``gram_pair_moments`` / ``dof_from_moments``) to cut the variance.

Jackknife (R >= 3; one extra all-reduce of 1 float per statistic)
    Sample j knows the reduced statistic and its own deviation, hence the leave-one-out
    statistic without itself: the Gram of the other R-1 samples about their own mean is
    M_(-j) = M - R/(R-1) d_j d_j^T (``loo_gram``), and per coordinate
    sum_{k != j} (x_k - mean_(-j))^2 = sum_k d_k^2 - R/(R-1) d_j^2 (``loo_sum_sq``). It
    evaluates the estimator f (e.g. tr C^{1/2} with C = b M_(-j)/(R-2), or ||s||_1) on its
    leave-one-out statistic; the R values are summed by the extra all-reduce. If
    E f_R = f + a/(R-1) + O(R^-2) (the form of every small-sample bias here: 1 - c4(R) and the
    Wishart beta are both a/(R-1) to first order), then
        f_J = (R-1) f_R - (R-2) mean_j f_(-j)                               (``jackknife``)
    has bias O(R^-2) whatever the distribution. Applied to an already corrected f (c4 for
    l1, the Wishart correction for nuclear) it removes what that correction's model misses.

Pooling (any R; no extra collective; state: one m x m matrix per parameter matrix)
    Average C over K measurements (or an EMA) before the sqrt-trace: the pooled estimate has
    K nu degrees of freedom (``pooled_dof``), so the small-sample bias shrinks ~K-fold. The
    per-measurement nu comes from the pair moments summed over the same window. Assumption:
    the noise distribution changes little over the window (it then tracks the window's
    average noise, with the same lag as an EMA of the noise itself).

Bias-reduced signals (the raw signals ||g||_1, ||G||_S1 are biased up by the noise in g;
no unbiased estimator exists, see docs/estimators.md):
``l1_signal_debiased``   sum_i sqrt(max(g_i^2 - s2_i / B, 0))   (g_i^2 - s2_i/B is unbiased for mu_i^2)
``l1_signal_folded``     sum_i mu_hat_i, mu_hat_i solving E|N(mu, s2_i/B)| = |g_i| (0 below)
``nuclear_signal_debiased``  tr (PSD part of G G^T - C_hat / B)^{1/2}  (G G^T - C_hat/B is
                         unbiased for E[G] E[G]^T on the smaller Gram side)
"""
from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

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


def _rows_side(d: Tensor) -> Tensor:
    return d.mT if d.shape[-2] > d.shape[-1] else d


def per_sample_quartic_sums(d: Tensor) -> tuple[Tensor, Tensor]:
    """One sample's contribution to the extra all-reduce: (q, a).

    d: (..., m, n) the sample's deviation from the mean of all samples (G^j - G).
    q = ||d d^T||_F^2 (smaller Gram side; both sides give the same value), a = ||d||_F^4.
    Returns two (...) float64 tensors. Cost: one Gram (m^2 n) per matrix.
    """
    if not isinstance(d, Tensor) or d.dim() < 2:
        raise ValueError("d: expected a tensor (..., m, n) of one sample's deviation")
    x = _rows_side(d.detach().to(torch.float64))
    g = x @ x.mT
    q = (g * g).sum(dim=(-2, -1))
    a = torch.diagonal(g, dim1=-2, dim2=-1).sum(-1) ** 2
    return q, a


def _f64(v) -> Tensor:
    """v as a float64 tensor without autograd history (v itself when it is one)."""
    if isinstance(v, Tensor) and v.dtype == torch.float64 and not v.requires_grad:
        return v
    return torch.as_tensor(v).detach().to(torch.float64)


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
    R = float(_check_r3(num_samples))  # a float scalar: an int one costs 4 more aten ops per use
    Q, A, t, F = _f64(sum_q), _f64(sum_a), _f64(gram_trace), _f64(gram_fro2)
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
    x = _rows_side(samples.detach().to(torch.float64))
    d = x - x.mean(dim=-3, keepdim=True)
    q, a = per_sample_quartic_sums(d)
    M = (d @ d.mT).sum(dim=-3)
    return dof_from_sample_sums(q.sum(-1), a.sum(-1), torch.diagonal(M, dim1=-2, dim2=-1).sum(-1),
                                (M * M).sum(dim=(-2, -1)), R)


def gram_pair_moments(C_t: Tensor, C_s: Tensor) -> tuple[Tensor, Tensor]:
    """(numerator, var_f) of two independent covariance estimates (..., m, m), same units.

    numerator = tr C_t tr C_s + <C_t, C_s> (unbiased for (tr C)^2 + ||C||_F^2),
    var_f = 1/2 ||C_t - C_s||_F^2 (unbiased for E||C_hat - C||_F^2). float64.
    """
    if C_t.shape != C_s.shape or C_t.dim() < 2 or C_t.shape[-1] != C_t.shape[-2]:
        raise ValueError(f"C_t, C_s: expected two (..., m, m) tensors of one shape, got "
                         f"{tuple(C_t.shape)} and {tuple(C_s.shape)}")
    a = C_t.detach().to(torch.float64)
    b = C_s.detach().to(torch.float64)
    tr = lambda c: torch.diagonal(c, dim1=-2, dim2=-1).sum(-1)  # noqa: E731
    num = tr(a) * tr(b) + (a * b).sum(dim=(-2, -1))
    diff = a - b
    return num, 0.5 * (diff * diff).sum(dim=(-2, -1))


def dof_from_moments(numerator: Tensor, var_f: Tensor) -> Tensor:
    """nu = numerator / var_f (each possibly averaged over several measurement pairs).

    inf where var_f <= 0 (no correction), nan for non-finite input. float64.
    """
    num = _f64(numerator)
    var = _f64(var_f)
    pos = var > 0.0
    nu = torch.where(pos, num.clamp_min(0) / torch.where(pos, var, 1.0), math.inf)
    # both finite: x * 0 is 0 for a finite x and NaN for inf / NaN (4 aten ops, isfinite 7 each)
    return torch.where(num * 0.0 + var * 0.0 == 0.0, nu, math.nan)


def dof_from_gram_pair(C_t: Tensor, C_s: Tensor) -> Tensor:
    """nu of C_t from an independent estimate C_s of the same distribution (module docstring)."""
    return dof_from_moments(*gram_pair_moments(C_t, C_s))


def loo_gram(M: Tensor, d: Tensor, num_samples: int) -> Tensor:
    """Centred Gram of the samples other than j: M - R/(R-1) d d^T.

    M: (..., m, m) sum_k d_k d_k^T over all R samples; d: (..., m, n) sample j's deviation
    (rows side of M). Returns float64 (..., m, m). num_samples: R >= 3.
    """
    R = _check_r3(num_samples)
    x = d.detach().to(torch.float64)
    if M.shape[-1] != x.shape[-2]:
        x = x.mT
    if M.shape[-2:] != (x.shape[-2], x.shape[-2]):
        raise ValueError(f"M: expected (..., {x.shape[-2]}, {x.shape[-2]}) for d of shape {tuple(d.shape)}, "
                         f"got {tuple(M.shape)}")
    return M.detach().to(torch.float64) - (R / (R - 1)) * (x @ x.mT)


def loo_sum_sq(sum_sq: Tensor, d: Tensor, num_samples: int) -> Tensor:
    """Per-coordinate centred sum of squares of the samples other than j:
    sum_sq - R/(R-1) d^2 (sum_sq = sum_k d_k^2 over all R samples). float64."""
    R = _check_r3(num_samples)
    x = d.detach().to(torch.float64)
    return sum_sq.detach().to(torch.float64) - (R / (R - 1)) * x * x


def jackknife(full, loo_mean, num_samples: int):
    """(R-1) * full - (R-2) * loo_mean: removes a bias a/(R-1) of an estimator of R samples,
    full its value on all R samples, loo_mean the mean of its R leave-one-out values."""
    R = _check_r3(num_samples)
    return (R - 1) * full - (R - 2) * loo_mean


def _check_r3(R) -> int:
    if isinstance(R, bool) or int(R) != R or R < 3:
        raise ValueError(f"num_samples: expected an integer >= 3 (leave-one-out needs 2 left), got {R}")
    return int(R)


def pooled_dof(nu, count: float | None = None, beta: float | None = None):
    """Degrees of freedom of a covariance averaged over measurements: nu * K.

    nu: one measurement's dof (e.g. dof_from_moments of the summed pair moments). Give
    either count (K measurements averaged with equal weights) or beta (an EMA
    C <- beta C + (1 - beta) C_new over many independent measurements, whose variance is
    (1 - beta)/(1 + beta) of one measurement's: K = (1 + beta)/(1 - beta)). Pass
    pooled_dof(...) / (R - 1) as dof_per_sample with the pooled covariance's eigenvalues.
    Assumes the measurements are independent and identically distributed (no drift).
    """
    if (count is None) == (beta is None):
        raise ValueError("pooled_dof: give exactly one of count and beta")
    if count is not None:
        K = float(count)
        if not (K >= 1 and math.isfinite(K)):
            raise ValueError(f"count: expected a number of measurements >= 1, got {count!r}")
    else:
        b = float(beta)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"beta: expected an EMA factor in [0, 1), got {beta!r}")
        K = (1.0 + b) / (1.0 - b)
    return nu * K


def _check_b(batch_size) -> float:
    B = float(batch_size)
    if not (B >= 1 and math.isfinite(B)):
        raise ValueError(f"batch_size: expected a finite number of examples >= 1, got {batch_size!r}")
    return B


def l1_signal_debiased(g: Tensor, s2: Tensor, batch_size: float) -> Tensor:
    """sum_i sqrt(max(g_i^2 - s2_i / B, 0)) over all elements; g the mean gradient, s2 the
    per-coordinate variance estimate (single-example units), B the global batch. float64 0-d.
    """
    if g.shape != s2.shape:
        raise ValueError(f"s2: expected the shape of g {tuple(g.shape)}, got {tuple(s2.shape)}")
    B = _check_b(batch_size)
    g = g.detach().to(torch.float64)
    v = g * g - s2.detach().to(torch.float64) / B
    return torch.where(v > 0, v, torch.zeros_like(v)).sqrt().sum()


_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def l1_signal_folded(g: Tensor, s2: Tensor, batch_size: float, iters: int = 30) -> Tensor:
    """sum_i mu_hat_i with E|N(mu_hat_i, tau_i^2)| = |g_i|, tau_i^2 = s2_i / B (0 when
    |g_i| <= tau_i sqrt(2/pi), the folded mean at mu = 0). Newton on the increasing function
    F(mu) = tau sqrt(2/pi) exp(-mu^2 / (2 tau^2)) + mu erf(mu / (tau sqrt 2)). float64 0-d.
    """
    if g.shape != s2.shape:
        raise ValueError(f"s2: expected the shape of g {tuple(g.shape)}, got {tuple(s2.shape)}")
    B = _check_b(batch_size)
    y = g.detach().to(torch.float64).abs()
    tau = (s2.detach().to(torch.float64).clamp_min(0) / B).sqrt()
    pos = tau > 0
    t = torch.where(pos, tau, torch.ones_like(tau))
    mu = (y * y - t * t).clamp_min(0).sqrt()  # start at or below the root (F convex, F >= |mu|)
    for _ in range(iters):
        z = mu / (t * math.sqrt(2.0))
        F = t * _SQRT_2_PI * torch.exp(-z * z) + mu * torch.erf(z)
        dF = torch.erf(z)
        step = (F - y) / torch.where(dF > 1e-12, dF, torch.full_like(dF, 1e-12))
        mu = (mu - step).clamp_min(0)
    mu = torch.where(y <= t * _SQRT_2_PI, torch.zeros_like(mu), mu)
    return torch.where(pos, mu, y).sum()


def nuclear_signal_debiased(G: Tensor, C: Tensor, batch_size: float) -> Tensor:
    """tr((G G^T - C / B)_+^{1/2}) on the smaller Gram side: G (..., m, n) the mean gradient,
    C the covariance estimate on the same (smaller) side in single-example units, B the
    global batch. (.)_+ keeps the non-negative eigenvalues. float64 (...).
    """
    B = _check_b(batch_size)
    x = _rows_side(G.detach().to(torch.float64))
    if C.shape[-2:] != (x.shape[-2], x.shape[-2]):
        raise ValueError(f"C: expected (..., {x.shape[-2]}, {x.shape[-2]}) on G's smaller side, "
                         f"got {tuple(C.shape)}")
    A = x @ x.mT - C.detach().to(torch.float64) / B
    ev = torch.linalg.eigvalsh(0.5 * (A + A.mT))
    return torch.where(ev > 0, ev, torch.zeros_like(ev)).sqrt().sum(-1)
