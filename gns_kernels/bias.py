"""Small-sample bias corrections of the l1 and nuclear noise terms (derived, not fitted).

Pure functions of statistics that are already computed; no torch.distributed, importable
by the spectral ops. See docs/estimators.md for the derivations and measured bias removal.

Notation: R samples (ranks, or ranks x micro-batches), each the mean gradient over
b = B/R examples; s2_i the per-coordinate variance estimate, C the covariance estimate
on one Gram side (m x m), lambda its eigenvalues.

l1 (exact for Gaussian rank means)
    s2_i = sigma_i^2 * chi2_{R-1}/(R-1), so E[s_i] = c4(R) sigma_i with
    c4(R) = sqrt(2/(R-1)) Gamma(R/2) / Gamma((R-1)/2).   ||s||_1 / c4(R) is unbiased.

nuclear (second order in 1/nu, exact for m = 1)
    Model: C_hat = C + Delta, with C_hat a Wishart-like mean of nu = (R-1)*d rank-one terms,
    E[Delta_ij^2] = lambda_i lambda_j (1 + delta_ij) / nu in the eigenbasis of C (Gaussian
    columns; d = the number of independent columns each sample contributes).
    The second-order Daleckii-Krein expansion of tr f(C + Delta), f = sqrt, gives
        E tr(C_hat^{1/2}) = tr(C^{1/2}) - beta(lambda) + O(nu^-2),
        beta(lambda) = 1/(4 nu) * [ sum_{i,j} s_i s_j / (s_i + s_j) + 1/2 sum_i s_i ],
    s_i = sqrt(lambda_i). The i != j terms are the eigenvalue-repulsion terms
    lambda_i lambda_j / (nu (lambda_i - lambda_j)) of the eigenvalue perturbation, folded
    with the divided difference of sqrt (no singular denominators). For m = 1 this is
    the first-order term of c4: beta = sqrt(lambda)/(4 nu). We write the bias like c4 with
    an effective number of degrees of freedom nu_eff = nu / k,
        k = 4 nu beta(lambda_hat) / tr(C_hat^{1/2})   (1 <= k <= (m+1)/2),
    and return tr(C_hat^{1/2}) / c4(nu_eff + 1): exact c4 when m = 1 (and so consistent
    with the l1 correction), the plug-in second-order correction otherwise.
"""
from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

__all__ = ["c4", "l1_noise_factor", "c4_tensor", "nuclear_dof", "nuclear_sqrt_trace_corrected"]


def c4(R: int | float) -> float:
    """c4(R) = E[sample standard deviation of R iid Gaussians] / sigma
    = sqrt(2/(R-1)) Gamma(R/2) / Gamma((R-1)/2).  R > 1 (real R allowed). c4(2) = sqrt(2/pi).
    """
    R = float(R)
    if not R > 1.0 or not math.isfinite(R):
        raise ValueError(f"R: expected a finite number of samples > 1, got {R}")
    if R > _C4_SERIES_FROM:
        return 1.0 - 1.0 / (4 * R) - 7.0 / (32 * R * R) - 19.0 / (128 * R**3)
    return math.exp(0.5 * math.log(2.0 / (R - 1.0)) + math.lgamma(R / 2.0) - math.lgamma((R - 1.0) / 2.0))


# lgamma differences lose digits for huge N; the asymptotic series is exact to ~N^-4 there
_C4_SERIES_FROM = 1e4


def c4_tensor(N: Tensor) -> Tensor:
    """Element-wise c4(N) for a tensor of real N > 1 (no host sync)."""
    small = N.clamp_max(_C4_SERIES_FROM)
    exact = torch.exp(0.5 * torch.log(2.0 / (small - 1.0)) + torch.lgamma(small / 2.0) - torch.lgamma((small - 1.0) / 2.0))
    series = 1.0 - 1.0 / (4 * N) - 7.0 / (32 * N * N) - 19.0 / (128 * N**3)
    return torch.where(N > _C4_SERIES_FROM, series, exact)


def l1_noise_factor(R: int) -> float:
    """Factor 1/c4(R) that makes ||s||_1 unbiased for ||sigma||_1 (Gaussian rank means).

    The l1 noise term ||s||_1^2 is multiplied by its square, 1/c4(R)^2 (1.571 at R = 2,
    1.073 at R = 8), which is what the controller's batch sizes scale by.
    """
    if int(R) != R or R < 2:
        raise ValueError(f"R: expected an integer number of samples >= 2, got {R}")
    return 1.0 / c4(int(R))


