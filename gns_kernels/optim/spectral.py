"""Stochastic spectral descent (specSGD): the Schatten-infinity steepest descent method whose
GNS lives in the dual nuclear (S1) geometry (paper section 2, eq. (2), footnote on matsign).

For each 2-D parameter X (m x n) with update direction G (the gradient, or its momentum):

    G = U diag(S) V^T  (reduced SVD)      P = matsign(G) = U sign(S) V^T
    X <- X (1 - lr wd) - lr P

P is the exact orthogonal polar factor of G (the closest semi-orthogonal matrix in
Frobenius norm), computed by SVD — not by Newton-Schulz as torch.optim.Muon does.
sign(S): singular values <= max(m, n) * eps * S_max (eps of the SVD dtype; numpy's
matrix_rank tolerance) count as zero, so a rank-deficient G gives a partial isometry
(P = 0 for G = 0), consistent with sign(0) = 0 for signSGD.

Momentum (optional, like Muon): m <- beta m + (1 - beta) G (EMA form, gradient scale, so
``state["momentum_buffer"]`` can serve as the GNS shift); the direction is m, or with
nesterov=True G + beta (m - G) = lerp(G, m, beta) (torch.optim.Muon's convention).

Parameters that are not 2-D are rejected with ValueError (as torch.optim.Muon does): give
embeddings/norm gains/biases to another optimizer (the paper uses AdamW for 1-D
parameters in composite set-ups and measures the nuclear GNS on the 2-D parameters only).
No shape-dependent learning-rate adjustment is applied (Muon's adjust_lr_fn is not).
SVD runs in float32 for half/bfloat16/float32 parameters and in float64 for float64 ones.
A non-finite gradient (or momentum) gives a NaN direction, so the parameter turns NaN as
with any torch optimizer (use GradScaler / skip such steps; torch.linalg.svd would raise on
NaN and silently return zeros on inf).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import Optimizer

from ._common import check_hyper

__all__ = ["SpecSGD", "polar_factor"]


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """matsign(G) = U sign(S) V^T of a 2-D tensor (m x n) by reduced SVD; same dtype as G.

    Singular values <= max(m, n) * eps * max(S) are treated as zero. A G with any
    non-finite entry gives an all-NaN result (the polar factor is undefined; the NaN then
    shows in the parameters, as with torch's optimizers, instead of a silent finite step).
    """
    if G.ndim != 2:
        raise ValueError(f"polar_factor expects a 2-D tensor, got shape {tuple(G.shape)}")
    work = torch.float64 if G.dtype == torch.float64 else torch.float32
    A = G.to(work)
    if not bool(torch.isfinite(A).all()):
        return torch.full_like(G, float("nan"))
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    if S.numel() == 0:
        return torch.zeros_like(G)
    tol = max(A.shape) * torch.finfo(work).eps * S.max()
    keep = (S > tol).to(work)
    return ((U * keep) @ Vh).to(G.dtype)


class SpecSGD(Optimizer):
    """specSGD: ``X -= lr * U V^T`` per 2-D parameter (after ``X *= 1 - lr*wd``).

    Args:
        params: iterable of 2-D parameters or param groups (others: ValueError).
        lr: step length (the step has spectral norm lr), >= 0.
        momentum: beta in [0, 1); 0 = plain specSGD on the gradient.
        nesterov: use lerp(G, m, beta) instead of m (needs momentum > 0).
        weight_decay: decoupled weight decay factor, >= 0.

    State (momentum > 0): ``state[p]["momentum_buffer"]`` (gradient scale, p's dtype).
    """

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0) -> None:
        momentum = check_hyper("momentum", momentum, 0.0, 1.0)
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
        if nesterov and momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0")
        defaults = dict(lr=check_hyper("lr", lr, 0.0), momentum=momentum, nesterov=nesterov,
                        weight_decay=check_hyper("weight_decay", weight_decay, 0.0))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for i, p in enumerate(params):
            if p.ndim != 2:
                raise ValueError(
                    f"SpecSGD only supports 2-D parameters; params[{i}] has shape "
                    f"{tuple(p.shape)}: give non-matrix parameters to another optimizer "
                    "(e.g. AdamW, as the paper does)"
                )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse or torch.is_complex(g):
                    raise RuntimeError("SpecSGD does not support sparse or complex gradients")
                d = g
                if beta > 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    m = state["momentum_buffer"]
                    m.mul_(beta).add_(g.to(m.dtype), alpha=1 - beta)
                    d = g.to(m.dtype).lerp(m, beta) if group["nesterov"] else m
                P = polar_factor(d)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(P.to(p.dtype), alpha=-lr)
        return loss
