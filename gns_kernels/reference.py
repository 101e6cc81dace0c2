"""Eager, float64-capable oracle of every statistic gns_kernels computes.

Clarity over speed: nothing here is fused, vectorised across layers or clever. Every
fast path (C++, Triton, CUDA, the spectral ops, the distributed hooks) is tested against
these functions. Functions take a ``dtype`` (default float64) and compute in it.

Notation: R samples (ranks, or ranks x micro-batches), each the
local MEAN gradient over b = B/R examples of a global batch B; g^j the sample j gradient,
g = mean_j g^j.

- per-coordinate variance  s2_i = B/(R-1) * (mean_j (g^j_i)^2 - g_i^2)
                                 = (B/R) * unbiased sample variance of g^j_i over j
- row covariance (m <= n)  C = B/(R-1) * (mean_j G^j G^jT - G G^T)          (m x m)
  (the column covariance G^T G side when m > n; tr(C_row^{1/2}) == tr(C_col^{1/2}))

The oracle computes variances by the two-pass (deviation) form, which equals the
formulas above in exact arithmetic and loses no digits to cancellation.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

Tensor = torch.Tensor

__all__ = [
    "mean_of_samples",
    "coordinate_variance",
    "gram",
    "gram_side",
    "row_covariance",
    "sqrt_trace",
    "nuclear_norm",
    "l1_norm",
    "l2_norm_sq",
    "variance_norms",
    "square_pack",
    "accumulate_sq",
    "nuclear_stats",
    "raw_gns",
    "pooled_noise",
]


def _stack(samples: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    if len(samples) == 0:
        raise ValueError("samples: expected at least one tensor, got none")
    shape = samples[0].shape
    for j, s in enumerate(samples):
        if s.shape != shape:
            raise ValueError(
                f"samples[{j}]: shape {tuple(s.shape)} differs from samples[0] shape {tuple(shape)}"
            )
    return torch.stack([s.detach().to(dtype) for s in samples])


def mean_of_samples(samples: Sequence[Tensor], dtype: torch.dtype = torch.float64) -> Tensor:
    """g = mean_j g^j. samples: R tensors of one shape. Returns that shape in ``dtype``."""
    return _stack(samples, dtype).mean(dim=0)


def coordinate_variance(
    samples: Sequence[Tensor], batch_size: float, dtype: torch.dtype = torch.float64
) -> Tensor:
    """Per-coordinate variance of ONE example's gradient, estimated from R sample means.

    s2_i = B/(R-1) * (mean_j (g^j_i)^2 - g_i^2) = B/(R(R-1)) * sum_j (g^j_i - g_i)^2.
    samples: R >= 2 tensors of one shape, each the mean gradient over B/R examples.
    Returns s2 (same shape, ``dtype``); never negative (two-pass form).
    """
    x = _stack(samples, dtype)
    r = x.shape[0]
    if r < 2:
        raise ValueError(f"samples: need at least 2 samples for a variance, got {r}")
    dev = x - x.mean(dim=0, keepdim=True)
    return (batch_size / (r * (r - 1))) * (dev * dev).sum(dim=0)


def gram_side(shape: Sequence[int], side: str = "auto") -> str:
    """'row' (G G^T, m x m) or 'col' (G^T G, n x n). 'auto' picks the smaller: row when m <= n."""
    if side not in ("auto", "row", "col"):
        raise ValueError(f"side: expected 'auto', 'row' or 'col', got {side!r}")
    if side != "auto":
        return side
    m, n = shape[-2], shape[-1]
    return "row" if m <= n else "col"


def gram(G: Tensor, side: str = "auto", dtype: torch.dtype = torch.float64) -> Tensor:
    """G G^T (side 'row', m x m) or G^T G (side 'col', n x n) of a 2-D (or batched) G."""
    s = gram_side(G.shape, side)
    x = G.detach().to(dtype)
    return x @ x.mT if s == "row" else x.mT @ x


def row_covariance(
    samples: Sequence[Tensor],
    batch_size: float,
    side: str = "auto",
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Covariance estimate of one example's gradient matrix, on one side.

    C = B/(R-1) * (mean_j G^j G^jT - G G^T) = B/(R(R-1)) * sum_j (G^j - G)(G^j - G)^T
    for side 'row' (m x m); the same with transposes (n x n) for side 'col'.
    'auto' takes the smaller side (the package's convention). tr(C^{1/2}) is the nuclear
    norm of the deviations stacked side by side, [D_1 .. D_R] (m x Rn) for 'row' and
    [D_1; ..; D_R] (Rm x n) for 'col', times sqrt(B/(R(R-1))): the two sides agree at
    R = 2 (D_2 = -D_1) and differ in general for R > 2.
    samples: R >= 2 tensors of one shape (m, n). Returns a PSD matrix in ``dtype``.
    """
    x = _stack(samples, dtype)
    if x.dim() != 3:
        raise ValueError(f"samples: expected 2-D tensors, got {x.dim() - 1}-D")
    r = x.shape[0]
    if r < 2:
        raise ValueError(f"samples: need at least 2 samples for a covariance, got {r}")
    dev = x - x.mean(dim=0, keepdim=True)
    return (batch_size / (r * (r - 1))) * gram(dev, side, dtype).sum(dim=0)


