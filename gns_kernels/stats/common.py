"""Argument checks and small tensor helpers that several statistics modules share.

Pure torch; no other module of the package.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Sequence

import torch

Tensor = torch.Tensor

__all__ = ["check_sample_count", "check_loo_count", "rows_side", "smaller_side", "as_float64", "scatter_cols"]


def check_sample_count(name: str, R) -> int:
    """A number of samples: an integer >= 2 (an integral float such as 4.0 is accepted)."""
    ok = not isinstance(R, bool) and isinstance(R, Real) and math.isfinite(R) and int(R) == R and R >= 2
    if not ok:
        raise ValueError(f"{name}: expected an integer number of samples >= 2, got {R!r}")
    return int(R)


def check_loo_count(R) -> int:
    """A number of samples for the leave-one-out and fourth-moment sums: an integer >= 3."""
    if isinstance(R, bool) or int(R) != R or R < 3:
        raise ValueError(f"num_samples: expected an integer >= 3 (leave-one-out needs 2 left), got {R}")
    return int(R)


def rows_side(d: Tensor) -> Tensor:
    """d (..., m, n) with its smaller side as the rows: d.mT when m > n, else d."""
    return d.mT if d.shape[-2] > d.shape[-1] else d


def as_float64(v) -> Tensor:
    """v as a float64 tensor without autograd history (v itself when it is one)."""
    if isinstance(v, Tensor) and v.dtype == torch.float64 and not v.requires_grad:
        return v
    return torch.as_tensor(v).detach().to(torch.float64)


def smaller_side(shape: Sequence[int]) -> str:
    """'row' (G G^T, m x m) when m <= n, else 'col' (G^T G, n x n), for a shape (..., m, n)."""
    m, n = shape[-2], shape[-1]
    return "row" if m <= n else "col"


def scatter_cols(part: Tensor, cols: list, L: int) -> Tensor:
    """[rows, L] with part[:, j] in column cols[j] (ascending) and 0 elsewhere: slices of
    part and of one zero block (runs of consecutive columns stay one slice; no index
    tensor from the host)."""
    if len(cols) == L:
        return part
    zero = torch.zeros((part.shape[0], L), dtype=part.dtype, device=part.device)
    pieces = []
    prev = j = 0
    n = len(cols)
    while j < n:
        e = j
        while e + 1 < n and cols[e + 1] == cols[e] + 1:
            e += 1
        if cols[j] > prev:
            pieces.append(zero[:, prev:cols[j]])
        pieces.append(part[:, j:e + 1])
        prev = cols[e] + 1
        j = e + 1
    if prev < L:
        pieces.append(zero[:, prev:L])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
