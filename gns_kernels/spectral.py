"""Nuclear (S1) statistics: batched Grams, tr(A^{1/2}), per-layer noise and signal.

First version: simple and exact (float64 eigvalsh). Faster paths follow behind the same
signatures.

Notation (DESIGN.md): per layer a gradient matrix G (m x n); samples j = 1..R; the row
covariance C = scale * (mean_j G^j G^jT - G G^T), scale = B/(R-1); noise tr(C^{1/2}),
signal ||G||_S1 = tr((G G^T)^{1/2}).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .reference import gram_side

Tensor = torch.Tensor

__all__ = ["gram", "sqrt_trace", "nuclear_stats"]


def gram(tensors: Sequence[Tensor], side: str = "auto") -> list[Tensor]:
    """Per 2-D tensor G (m x n): G G^T ('row', m x m) or G^T G ('col', n x n), float32.

    'auto' takes the smaller side (row when m <= n). Returns a list in input order.
    """
    out = []
    for i, g in enumerate(tensors):
        if g.dim() != 2:
            raise ValueError(f"tensors[{i}]: expected a 2-D tensor, got shape {tuple(g.shape)}")
        s = gram_side(g.shape, side)
        x = g.detach().float()
        out.append(x @ x.mT if s == "row" else x.mT @ x)
    return out


def sqrt_trace(A: Tensor, method: str = "auto") -> Tensor:
    """tr(A^{1/2}) = sum_i sqrt(max(lambda_i, 0)) for symmetric PSD A (..., m, m).

    Returns a float32 tensor of shape (...). Negative eigenvalues (rounding) count as 0.
    """
    if method not in ("auto", "eigh", "newton"):
        raise ValueError(f"method: expected 'auto', 'eigh' or 'newton', got {method!r}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A: expected square matrices (..., m, m), got shape {tuple(A.shape)}")
    x = A.detach().double()
    x = 0.5 * (x + x.mT)
    return torch.linalg.eigvalsh(x).clamp_min(0).sqrt().sum(-1).float()


def nuclear_stats(
    mean_grams: Sequence[Tensor],
    mean_grads: Sequence[Tensor] | None = None,
    scale: float = 1.0,
    shifts: Sequence[Tensor | None] | None = None,
    mean_grad_grams: Sequence[Tensor] | None = None,
    side: str = "auto",
    bias_correction: bool = False,
    num_samples: int | None = None,
    batch_size: float | None = None,
    signal_grams: Sequence[Tensor] | None = None,
    validate: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per layer (noise tr(C_l^{1/2}), signal ||G_l||_S1), each a float32 Tensor[L].

    C_l = scale * (mean_grams[l] - D_l D_l^T) on the Gram side of mean_grams[l];
    D_l = mean_grads[l] (the mean over samples of the shifted gradients G^j - S_l),
    G_l = D_l + shifts[l] (D_l when no shift). Instead of mean_grads, the Gram of D_l may be
    given as mean_grad_grams (FSDP2); the signal then uses signal_grams (the Gram of G_l)
    or, without it, mean_grad_grams (valid only when no shift was applied).
    """
    L = len(mean_grams)
    noise, signal = [], []
    for l in range(L):
        A = mean_grams[l].detach().double()
        k = A.shape[-1]
        if mean_grad_grams is not None:
            DD = mean_grad_grams[l].detach().double()
            GG = (signal_grams[l] if signal_grams is not None else mean_grad_grams[l]).detach().double()
        else:
            D = mean_grads[l].detach().double()
            s = "row" if D.shape[0] == k else "col"
            if side != "auto":
                s = side
            DD = D @ D.mT if s == "row" else D.mT @ D
            G = D if shifts is None or shifts[l] is None else D + shifts[l].detach().double()
            GG = G @ G.mT if s == "row" else G.mT @ G
        C = scale * (A - DD)
        if bias_correction:
            from .bias import nuclear_sqrt_trace_corrected

            ev = torch.linalg.eigvalsh(0.5 * (C + C.mT))
            noise.append(nuclear_sqrt_trace_corrected(ev, num_samples, batch_size).float())
        else:
            noise.append(sqrt_trace(C))
        signal.append(sqrt_trace(GG))
    return torch.stack(noise), torch.stack(signal)
