"""Nuclear statistics of reduced Grams for the hooks: spectral.nuclear_stats, guarded.

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

    hints: the hook state's eigensolver hints (keyed by the shapes of mean_grads; reports
    applied when the measurement finishes, identical on every rank: every rank solves the
    same matrices)."""
    nan = torch.full((len(mean_grams),), float("nan"))
    finite = all(bool(torch.isfinite(A).all()) for A in mean_grams) and all(
        bool(torch.isfinite(D).all()) for D in mean_grads)
    if not finite:
        return nan, nan
    try:
        return spectral.nuclear_stats(
            list(mean_grams), list(mean_grads), scale=scale, shifts=shifts,
            bias_correction=bias_correction, num_samples=num_samples, batch_size=batch_size,
            eig_hints=hints)
    except (RuntimeError, torch.linalg.LinAlgError) as exc:  # LinAlgError is a RuntimeError
        warnings.warn(f"gns_kernels: nuclear statistics failed ({exc}); this measurement is "
                      "marked invalid", RuntimeWarning, stacklevel=2)
        return nan, nan