def sqrt_trace(A: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """tr(A^{1/2}) = sum_i sqrt(max(lambda_i, 0)) of symmetric A (..., m, m), via eigvalsh.

    Negative eigenvalues (rounding of a PSD matrix) are clamped to 0. Returns shape (...).
    """
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A: expected square matrices (..., m, m), got shape {tuple(A.shape)}")
    x = A.detach().to(dtype)
    x = 0.5 * (x + x.mT)
    return torch.linalg.eigvalsh(x).clamp_min(0).sqrt().sum(dim=-1)


def nuclear_norm(G: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """||G||_S1 = sum of singular values of G (..., m, n)."""
    return torch.linalg.svdvals(G.detach().to(dtype)).sum(dim=-1)


def l1_norm(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """||x||_1 over all elements."""
    return x.detach().to(dtype).abs().sum()


def l2_norm_sq(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """||x||_2^2 over all elements."""
    y = x.detach().to(dtype)
    return (y * y).sum()


def variance_norms(
    mean_grad: Tensor,
    mean_sq: Tensor,
    scale: float,
    shift: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Oracle of the fused op ``variance_norms``.

    d = mean_grad (the mean over samples of the shifted gradients g^j - shift),
    mean_sq = mean_j (g^j - shift)^2, g = d + shift (d when shift is None),
    s2 = max(scale * (mean_sq - d^2), 0)   (NaN stays NaN), s = sqrt(s2).
    Returns a 4-vector in ``dtype``: [||s||_1, ||g||_1, sum s2, ||g||_2^2].
    """
    d = mean_grad.detach().to(dtype).reshape(-1)
    q = mean_sq.detach().to(dtype).reshape(-1)
    if d.shape != q.shape:
        raise ValueError(f"mean_sq: expected {d.numel()} elements like mean_grad, got {q.numel()}")
    g = d if shift is None else d + shift.detach().to(dtype).reshape(-1)
    s2 = scale * (q - d * d)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)  # keeps NaN, unlike clamp_min on some paths
    return torch.stack([s2.sqrt().sum(), g.abs().sum(), s2.sum(), (g * g).sum()])


def square_pack(grad: Tensor, shift: Tensor | None = None, dtype: torch.dtype = torch.float64) -> Tensor:
    """Oracle of ``square_pack``: [x, x^2] flattened, x = grad - shift (grad when no shift)."""
    x = grad.detach().to(dtype).reshape(-1)
    if shift is not None:
        x = x - shift.detach().to(dtype).reshape(-1)
    return torch.cat([x, x * x])


def accumulate_sq(
    grad: Tensor, prev: Tensor, sq: Tensor, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """Oracle of ``accumulate_sq``: d = grad - prev; returns (sq + d*d, grad) in ``dtype``.

    (The fused op updates ``sq`` and ``prev`` in place; this returns the new values.)
    """
    d = grad.detach().to(dtype) - prev.detach().to(dtype)
    return sq.detach().to(dtype) + d * d, grad.detach().to(dtype).clone()


def nuclear_stats(
    samples_per_layer: Sequence[Sequence[Tensor]],
    batch_size: float,
    shifts: Sequence[Tensor | None] | None = None,
    side: str = "auto",
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor]:
    """Per layer: (tr(C_l^{1/2}) raw, ||G_l||_S1). samples_per_layer[l] = R matrices of layer l.

    C is computed by the two-pass row_covariance (deviations from the mean), which equals
    the subtraction form B/(R-1) (mean_j (G^j-S)(G^j-S)^T - (G-S)(G-S)^T) for any shift S
    in exact arithmetic and has no cancellation in floating point.
    """
    noise, signal = [], []
    for l, samples in enumerate(samples_per_layer):
        cov = row_covariance(samples, batch_size, side, dtype)
        noise.append(sqrt_trace(cov, dtype))
        signal.append(nuclear_norm(mean_of_samples(samples, dtype), dtype))
    return torch.stack(noise), torch.stack(signal)


def raw_gns(
    rank_grads: Sequence[Sequence[Tensor]], batch_size: float, geometry: str
) -> tuple[float, float]:
    """The paper's uncorrected estimators (eqs. GNS_estimate / spec_sample_variance), float64.

    rank_grads[j][p]: sample j's mean gradient of parameter p. Returns (noise, signal):
      l2:      (sum_i s2_i,                         ||g||_2^2)
      l1:      (||s||_1^2,                          ||g||_1^2)
      nuclear: ((sum_l tr(C_l^{1/2}))^2,            (sum_l ||G_l||_S1)^2), 2-D params only.
    """
    n_params = len(rank_grads[0])
    per_param = [[rg[p] for rg in rank_grads] for p in range(n_params)]
    if geometry == "l2":
        noise = sum(coordinate_variance(s, batch_size).sum() for s in per_param)
        signal = sum(l2_norm_sq(mean_of_samples(s)) for s in per_param)
        return float(noise), float(signal)
    if geometry == "l1":
        noise = sum(coordinate_variance(s, batch_size).sqrt().sum() for s in per_param)
        signal = sum(l1_norm(mean_of_samples(s)) for s in per_param)
        return float(noise) ** 2, float(signal) ** 2
    if geometry == "nuclear":
        mats = [s for s in per_param if s[0].dim() == 2]
        if not mats:
            raise ValueError("rank_grads: nuclear geometry needs at least one 2-D tensor")
        n, s = nuclear_stats(mats, batch_size)
        return float(n.sum()) ** 2, float(s.sum()) ** 2
    raise ValueError(f"geometry: expected 'l2', 'l1' or 'nuclear', got {geometry!r}")


def _c4(n: float) -> float:
    """E[s] / sigma for a sample standard deviation of n Gaussian samples (real n > 1)."""
    return math.sqrt(2.0 / (n - 1.0)) * math.exp(math.lgamma(n / 2.0) - math.lgamma((n - 1.0) / 2.0))


def _pooled_sqrt_trace(P: Tensor, nu: float) -> float:
    """tr(P^{1/2}) corrected for nu degrees of freedom (the second-order Wishart form):
    raw / c4(nu / k + 1), k = (sum_ij s_i s_j / (s_i + s_j) + raw / 2) / raw."""
    s = torch.linalg.eigvalsh(P).clamp_min(0).sqrt()
    raw = float(s.sum())
    if raw == 0.0:
        return 0.0
    ss = s[:, None] + s[None, :]
    pair = float(torch.where(ss > 0, s[:, None] * s[None, :] / torch.where(ss > 0, ss, torch.ones_like(ss)),
                             torch.zeros_like(ss)).sum())
    k = (pair + 0.5 * raw) / raw
    nu_eff = max(nu / k, 1.0)
    return raw / _c4(nu_eff + 1.0) if math.isfinite(nu_eff) else raw


def pooled_noise(
    measurements: Sequence[tuple[Sequence[Sequence[Tensor]], float] | None],
    geometry: str,
    beta: float,
    grad_scales: Sequence[float] | None = None,
) -> list[list[float]]:
    """The noise pools of gns_kernels.stats.pool, eagerly, in float64 (loops, two-pass variances).

    measurements[t] = (rank_grads, batch_size) of measurement t (rank_grads as raw_gns), or
    None for a measurement that is not folded (invalid). grad_scales[t]: the loss scale the
    gradients of measurement t carry (default 1). Returns, per measurement, one pooled value
    per parameter in the units of that measurement's gradients:
      l1:      sum_i sqrt(P_i) / c4(1/U + 1)  (P the EMA of s2_i; U = sum_k w_k^2 / (S_k - 1));
      nuclear: per 2-D parameter the corrected tr(P^{1/2}) for nu_s / U degrees of freedom,
               nu_s = max(num / var, 1) from the EMAs (from the second measurement) of
               tr C tr P' + <C, P'> and ||C - P'||_F^2 / (1/(S - 1) + U'), P' and U' the pool
               before the fold; nan for the first measurement (no pair yet).
    EMA: the first folded measurement sets the pool, each later one P <- beta P + (1-beta) x.
    An invalid measurement (None) gives [] and changes nothing; a parameter whose statistics
    are not finite gives nan and its pool skips that measurement (the others fold it).
    """
    if geometry not in ("l1", "nuclear"):
        raise ValueError(f"geometry: expected 'l1' or 'nuclear', got {geometry!r}")
    state: dict = {}
    out: list[list[float]] = []
    for t, meas in enumerate(measurements):
        if meas is None:
            out.append([])
            continue
        rank_grads, B = meas
        gs = 1.0 if grad_scales is None else float(grad_scales[t])
        S = len(rank_grads)
        vals = []
        for p in range(len(rank_grads[0])):
            samples = [rg[p] for rg in rank_grads]
            if geometry == "nuclear" and samples[0].dim() != 2:
                continue
            if geometry == "l1":
                x = coordinate_variance(samples, B).reshape(-1) / gs ** 2
            else:
                x = row_covariance(samples, B) / gs ** 2
            if not bool(torch.isfinite(x).all()):  # this parameter's pool skips the measurement
                vals.append(math.nan)
                continue
            st = state.get(p)
            if st is None:
                st = state[p] = {"P": x.clone(), "n": 1, "U": 1.0 / (S - 1), "num": 0.0, "var": 0.0,
                                 "npair": 0}
            else:
                if geometry == "nuclear":
                    P0 = st["P"]
                    num_k = float(torch.trace(x) * torch.trace(P0) + (x * P0).sum())
                    var_k = float(((x - P0) ** 2).sum()) / (1.0 / (S - 1) + st["U"])
                    bp = beta if st["npair"] else 0.0
                    st["num"] = bp * st["num"] + (1 - bp) * num_k
                    st["var"] = bp * st["var"] + (1 - bp) * var_k
                    st["npair"] += 1
                st["P"] = beta * st["P"] + (1 - beta) * x
                st["U"] = beta ** 2 * st["U"] + (1 - beta) ** 2 / (S - 1)
                st["n"] += 1
            if geometry == "l1":
                vals.append(gs * float(st["P"].sqrt().sum()) / _c4(1.0 / st["U"] + 1.0))
            elif st["npair"] == 0:
                vals.append(math.nan)
            else:
                nu_s = max(st["num"] / st["var"], 1.0) if st["var"] > 0 else math.inf
                vals.append(gs * _pooled_sqrt_trace(st["P"], nu_s / st["U"]))
        out.append(vals)
    return out
