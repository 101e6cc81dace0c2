"""Ranks share the nuclear sqrt-trace solves of a measurement.

After the Gram all-reduce every rank holds the same mean Grams, so solving all 2L
sqrt-traces (noise tr(C_l^{1/2}) and signal ||G_l||_S1 per matrix l) on every rank repeats
the work R times. Instead each rank solves its share and one small all-reduce shares the
results:

- assignment: a matrix's two solves (noise and signal, each a k x k eigenproblem, k its
  Gram side) cost 2 k^3 and go to the same rank, which then forms the Gram of the mean
  gradient both read once (DDP: no other rank forms it; FSDP2's ranks all form their
  shard's part of it before the Gram all-reduce, ``add_grams``). The matrices of a bucket (DDP) or
  param group (FSDP2) are sorted by (cost descending, position) and each goes to the rank
  with the smallest running load (ties: the lowest rank); the loads
  carry over from one bucket to the next (greedy longest-processing-time). Every rank sees
  the same buckets in the same order, so every rank computes the same assignment without
  communicating.
- the shared vector (float64, rows x L over the whole measurement, L its measured
  matrices in bucket order), rows [noise_l, signal_l, used64_l] where each rank writes the
  values it solved and 0 elsewhere. Its all-reduce (sum) gives every rank every value
  exactly (each entry has one non-zero contributor: x + 0 = x), so the totals are bitwise
  identical on every rank. used64_l (1.0: the eigenvalue solver needed float64 for matrix
  l) is the eigensolver hint report: every rank records the same report, so the hints stay
  identical on every rank. signal='debiased' adds a row signal_deb_l (tr((G G^T -
  C/B)_+^{1/2}), solved by the rank that solves signal_l).
- bias correction, dof 'columns': the corrected noise is computed by the rank that solves
  it, from the eigenvalues of its own solve (or the Newton trace and pair sum); the
  corrected value is what is shared.
- bias correction, dof 'gauss-sums' (ranks as samples, R >= 3): the dof needs every
  rank's q_j = ||d_j d_j^T||_F^2 and a_j = ||d_j||_F^4 (d_j = G^j - G, this rank's own
  deviation from the mean gradient, known after the bucket's all-reduce), so the
  correction is formed after the share all-reduce. Rows added: pair_l, trace_l, fro2_l
  (the solving rank's pair sum sum_ik s_i s_k / (s_i + s_k), tr C_l and ||C_l||_F^2; the
  noise row holds the raw tr(C_l^{1/2})) and q_l, a_l (written by EVERY rank: the sum is
  Q_l = sum_j q_j, A_l = sum_j a_j). After the all-reduce every rank computes, from the
  same reduced numbers in the same order, nu_l = nuclear_dof.dof_from_sample_sums(Q_l, A_l,
  tr M_l, ||M_l||_F^2, R) (M_l = R / scale C_l = sum_j d_j d_j^T) and the corrected
  sqrt-trace (bias.nuclear_sqrt_trace_corrected_from_sums's formula): device ops only, so
  on the Newton (GPU) path nothing is read on the host either.
- noise pool (``pool``, gns_kernels.pooling; l1 / nuclear with bias correction): the rank
  that solves a matrix's noise also folds its covariance C_l = scale (M_l - D_l D_l^T) into
  the pool under the matrix's key, solves the pooled covariance's sqrt-trace and pair sum
  (one more sqrt-trace per owned matrix, same solver) and corrects it for the pool's
  degrees of freedom. Rows added: pool_tr_l, pool_pair_l (the pooled tr(P_l^{1/2}) and
  pair sum), pool_nu_l (the pool's degrees of freedom, NaN where the covariance was not
  finite) and pool_new_l (1.0 when the pool has no pair of measurements yet, the first
  measurement: the pooled value is then that measurement's own corrected noise); the
  pooled value is corrected after the all-reduce, by the same call as the 'gauss-sums'
  noise. The pooled total is kept as ``pooled_total``.
- validity: a rank whose solved inputs are non-finite (non-finite gradients on some rank)
  writes NaN for the values it owns in that part; a solver failure likewise (with a
  warning). NaN survives the sum, so the measurement is invalid on every rank.

- order: ``read()`` sums the per-matrix values (``share_columns``) on the host with
  ``exact_sum`` (correctly rounded, so the totals are a function of the values, not of the
  column order). DDP lays out a fresh model's first-iteration buckets in reverse
  registration order and rebuilds them after that iteration in the order the gradients
  became ready, so the first step of a resumed run presents the matrices in another order
  (and other buckets) than the uninterrupted run did at that step; its totals are the same.

- one solve per measurement: ``add_grads`` / ``add_grams`` only assign the part's
  matrices and keep, for the ones this rank owns, a copy of the mean Gram (k x k float32)
  and of the mean gradient D (m x n float32; its D D^T is formed at the solve, one batch
  per shape and side over the whole measurement) -- or D D^T itself (FSDP2 hands it in;
  DDP forms it in the part for a D wider than 4 k^2 elements), and G G^T for a shifted
  matrix's signal -- held from the part until ``launch`` (DDP: after the last bucket), and
  the deviation sums (rows q, a); ``launch`` (or ``vector``) then solves every owned
  matrix of the measurement in one call (noise, signal, debiased signal and the pool's
  solves each batched by Gram size) and spreads the values into this rank's columns (one
  gather by an index, ``column_index``). The layout of the shared vector (columns
  in part order) is unchanged.

With one rank the solver runs everything and no collective is issued. Nothing here reads
a device value on the host: the totals stay device tensors until ``read()`` (called when
the estimate is first read).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from .. import spectral
from .._validation import check_signal
from .._validation import warn_user as _warn_user
from ..bias import _corrected
from ..nuclear_dof import dof_from_sample_sums
from ..pooling import NoisePool
from ..spectral.grams import aligned_in_stack, grams64_on_sides, grams_on_sides
from ..spectral.precision import bmm
from ..spectral.trace import NEWTON_METHODS, resolve_method
from ..spectral.nuclear import _scatter_cols, nuclear_stats_from_grams_select
from ._stats import all_finite, exact_sum

Tensor = torch.Tensor

__all__ = ["assign_solves", "SolveShare", "share_columns", "share_totals", "solve_part"]


def assign_solves(costs: Sequence[int], loads: list) -> list[int]:
    """Owner rank of each solve: greedy longest-processing-time over (cost desc, index).

    costs: one non-negative number per solve; loads: the running load per rank (updated in
    place). Deterministic: the same costs and loads give the same owners on every rank."""
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(len(loads)), key=lambda q: (loads[q], q))
        owners[i] = r
        loads[r] += costs[i]
    return owners


def share_rows(signal_debiased: bool = False, gauss_sums: bool = False, pooled: bool = False) -> dict:
    """Row name -> row index of the shared vector (module docstring)."""
    names = ["noise", "signal", "used64"]
    if signal_debiased:
        names.append("signal_deb")
    if gauss_sums:
        names += ["pair", "trace", "fro2", "q", "a"]
    if pooled:
        names += ["pool_tr", "pool_pair", "pool_nu", "pool_new"]
    return {n: i for i, n in enumerate(names)}


def pool_folder(pool: NoisePool, keys: Sequence, num_samples: int, grad_scale: float) -> tuple[Callable, list]:
    """(fold, folds): fold(ls, C) folds the covariances C (n, k, k) of the matrices ls
    (indices into keys) into the pool (NoisePool.fold_covariances, one call per Gram size)
    and returns their pooled matrices P; each call appends (ls, nu, first) to folds. The
    ``pool_fold`` of spectral's nuclear_stats_from_grams_select (the pooled matrices join
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
    vector carries them raw: the read corrects them with the noise, ``share_columns``)."""
    nu = torch.zeros(L, dtype=torch.float64, device=device)
    new = torch.zeros(L, dtype=torch.bool, device=device)
    for ls, nu_k, first_k in folds:
        if len(ls) == L:
            nu, new = nu_k.to(device), first_k.to(device)
        else:
            nu = nu + _scatter_cols(nu_k.to(device).view(1, -1), ls, L)[0]
            new = new | _scatter_cols(first_k.to(device).view(1, -1), ls, L)[0]
    return torch.cat([sums.to(device=device, dtype=torch.float64), torch.stack([nu, new.to(torch.float64)])])


def _pool_nu(nu: Tensor) -> Tensor:
    """The pool's nu as the correction takes it (1 where there is none yet: nu <= 0)."""
    return torch.where(nu > 0, nu, 1.0)


