"""Argument checks shared by the spectral entry points."""
from __future__ import annotations

import os

import torch

Tensor = torch.Tensor

_DEBUG_ENV = "GNS_KERNELS_VALIDATE"


def validate_requested(validate: bool) -> bool:
    """validate, or the environment variable GNS_KERNELS_VALIDATE set to anything but '' / '0'."""
    return bool(validate) or os.environ.get(_DEBUG_ENV, "") not in ("", "0")


def check_square(A, name: str) -> None:
    """A is a floating torch.Tensor of square matrices (..., m, m); ValueError naming ``name``."""
    if not isinstance(A, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(A).__name__}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name}: expected square matrices (..., m, m), got shape {tuple(A.shape)}")
    if not A.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {A.dtype}")


def validate_symmetric(A: Tensor, name: str) -> None:
    """Finite and symmetric to 1e-3 of max|A| (reads the data: a host synchronization)."""
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"{name}: contains non-finite values")
    if A.numel() == 0:
        return
    x = A.detach().double()
    asym = (x - x.mT).abs().amax()
    size = x.abs().amax()
    if float(asym) > 1e-3 * float(size):
        raise ValueError(f"{name}: expected symmetric matrices, max |A - A^T| = {float(asym):.3g} "
                         f"vs max |A| = {float(size):.3g}")
