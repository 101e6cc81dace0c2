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

    nu decides how much is corrected and depends on the gradient structure: the modes
    ('columns', 'rank_one', 'data', 'gauss-sums') and their models and estimates are in
    gns_kernels.stats.dof and gns_kernels.stats.fourth_moments.

    The correction needs two spectral sums of C_hat: tr(C_hat^{1/2}) = sum_i s_i and the
    pair sum sum_{i,j} s_i s_j / (s_i + s_j) = int_0^inf tr(S e^{-tS})^2 dt, S = C_hat^{1/2}.
    nuclear_sqrt_trace_corrected takes eigenvalues; nuclear_sqrt_trace_corrected_from_sums
    takes the two sums, which gns_kernels.spectral.sqrt_trace_pair_sum computes by
    Newton-Schulz and matmul quadrature (no eigenvalues).
"""
from __future__ import annotations

import math
from numbers import Real

import torch

from .common import check_sample_count
from .dof import nuclear_dof

Tensor = torch.Tensor

__all__ = [
    "c4",
    "l1_noise_factor",
    "c4_tensor",
    "pair_sum",
    "corrected_sqrt_trace",
    "nuclear_sqrt_trace_corrected",
    "nuclear_sqrt_trace_corrected_from_sums",
]


def c4(R: int | float) -> float:
    """c4(R) = E[sample standard deviation of R iid Gaussians] / sigma
    = sqrt(2/(R-1)) Gamma(R/2) / Gamma((R-1)/2).  R > 1 (real R allowed). c4(2) = sqrt(2/pi).
    """
    if isinstance(R, bool) or not isinstance(R, Real):
        raise TypeError(f"R: expected a finite number of samples > 1, got {R!r} ({type(R).__name__})")
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
    series = 1.0 - 1.0 / (4.0 * N) - 7.0 / (32.0 * N * N) - 19.0 / (128.0 * N**3)
    return torch.where(N > _C4_SERIES_FROM, series, exact)


def l1_noise_factor(R: int) -> float:
    """Factor 1/c4(R) that makes ||s||_1 unbiased for ||sigma||_1 (Gaussian rank means).

    The l1 noise term ||s||_1^2 is multiplied by its square, 1/c4(R)^2 (1.571 at R = 2,
    1.073 at R = 8), which is what the controller's batch sizes scale by.
    """
    return 1.0 / c4(check_sample_count("R", R))


_PAIR_BLOCK_ELEMS = 1 << 22  # bound on the (..., rows, m) temporary of the pair sum


def pair_sum(s: Tensor) -> Tensor:
    """sum_{i,j} s_i s_j / (s_i + s_j) over the last dim (0/0 := 0), in row blocks so the
    temporary stays below ~32 MB for any m and batch (vectorised within a block)."""
    m = s.shape[-1]
    if m == 0:  # no eigenvalues: an empty sum
        return s.new_zeros(s.shape[:-1])
    batch = max(1, s[..., 0].numel())
    rows = max(1, min(m, _PAIR_BLOCK_ELEMS // max(1, batch * m)))
    total = torch.zeros_like(s[..., 0])
    for i0 in range(0, m, rows):
        si = s[..., i0 : i0 + rows, None]
        ssum = si + s[..., None, :]
        total = total + ((si * s[..., None, :]) / torch.where(ssum > 0, ssum, torch.ones_like(ssum))).sum(dim=(-2, -1))
    return total


def nuclear_sqrt_trace_corrected(
    eigvals: Tensor,
    num_samples: int,
    batch_size: float | None = None,
    *,
    other_dim: int | None = None,
    dof_per_sample: float | Tensor | None = None,
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
    square-root trace under a Wishart model). Vectorised over leading dims, O(m^2) work per
    matrix in row blocks (temporaries <= 4M elements), no host synchronisation. A zero C
    gives 0, and so does m = 0 (the empty matrix of a 0 x n gradient); NaN/inf propagate.
    """
    if not isinstance(eigvals, Tensor) or eigvals.dim() < 1:
        raise ValueError("eigvals: expected a tensor (..., m) of eigenvalues")
    m = eigvals.shape[-1]
    if m == 0:  # the empty Gram of a 0 x n gradient: tr C^{1/2} = 0
        check_sample_count("num_samples", num_samples)
        return eigvals.new_zeros(eigvals.shape[:-1], dtype=eigvals.dtype if eigvals.is_floating_point() else torch.float64)
    nu = nuclear_dof(num_samples, m, other_dim, batch_size, dof_per_sample, dof_model)
    lam = eigvals.detach().to(torch.float64)
    lam = torch.where(lam < 0, torch.zeros_like(lam), lam)  # clamp, NaN preserved
    s = lam.sqrt()
    out = corrected_sqrt_trace(s.sum(dim=-1), pair_sum(s), nu)
    return out.to(eigvals.dtype if eigvals.is_floating_point() else torch.float64)


