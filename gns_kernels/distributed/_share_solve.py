"""The one solve of a measurement's shared nuclear statistics (gns_kernels.distributed._share):
every matrix this rank owns, solved in one call, written into this rank's part of the
shared vector (gns_kernels.distributed._share_vector).

``ShareSolver`` keeps, for each matrix its SolveShare assigns to this rank, the mean Gram,
D D^T or D itself, the signal's Gram, the parameter shape, the pool key and the column
(``KeptMatrix``; ``keep_grads`` / ``keep_grams``, one call per part) until the share's
``launch``; ``ShareSolver.solve`` then prepares the solver's arguments, calls the solver
(gns_kernels.spectral: the kept D's Grams, one batch per shape and side; the noise,
signal, debiased signal and the pool's sqrt-traces, each batched by Gram size) and writes
the values into this rank's columns (one gather by an index, ``column_index``); the
deviation sums of every matrix fill rows q, a.

Validity: a rank whose solved inputs are non-finite (non-finite gradients on some rank)
writes NaN for the values it owns in that part; a solver failure likewise (with a
warning). NaN survives the sum, so the measurement is invalid on every rank.

The host route (method "host"; "auto" off the CPU: ``ShareSolver.resolved``) does not
call ``solve``: the share stages the kept matrices instead
(gns_kernels.distributed._share_host) and a host thread solves them.

Nothing here reads a device value on the host.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .._validation import warn_user as _warn_user
from ..spectral.grams import grams64_on_sides, grams_on_sides
from ..spectral.nuclear import NuclearRequest, nuclear_stats
from ..spectral.trace import NEWTON_METHODS
from ..stats.pool import NoisePool
from ..spectral.pooled import pooled_sqrt_traces
from ..stats.pooled import pool_folder, pooled_sums
from ._stats import all_finite
from .config import hook_method

Tensor = torch.Tensor

__all__ = ["KeptMatrix", "ShareSolver", "column_index", "copy_detached", "KEEP_D_ASPECT"]


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


def copy_detached(t: Tensor) -> Tensor:
    """A copy of t without autograd history (no detach() op where there is none)."""
    return (t.detach() if t.requires_grad else t).clone()


# a kept mean gradient D (m x n) is copied for the one solve when m n <= this x k^2
# (``ShareSolver.owned_grams``)
KEEP_D_ASPECT = 4


class ShareSolver:
    """The solver settings of a SolveShare, the matrices it keeps for its one solve, and
    the solve (module docstring).

    rows: share_rows of the measurement (a 'signal_deb' row: the debiased signal is
    solved too); scale, bias_correction, num_samples, batch_size, hints, method: as
    spectral.nuclear_stats; gauss: the 'gauss-sums' dof (rows q, a and the sums); pool,
    grad_scale: the noise pool (None: no pool) and the loss scale of the measured backward.
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
        self.kept: list[KeptMatrix] = []  # this rank's matrices, from their parts until the solve

    def kw(self, device) -> dict:
        """The solver arguments of the solve's nuclear_stats calls (their common part), the
        method resolved for ``device`` (``resolved``)."""
        return dict(scale=self.scale, bias_correction=self.bias_correction,
                    num_samples=self.num_samples, batch_size=self.batch_size,
                    method=self.resolved(device), eig_hints=self.hints)

    def resolved(self, device) -> str:
        """The solver this share runs on ``device``: 'eigh', 'newton' or 'host'
        (gns_kernels.distributed.config.hook_method: 'auto' is 'eigh' on CPU tensors, the
        host route elsewhere)."""
        return hook_method(self.method, device)

    def newton(self, device) -> bool:
        """Whether this share's method resolves to the Newton path on ``device``."""
        return self.resolved(device) in NEWTON_METHODS

    def host(self, device) -> bool:
        """Whether this share's method resolves to the host route on ``device`` (staged by
        gns_kernels.distributed._share_host, solved on a host thread)."""
        return self.resolved(device) == "host"

    def mean_grad_gram_op(self, device) -> Callable:
        """The Gram function of the mean gradients D D^T: float64 products on every route,
        as spectral.nuclear_stats forms them (a float32 D D^T put the eigh route up to 3x
        over the steep-spectrum bound; issue 43 item 5)."""
        return grams64_on_sides

    def owned_grams(self, grads: list, ks: list, shapes: list, shifts: list,
                    device) -> tuple[list, list, list]:
        """(D D^T, signal Gram, copy of D) of a part's owned matrices, each None where the
        solve forms it: grads the mean shifted gradients D (m x n), ks their Gram sides,
        shapes the parameter shapes, shifts None or the shift S of each matrix.

        D D^T is formed at the solve, batched over the measurement (``solve``), from a copy
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

    # ----------------------------------------------------------- the kept matrices
    def keep_grads(self, grams: list, grads: list, idx: list, ks: Sequence[int], shapes: list,
                   shifts: Optional[Sequence[Optional[Tensor]]], keys: Optional[Sequence], base: int,
                   device) -> None:
        """Keep a part's owned matrices for the one solve (DDP / MicroBatchGNS: the mean
        Grams and the mean shifted gradients). idx: the owned matrices' positions in the
        part (ascending); grams, grads: their mean Grams (k x k) and mean shifted gradients
        D (m x n); ks, shapes, shifts (None or one per matrix), keys (None without a pool):
        the Gram side, the parameter shape, the shift and the pool key of each of the
        part's matrices; base: the part's first column in the measurement. Which Grams are
        formed now and which at the solve: ``owned_grams``."""
        dd, gg, copies = self.owned_grams(grads, [ks[l] for l in idx], [shapes[l] for l in idx],
                                          [None if shifts is None else shifts[l] for l in idx], device)
        self._keep(grams, dd, gg, idx, shapes, keys, base, copies)

    def keep_grams(self, grams: list, dd: list, idx: list, shapes: list, keys: Optional[Sequence],
                   base: int) -> None:
        """Keep a part's owned matrices for the one solve (FSDP2: the mean Grams and the
        Grams of the mean gradient D D^T, which is also the signal's). grams, dd: those of
        the owned matrices (idx: their positions in the part), copied (the caller may reuse
        the buffers they view before the solve); shapes, keys, base: as ``keep_grads``."""
        copies = [copy_detached(t) for t in dd]
        self._keep(grams, copies, copies, idx, shapes, keys, base)

    def _keep(self, grams: list, dd: list, gg: list, idx: list, shapes: list, keys, base: int,
              grads: Optional[list] = None) -> None:
        """Append the owned matrices idx of a part to ``kept``: a copy of the mean Gram
        (grams[j], k x k float32), D D^T (dd[j], k x k) or, when dd[j] is None, a copy of D
        itself (grads[j], m x n float32: its Gram is formed at the solve), the signal's Gram
        (gg[j]; None: D D^T), the parameter shape, the pool key and the column (base + its
        position in the part)."""
        for j, l in enumerate(idx):
            self.kept.append(KeptMatrix(copy_detached(grams[j]), dd[j], gg[j], shapes[l],
                                        None if keys is None else keys[l], base + l,
                                        None if grads is None else grads[j]))

    # ----------------------------------------------------------- the one solve
    def solve(self, qa: Optional[Tensor], L: int, dev) -> tuple[Tensor, list]:
        """(part, inputs): the one solve of the measurement (module docstring) over every
        kept matrix, which it takes from ``kept``. part: this rank's float64 rows x L part
        of the measurement's L matrices (0 in the columns it does not own); qa: the
        deviation sums of every matrix (Tensor[2, L], 'gauss-sums'; None), written into rows
        q, a. inputs: the tensors the solve read (the caller records them on its stream).

        A solver failure (RuntimeError, torch.linalg.LinAlgError) warns and gives a part of
        NaN values (used64 0): the measurement is then invalid on every rank."""
        kept, self.kept = self.kept, []
        inputs = [e.gram for e in kept] + [t for e in kept for t in (e.dd, e.gg, e.grad) if t is not None]
        try:
            out = self._solve(kept, inputs, qa, L, dev)
        except (RuntimeError, torch.linalg.LinAlgError) as exc:  # LinAlgError is a RuntimeError
            _warn_user(f"gns_kernels: nuclear statistics failed ({exc}); this measurement "
                       "is marked invalid")
            out = torch.full((len(self.rows), L), float("nan"), dtype=torch.float64, device=dev)
            out[2] = 0.0
        return out, inputs + ([] if qa is None else [qa])

    def _solve(self, kept: list, inputs: list, qa: Optional[Tensor], L: int, dev) -> Tensor:
        """``solve`` without its guard, in three steps: the solver's arguments (this
        module), the solver's calls (gns_kernels.spectral, one after the other: the method,
        the kept D's Grams, the noise and signal, the debiased signal, the pool's
        sqrt-traces), and the rows written from their results (torch only).

        The kept D's Grams are formed one batch per (shape, side), on the Gram's side
        ('row' for a square matrix): float64 products on the Newton path (as
        spectral.nuclear_stats forms them there), float32 Grams on the eigenvalue path.
        Every kept matrix's noise and signal are solved in one call (batched by Gram size;
        with return_sums when rows has 'pair'), the debiased signals (row signal_deb) in
        another. The pool (rows pool_tr, pool_pair, pool_nu, pool_new): on the Newton path
        with 'gauss-sums' its covariances are folded inside the noise chain
        (``pool_folder``) and its rows formed from the pooled matrices' sums
        (``pooled_sums``); else the solve returns the covariances and
        ``pooled_sqrt_traces`` folds and solves them.

        Validity: rows noise, signal, (signal_deb, pair, trace, fro2, the pool's) are all
        NaN when an input is non-finite (non-finite gradients on some rank): on the Newton
        path a non-finite input element makes its matrix's trace (and sums) NaN (the
        normalization divides inf by inf), so the outputs decide, in one check; on the
        eigenvalue path the inputs are checked (``all_finite``). NaN survives the sum, so
        the measurement is invalid on every rank. used64 is 0 / 1; rows q, a hold qa. No
        host synchronization."""
        rows = self.rows
        n = len(kept)
        f64 = dict(device=dev, dtype=torch.float64)
        if not n:
            out = torch.zeros((len(rows), L), **f64)
            if qa is not None:
                out[rows["q"]:rows["q"] + 2] = qa.to(**f64)
            return out
        # the solver's arguments
        kw = self.kw(dev)
        grams = [e.gram for e in kept]
        shapes = [e.shape for e in kept]
        keys = [e.key for e in kept]
        todo = [i for i, e in enumerate(kept) if e.dd is None]
        sides = ["row" if kept[i].shape[0] == kept[i].gram.shape[-1] else "col" for i in todo]
        # a gather (deterministic; index_copy_ is not on CUDA): column l takes the solved
        # column j when this rank owns it (cols[j] = l), else a zero column
        index = None if n == L else column_index([e.col for e in kept], L, dev)
        debiased = "signal_deb" in rows
        nan = torch.full((), float("nan"), **f64)

        # the solver's calls
        newton = self.newton(dev)
        dd = [e.dd for e in kept]
        if todo:
            on_sides = grams64_on_sides  # every route, as nuclear_stats (issue 43 item 5)
            for i, G in zip(todo, on_sides([kept[i].grad for i in todo], sides)):
                dd[i] = G
        gg = [e.gg if e.gg is not None else dd[i] for i, e in enumerate(kept)]
        chain, folds = None, None  # the pool folded inside the Newton chain ('gauss-sums' sums)
        if self.pool is not None and self.gauss and newton:
            chain, folds = pool_folder(self.pool, keys, self.num_samples, self.grad_scale)
        req = NuclearRequest(select=([True] * n, [True] * n), record_hints=False, sums=self.gauss,
                             covariances=self.pool is not None and chain is None, pool_fold=chain)
        res = nuclear_stats(grams, None, mean_grad_grams=dd, signal_grams=gg, shapes=shapes,
                            signal="raw", request=req, **kw)
        deb = None
        if debiased:
            deb = nuclear_stats(grams, None, mean_grad_grams=dd, signal_grams=gg, shapes=shapes,
                                signal="debiased", request=NuclearRequest(
                                    select=([False] * n, [True] * n), record_hints=False),
                                **kw).signal
        pool = None  # Tensor[4, n]: the pool rows of the kept matrices
        if chain is not None:
            pool = pooled_sums(res.pooled, folds, n, dev)
        elif self.pool is not None and res.covariances:
            pool = pooled_sqrt_traces(self.pool, keys, [C for _, C in res.covariances], shapes,
                                      self.num_samples, self.grad_scale, kw["method"], self.hints, raw=True)

        # the rows
        if newton:
            outs = [res.noise, res.signal] + ([res.sums] if self.gauss else []) + (
                [res.pooled] if chain is not None else [])
            ok = torch.isfinite(torch.cat([t.reshape(-1).to(**f64) for t in outs])).all()
        else:
            ok = all_finite(inputs, dev)
        out = torch.zeros((len(rows), n), **f64)
        vals = torch.stack([res.noise, res.signal]).to(**f64)
        if "pair" in rows:  # the float64 raw trace of the kept noise matrices, and the sums
            vals[0] = res.sums[0].to(**f64)
            p = rows["pair"]
            out[p:p + 3] = torch.where(ok, res.sums[1:4].to(**f64), nan)
        out[:2] = torch.where(ok, vals, nan)
        if res.used64 is not None:
            out[2] = res.used64.to(**f64)
        if deb is not None:
            out[rows["signal_deb"]] = torch.where(ok, deb.to(**f64), nan)
        if pool is not None:
            out[rows["pool_tr"]:rows["pool_tr"] + 4] = torch.where(ok, pool.to(**f64), nan)
        if index is not None:
            out = torch.cat([out, out.new_zeros((len(rows), 1))], dim=1).index_select(1, index)
        if qa is not None:
            out[rows["q"]:rows["q"] + 2] = qa.to(**f64)
        return out
