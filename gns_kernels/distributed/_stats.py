"""Nuclear statistics of one process's Grams (MicroBatchGNS on one rank): guarded.

Non-finite inputs (non-finite gradients on some rank) and an eigensolver failure both give
nan statistics -- an invalid measurement on every rank (all ranks hold the same reduced
numbers, so they fail alike) -- instead of an exception inside DDP's backward; a solver
failure also warns, since it means the measurement was lost for a numerical reason.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .. import spectral
from .._validation import warn_user as _warn_user

Tensor = torch.Tensor


def all_finite(tensors: Sequence[Tensor], device) -> Tensor:
    """0-d bool tensor on `device`: every element of every tensor is finite (no host read).

    One read of each tensor and no tensor-sized temporary: the min and max of a tensor are
    finite exactly when every element is (aminmax propagates NaN; an inf is the max or the
    min). Empty tensors count as finite."""
    ends = [x.to(device=device, dtype=torch.float64) for t in tensors if t.numel()
            for x in torch.aminmax(t)]
    if not ends:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.isfinite(torch.stack(ends)).all()


def exact_sum(values: Sequence[float]) -> float:
    """The correctly rounded sum of floats (math.fsum): a function of the values alone, not
    of their order, so totals over matrices or parameters do not depend on the order in
    which DDP's bucket layout presented them. Non-finite values: the plain sum (NaN or inf,
    where fsum would raise on inf - inf)."""
    vals = [float(v) for v in values]
    if all(math.isfinite(v) for v in vals):
        return math.fsum(vals)
    return float(sum(vals))


def l1_signal_debiased_sum(means: Sequence[Tensor], mean_sqs: Sequence[Tensor],
                           shifts: Sequence[Optional[Tensor]], scale: float,
                           batch_size: float) -> Tensor:
    """float64 0-d: sum over the given parameters of sum_i sqrt(max(g_i^2 - s2_i / B, 0))
    (stats.signal.l1_signal_debiased) from the reduced halves of the l1 pack: means[p] =
    mean_j x^j, mean_sqs[p] = mean_j (x^j)^2 (flat, x = g - S), shifts[p] = S or None;
    s2 = scale (mean_sqs - means^2) clamped at 0, g = means + S. float64 arithmetic (the
    clamp at 0 is where float32 cancellation would show). No host synchronization."""
    total = torch.zeros((), dtype=torch.float64, device=means[0].device if means else None)
    for d, q, S in zip(means, mean_sqs, shifts):
        d64 = d.detach().to(torch.float64)
        s2 = (scale * (q.detach().to(torch.float64) - d64 * d64)).clamp_min(0)
        g = d64 if S is None else d64 + S.detach().reshape(-1).to(torch.float64)
        v = g * g - s2 / batch_size
        total = total + torch.where(v > 0, v, torch.zeros_like(v)).sqrt().sum()
    return total


def nuclear_stats_or_nan(mean_grams: Sequence[Tensor], mean_grads: Sequence[Tensor],
                         shifts: Optional[Sequence[Optional[Tensor]]], scale: float,
                         bias_correction: bool, num_samples: int, batch_size: float,
                         hints: Optional[spectral.EigHints] = None, signal: str = "raw",
                         method: str = "auto"):
    """(noise Tensor[L], signal Tensor[L]) as spectral.nuclear_stats, or nan tensors.
    signal: 'raw' or 'debiased' (spectral.nuclear_stats's signal); method: its solver.

    hints: the state's eigensolver hints (keyed by the shapes of mean_grads; reports applied
    when the measurement finishes). Validity is decided on the device: no host read here
    (the eigenvalue path's hint report reads the solver's flags)."""
    L = len(mean_grams)
    dev = mean_grams[0].device if L else torch.device("cpu")
    nan = torch.full((L,), float("nan"), device=dev)
    if L == 0:
        return nan, nan
    # validity stays on the device (no host read): non-finite inputs -> nan statistics
    finite = all_finite(list(mean_grams) + list(mean_grads), dev)
    try:
        noise, signal = spectral.nuclear_stats(
            list(mean_grams), list(mean_grads), scale=scale, shifts=shifts,
            bias_correction=bias_correction, num_samples=num_samples, batch_size=batch_size,
            eig_hints=hints, signal=signal, method=method)
    except (RuntimeError, torch.linalg.LinAlgError) as exc:  # LinAlgError is a RuntimeError
        _warn_user(f"gns_kernels: nuclear statistics failed ({exc}); this measurement is "
                   "marked invalid")
        return nan, nan
    return torch.where(finite, noise, nan), torch.where(finite, signal, nan)
