"""Degrees of freedom nu of the nuclear covariance estimate: the ``nuclear_dof=`` modes, the
models, and the estimates from the moments of pairs of measurements.

Pure torch functions (float64 results), no torch.distributed. They feed
``gns_kernels.stats.bias.nuclear_sqrt_trace_corrected(..., dof_per_sample=nu / (R - 1))``.

Notation. R samples (ranks, or ranks x micro-batches) of one matrix parameter, each the mean
gradient over b examples; the smaller Gram side is the row side (transpose first when
m > n). d_j = x_j - mean_k x_k (m x n), the deviation sample j can form once the mean is
known. M = sum_j d_j d_j^T (m x m; the estimator's covariance is C_hat = B M / (R (R-1))).
For iid samples y (centred rank means) let X = y y^T and

    C = E X,  P1 = ||C||_F^2,  T1 = (tr C)^2,  mu4 = E ||X||_F^2,  m4 = E (tr X)^2.

The nuclear correction (gns_kernels.stats.bias) models C_hat as a Wishart mean with nu
degrees of freedom, matched in Frobenius norm: E ||C_hat - C||_F^2 = (T1 + P1) / nu (as
fourth_moments.nuclear_dof_from_samples). nu decides how much is corrected and depends on
the gradient structure (``nuclear_dof=``, ``resolve_nuclear_dof``):
    'columns' (R-1)*n, exact for Gaussian noise with independent columns and otherwise an
    over-estimate of nu (so an under-correction) -- the model from eigenvalues alone (the
    default at R = 2, under FSDP2 and with micro-batch samples);
    'rank_one' (R-1)*n*b/(n+b) for per-example gradients r x^T; given R >= 4 samples,
    nuclear_dof_from_samples: nu matched to the samples' own fourth moments in Frobenius
    norm, E||C_hat - C||_F^2 = ((tr C)^2 + tr C^2)/nu, from an unbiased estimate of the
    left side (nuclear_frobenius_variance); or, given R >= 3 samples and Gaussian rank
    means, dof_from_sample_sums from per-sample sums a hook can
    form -- 'gauss-sums', the default at R >= 3 (resolve_nuclear_dof).
The estimates from the samples' own fourth moments ('data', 'gauss-sums') are in
gns_kernels.stats.fourth_moments.

Two estimates of nu that need no cross-sample terms: ``dof_from_sample_sums``
(gns_kernels.stats.fourth_moments; R >= 3, one extra all-reduce of 2 floats per matrix) and

``dof_from_gram_pair`` (any R >= 2; no extra collective)
    C_t and C_s: the covariance estimates of two independent measurements of the same
    distribution (same R and b; e.g. consecutive measurements of a run). Distribution-free:
        E <C_t, C_s> = P1,   E tr C_t tr C_s = T1,   E 1/2 ||C_t - C_s||_F^2 = Var_F,
    so nu = (tr C_t tr C_s + <C_t, C_s>) / (1/2 ||C_t - C_s||_F^2) (ratio of unbiased terms).
    Assumption: stationarity between the two measurements (a drifting C adds
    1/2 ||C - C'||_F^2 to the denominator: more correction). The hook keeps its last m x m
    covariance. Moments can be averaged over several pairs before the ratio
    (``gram_pair_moments`` / ``dof_from_moments``) to cut the variance.

Pooling (any R; no extra collective; state: one m x m matrix per parameter matrix)
    Average C over K measurements (or an EMA) before the sqrt-trace: the pooled estimate has
    K nu degrees of freedom (``pooled_dof``), so the small-sample bias shrinks ~K-fold. The
    per-measurement nu comes from the pair moments summed over the same window. Assumption:
    the noise distribution changes little over the window (it then tracks the window's
    average noise, with the same lag as an EMA of the noise itself).

The jackknife (gns_kernels.stats.leave_one_out) and the bias-reduced signals
(gns_kernels.stats.signal) need no nu.
"""
from __future__ import annotations

import math

import torch

from .common import as_float64, check_sample_count

Tensor = torch.Tensor

__all__ = [
    "NUCLEAR_DOF_MODES",
    "GAUSS_SUMS_MIN_SAMPLES",
    "resolve_nuclear_dof",
    "nuclear_dof",
    "gram_pair_moments",
    "dof_from_moments",
    "dof_from_gram_pair",
    "pooled_dof",
]

