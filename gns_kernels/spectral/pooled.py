"""The sqrt-traces of the noise pool's pooled covariances: fold a measurement's covariances
into a gns_kernels.stats.NoisePool, solve the pooled matrices (eigenvalues or Newton, one
``nuclear_stats`` call) and correct them for the pool's degrees of freedom
(gns_kernels.stats.pooled). The hooks' Newton path folds inside the noise solve instead
(``stats.pool_folder`` as the NuclearRequest's pool_fold).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..stats.pool import NoisePool
from ..stats.pooled import pool_folder, pooled_sums, pooled_values
from .nuclear import NuclearRequest, nuclear_stats
from .solver import EighConfig, resolve_method

Tensor = torch.Tensor

__all__ = ["pooled_sqrt_traces", "POOL_EIGH_TOL"]

# The eigenvalue route's error bound for the pooled matrices (relative, per sqrt-trace): the
# pooled noise is the controller's input and the square of sum_l tr(P_l^{1/2}), so a bound
# of 2.5e-5 keeps it within 5e-5 of float64 eigh (the per-measurement solves keep EIGH_TOL):
# the pooled noise then agrees with the host and Newton routes' to 1e-4 (bench/truth.py
# --pooled --methods, bench/RESULTS.md), where EIGH_TOL = 5e-4 let it differ by 1.5e-4.
POOL_EIGH_TOL = 2.5e-5


def pooled_sqrt_traces(pool: NoisePool, keys: Sequence, covs: Sequence[Tensor],
                       shapes: Sequence[tuple], num_samples: int, grad_scale: float,
                       method: str = "auto", hints=None, raw: bool = False) -> Tensor:
    """Fold each covariance into the pool under its key, then the pooled, corrected
    tr(P^{1/2}) per matrix: float64 Tensor[2, L] rows [pooled value, new] (``pooled_values``;
    new = 1.0 where the pool has no pair yet: the caller uses the measurement's own
    corrected noise there; the value is then 0), NaN values where a covariance is not
    finite; raw: the uncorrected Tensor[4, L] of ``pooled_sums`` instead. The sqrt-traces and
    pair sums of the pooled matrices come from the package's solver (eigenvalues, Newton or
    host) in one call, of their positive parts; no host synchronization on the eigenvalue
    and Newton routes. ``method`` 'eigh' (or 'auto' on CPU) solves with EighConfig(tol=
    POOL_EIGH_TOL), a tighter bound than the per-measurement solves' (module constant). (The hooks' Newton path
    folds inside the noise solve instead: ``pool_folder``.)"""
    L = len(covs)
    dev = covs[0].device
    fold, folds = pool_folder(pool, keys, num_samples, grad_scale)
    by_k: dict = {}
    for l, C in enumerate(covs):
        by_k.setdefault(C.shape[-1], []).append(l)
    Ps: list = [None] * L
    for k, ls in by_k.items():
        P = fold(ls, torch.stack([covs[l] for l in ls]))
        for j, l in enumerate(ls):
            Ps[l] = P[j]
    zeros = [torch.zeros_like(P) for P in Ps]
    if isinstance(method, str) and resolve_method(method, dev) == "eigh":
        method = EighConfig(tol=POOL_EIGH_TOL)  # an EighConfig given is used as it is
    sums = nuclear_stats(Ps, None, 1.0, mean_grad_grams=zeros, shapes=shapes, method=method, eig_hints=hints,
                         request=NuclearRequest(select=([True] * L, [False] * L), record_hints=False,
                                                sums=True)).sums
    rows = pooled_sums(sums[:2], folds, L, dev)
    return rows if raw else pooled_values(rows)
