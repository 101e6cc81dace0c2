"""The one solve of a measurement's shared nuclear statistics (gns_kernels.distributed._share):
every matrix this rank owns, solved in one call, written into this rank's part of the
shared vector (gns_kernels.distributed._share_vector).

``SolveShare`` keeps, for each matrix it owns, the mean Gram, D D^T or D itself, the signal's
Gram, the parameter shape, the pool key and the column (``KeptMatrix``) until ``launch``;
``ShareSolver.part`` then forms the kept D's Grams (one batch per shape and side), solves
the noise, signal, debiased signal and the pool's sqrt-traces, each batched by Gram size
(``solve_part``), and spreads the values into this rank's columns (one gather by an index,
``column_index``); the deviation sums of every matrix fill rows q, a.

Validity: a rank whose solved inputs are non-finite (non-finite gradients on some rank)
writes NaN for the values it owns in that part; a solver failure likewise (with a
warning). NaN survives the sum, so the measurement is invalid on every rank.

Nothing here reads a device value on the host.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .._validation import warn_user as _warn_user
from ..spectral.grams import grams64_on_sides, grams_on_sides
from ..spectral.nuclear import NuclearRequest, nuclear_stats
from ..spectral.trace import NEWTON_METHODS, resolve_method
from ..stats.pool import NoisePool
from ..spectral.pooled import pooled_sqrt_traces
from ..stats.pooled import pool_folder, pooled_sums
from ._share_vector import share_rows
from ._stats import all_finite

Tensor = torch.Tensor

__all__ = ["KeptMatrix", "ShareSolver", "column_index", "solve_part", "copy_detached", "KEEP_D_ASPECT"]


class KeptMatrix(NamedTuple):
    """A matrix this rank owns, kept from its part until the measurement's one solve."""

    gram: Tensor                # a copy of the mean Gram (k x k float32)
    dd: Optional[Tensor]        # D D^T (k x k), or None: formed at the solve from ``grad``
    gg: Optional[Tensor]        # the signal's Gram G G^T (a shifted matrix), or None: D D^T
    shape: tuple                # the parameter shape (m, n)
    key: object                 # the noise pool's key (None without a pool)
    col: int                    # its column in the measurement (position over the parts)
    grad: Optional[Tensor]      # a copy of D (m x n float32) when dd is None


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
    selected sqrt-traces (spectral.nuclear_stats with a NuclearRequest
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


def copy_detached(t: Tensor) -> Tensor:
    """A copy of t without autograd history (no detach() op where there is none)."""
    return (t.detach() if t.requires_grad else t).clone()


# a kept mean gradient D (m x n) is copied for the one solve when m n <= this x k^2
# (``ShareSolver.owned_grams``)
KEEP_D_ASPECT = 4


class ShareSolver:
    """The solver settings of a SolveShare and its one solve (module docstring).

    rows: share_rows of the measurement; scale, bias_correction, num_samples, batch_size,
    hints, method: as spectral.nuclear_stats; signal: 'raw' or 'debiased'; gauss: the
    'gauss-sums' dof (rows q, a and the sums); pool, grad_scale: the noise pool (None: no
    pool) and the loss scale of the measured backward.
    """

    def __init__(self, rows: dict, scale: float, bias_correction: bool, num_samples: int,
                 batch_size: float, hints, method: str, gauss: bool,
                 pool: Optional[NoisePool], grad_scale: float):
        self.rows = rows
        self.scale = scale
        self.bias_correction = bias_correction
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.hints = hints
        self.method = method
        self.gauss = gauss
        self.pool = pool
        self.grad_scale = grad_scale

    def kw(self) -> dict:
        """Solver arguments common to every part."""
        return dict(scale=self.scale, bias_correction=self.bias_correction,
                    num_samples=self.num_samples, batch_size=self.batch_size,
                    method=self.method, eig_hints=self.hints)

    def newton(self, device) -> bool:
        """Whether this share's method resolves to the Newton path on ``device``."""
        return resolve_method(self.method, device) in NEWTON_METHODS

    def mean_grad_gram_op(self, device) -> Callable:
        """The Gram function of the mean gradients D D^T: float64 products on the Newton
        path (as spectral.nuclear_stats forms them there), float32 Grams else."""
        return grams64_on_sides if self.newton(device) else grams_on_sides

    def owned_grams(self, grads: list, ks: list, shapes: list, shifts: list,
                    device) -> tuple[list, list, list]:
        """(D D^T, signal Gram, copy of D) of a part's owned matrices, each None where the
        solve forms it: grads the mean shifted gradients D (m x n), ks their Gram sides,
        shapes the parameter shapes, shifts None or the shift S of each matrix.

        D D^T is formed at the solve, batched over the measurement (``part``), from a copy
        of D (the caller reuses the pack it views), where D is at most KEEP_D_ASPECT k^2
        elements (its copy then takes at most twice the memory of the float64 D D^T); a
        wider D (an embedding) has its D D^T formed now. A shifted matrix's signal Gram
        G G^T (G = D + S) is formed now, before this measurement's mean replaces a
        shift="last"."""
        n_o = len(grads)
        sides = ["row" if shapes[j][0] == ks[j] else "col" for j in range(n_o)]
        keep_d = [shapes[j][0] * shapes[j][1] <= KEEP_D_ASPECT * ks[j] ** 2 for j in range(n_o)]
        dd: list = [None] * n_o
        now = [j for j in range(n_o) if not keep_d[j]]
        if now:
            on_sides = self.mean_grad_gram_op(device)
            for j, G in zip(now, on_sides([grads[j] for j in now], [sides[j] for j in now])):
                dd[j] = G
        gg: list = [None] * n_o
        sh = [j for j in range(n_o) if shifts[j] is not None]
        if sh:  # one batched call (each Gram a function of its own matrix)
            for j, G in zip(sh, grams_on_sides([grads[j].float() + shifts[j].float() for j in sh],
                                               [sides[j] for j in sh])):
                gg[j] = G
        return dd, gg, [copy_detached(D) if k else None for D, k in zip(grads, keep_d)]

    def mean_grad_grams(self, kept: list, device) -> tuple[list, list]:
        """(D D^T, signal Gram) per kept matrix: the kept D's Grams formed here, one batch
        per (shape, side) (float64 products on the Newton path, as
        spectral.nuclear_stats forms them there; float32 Grams on the eigenvalue
        path), on the Gram's side ('row' for a square matrix)."""
        todo = [i for i, e in enumerate(kept) if e.dd is None]
        dd = [e.dd for e in kept]
        if todo:
            on_sides = self.mean_grad_gram_op(device)
            Ds = [kept[i].grad for i in todo]
            sides = ["row" if kept[i].shape[0] == kept[i].gram.shape[-1] else "col" for i in todo]
            for i, G in zip(todo, on_sides(Ds, sides)):
                dd[i] = G
        return dd, [e.gg if e.gg is not None else dd[i] for i, e in enumerate(kept)]

    def guard(self, fn: Callable[[], Tensor], L: int, device) -> Callable[[], Tensor]:
        """fn, whose solver failure (a warning) gives a part of NaN values (used64 0): the
        measurement is then invalid on every rank."""
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

    def part(self, kept: list, qa: Optional[Tensor], L: int, dev) -> tuple[Callable[[], Tensor], list]:
        """(run, inputs): run() -> this rank's float64 rows x L part of the measurement's L
        matrices, from its kept matrices (``KeptMatrix``, column order), every one solved in
        one call, batched by Gram size (spectral's _solve groups by size), spread into
        their columns (0 in the columns it does not own); qa: the deviation sums of every
        matrix (Tensor[2, L], 'gauss-sums'; None), written into rows q, a. inputs: the
        tensors run() reads (the caller records them on its stream). Guarded (``guard``)."""
        rows = self.rows
        n = len(kept)
        grams = [e.gram for e in kept]
        mats: list = []  # [D D^T, signal Grams], formed in run() (on CUDA on the side stream)
        shapes = [e.shape for e in kept]
        cols = [e.col for e in kept]
        inputs = grams + [t for e in kept for t in (e.dd, e.gg, e.grad) if t is not None]
        fold = None
        chain = None  # the pool's fold inside the Newton chain ('gauss-sums' sums)
        if self.pool is not None and n:
            okeys = [e.key for e in kept]
            if self.gauss and self.newton(dev):
                chain, folds = pool_folder(self.pool, okeys, self.num_samples, self.grad_scale)
                fold = lambda sums: pooled_sums(sums, folds, n, dev)  # noqa: E731
            else:
                fold = lambda covs: pooled_sqrt_traces(self.pool, okeys, covs, shapes,  # noqa: E731
                                                       self.num_samples, self.grad_scale, self.method,
                                                       self.hints, raw=True)

        def solve(select, cov_out=None, signal="raw"):
            raw = signal == "raw"
            sums = self.gauss and raw
            req = NuclearRequest(select=select, record_hints=False, sums=sums,
                                 covariances=cov_out is not None and chain is None,
                                 pool_fold=chain if raw else None)
            res = nuclear_stats(grams, None, mean_grad_grams=mats[0], signal_grams=mats[1], shapes=shapes,
                                signal=signal, request=req, **self.kw())
            if req.covariances:
                cov_out.extend(res.covariances)
            return (res.noise, res.signal, res.used64) + ((res.sums,) if sums else ()) + (
                (res.pooled,) if req.pool_fold is not None else ())

        def run() -> Tensor:
            if n:
                mats.extend(self.mean_grad_grams(kept, dev))
                part = solve_part(solve, inputs, [True] * n, [True] * n, dev, rows,
                                  lambda sel: solve(sel, signal="debiased"), fold,
                                  finite_from_outputs=self.newton(dev))
                # a gather (deterministic; index_copy_ is not on CUDA): column l takes
                # part's column j when this rank solved it (cols[j] = l), else a zero column
                out = part if n == L else torch.cat([part, part.new_zeros((len(rows), 1))], dim=1).index_select(
                    1, column_index(cols, L, dev))
            else:
                out = torch.zeros((len(rows), L), dtype=torch.float64, device=dev)
            if qa is not None:
                out[rows["q"]:rows["q"] + 2] = qa.to(device=dev, dtype=torch.float64)
            return out

        return self.guard(run, L, dev), inputs + ([] if qa is None else [qa])
