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


def shape_key(shape) -> str:
    """The eigensolver-hint key of a parameter shape: '768x256'."""
    return "x".join(str(int(d)) for d in shape)


def nuclear_stats_or_nan(mean_grams: Sequence[Tensor], mean_grads: Sequence[Tensor],
                         shifts: Optional[Sequence[Optional[Tensor]]], scale: float,
                         bias_correction: bool, num_samples: int, batch_size: float,
                         state=None, shapes: Optional[Sequence] = None):
    """(noise Tensor[L], signal Tensor[L]) as spectral.nuclear_stats, or nan tensors.

    state / shapes (one parameter shape per layer): the hook state's eigensolver hints
    (``state._eig_float64``, by shape) go to spectral.nuclear_stats(eig_float64=...), and
    its eig_report is OR-ed into ``state._eig_seen`` (applied when the measurement
    finishes; identical on every rank: every rank solves the same matrices)."""
    return nuclear_stats_hinted(
        lambda hint, report: _guarded(mean_grams, mean_grads, shifts, scale, bias_correction,
                                      num_samples, batch_size, hint, report), state, shapes)


def nuclear_stats_hinted(call, state, shapes):
    """call(eig_float64 hint or None, eig_report list or None) with the state's hints."""
    if state is None:
        return call(None, None)
    keys = [shape_key(s) for s in shapes]
    report: list = []
    out = call([state._eig_float64.get(k, False) for k in keys], report)
    for k, f in zip(keys, report):
        state._eig_seen[k] = state._eig_seen.get(k, False) or bool(f)
    return out


def _guarded(mean_grams, mean_grads, shifts, scale, bias_correction, num_samples, batch_size,
             hint, report):
    nan = torch.full((len(mean_grams),), float("nan"))
    finite = all(bool(torch.isfinite(A).all()) for A in mean_grams) and all(
        bool(torch.isfinite(D).all()) for D in mean_grads)
    if not finite:
        return nan, nan
    try:
        return spectral.nuclear_stats(
            list(mean_grams), list(mean_grads), scale=scale, shifts=shifts,
            bias_correction=bias_correction, num_samples=num_samples, batch_size=batch_size,
            eig_float64=hint, eig_report=report)
    except (RuntimeError, torch.linalg.LinAlgError) as exc:  # LinAlgError is a RuntimeError
        warnings.warn(f"gns_kernels: nuclear statistics failed ({exc}); this measurement is "
                      "marked invalid", RuntimeWarning, stacklevel=3)
        return nan, nan