# nuclear_dof= of gk.estimate and the hook states: where the dof of the nuclear correction
# comes from ('auto': 'gauss-sums' at >= 3 samples where the per-sample deviations exist,
# else 'columns'); see resolve_nuclear_dof
NUCLEAR_DOF_MODES = ("auto", "gauss-sums", "columns", "data", "rank_one")


GAUSS_SUMS_MIN_SAMPLES = 3  # 'gauss-sums' estimates a fourth moment from the samples' deviations


def resolve_nuclear_dof(mode: str, num_samples: int, *, per_sample: bool = True) -> str:
    """The dof mode a measurement of ``num_samples`` samples uses for ``nuclear_dof=mode``.

    'auto' -> 'gauss-sums' when num_samples >= 3 and ``per_sample`` (each sample's own
    deviation d_j = x_j - mean is available: gk.estimate, the DDP hook with ranks as
    samples), else 'columns'. 'gauss-sums' needs R >= 3 and 'data' R >= 4 (ValueError
    otherwise, naming nuclear_dof); 'columns' and 'rank_one' are returned as given.
    """
    if mode not in NUCLEAR_DOF_MODES:
        raise ValueError(f"nuclear_dof: expected one of {NUCLEAR_DOF_MODES}, got {mode!r}")
    R = check_sample_count("num_samples", num_samples)
    if mode == "auto":
        return "gauss-sums" if (R >= GAUSS_SUMS_MIN_SAMPLES and per_sample) else "columns"
    if mode == "gauss-sums" and R < GAUSS_SUMS_MIN_SAMPLES:
        raise ValueError(f"nuclear_dof: 'gauss-sums' needs at least {GAUSS_SUMS_MIN_SAMPLES} samples, got {R} "
                         "(use 'auto', which falls back to 'columns' below 3)")
    if mode == "data" and R < 4:
        raise ValueError(f"nuclear_dof: 'data' needs at least 4 samples (a fourth moment), got {R}")
    return mode


def nuclear_dof(
    num_samples: int,
    gram_dim: int,
    other_dim: int | None = None,
    batch_size: float | None = None,
    dof_per_sample: float | Tensor | None = None,
    dof_model: str = "columns",
) -> float | Tensor:
    """Degrees of freedom nu = (R-1) * d of the covariance estimate C (m x m, m = gram_dim).

    d = dof_per_sample when given (a float, math.inf for no correction, or a tensor of
    per-matrix values, e.g. nuclear_dof_from_samples(x) / (R-1)); else by ``dof_model``:
      'columns'  d = other_dim (each sample's m x n gradient noise has n independent
                 Gaussian columns; other_dim defaults to gram_dim, a lower bound of n
                 when the smaller Gram side is used). The default: mildest assumption.
      'rank_one' d = n b / (n + b), b = batch_size / R: per-example gradients of rank
                 one (r x^T, a Linear layer without a sequence dimension). The Gram of a
                 mean of b outer products with isotropic x is a weighted Wishart whose
                 effective dof is (tr A)^2 / tr(A^2) = n b / (n + b), A = X^T X.
    """
    num_samples = check_sample_count("num_samples", num_samples)
    n = float(other_dim) if other_dim is not None else float(gram_dim)
    if isinstance(dof_per_sample, Tensor):
        return (num_samples - 1) * dof_per_sample.detach().to(torch.float64)
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
    if not d > 0:  # math.inf allowed: no correction
        raise ValueError(f"dof_per_sample: expected a positive number (inf for none), got {d}")
    return (num_samples - 1) * d


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
    num = as_float64(numerator)
    var = as_float64(var_f)
    pos = var > 0.0
    nu = torch.where(pos, num.clamp_min(0) / torch.where(pos, var, 1.0), math.inf)
    # both finite: x * 0 is 0 for a finite x and NaN for inf / NaN (4 aten ops, isfinite 7 each)
    return torch.where(num * 0.0 + var * 0.0 == 0.0, nu, math.nan)


def dof_from_gram_pair(C_t: Tensor, C_s: Tensor) -> Tensor:
    """nu of C_t from an independent estimate C_s of the same distribution (module docstring)."""
    return dof_from_moments(*gram_pair_moments(C_t, C_s))


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
