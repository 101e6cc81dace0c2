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

    nu decides how much is corrected and depends on the gradient structure (nuclear_dof):
    'columns' (R-1)*n, exact for Gaussian noise with independent columns and otherwise an
    over-estimate of nu (so an under-correction) -- the model from eigenvalues alone (the
    default at R = 2, under FSDP2 and with micro-batch samples);
    'rank_one' (R-1)*n*b/(n+b) for per-example gradients r x^T; given R >= 4 samples,
    nuclear_dof_from_samples: nu matched to the samples' own fourth moments in Frobenius
    norm, E||C_hat - C||_F^2 = ((tr C)^2 + tr C^2)/nu, from an unbiased estimate of the
    left side (nuclear_frobenius_variance); or, given R >= 3 samples and Gaussian rank
    means, gns_kernels.nuclear_dof.dof_from_sample_sums from per-sample sums a hook can
    form -- 'gauss-sums', the default at R >= 3 (resolve_nuclear_dof).

    The correction needs two spectral sums of C_hat: tr(C_hat^{1/2}) = sum_i s_i and the
    pair sum sum_{i,j} s_i s_j / (s_i + s_j) = int_0^inf tr(S e^{-tS})^2 dt, S = C_hat^{1/2}.
    nuclear_sqrt_trace_corrected takes eigenvalues; nuclear_sqrt_trace_corrected_from_sums
    takes the two sums, which gns_kernels.spectral.sqrt_trace_pair_sum computes by
    Newton-Schulz and matmul quadrature (no eigenvalues).
"""
from __future__ import annotations

import functools
import math
from numbers import Real

import torch

Tensor = torch.Tensor

__all__ = [
    "c4",
    "l1_noise_factor",
    "c4_tensor",
    "nuclear_dof",
    "nuclear_dof_from_samples",
    "nuclear_frobenius_variance",
    "nuclear_sqrt_trace_corrected",
    "nuclear_sqrt_trace_corrected_from_sums",
    "NUCLEAR_DOF_MODES",
    "resolve_nuclear_dof",
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
    R = _sample_count("num_samples", num_samples)
    if mode == "auto":
        return "gauss-sums" if (R >= GAUSS_SUMS_MIN_SAMPLES and per_sample) else "columns"
    if mode == "gauss-sums" and R < GAUSS_SUMS_MIN_SAMPLES:
        raise ValueError(f"nuclear_dof: 'gauss-sums' needs at least {GAUSS_SUMS_MIN_SAMPLES} samples, got {R} "
                         "(use 'auto', which falls back to 'columns' below 3)")
    if mode == "data" and R < 4:
        raise ValueError(f"nuclear_dof: 'data' needs at least 4 samples (a fourth moment), got {R}")
    return mode


def _sample_count(name: str, R) -> int:
    """A number of samples: an integer >= 2 (an integral float such as 4.0 is accepted)."""
    ok = not isinstance(R, bool) and isinstance(R, Real) and math.isfinite(R) and int(R) == R and R >= 2
    if not ok:
        raise ValueError(f"{name}: expected an integer number of samples >= 2, got {R!r}")
    return int(R)


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
    return 1.0 / c4(_sample_count("R", R))


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
    num_samples = _sample_count("num_samples", num_samples)
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


_PAIR_BLOCK_ELEMS = 1 << 22  # bound on the (..., rows, m) temporary of the pair sum


def _pair_sum(s: Tensor) -> Tensor:
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
        _sample_count("num_samples", num_samples)
        return eigvals.new_zeros(eigvals.shape[:-1], dtype=eigvals.dtype if eigvals.is_floating_point() else torch.float64)
    nu = nuclear_dof(num_samples, m, other_dim, batch_size, dof_per_sample, dof_model)
    lam = eigvals.detach().to(torch.float64)
    lam = torch.where(lam < 0, torch.zeros_like(lam), lam)  # clamp, NaN preserved
    s = lam.sqrt()
    corrected = _corrected(s.sum(dim=-1), _pair_sum(s), nu)
    return corrected.to(eigvals.dtype if eigvals.is_floating_point() else torch.float64)


def _corrected(raw: Tensor, pair_sum: Tensor, nu) -> Tensor:
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
        _sample_count("num_samples", num_samples)
        return torch.zeros_like(sqrt_trace)
    nu = nuclear_dof(num_samples, gram_dim, other_dim, batch_size, dof_per_sample, dof_model)
    raw = sqrt_trace.detach().to(torch.float64)
    return _corrected(raw, pair_sum.detach().to(torch.float64), nu).to(sqrt_trace.dtype)


@functools.lru_cache(maxsize=64)
def _fourth_moment_system(R: int) -> tuple[Tensor, Tensor]:
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
    mean_j x_j. Var_F = (mu4 - P1)/R + (P2 + P3)/(R (R-1)) (see _fourth_moment_system) with
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
    A, w = _fourth_moment_system(R)
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
