"""The noise pool's part of the nuclear solves: fold a measurement's covariances into the
pool (gns_kernels.stats.pool.NoisePool) and correct the pooled covariances' sqrt-traces for
the pool's degrees of freedom (the solve itself: gns_kernels.spectral.pooled_sqrt_traces,
or the Newton chain the folder joins).

Per matrix l the pool gives four raw rows (``pooled_sums``): tr P_l^{1/2} and the pair sum
sum_ik s_i s_k / (s_i + s_k) of the pooled covariance P_l (its positive part), nu_l (the
pool's degrees of freedom, NaN where the covariance was not finite) and new_l (1.0 while
the pool has no pair of measurements yet: the first measurement of a key, which has no nu).
Their value (``pooled_values``, ``pooled_correct``) is tr P_l^{1/2} / c4(nu_l / k + 1) (the
correction of gns_kernels.stats.bias.corrected_sqrt_trace, nu_l read by ``pool_nu``), the
measurement's own corrected noise where new_l, NaN where nu_l is NaN. The hooks' shared
solves (gns_kernels.distributed._share) carry the raw rows in the shared vector and correct
them after its all-reduce, with the noise.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .bias import corrected_sqrt_trace
from .common import scatter_cols
from .pool import NoisePool

Tensor = torch.Tensor

__all__ = ["pool_folder", "pooled_sums", "pool_nu", "pooled_correct", "pooled_values"]


def pool_folder(pool: NoisePool, keys: Sequence, num_samples: int, grad_scale: float) -> tuple[Callable, list]:
    """(fold, folds): fold(ls, C) folds the covariances C (n, k, k) of the matrices ls
    (indices into keys) into the pool (NoisePool.fold_covariances, one call per Gram size)
    and returns their pooled matrices P; each call appends (ls, nu, first) to folds. The
    ``pool_fold`` of spectral's nuclear_stats (NuclearRequest) (the pooled matrices join
    the noise matrices' Newton chain)."""
    folds: list = []

    def fold(ls, C):
        P, nu, first = pool.fold_covariances([keys[l] for l in ls], C, num_samples, grad_scale)
        folds.append((list(ls), nu, first))
        return P

    return fold, folds


def pooled_sums(sums: Tensor, folds: list, L: int, device) -> Tensor:
    """float64 Tensor[4, L] rows [tr P^{1/2}, pair sum, nu, new] of the pooled matrices,
    from their [tr P^{1/2}, pair sum] (sums, Tensor[2, L]) and the folds' (ls, nu, first):
    nu the pool's degrees of freedom (NaN where the covariance was not finite), new 1.0
    where the pool has no pair yet. ``pooled_correct`` turns them into values (the share
    vector carries them raw: the read corrects them with the noise,
    gns_kernels.distributed._share_vector.share_columns)."""
    nu = torch.zeros(L, dtype=torch.float64, device=device)
    new = torch.zeros(L, dtype=torch.bool, device=device)
    for ls, nu_k, first_k in folds:
        if len(ls) == L:
            nu, new = nu_k.to(device), first_k.to(device)
        else:
            nu = nu + scatter_cols(nu_k.to(device).view(1, -1), ls, L)[0]
            new = new | scatter_cols(first_k.to(device).view(1, -1), ls, L)[0]
    return torch.cat([sums.to(device=device, dtype=torch.float64), torch.stack([nu, new.to(torch.float64)])])


def pool_nu(nu: Tensor) -> Tensor:
    """The pool's nu as the correction takes it (1 where there is none yet: nu <= 0)."""
    return torch.where(nu > 0, nu, 1.0)


def pooled_correct(corrected: Tensor, nu: Tensor, new: Tensor, own: Tensor) -> Tensor:
    """The pooled values from the pooled tr P^{1/2} corrected for pool_nu(nu)
    (``corrected``): ``own`` (the measurement's own corrected noise, or 0) where new > 0.5
    (no pair yet), NaN where nu is NaN (a covariance that was not finite)."""
    return torch.where(new > 0.5, own, torch.where(torch.isnan(nu), math.nan, corrected))


def pooled_values(rows: Tensor) -> Tensor:
    """float64 Tensor[2, L] rows [pooled value, new] of ``pooled_sums``'s rows: tr P^{1/2}
    corrected for the pool's nu degrees of freedom, 0 where new (no pair yet), NaN where
    the covariance was not finite."""
    tr, pair, nu, new = rows
    value = pooled_correct(corrected_sqrt_trace(tr, pair, pool_nu(nu)), nu, new, torch.zeros_like(tr))
    return torch.stack([value, new])