def corrected_sqrt_trace(raw: Tensor, pair_sum: Tensor, nu) -> Tensor:
    """raw / c4(nu / k + 1), k = (pair_sum + raw / 2) / raw (float64); raw = 0 gives 0."""
    # k = 4 nu beta / raw (nu cancels): 1 for one eigen-direction, (m+1)/2 for m equal ones
    pos = raw > 0.0
    k = (pair_sum + 0.5 * raw) / torch.where(pos, raw, 1.0)
    if isinstance(nu, Tensor):
        nu = nu.to(device=raw.device)
    nu_eff = (nu / torch.where(pos, k, 1.0)).clamp_min(1.0)  # inf: no correction
    return torch.where(pos, raw / c4_tensor(nu_eff + 1.0), raw)


def nuclear_sqrt_trace_corrected_from_sums(
    sqrt_trace: Tensor,
    pair_sum: Tensor,
    num_samples: int,
    batch_size: float | None = None,
    *,
    gram_dim: int,
    other_dim: int | None = None,
    dof_per_sample: float | Tensor | None = None,
    dof_model: str = "columns",
) -> Tensor:
    """nuclear_sqrt_trace_corrected from the two spectral sums it needs, for solvers that do
    not produce eigenvalues (the Newton path: gns_kernels.spectral.sqrt_trace_pair_sum).

    sqrt_trace: (...) tr(C_hat^{1/2}) = sum_i s_i; pair_sum: (...) sum_{i,j} s_i s_j /
    (s_i + s_j), s_i = sqrt(max(lambda_i, 0)) of the raw covariance estimate C_hat
    (gram_dim x gram_dim). Other arguments as nuclear_sqrt_trace_corrected (gram_dim is
    the m it reads from the eigenvalues' shape). Returns (...) in sqrt_trace's dtype:
    tr(C_hat^{1/2}) / c4(nu / k + 1), k = (pair_sum + sqrt_trace / 2) / sqrt_trace; equal
    to nuclear_sqrt_trace_corrected(eigenvalues, ...) when the two sums are computed from
    them. No host synchronization; NaN propagates; a zero trace gives 0.
    """
    for name, t in (("sqrt_trace", sqrt_trace), ("pair_sum", pair_sum)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor, got "
                             f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    if sqrt_trace.shape != pair_sum.shape:
        raise ValueError(f"pair_sum: expected shape {tuple(sqrt_trace.shape)} like sqrt_trace, got {tuple(pair_sum.shape)}")
    if isinstance(gram_dim, bool) or not isinstance(gram_dim, int) or gram_dim < 0:
        raise ValueError(f"gram_dim: expected a non-negative int (the Gram side m), got {gram_dim!r}")
    if gram_dim == 0:
        check_sample_count("num_samples", num_samples)
        return torch.zeros_like(sqrt_trace)
    nu = nuclear_dof(num_samples, gram_dim, other_dim, batch_size, dof_per_sample, dof_model)
    raw = sqrt_trace.detach().to(torch.float64)
    return corrected_sqrt_trace(raw, pair_sum.detach().to(torch.float64), nu).to(sqrt_trace.dtype)