def nuclear_dof(
    num_samples: int,
    gram_dim: int,
    other_dim: int | None = None,
    batch_size: float | None = None,
    dof_per_sample: float | None = None,
    dof_model: str = "columns",
) -> float:
    """Degrees of freedom nu = (R-1) * d of the covariance estimate C (m x m, m = gram_dim).

    d = dof_per_sample when given; else by ``dof_model``:
      'columns'  d = other_dim (each sample's m x n gradient noise has n independent
                 Gaussian columns; other_dim defaults to gram_dim, a lower bound of n
                 when the smaller Gram side is used). The default: mildest assumption.
      'rank_one' d = n b / (n + b), b = batch_size / R: per-example gradients of rank
                 one (r x^T, a Linear layer without a sequence dimension). The Gram of a
                 mean of b outer products with isotropic x is a weighted Wishart whose
                 effective dof is (tr A)^2 / tr(A^2) = n b / (n + b), A = X^T X.
    """
    if int(num_samples) != num_samples or num_samples < 2:
        raise ValueError(f"num_samples: expected an integer >= 2, got {num_samples}")
    n = float(other_dim) if other_dim is not None else float(gram_dim)
    if dof_per_sample is not None:
        d = float(dof_per_sample)
    elif dof_model == "columns":
        d = n
    elif dof_model == "rank_one":
        if batch_size is None:
            raise ValueError("batch_size: dof_model='rank_one' needs the global batch size")
        b = float(batch_size) / num_samples
        d = n * b / (n + b)
    else:
        raise ValueError(f"dof_model: expected 'columns' or 'rank_one', got {dof_model!r}")
    if not d > 0 or not math.isfinite(d):
        raise ValueError(f"dof_per_sample: expected a positive finite number, got {d}")
    return (num_samples - 1) * d


def nuclear_sqrt_trace_corrected(
    eigvals: Tensor,
    num_samples: int,
    batch_size: float | None = None,
    *,
    other_dim: int | None = None,
    dof_per_sample: float | None = None,
    dof_model: str = "columns",
) -> Tensor:
    """Bias-corrected tr(C^{1/2}) from the eigenvalues of the raw covariance estimate C.

    eigvals: (..., m) eigenvalues of C_hat (float32 or float64; negatives from rounding are
    clamped to 0). num_samples: R >= 2. batch_size: global batch B (used by
    dof_model='rank_one'). other_dim: the gradient matrix's other dimension n (the
    number of columns summed into the m x m Gram); defaults to m. dof_per_sample overrides
    the model. Returns (...) in eigvals' dtype:
        tr(C_hat^{1/2}) / c4(nu / k + 1),  k = 4 nu beta(lambda_hat) / tr(C_hat^{1/2}),
    nu from nuclear_dof(...), beta as in the module docstring (second-order bias of the
    square-root trace under a Wishart model). Vectorised over leading dims, O(m^2) memory
    per matrix, no host synchronisation. A zero C gives 0; NaN/inf propagate.
    """
    if not isinstance(eigvals, Tensor) or eigvals.dim() < 1:
        raise ValueError("eigvals: expected a tensor (..., m) of eigenvalues")
    m = eigvals.shape[-1]
    nu = nuclear_dof(num_samples, m, other_dim, batch_size, dof_per_sample, dof_model)
    lam = eigvals.detach().to(torch.float64)
    lam = torch.where(lam < 0, torch.zeros_like(lam), lam)  # clamp, NaN preserved
    s = lam.sqrt()
    raw = s.sum(dim=-1)
    ssum = s[..., :, None] + s[..., None, :]
    pair = (s[..., :, None] * s[..., None, :]) / torch.where(ssum > 0, ssum, torch.ones_like(ssum))
    beta = (pair.sum(dim=(-2, -1)) + 0.5 * raw) / (4.0 * nu)
    safe_raw = torch.where(raw > 0, raw, torch.ones_like(raw))
    k = 4.0 * nu * beta / safe_raw
    nu_eff = (nu / k).clamp_min(1.0)
    corrected = torch.where(raw > 0, raw / c4_tensor(nu_eff + 1.0), raw)
    return corrected.to(eigvals.dtype if eigvals.is_floating_point() else torch.float64)
