"""Random test matrices and gradients for the spectral tests (float64 unless asked)."""
from __future__ import annotations

import math

import torch

import gns_kernels as gk

TOL = 1e-3  # the accuracy budget of every sqrt-trace method (docs/spectral.md)
METHODS = ("eigh", "newton", "host")
SHAPES = [(12, 30), (30, 12), (12, 30), (17, 17), (40, 9), (3, 50), (64, 100)]


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def rand_orthogonal(gen, m):
    Q, _ = torch.linalg.qr(randn(gen, m, m))
    return Q


def with_eigenvalues(gen, lam, dtype=torch.float64):
    """Q diag(lam) Q^T for a random orthogonal Q, exactly symmetrized."""
    lam = torch.as_tensor(lam, dtype=torch.float64)
    Q = rand_orthogonal(gen, lam.numel())
    A = (Q * lam) @ Q.T
    return (0.5 * (A + A.T)).to(dtype)


def rand_psd(gen, m, cond, dtype=torch.float64):
    """Q diag(lambda) Q^T, lambda log-spaced from 1 to 1/cond (random orthogonal Q)."""
    lam = torch.logspace(0, -math.log10(cond), m, dtype=torch.float64) if m > 1 else torch.ones(1, dtype=torch.float64)
    return with_eigenvalues(gen, lam, dtype)


def rank_deficient(gen, m, r, dtype=torch.float64):
    X = randn(gen, m, r)
    return (X @ X.T).to(dtype)


def grad_with_spectrum(gen, m, n, decades=6):
    """float32 m x n gradient whose singular values are log-spaced over ``decades``."""
    k = min(m, n)
    U, _ = torch.linalg.qr(randn(gen, m, k))
    V, _ = torch.linalg.qr(randn(gen, n, k))
    s = torch.logspace(0, -decades, k, dtype=torch.float64)
    return ((U * s) @ V.T).float()


def rel_err(x, y):
    x, y = x.double(), y.double()
    return ((x - y).abs() / y.abs().clamp_min(1e-300)).max().item()


def samples(gen, R, shapes, dtype=torch.float32, noise=1.0):
    """R samples per layer: a common mean plus independent noise (as rank gradients)."""
    layers = []
    for s in shapes:
        mean = randn(gen, *s)
        layers.append([(mean + noise * randn(gen, *s)).to(dtype) for _ in range(R)])
    return layers


def stats_inputs(layers, shifts=None):
    """What a hook holds after the all-reduce: mean local Grams (float32, via gk.gram on the
    smaller side) and mean (shifted) gradients."""
    R = len(layers[0])
    mean_grams, mean_grads = [], []
    for l, smp in enumerate(layers):
        S = None if shifts is None else shifts[l]
        xs = [x.float() if S is None else x.float() - S for x in smp]
        mean_grams.append(torch.stack(gk.gram(xs)).sum(0) / R)
        mean_grads.append(torch.stack(xs).mean(0))
    return mean_grams, mean_grads


def sparse_row_covariance(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two ranks' embedding-like gradients (20 nonzero rows each of 256): the mean Gram,
    the mean gradient and C = 8 (A - D D^T), which has many exactly-zero rows and columns."""
    g = torch.Generator().manual_seed(seed)
    m = n = 256
    G1, G2 = torch.zeros(m, n), torch.zeros(m, n)
    G1[torch.randperm(m, generator=g)[:20]] = 1e-2 * torch.randn(20, n, generator=g)
    G2[torch.randperm(m, generator=g)[:20]] = 1e-2 * torch.randn(20, n, generator=g)
    A = (G1 @ G1.T + G2 @ G2.T) / 2
    D = (G1 + G2) / 2
    return A, D, 8.0 * (A - D @ D.T)
