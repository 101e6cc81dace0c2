"""Stochastic sign descent (signSGD) and sign of momentum (Signum): the l-infinity steepest
descent methods whose GNS lives in the dual l1 geometry (paper section 2, eq. (2)).

signSGD:  x <- x - lr * sign(g)
Signum:   m <- beta * m + (1 - beta) * g      (m_0 = 0; Bernstein et al. 2018, Algorithm 1)
          x <- x - lr * sign(m)

Conventions:
- sign(0) = 0, so a coordinate with exactly zero gradient / momentum stays put.
- Non-finite inputs: a NaN or inf gradient (or momentum) coordinate gives a NaN step, so the
  parameter turns NaN as with torch's other optimizers (torch.sign alone maps NaN to 0, a
  silent non-step, and inf to 1). Use GradScaler or skip such steps.
- Signum's momentum is the exponential moving average form ("EMA parameter beta" in the
  paper's tables). The heavy-ball form m <- beta m + g gives the same sign (it is the EMA
  scaled by 1/(1-beta) from m_0 = 0), but the EMA keeps ``state["momentum_buffer"]`` on the
  gradient's scale, which makes it a good ``shift`` for the GNS estimators (a tensor
  identical on all DDP ranks close to the mean gradient; docs/fused_ops.md, "Cancellation").
- weight_decay is decoupled (AdamW / Lion / torch.optim.Muon style): x <- x (1 - lr wd)
  before the sign step; it never enters the sign or the momentum.
- Parameters are updated in their own dtype; the momentum buffer has the parameter's dtype.
Units: lr is the per-coordinate step length (the step has l-infinity norm lr).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import Optimizer

from ._common import check_hyper

__all__ = ["SignSGD", "Signum"]


def _sign(x: torch.Tensor) -> torch.Tensor:
    """sign(x) with NaN wherever x is not finite (x - x is 0 for finite x, NaN otherwise)."""
    return torch.sign(x).add_(x - x)


def _grad_of(p: torch.Tensor, name: str) -> torch.Tensor:
    g = p.grad
    if g.is_sparse:
        raise RuntimeError(f"{name} does not support sparse gradients")
    if torch.is_complex(g):
        raise RuntimeError(f"{name} does not support complex parameters")
    return g


class SignSGD(Optimizer):
    """signSGD: ``p -= lr * sign(p.grad)`` (after decoupled weight decay ``p *= 1 - lr*wd``).

    Args:
        params: iterable of parameters or param groups.
        lr: step length per coordinate, >= 0.
        weight_decay: decoupled weight decay factor, >= 0.
    """

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        defaults = dict(lr=check_hyper("lr", lr, 0.0),
                        weight_decay=check_hyper("weight_decay", weight_decay, 0.0))
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = _grad_of(p, "SignSGD")
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(_sign(g).to(p.dtype), alpha=-lr)
        return loss


class Signum(Optimizer):
    """Signum (sign of momentum): ``m = beta*m + (1-beta)*g; p -= lr * sign(m)``.

    Args:
        params: iterable of parameters or param groups.
        lr: step length per coordinate, >= 0.
        momentum: beta in [0, 1) (0 = signSGD).
        weight_decay: decoupled weight decay factor, >= 0 (``p *= 1 - lr*wd`` first).

    State: ``state[p]["momentum_buffer"]`` = m (gradient scale, same dtype as p).
    """

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> None:
        defaults = dict(lr=check_hyper("lr", lr, 0.0),
                        momentum=check_hyper("momentum", momentum, 0.0, 1.0),
                        weight_decay=check_hyper("weight_decay", weight_decay, 0.0))
        super().__init__(params, defaults)

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
                g = _grad_of(p, "Signum")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["momentum_buffer"]
                m.mul_(beta).add_(g.to(m.dtype), alpha=1 - beta)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(_sign(m), alpha=-lr)
        return loss
