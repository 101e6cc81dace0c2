"""Bias-reduced signals (the raw signals ||g||_1, ||G||_S1 are biased up by the noise in g;
no unbiased estimator exists, see docs/estimators.md):
``l1_signal_debiased``   sum_i sqrt(max(g_i^2 - s2_i / B, 0))   (g_i^2 - s2_i/B is unbiased for mu_i^2)
``l1_signal_folded``     sum_i mu_hat_i, mu_hat_i solving E|N(mu, s2_i/B)| = |g_i| (0 below)
``nuclear_signal_debiased``  tr (PSD part of G G^T - C_hat / B)^{1/2}  (G G^T - C_hat/B is
                         unbiased for E[G] E[G]^T on the smaller Gram side)

Pure torch functions (float64 results), no torch.distributed: gk.estimate and the hooks
use them with signal='debiased'.
"""
from __future__ import annotations

import math

import torch

from .common import rows_side

Tensor = torch.Tensor

__all__ = ["l1_signal_debiased", "l1_signal_folded", "nuclear_signal_debiased"]


def _check_b(batch_size) -> float:
    B = float(batch_size)
    if not (B >= 1 and math.isfinite(B)):
        raise ValueError(f"batch_size: expected a finite number of examples >= 1, got {batch_size!r}")
    return B


def l1_signal_debiased(g: Tensor, s2: Tensor, batch_size: float) -> Tensor:
    """sum_i sqrt(max(g_i^2 - s2_i / B, 0)) over all elements; g the mean gradient, s2 the
    per-coordinate variance estimate (single-example units), B the global batch. float64 0-d.
    """
    if g.shape != s2.shape:
        raise ValueError(f"s2: expected the shape of g {tuple(g.shape)}, got {tuple(s2.shape)}")
    B = _check_b(batch_size)
    g = g.detach().to(torch.float64)
    v = g * g - s2.detach().to(torch.float64) / B
    return torch.where(v > 0, v, torch.zeros_like(v)).sqrt().sum()


_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def l1_signal_folded(g: Tensor, s2: Tensor, batch_size: float, iters: int = 30) -> Tensor:
    """sum_i mu_hat_i with E|N(mu_hat_i, tau_i^2)| = |g_i|, tau_i^2 = s2_i / B (0 when
    |g_i| <= tau_i sqrt(2/pi), the folded mean at mu = 0). Newton on the increasing function
    F(mu) = tau sqrt(2/pi) exp(-mu^2 / (2 tau^2)) + mu erf(mu / (tau sqrt 2)). float64 0-d.
    """
    if g.shape != s2.shape:
        raise ValueError(f"s2: expected the shape of g {tuple(g.shape)}, got {tuple(s2.shape)}")
    B = _check_b(batch_size)
    y = g.detach().to(torch.float64).abs()
    tau = (s2.detach().to(torch.float64).clamp_min(0) / B).sqrt()
    pos = tau > 0
    t = torch.where(pos, tau, torch.ones_like(tau))
    mu = (y * y - t * t).clamp_min(0).sqrt()  # start at or below the root (F convex, F >= |mu|)
    for _ in range(iters):
        z = mu / (t * math.sqrt(2.0))
        F = t * _SQRT_2_PI * torch.exp(-z * z) + mu * torch.erf(z)
        dF = torch.erf(z)
        step = (F - y) / torch.where(dF > 1e-12, dF, torch.full_like(dF, 1e-12))
        mu = (mu - step).clamp_min(0)
    mu = torch.where(y <= t * _SQRT_2_PI, torch.zeros_like(mu), mu)
    return torch.where(pos, mu, y).sum()


def nuclear_signal_debiased(G: Tensor, C: Tensor, batch_size: float) -> Tensor:
    """tr((G G^T - C / B)_+^{1/2}) on the smaller Gram side: G (..., m, n) the mean gradient,
    C the covariance estimate on the same (smaller) side in single-example units, B the
    global batch. (.)_+ keeps the non-negative eigenvalues. float64 (...).
    """
    B = _check_b(batch_size)
    x = rows_side(G.detach().to(torch.float64))
    if C.shape[-2:] != (x.shape[-2], x.shape[-2]):
        raise ValueError(f"C: expected (..., {x.shape[-2]}, {x.shape[-2]}) on G's smaller side, "
                         f"got {tuple(C.shape)}")
    A = x @ x.mT - C.detach().to(torch.float64) / B
    ev = torch.linalg.eigvalsh(0.5 * (A + A.mT))
    return torch.where(ev > 0, ev, torch.zeros_like(ev)).sqrt().sum(-1)
