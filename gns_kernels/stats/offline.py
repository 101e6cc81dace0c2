"""gk.estimate: the gradient noise scale of R sample gradients held in memory (ranks or
ranks x micro-batches; the hooks measure the same during training).

The formulas, their units, the bias correction and the signals: gns_kernels.stats.gns.
R samples g^j, each the MEAN gradient over b = B/R examples of a global batch B (equal
split), g = mean_j g^j, S an optional shift identical on all samples:

    s2_i = B/(R-1) * ( mean_j (g^j_i - S_i)^2 - (g_i - S_i)^2 )          (clamped at 0)
    C    = B/(R-1) * ( mean_j (G^j-S)(G^j-S)^T - (G-S)(G-S)^T )         (m x m, m <= n;
           the n x n column side when m > n: spectral.smaller_side)

computed here in the centred two-pass form (no cancellation), float64 by default.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .._validation import check_signal
from ..ops import eager_variance_sums
from .bias import nuclear_sqrt_trace_corrected
from .common import smaller_side
from .dof import resolve_nuclear_dof
from .fourth_moments import dof_from_samples_gaussian, nuclear_dof_from_samples
from .gns import GNSEstimate, as_float, check_counts, check_geometry, estimate_from_stats
from .signal import l1_signal_debiased, nuclear_signal_debiased

Tensor = torch.Tensor

__all__ = ["estimate"]


def _check_real_tensor(name: str, t: Tensor) -> None:
    """A real (floating or integer, not bool/complex) tensor with data (not on meta)."""
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name}: expected a real floating-point tensor, got dtype {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (CPU or CUDA), got device meta")


def _normalise_samples(rank_grads) -> list[list[Tensor]]:
    if isinstance(rank_grads, Tensor) or rank_grads is None:
        raise ValueError(
            "rank_grads: expected a list (one entry per sample) of lists of tensors, got "
            f"{type(rank_grads).__name__}"
        )
    samples = list(rank_grads)
    if len(samples) == 0:
        raise ValueError("rank_grads: empty; expected at least 2 samples (ranks or micro-batches)")
    out = []
    for j, sample in enumerate(samples):
        params = [sample] if isinstance(sample, Tensor) else list(sample)
        for p, t in enumerate(params):
            if not isinstance(t, Tensor):
                raise ValueError(f"rank_grads[{j}][{p}]: expected a tensor, got {type(t).__name__}")
            _check_real_tensor(f"rank_grads[{j}][{p}]", t)
        out.append(params)
    if len(out) < 2:
        raise ValueError(f"rank_grads: expected at least 2 samples for a variance, got {len(out)}")
    n_params = len(out[0])
    if n_params == 0:
        raise ValueError("rank_grads[0]: empty; expected at least one gradient tensor per sample")
    for j, params in enumerate(out):
        if len(params) != n_params:
            raise ValueError(
                f"rank_grads[{j}]: has {len(params)} tensors, rank_grads[0] has {n_params}; "
                "every sample must hold the same parameters"
            )
        for p, t in enumerate(params):
            if t.device != out[0][0].device:
                raise ValueError(
                    f"rank_grads[{j}][{p}]: expected device {out[0][0].device} like "
                    f"rank_grads[0][0], got {t.device}"
                )
            if t.shape != out[0][p].shape:
                raise ValueError(
                    f"rank_grads[{j}][{p}]: shape {tuple(t.shape)} differs from "
                    f"rank_grads[0][{p}] shape {tuple(out[0][p].shape)}"
                )
    if sum(t.numel() for t in out[0]) == 0:
        raise ValueError("rank_grads: the gradient tensors hold no elements")
    return out


def _normalise_shift(shift, first: list[Tensor]) -> list[Tensor | None]:
    if shift is None:
        return [None] * len(first)
    shifts = [shift] if isinstance(shift, Tensor) else list(shift)
    if len(shifts) != len(first):
        raise ValueError(f"shift: expected {len(first)} tensors (one per parameter, or None), got {len(shifts)}")
    for p, (s, t) in enumerate(zip(shifts, first)):
        if s is not None and (not isinstance(s, Tensor) or s.shape != t.shape):
            got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise ValueError(f"shift[{p}]: expected None or a tensor of shape {tuple(t.shape)}, got {got}")
        if s is not None:
            _check_real_tensor(f"shift[{p}]", s)
    return shifts


def estimate(
    rank_grads: Sequence[Sequence[Tensor]],
    batch_size: int,
    geometry: str = "l1",
    bias_correction: bool = True,
    shift: Sequence[Tensor | None] | Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    *,
    nuclear_dof: str = "auto",
    signal: str = "raw",
) -> GNSEstimate:
    """GNS of R sample gradients in the given geometry (see gns_kernels.stats.gns).

    rank_grads: R >= 2 samples, each a list of tensors (one per parameter, same shapes in
      every sample; a bare tensor counts as a one-parameter list); sample j holds the MEAN
      gradient over batch_size / R examples.
    batch_size: global batch B, a multiple of R.
    geometry: 'l2', 'l1' or 'nuclear' (nuclear uses 2-D tensors only; others are ignored).
    bias_correction: correct the small-R bias of the noise (l1: 1/c4(R)^2; nuclear:
      bias.nuclear_sqrt_trace_corrected per matrix); False gives the paper's estimator.
    nuclear_dof: degrees of freedom nu of each matrix's covariance estimate for the nuclear
      correction (docs/estimators.md, docs/fidelity.md):
      'auto' (default): 'gauss-sums' when R >= 3, else 'columns' -- what the DDP hook
        (ranks as samples) computes, so the default estimate equals the hook's;
      'gauss-sums': nu from the per-sample sums sum_j ||d_j d_j^T||_F^2,
        sum_j ||d_j||_F^4 and the Gram M = sum_j d_j d_j^T (d_j = x_j - mean, Gaussian
        rank means; gns_kernels.stats.fourth_moments.dof_from_samples_gaussian); R >= 3;
      'columns': (R-1) * n, n the matrix's longer side (Gaussian independent columns; an
        over-estimate of nu for correlated inputs: on real networks at local batch 16 it
        removes 2-20% of the small-R bias, 'gauss-sums' 49-112%:
        docs/record/fidelity-experiments.md);
      'data': estimated from the samples' fourth moments without a Gaussian assumption
        (stats.fourth_moments.nuclear_dof_from_samples; R >= 4; O(R^2 m^2 n), needs cross-sample terms a
        hook cannot form); 'rank_one': (R-1) * n b / (n + b).
    signal: 'raw' (default, the paper's) or 'debiased' (gns_kernels.stats.gns).
    shift: None, or one tensor (or None) per parameter, identical for all samples (e.g. the
      momentum buffer). The statistics are computed from x^j = g^j - S. In exact arithmetic
      S changes nothing; in floating point it changes only rounding: the variance is the
      centered two-pass form mean_j (x^j - mean x)^2 (no cancellation), whose relative
      rounding error is about eps * |g - S| / sigma (sigma the per-coordinate standard
      deviation of the samples), so a shift close to g helps in float32 and a shift far
      from g (|S| >> |g|) costs accuracy.
    dtype: arithmetic of the statistics (float64 by default).
    Returns GNSEstimate; non-finite gradients give valid=False. On CPU the result does not
    depend on the number of threads (torch.set_num_threads) for 'l2' and 'l1' (sums in a
    fixed order); 'nuclear' uses BLAS/LAPACK (matmul, eigvalsh, svdvals), whose last bits
    may.
    """
    check_geometry(geometry)
    samples = _normalise_samples(rank_grads)
    R, B = check_counts(len(samples), batch_size)
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    shifts = _normalise_shift(shift, samples[0])
    scale = B / (R - 1)
    n_params = len(samples[0])

    def shifted(p: int) -> tuple[Tensor, Tensor | None]:
        x = torch.stack([samples[j][p].detach().to(dtype) for j in range(R)])
        S = shifts[p]
        if S is None:
            return x, None
        S = S.detach().to(device=x.device, dtype=dtype)
        return x - S, S

    check_signal(signal)
    debiased = signal == "debiased"
    if geometry in ("l2", "l1"):
        sums = torch.zeros(4, dtype=dtype)
        deb = torch.zeros((), dtype=torch.float64)
        for p in range(n_params):
            x, S = shifted(p)
            d = x.mean(dim=0)
            v = (x - d).square().mean(dim=0)  # centered two-pass variance: no cancellation
            g = d if S is None else d + S
            sums = sums + eager_variance_sums(scale * v, g, dtype).cpu()
            if debiased and geometry == "l1":
                deb = deb + l1_signal_debiased(g, scale * v, B).cpu()
        if geometry == "l2":
            return estimate_from_stats(geometry, sums[2], sums[3], R, B, bias_correction, signal=signal)
        return estimate_from_stats(geometry, sums[0], sums[1], R, B, bias_correction, signal=signal,
                                   signal_debiased_sum=deb if debiased else None)

    mode = resolve_nuclear_dof(nuclear_dof, R)
    # a 0 x n matrix adds nothing to either sum (tr C^{1/2} = ||G||_S1 = 0): skipped
    mats = [p for p in range(n_params) if samples[0][p].dim() == 2 and samples[0][p].numel() > 0]
    if not mats:
        raise ValueError(
            "rank_grads: geometry 'nuclear' needs at least one non-empty 2-D tensor per sample "
            "(0 x n matrices hold nothing and are skipped)"
        )
    noise_sum, noise_unc, signal_sum, deb_sum = 0.0, 0.0, 0.0, 0.0
    for p in mats:
        x, S = shifted(p)
        if smaller_side(x.shape) == "col":  # the Gram side of spectral.nuclear_stats and the hooks
            x = x.mT
            S = None if S is None else S.mT
        m, n = x.shape[-2], x.shape[-1]
        d = x.mean(dim=0)
        y = x - d  # centered: C = B/(R-1) mean_j y_j y_j^T, free of the A - d d^T cancellation
        C = scale * (y @ y.mT).mean(dim=0)
        if not bool(torch.isfinite(C).all()):
            ev = torch.full((m,), math.nan, dtype=dtype, device=C.device)
        else:
            ev = torch.linalg.eigvalsh(0.5 * (C + C.mT))
        raw = torch.where(ev < 0, torch.zeros_like(ev), ev).sqrt().sum()
        if bias_correction:
            if mode in ("data", "gauss-sums"):
                # nan for non-finite x: an invalid estimate
                nu = (nuclear_dof_from_samples(x) if mode == "data"
                      else dof_from_samples_gaussian(x))
                corr = nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu / (R - 1))
            else:
                corr = nuclear_sqrt_trace_corrected(ev, R, B, other_dim=n, dof_model=mode)
        else:
            corr = raw
        g = d if S is None else d + S
        finite_g = bool(torch.isfinite(g).all())
        if finite_g:
            sv = torch.linalg.svdvals(g).sum()
        else:
            sv = torch.tensor(math.nan, dtype=dtype)
        if debiased:
            if finite_g and bool(torch.isfinite(C).all()):
                deb_sum = deb_sum + as_float(nuclear_signal_debiased(g, C, B))
            else:
                deb_sum = math.nan
        noise_sum = noise_sum + as_float(corr)
        noise_unc = noise_unc + as_float(raw)
        signal_sum = signal_sum + as_float(sv)
    return estimate_from_stats(
        "nuclear", noise_sum, signal_sum, R, B, bias_correction, noise_uncorrected_sum=noise_unc,
        signal=signal, signal_debiased_sum=deb_sum if debiased else None, nuclear_dof=mode,
    )