def pooled_correct(corrected: Tensor, nu: Tensor, new: Tensor, own: Tensor) -> Tensor:
    """The pooled values from the pooled tr P^{1/2} corrected for _pool_nu(nu)
    (``corrected``): ``own`` (the measurement's own corrected noise, or 0) where new > 0.5
    (no pair yet), NaN where nu is NaN (a covariance that was not finite)."""
    return torch.where(new > 0.5, own, torch.where(torch.isnan(nu), math.nan, corrected))


def pooled_sqrt_traces(pool: NoisePool, keys: Sequence, covs: Sequence[Tensor],
                       shapes: Sequence[tuple], num_samples: int, grad_scale: float,
                       method: str = "auto", hints=None, raw: bool = False) -> Tensor:
    """Fold each covariance into the pool under its key, then the pooled, corrected
    tr(P^{1/2}) per matrix: float64 Tensor[2, L] rows [pooled value, new] (``pooled_values``;
    new = 1.0 where the pool has no pair yet: the caller uses the measurement's own
    corrected noise there; the value is then 0), NaN values where a covariance is not
    finite; raw: the uncorrected Tensor[4, L] of ``pooled_sums`` instead. The sqrt-traces and
    pair sums of the pooled matrices come from the package's solver (eigenvalues or Newton)
    in one call, of their positive parts; no host synchronization. (The hooks' Newton path
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
    _, _, _, sums = nuclear_stats_from_grams_select(
        Ps, zeros, 1.0, shapes=shapes, select=([True] * L, [False] * L), method=method,
        eig_hints=hints, record_hints=False, return_sums=True, project=True)
    rows = pooled_sums(sums[:2], folds, L, dev)
    return rows if raw else pooled_values(rows)


def pooled_values(rows: Tensor) -> Tensor:
    """float64 Tensor[2, L] rows [pooled value, new] of ``pooled_sums``'s rows: tr P^{1/2}
    corrected for the pool's nu degrees of freedom, 0 where new (no pair yet), NaN where
    the covariance was not finite."""
    tr, pair, nu, new = rows
    value = pooled_correct(_corrected(tr, pair, _pool_nu(nu)), nu, new, torch.zeros_like(tr))
    return torch.stack([value, new])


def deviation_sums(deviations: Sequence[Tensor], device) -> Tensor:
    """float64 Tensor[2, L]: per matrix [q, a] = [||d d^T||_F^2, ||d||_F^4] of this rank's
    deviation d = G^j - G (m x n) from the mean gradient, from the Gram d d^T on the smaller
    side (float32 matmul, sums in float64). No host synchronization. Each run of
    consecutive matrices of one shape is stacked into one float32 batch and multiplied by
    one bmm when every matrix of the stack starts on a 64-byte boundary (its size a
    multiple of 64 bytes: the CPU GEMM's bits depend on the operand's alignment, so a
    matrix's values must not depend on its place in the stack); other shapes go through
    spectral.gram per matrix (an aligned copy each). ``deviation_sums_parts`` takes the
    runs already formed."""
    if not deviations:
        return torch.zeros((2, 0), dtype=torch.float64, device=device)
    runs: list = []
    for i, d in enumerate(deviations):
        if runs and tuple(deviations[runs[-1][0]].shape) == tuple(d.shape):
            runs[-1].append(i)
        else:
            runs.append([i])
    stacks = []
    for idx in runs:
        m, n = deviations[idx[0]].shape
        stacks.append(torch.stack([deviations[i] for i in idx]) if aligned_in_stack(m * n)
                      else [deviations[i] for i in idx])
    qs, as_ = deviation_sums_parts(stacks)
    out = torch.stack([qs[0], as_[0]]) if len(qs) == 1 else torch.stack([torch.cat(qs), torch.cat(as_)])
    return out if out.device == torch.device(device) else out.to(device)


def deviation_sums_parts(runs: Sequence) -> tuple[list, list]:
    """``deviation_sums`` of runs already formed, as two lists of float64 vectors (q, a)
    whose concatenations are its rows (kept apart so a measurement joins them once,
    ``SolveShare.add_part``). Each run: a 64-byte aligned contiguous Tensor (c, m, n) of c
    consecutive same-shape deviations (a fresh stack, or a view of a fresh tensor at a
    64-byte offset), or a list of 2-D deviations (a shape whose matrices are not a
    multiple of 64 bytes may come either way: those go through spectral.gram per matrix);
    the same values and bits as ``deviation_sums`` of the runs' matrices in order.
    Each run's float32 Grams come from one bmm (a stacked run) or per matrix; the Grams of
    one side k are joined and their sums taken together (one set of reductions per k, not
    per run: the values do not depend on the grouping, the reductions being per matrix)."""
    grams, ks = [], []
    for run in runs:
        if isinstance(run, Tensor) and aligned_in_stack(run.shape[-2] * run.shape[-1]):
            m, n = run.shape[-2:]
            X = run if run.dtype == torch.float32 else run.float()
            grams.append(bmm(X, X.transpose(-2, -1), "ieee") if m <= n else bmm(X.transpose(-2, -1), X, "ieee"))
            ks.append(min(m, n))
        else:
            for d in (run.unbind(0) if isinstance(run, Tensor) else run):
                (G,) = spectral.gram([d.float()], side=spectral.smaller_side(tuple(d.shape)))
                grams.append(G.unsqueeze(0))
                ks.append(G.shape[-1])
    if not grams:
        return [], []
    by_k: dict = {}
    for i, k in enumerate(ks):
        by_k.setdefault(k, []).append(i)
    sums: list = [None] * len(grams)
    for k, idx in by_k.items():
        G = (grams[idx[0]] if len(idx) == 1 else torch.cat([grams[i] for i in idx])).double()
        q = (G * G).sum((-2, -1))
        t = G.diagonal(dim1=-2, dim2=-1).sum(-1)
        a = t * t
        if len(by_k) == 1:
            return [q], [a]
        j = 0
        for i in idx:
            c = grams[i].shape[0]
            sums[i] = (q[j:j + c], a[j:j + c])
            j += c
    return [q for q, _ in sums], [a for _, a in sums]


def _copy(t: Tensor) -> Tensor:
    """A copy of t without autograd history (no detach() op where there is none)."""
    return (t.detach() if t.requires_grad else t).clone()


# a kept mean gradient D (m x n) is copied for the one solve when m n <= this x k^2
# (``SolveShare.add_part``)
_KEEP_D_ASPECT = 4


def column_index(cols: Sequence[int], L: int, device) -> Tensor:
    """int64 Tensor[L] on ``device``: entry l is j where cols[j] = l, else len(cols) (the
    source index that spreads a part's columns into L columns, a zero column appended).
    To CUDA it goes from pinned memory without blocking, on the current stream (a pageable
    host-to-device copy waits for the stream: a host synchronization inside the
    measurement)."""
    src = [len(cols)] * L
    for j, l in enumerate(cols):
        src[l] = j
    idx = torch.tensor(src, dtype=torch.int64)
    dev = torch.device(device)
    if dev.type == "cuda":
        return idx.pin_memory().to(dev, non_blocking=True)
    return idx if dev.type == "cpu" else idx.to(dev)


def solve_part(solve: Callable, inputs: Sequence[Tensor], owned_n: Sequence[bool],
               owned_s: Sequence[bool], device, rows: Optional[dict] = None,
               solve_debiased: Optional[Callable] = None,
               pool_fold: Optional[Callable] = None, finite_from_outputs: bool = False) -> Tensor:
    """The solve of a rank's share (SolveShare's one per measurement: every matrix it owns):
    float64 Tensor[len(rows), L_part].

    solve(select) -> (noise[L], signal[L], used64[L] or None[, sums[4, L]]) solves the
    selected sqrt-traces (spectral.nuclear_stats_select / nuclear_stats_from_grams_select
    with record_hints=False; with return_sums=True when rows has 'pair'). inputs: the
    tensors the owned solves read (checked for finiteness on the device). rows: share_rows
    (default: noise, signal, used64). Rows noise, signal, (signal_deb, pair, trace, fro2):
    all NaN when an owned input is non-finite; used64 (0 / 1); rows q, a are left 0 (the
    caller writes them). solve_debiased(select): the debiased signals (row signal_deb).
    pool_fold -> Tensor[4, number of owned noise matrices]: the pool rows of the owned
    matrices, given either the pooled matrices' sums the Newton chain returned (its fifth
    result: the pool folded inside the chain, ``pool_folder``) or the covariances the solve
    appended to its ``cov_out`` list as (l, C), one per selected matrix
    (pooled_sqrt_traces). Entries this rank does not own are
    0. No host synchronization.
    """
    rows = rows or share_rows()
    L = len(owned_n)
    out = torch.zeros((len(rows), L), dtype=torch.float64, device=device)
    covs: list = []
    res = solve((list(owned_n), list(owned_s)), covs) if pool_fold is not None else \
        solve((list(owned_n), list(owned_s)))
    chained = pool_fold is not None and len(res) > 4  # the pool solved in the noise chain
    noise, signal, used = res[0], res[1], res[2]
    if finite_from_outputs:
        # the Newton path: a non-finite input element makes its matrix's trace (and sums)
        # NaN (the normalization divides inf by inf), so the outputs decide, in one check
        parts = [noise, signal] + ([res[3]] if len(res) > 3 else []) + ([res[4]] if len(res) > 4 else [])
        ok = torch.isfinite(torch.cat([t.reshape(-1).to(device=device, dtype=torch.float64) for t in parts])).all()
    else:
        ok = all_finite(inputs, device)
    nan_like = lambda v: torch.full_like(v, float("nan"))  # noqa: E731
    vals = torch.stack([noise, signal]).to(device=device, dtype=torch.float64)
    if "pair" in rows:  # the float64 raw trace of the owned noise matrices
        vals[0] = res[3][0].to(device=device, dtype=torch.float64)
        sums = res[3][1:4].to(device=device, dtype=torch.float64)
        p = rows["pair"]
        out[p:p + 3] = torch.where(ok, sums, nan_like(sums))
    # non-finite owned inputs: the whole part is NaN on this rank (and, through the sum,
    # on every rank); entries not owned are 0 from the solver
    out[:2] = torch.where(ok, vals, nan_like(vals))
    if used is not None:
        out[2] = used.to(device=device, dtype=torch.float64)
    if "signal_deb" in rows and any(owned_s):
        deb = solve_debiased(([False] * L, list(owned_s)))[1].to(device=device, dtype=torch.float64)
        out[rows["signal_deb"]] = torch.where(ok, deb, nan_like(deb))
    if pool_fold is not None and (chained or covs):
        # the 4 pool rows, every column: from the pooled matrices' sums (chained), or from
        # the covariances (every matrix is owned, the caller solves only its own: covs in
        # column order)
        vals = pool_fold(res[4] if chained else [C for _, C in covs]).to(device=device, dtype=torch.float64)
        out[rows["pool_tr"]:rows["pool_tr"] + 4] = torch.where(ok, vals, nan_like(vals))
    return out


def share_columns(vec: Tensor, rows: Optional[dict] = None, num_samples: Optional[int] = None,
                  scale: Optional[float] = None) -> Tensor:
    """float64 Tensor[T, L]: the per-matrix values whose sums over the L matrices are the
    totals, rows noise (corrected here with the 'gauss-sums' rows), signal, then
    signal_deb when rows has it and the pooled noise when rows has the pool's (T = 2, 3 or
    4; the pooled sqrt-traces corrected here for the pool's degrees of freedom).
    Element-wise per matrix, so a matrix's values do not depend on the column order
    (the bucket layout). With the 'gauss-sums' rows: nu_l from (Q_l, A_l, tr M_l,
    ||M_l||_F^2), M_l = num_samples / scale * C_l (module docstring); needs num_samples and
    scale. No host synchronization."""
    rows = rows or share_rows()
    L = vec.numel() // len(rows)
    v = vec.view(len(rows), L)
    noise = v[rows["noise"]]
    pool = "pool_tr" in rows
    if pool:
        i = rows["pool_tr"]
        p_tr, p_pair, p_nu, p_new = v[i:i + 4]
    if "pair" in rows:
        R = int(num_samples)
        f = R / float(scale)  # M = sum_j d_j d_j^T = R / scale * C
        nu = dof_from_sample_sums(v[rows["q"]], v[rows["a"]], f * v[rows["trace"]],
                                  (f * f) * v[rows["fro2"]], R)
        if pool:  # the noise and the pooled noise corrected by one call
            c = _corrected(torch.cat([noise, p_tr]), torch.cat([v[rows["pair"]], p_pair]),
                           torch.cat([nu, _pool_nu(p_nu)]))
            noise, pooled = c[:L], c[L:]
        else:
            noise = _corrected(noise, v[rows["pair"]], nu)
    elif pool:
        pooled = _corrected(p_tr, p_pair, _pool_nu(p_nu))
    out = [noise, v[rows["signal"]]]
    if "signal_deb" in rows:
        out.append(v[rows["signal_deb"]])
    if pool:  # the first measurement of a pool: its own corrected noise
        out.append(pooled_correct(pooled, p_nu, p_new, noise))
    return torch.stack(out)


def share_totals(vec: Tensor, rows: Optional[dict] = None, num_samples: Optional[int] = None,
                 scale: Optional[float] = None) -> Tensor:
    """float64 Tensor[2] (sum_l noise_l, sum_l signal_l), or Tensor[3] with the debiased
    signal total last when rows has 'signal_deb' (and the pooled total last when rows has
    the pool's), of a reduced shared vector: the row sums of ``share_columns`` on the device
    (identical on every rank). ``SolveShare.read`` sums the same columns on the host with
    ``exact_sum`` instead, which does not depend on their order. No host synchronization."""
    return share_columns(vec, rows, num_samples, scale).sum(1)


class SolveShare:
    """The shared nuclear solves of one measurement (module docstring).

    world, rank: of the process group; scale, bias_correction, num_samples, batch_size,
    hints: as spectral.nuclear_stats. dof: the nuclear correction's dof, 'columns' (corrected
    by the solving rank) or 'gauss-sums' (corrected after the all-reduce; ``add_grads``
    then needs this rank's deviations). signal: 'raw' or 'debiased' (also solves the
    debiased signal). Parts are added in the same order on every rank (``add_grads`` for
    DDP / MicroBatchGNS, ``add_grams`` for FSDP2), then ``vector()`` is all-reduced once
    (``launch``), and ``read()`` returns the totals on the host.
    """

    def __init__(self, world: int, rank: int, scale: float, bias_correction: bool,
                 num_samples: int, batch_size: float, hints=None, method: str = "auto",
                 dof: str = "columns", signal: str = "raw", pool: Optional[NoisePool] = None,
                 grad_scale: float = 1.0, owners: Optional[dict] = None):
        if dof not in ("columns", "gauss-sums"):
            raise ValueError(f"dof: expected 'columns' or 'gauss-sums', got {dof!r}")
        check_signal(signal)
        self.gauss = bool(bias_correction) and dof == "gauss-sums"
        self.dof = dof if bias_correction else None
        self.signal = signal
        self.pool = pool if bias_correction else None
        self.grad_scale = float(grad_scale)
        # with a pool: key -> owner rank, kept across measurements (the pool of a matrix
        # lives on its owner, so a matrix keeps its owner when DDP rebuilds its buckets)
        self.sticky = owners if self.pool is not None else None
        self.pooled_total: Optional[float] = None
        self.rows = share_rows(signal == "debiased", self.gauss, self.pool is not None)
        self.world = world
        self.rank = rank
        self.scale = scale
        self.bias_correction = bias_correction
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.hints = hints
        self.method = method
        self.loads = [0] * world
        self.parts: list[Tensor] = []
        self.shapes: list[tuple] = []
        # the one solve (``_solve_kept``): owned matrices kept by the parts until launch
        self.kept: list[tuple] = []
        # 'gauss-sums': this rank's deviation sums q, a (float64 vectors, in column order)
        self.qa_q: list[Tensor] = []
        self.qa_a: list[Tensor] = []
        self.solved = False
        self.device = None
        self.stream = None  # CUDA: the side stream the solves run on
        self.future = None  # of the share all-reduce (None: nothing to share / one rank)
        self.reduced: Optional[Tensor] = None
        self.failed = False

    # ----------------------------------------------------------- assignment
    def _owners(self, ks: Sequence[int], keys: Optional[Sequence] = None) -> list:
        """Whether this rank owns each matrix (Gram sides ks): a matrix's noise and signal
        solves go to the same rank (cost 2 k^3), so the Gram of its mean gradient (which
        both read) is formed on that rank only. With a noise pool a matrix keeps the owner
        it got first (``sticky``, by key); the others are assigned greedily."""
        costs = [2 * int(k) ** 3 for k in ks]
        if self.sticky is None or keys is None:
            owners = assign_solves(costs, self.loads)
            return [o == self.rank for o in owners]
        owners: list = [None] * len(ks)
        for i, key in enumerate(keys):
            o = self.sticky.get(key)
            if o is not None and 0 <= o < self.world:
                owners[i] = o
                self.loads[o] += costs[i]
        free = [i for i in range(len(ks)) if owners[i] is None]
        for i, o in zip(free, assign_solves([costs[i] for i in free], self.loads)):
            owners[i] = o
            self.sticky[keys[i]] = o
        return [o == self.rank for o in owners]

    def _run(self, fn: Callable[[], Tensor], like: Tensor, inputs: Sequence[Tensor]) -> None:
        """Run fn (the part's solve) on a side stream on CUDA, inline elsewhere."""
        if self.device is None:
            self.device = like.device
        if like is not None and like.device.type == "cuda":
            if self.stream is None:
                self.stream = torch.cuda.Stream(device=like.device)
                if self.pool is not None:
                    # the pool's state was last updated on an earlier measurement's stream
                    # (whose estimate may never have been read): order after it
                    if self.pool.stream is not None:
                        self.stream.wait_stream(self.pool.stream)
                    self.pool.stream = self.stream
            self.stream.wait_stream(torch.cuda.current_stream(like.device))
            with torch.cuda.stream(self.stream):
                part = fn()
            for t in inputs:  # freed by the caller's stream after this call
                t.record_stream(self.stream)
        else:
            part = fn()
        self.parts.append(part)

    def _guard(self, fn: Callable[[], Tensor], L: int, device) -> Callable[[], Tensor]:
        def run() -> Tensor:
            try:
                return fn()
            except (RuntimeError, torch.linalg.LinAlgError) as exc:  # LinAlgError is a RuntimeError
                _warn_user(f"gns_kernels: nuclear statistics failed ({exc}); this measurement "
                           "is marked invalid")
                out = torch.full((len(self.rows), L), float("nan"), dtype=torch.float64, device=device)
                out[2] = 0.0
                return out
        return run

    def _kw(self) -> dict:
        """Solver arguments common to every part."""
        return dict(scale=self.scale, bias_correction=self.bias_correction,
                    num_samples=self.num_samples, batch_size=self.batch_size,
                    method=self.method, eig_hints=self.hints, record_hints=False)

    # ----------------------------------------------------------- parts
    def add_grads(self, mean_grams: Sequence[Tensor], mean_grads: Sequence[Tensor],
                  shifts: Optional[Sequence[Optional[Tensor]]],
                  deviations: Optional[Sequence[Tensor]] = None,
                  keys: Optional[Sequence] = None) -> None:
        """A DDP bucket: mean Grams (k x k), mean shifted gradients D (m x n), shifts, and
        (dof 'gauss-sums') this rank's deviations d_j = G^j - G (m x n) per matrix; keys:
        the noise pool's key of each matrix (needed with a pool). Nothing is solved here:
        the owned matrices' Grams are kept (``_keep``) and solved once, with every other
        part's, by ``launch`` (or ``vector``)."""
        mean_grams, mean_grads = list(mean_grams), list(mean_grads)
        L = len(mean_grams)
        if L == 0:
            return
        if self.gauss and (deviations is None or len(deviations) != L):
            raise ValueError("deviations: dof 'gauss-sums' needs this rank's deviation from the "
                             f"mean gradient for each of the {L} matrices")
        self._check_keys(keys, L)  # before the deviation sums (add_part checks again, cheaply)
        dev = mean_grams[0].device
        # on the calling stream, before the caller overwrites what the deviations view
        qa = deviation_sums(deviations, dev) if self.gauss else None

        def owned(idx):
            return [mean_grams[l] for l in idx], [mean_grads[l] for l in idx]

        self.add_part([A.shape[-1] for A in mean_grams], [tuple(D.shape) for D in mean_grads],
                      owned, qa, keys, dev, shifts)

    def add_part(self, ks: Sequence[int], shapes: Sequence[tuple], owned: Callable,
                 qa, keys: Optional[Sequence], device,
                 shifts: Optional[Sequence[Optional[Tensor]]] = None) -> None:
        """``add_grads`` with the inputs asked for only where this rank solves: ks, shapes:
        the Gram side and the shape of each of the part's L matrices; owned(idx) -> (mean
        Grams, mean shifted gradients) of the matrices idx (this rank's, ascending); qa:
        ``deviation_sums`` of this rank's deviations (dof 'gauss-sums', else None), a
        Tensor[2, L] or ``deviation_sums_parts``'s lists (joined once, at the solve)."""
        L = len(ks)
        if L == 0:
            return
        if isinstance(qa, Tensor):
            qa = ([qa[0]], [qa[1]])
        if self.gauss and (qa is None or sum(q.shape[0] for q in qa[0]) != L):
            raise ValueError("deviations: dof 'gauss-sums' needs this rank's deviation sums for "
                             f"each of the {L} matrices")
        self._check_keys(keys, L)
        own = self._owners(ks, keys)
        shapes = [tuple(sh) for sh in shapes]
        if self.gauss:
            self.qa_q.extend(qa[0])
            self.qa_a.extend(qa[1])
        idx = [l for l in range(L) if own[l]]
        grams_o, grads_o = owned(idx) if idx else ([], [])
        # D D^T is formed at the solve, batched over the measurement (``_solve_kept``),
        # from a copy of D (the caller reuses the pack it views), where D is at most
        # _KEEP_D_ASPECT k^2 elements (its copy then takes at most twice the memory of the
        # float64 D D^T); a wider D (an embedding) has its D D^T formed now. A shifted
        # matrix's signal Gram G G^T (G = D + S) is formed now, before this
        # measurement's mean replaces a shift="last"
        n_o = len(idx)
        sides = ["row" if shapes[l][0] == ks[l] else "col" for l in idx]
        keep_d = [shapes[l][0] * shapes[l][1] <= _KEEP_D_ASPECT * ks[l] ** 2 for l in idx]
        dd: list = [None] * n_o
        now = [j for j in range(n_o) if not keep_d[j]]
        if now:
            on_sides = self._mean_grad_gram_op(device)
            for j, G in zip(now, on_sides([grads_o[j] for j in now], [sides[j] for j in now])):
                dd[j] = G
        gg: list = [None] * n_o
        sh = [j for j, l in enumerate(idx) if shifts is not None and shifts[l] is not None]
        if sh:  # one batched call (each Gram a function of its own matrix)
            for j, G in zip(sh, grams_on_sides([grads_o[j].float() + shifts[idx[j]].float() for j in sh],
                                               [sides[j] for j in sh])):
                gg[j] = G
        self._keep(grams_o, dd, gg, shapes, idx, keys, device,
                   [_copy(D) if k else None for D, k in zip(grads_o, keep_d)])

    def add_grams(self, mean_grams: Sequence[Tensor], mean_grad_grams: Sequence[Tensor],
                  shapes: Sequence[Sequence[int]], keys: Optional[Sequence] = None) -> None:
        """An FSDP2 param group: mean Grams, Grams of the mean gradient, parameter shapes;
        keys: the noise pool's key of each matrix (needed with a pool). Solved with every
        other part by ``launch`` (as ``add_grads``)."""
        mean_grams, dd = list(mean_grams), list(mean_grad_grams)
        L = len(mean_grams)
        if L == 0:
            return
        if self.gauss:
            raise ValueError("dof: 'gauss-sums' needs each rank's deviation from the full mean "
                             "gradient, which an FSDP2 rank does not hold (only its shard)")
        self._check_keys(keys, L)
        ks = [A.shape[-1] for A in mean_grams]
        own = self._owners(ks, keys)
        shapes = [tuple(int(d) for d in s) for s in shapes]
        idx = [l for l in range(L) if own[l]]
        # copies: the caller may reuse the buffers the Grams view before launch()
        kept = [_copy(dd[l]) for l in idx]
        self._keep([mean_grams[l] for l in idx], kept, kept, shapes, idx, keys, mean_grams[0].device)

    def _check_keys(self, keys, L: int) -> None:
        if self.pool is not None and (keys is None or len(keys) != L):
            raise ValueError(f"keys: a noise pool needs one key per matrix ({L}), got "
                             f"{None if keys is None else len(keys)}")

    def _keep(self, grams: list, dd: list, gg: list, shapes: list, idx: list, keys, dev,
              grads: Optional[list] = None) -> None:
        """Keep a part's owned matrices (idx: their positions in the part) for the one
        solve: a copy of the mean Gram (grams[j], k x k float32), D D^T (dd[j], k x k) or,
        when dd[j] is None, a copy of D itself (grads[j], m x n float32: its Gram is formed
        at the solve), the signal's Gram (gg[j]; None: D D^T), the parameter shape, the
        pool key and the column (position in the measurement)."""
        if self.device is None:
            self.device = dev
        base = len(self.shapes)
        self.shapes.extend(shapes)
        for j, l in enumerate(idx):
            self.kept.append((_copy(grams[j]), dd[j], gg[j], shapes[l],
                              None if keys is None else keys[l], base + l,
                              None if grads is None else grads[j]))

    def _newton(self, device) -> bool:
        """Whether this share's method resolves to the Newton path on ``device``."""
        return resolve_method(self.method, device) in NEWTON_METHODS

    def _mean_grad_gram_op(self, device) -> Callable:
        """The Gram function of the mean gradients D D^T: float64 products on the Newton
        path (as spectral.nuclear_stats_select forms them there), float32 Grams else."""
        return grams64_on_sides if self._newton(device) else grams_on_sides

    def _mean_grad_grams(self, kept: list) -> tuple[list, list]:
        """(D D^T, signal Gram) per kept matrix: the kept D's Grams formed here, one batch
        per (shape, side) (float64 products on the Newton path, as
        spectral.nuclear_stats_select forms them there; float32 Grams on the eigenvalue
        path), on the Gram's side ('row' for a square matrix)."""
        todo = [i for i, e in enumerate(kept) if e[1] is None]
        dd = [e[1] for e in kept]
        if todo:
            on_sides = self._mean_grad_gram_op(self.device)
            Ds = [kept[i][6] for i in todo]
            sides = ["row" if kept[i][3][0] == kept[i][0].shape[-1] else "col" for i in todo]
            for i, G in zip(todo, on_sides(Ds, sides)):
                dd[i] = G
        return dd, [e[2] if e[2] is not None else dd[i] for i, e in enumerate(kept)]

    def _solve_kept(self) -> None:
        """The one solve of a measurement (module docstring): every owned matrix of every
        part, batched by Gram size (spectral's _solve groups by size), spread into this
        rank's rows x L part (0 in the columns it does not own); the deviation sums of
        every matrix fill rows q, a. On CUDA on the side stream. Runs once, from
        ``launch`` / ``vector``."""
        L = len(self.shapes)
        if L == 0 or self.solved:
            return
        self.solved = True
        kept, self.kept = self.kept, []
        qa = torch.stack([torch.cat(self.qa_q), torch.cat(self.qa_a)]) if self.qa_q else None
        self.qa_q, self.qa_a = [], []
        dev = self.device
        rows = self.rows
        n = len(kept)
        grams = [e[0] for e in kept]
        mats: list = []  # [D D^T, signal Grams], formed in run() (on CUDA on the side stream)
        shapes = [e[3] for e in kept]
        cols = [e[5] for e in kept]
        inputs = grams + [t for e in kept for t in (e[1], e[2], e[6]) if t is not None]
        fold = None
        chain = None  # the pool's fold inside the Newton chain ('gauss-sums' sums)
        if self.pool is not None and n:
            okeys = [e[4] for e in kept]
            if self.gauss and self._newton(dev):
                chain, folds = pool_folder(self.pool, okeys, self.num_samples, self.grad_scale)
                fold = lambda sums: pooled_sums(sums, folds, n, dev)  # noqa: E731
            else:
                fold = lambda covs: pooled_sqrt_traces(self.pool, okeys, covs, shapes,  # noqa: E731
                                                       self.num_samples, self.grad_scale, self.method,
                                                       self.hints, raw=True)

        def solve(select, cov_out=None, signal="raw"):
            raw = signal == "raw"
            return nuclear_stats_from_grams_select(
                grams, mats[0], signal_grams=mats[1], shapes=shapes, select=select, signal=signal,
                return_sums=self.gauss and raw, cov_out=None if chain is not None else cov_out,
                pool_fold=chain if raw else None, **self._kw())

        def run() -> Tensor:
            if n:
                mats.extend(self._mean_grad_grams(kept))
                part = solve_part(solve, inputs, [True] * n, [True] * n, dev, rows,
                                  lambda sel: solve(sel, signal="debiased"), fold,
                                  finite_from_outputs=self._newton(dev))
                # a gather (deterministic; index_copy_ is not on CUDA): column l takes
                # part's column j when this rank solved it (cols[j] = l), else a zero column
                out = part if n == L else torch.cat([part, part.new_zeros((len(rows), 1))], dim=1).index_select(
                    1, column_index(cols, L, dev))
            else:
                out = torch.zeros((len(rows), L), dtype=torch.float64, device=dev)
            if qa is not None:
                out[rows["q"]:rows["q"] + 2] = qa.to(device=dev, dtype=torch.float64)
            return out

        self._run(self._guard(run, L, dev), grams[0] if grams else None,
                  inputs + ([] if qa is None else [qa]))

    # ----------------------------------------------------------- sharing
    def vector(self) -> Optional[Tensor]:
        """The float64 rows x L vector of this rank ([noise (L), signal (L), used64 (L)],
        plus the rows of share_rows; None: no matrix)."""
        self._solve_kept()
        if not self.parts:
            return None
        return torch.cat(self.parts, dim=1).reshape(-1)

    def launch(self, group, all_reduce: Callable) -> None:
        """Solve this rank's share (``_solve_kept``: the one solve of the measurement), then
        start the one share all-reduce (async; on CUDA on the side stream). With one rank
        nothing is sent. all_reduce: torch.distributed.all_reduce."""
        self._solve_kept()
        if not self.parts:
            return
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                vec = self.vector()
                if self.world > 1:
                    work = all_reduce(vec, group=group, async_op=True)
                    self.future = work.get_future()
        else:
            vec = self.vector()
            if self.world > 1:
                work = all_reduce(vec, group=group, async_op=True)
                self.future = work.get_future()
        self.reduced = vec

    def finish_blocking(self, group, all_reduce: Callable) -> None:
        """The share all-reduce, waited for (FSDP2 finishes on the calling thread)."""
        self.launch(group, all_reduce)
        if self.future is not None:
            self.future.wait()

    def has_report(self) -> bool:
        """Whether read() has eigensolver hints to record (the eigenvalue path)."""
        return self.hints is not None and bool(self.shapes)

    def totals(self, vec: Tensor) -> Tensor:
        """share_totals of a reduced vector with this measurement's rows (device tensor)."""
        return share_totals(vec, self.rows, self.num_samples, self.scale)

    def read(self) -> tuple[float, float, Optional[float]]:
        """(noise total, signal total, debiased signal total or None) on the host: waits for
        the share all-reduce and reads the reduced vector once; records and applies the
        eigensolver report to the hints."""
        deb = self.signal == "debiased"
        if self.reduced is None:
            if self.pool is not None:
                self.pooled_total = float("nan")
            return float("nan"), float("nan"), (float("nan") if deb else None)
        if self.future is not None:
            self.future.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.reduced.device).wait_stream(self.stream)
        vec = self.reduced
        W = len(self.rows)
        L = vec.numel() // W
        cols = share_columns(vec, self.rows, self.num_samples, self.scale)
        host = torch.cat([cols.reshape(-1), vec.view(W, L)[2]]).cpu().tolist()  # the one sync
        nt = cols.shape[0]
        # the totals as exactly rounded sums: the columns come in bucket order, and DDP
        # presents the matrices in another order on a resumed run's first step (module
        # docstring, "order")
        tot = [exact_sum(host[i * L:(i + 1) * L]) for i in range(nt)]
        if self.hints is not None:
            self.hints.record(self.shapes, [f > 0.5 for f in host[nt * L:]])
        if self.pool is not None:  # the last total (module docstring)
            self.pooled_total = tot[nt - 1]
        return tot[0], tot[1], (tot[2] if deb else None)
