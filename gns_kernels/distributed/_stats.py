"""Nuclear statistics of one process's Grams (MicroBatchGNS on one rank): guarded.

Non-finite inputs (non-finite gradients on some rank) and an eigensolver failure both give
nan statistics -- an invalid measurement on every rank (all ranks hold the same reduced
numbers, so they fail alike) -- instead of an exception inside DDP's backward; a solver
failure also warns, since it means the measurement was lost for a numerical reason.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from .. import spectral

Tensor = torch.Tensor


def nuclear_stats_or_nan(mean_grams: Sequence[Tensor], mean_grads: Sequence[Tensor],
                         shifts: Optional[Sequence[Optional[Tensor]]], scale: float,
                         bias_correction: bool, num_samples: int, batch_size: float,
                         hints: Optional[spectral.EigHints] = None):
    """(noise Tensor[L], signal Tensor[L]) as spectral.nuclear_stats, or nan tensors.

    hints: the state's eigensolver hints (keyed by the shapes of mean_grads; reports applied
    when the measurement finishes). Validity is decided on the device: no host read here
    (the eigenvalue path's hint report reads the solver's flags)."""
    L = len(mean_grams)
    dev = mean_grams[0].device if L else torch.device("cpu")
    nan = torch.full((L,), float("nan"), device=dev)
    if L == 0:
        return nan, nan
    # validity stays on the device (no host read): non-finite inputs -> nan statistics
    finite = torch.stack([torch.isfinite(t).all() for t in list(mean_grams) + list(mean_grads)]).all()
    try:
        noise, signal = spectral.nuclear_stats(
            list(mean_grams), list(mean_grads), scale=scale, shifts=shifts,
            bias_correction=bias_correction, num_samples=num_samples, batch_size=batch_size,
            eig_hints=hints)
    except (RuntimeError, torch.linalg.LinAlgError) as exc:  # LinAlgError is a RuntimeError
        warnings.warn(f"gns_kernels: nuclear statistics failed ({exc}); this measurement is "
                      "marked invalid", RuntimeWarning, stacklevel=2)
        return nan, nan
    return torch.where(finite, noise, nan), torch.where(finite, signal, nan)
