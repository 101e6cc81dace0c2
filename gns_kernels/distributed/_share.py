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
- the shared vector (float64, rows x L over the whole measurement): each rank writes the
  values it solved and 0 elsewhere, so its all-reduce (sum) gives every rank every value
  exactly; its rows (noise, signal, the eigensolver report, and the rows of the debiased
  signal, the 'gauss-sums' correction and the noise pool) and their reading:
  gns_kernels.distributed._share_vector. The solve and its validity:
  gns_kernels.distributed._share_solve.
- order: ``read()`` sums the per-matrix values (``share_columns``) on the host with
  ``exact_sum`` (correctly rounded, so the totals are a function of the values, not of the
  column order). DDP lays out a fresh model's first-iteration buckets in reverse
  registration order and rebuilds them after that iteration in the order the gradients
  became ready, so the first step of a resumed run presents the matrices in another order
  (and other buckets) than the uninterrupted run did at that step; its totals are the same.

- one solve per measurement: ``add_grads`` / ``add_grams`` only assign the part's
  matrices and hand the ones this rank owns to its ``ShareSolver``
  (gns_kernels.distributed._share_solve, one call per part), which keeps a copy of the
  mean Gram (k x k float32) and of the mean gradient D (m x n float32; its D D^T is
  formed at the solve, one batch per shape and side over the whole measurement) -- or
  D D^T itself (FSDP2 hands it in; DDP forms it in the part for a D wider than 4 k^2
  elements), and G G^T for a shifted matrix's signal -- held from the part until
  ``launch`` (DDP: after the last bucket); the share keeps the deviation sums (rows q, a).
  ``launch`` (or ``vector``) then has the solver solve every owned matrix of the
  measurement in one call (noise, signal, debiased signal and the pool's solves each
  batched by Gram size) and spread the values into this rank's columns (one gather by an
  index, ``column_index``). The layout of the shared vector (columns in part order) is
  unchanged.

- host route (method "host"; "auto" off the CPU: ``config.hook_method``): ``launch(...,
  lag=True)`` stages the owned matrices instead of solving them (``stage``:
  gns_kernels.distributed._share_host, the noise pool folded now) and ``submit`` starts a
  host job that solves them (spectral.host.HostJob: float64 eigvalsh on a CPU thread);
  ``join`` -- at the next measurement, where that one launches (the hooks:
  ``Measurement.record_nuclear``) -- waits for the job, adds the host rows to the device
  rows (``part``) and starts the share all-reduce then: measurement k's vector rides
  measurement k+F's one extra collective. ``launch`` without lag joins at once.

With one rank the solver runs everything and no collective is issued. Nothing here reads
a device value on the host: the totals stay device tensors until ``read()`` (called when
the estimate is first read).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..spectral.deviations import deviation_sums
from ..stats.pool import NoisePool
from ..spectral.host import HostJob
from ._share_host import HostRoute, HostStaged
from ._share_solve import ShareSolver
from ._share_vector import share_columns, share_rows, share_totals
from .config import hook_method
from ._stats import exact_sum

Tensor = torch.Tensor

__all__ = ["assign_solves", "SolveShare"]


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


class SolveShare(HostRoute):
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
        self.gauss = bool(bias_correction) and dof == "gauss-sums"
        self.signal = signal
        self.pool = pool if bias_correction else None
        # with a pool: key -> owner rank, kept across measurements (the pool of a matrix
        # lives on its owner, so a matrix keeps its owner when DDP rebuilds its buckets)
        self.sticky = owners if self.pool is not None else None
        self.pooled_total: Optional[float] = None
        self.rows = share_rows(signal == "debiased", self.gauss, self.pool is not None)
        # this rank's matrices, kept from their parts, and their one solve (``_solve_kept``)
        self.solver = ShareSolver(self.rows, scale, bias_correction, num_samples, batch_size, hints,
                                  method, self.gauss, self.pool, float(grad_scale))
        self.method = method
        self.world = world
        self.rank = rank
        self.scale = scale
        self.num_samples = num_samples
        self.hints = hints
        self.loads = [0] * world
        self.parts: list[Tensor] = []
        self.shapes: list[tuple] = []
        # 'gauss-sums': this rank's deviation sums q, a (float64 vectors, in column order)
        self.qa_q: list[Tensor] = []
        self.qa_a: list[Tensor] = []
        self.solved = False
        self.device = None
        self.stream = None  # CUDA: the side stream the solves run on
        self.future = None  # of the share all-reduce (None: nothing to share / one rank)
        self.reduced: Optional[Tensor] = None
        # the host route (module docstring, "host route"): the staged solve, its job, the
        # monotonic time it was submitted, and this rank's full part once known
        self.staged: Optional[HostStaged] = None
        self.job: Optional[HostJob] = None
        self.submitted: Optional[float] = None
        self.full: Optional[Tensor] = None

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

    def _run(self, qa: Optional[Tensor], L: int, fn: Callable) -> Any:
        """fn(qa, L, device) -> (result, inputs): the solver's one solve of this rank's part
        (``ShareSolver.solve``) or the host route's staging (``_share_host.stage_host``),
        on a side stream on CUDA (where this rank owns a matrix), inline elsewhere.
        Returns the result."""
        kept = self.solver.kept
        like = kept[0].gram if kept else None
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
                out, inputs = fn(qa, L, self.device)
            for t in inputs:  # freed by the caller's stream after this call
                t.record_stream(self.stream)
        else:
            out, inputs = fn(qa, L, self.device)
        return out

    # ----------------------------------------------------------- parts
    def add_grads(self, mean_grams: Sequence[Tensor], mean_grads: Sequence[Tensor],
                  shifts: Optional[Sequence[Optional[Tensor]]],
                  deviations: Optional[Sequence[Tensor]] = None,
                  keys: Optional[Sequence] = None) -> None:
        """A DDP bucket: mean Grams (k x k), mean shifted gradients D (m x n), shifts, and
        (dof 'gauss-sums') this rank's deviations d_j = G^j - G (m x n) per matrix; keys:
        the noise pool's key of each matrix (needed with a pool). Nothing is solved here:
        the owned matrices are kept (``ShareSolver.keep_grads``) and solved once, with every
        other part's, by ``launch`` (or ``vector``)."""
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
        Tensor[2, L] or ``deviation_sums_parts``'s lists (joined once, at the solve). Which
        Grams are formed now and which at the solve: ``ShareSolver.owned_grams``; the
        owned matrices go to the solver in one call (``ShareSolver.keep_grads``)."""
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
        base = self._columns(shapes, device)
        self.solver.keep_grads(grams_o, grads_o, idx, ks, shapes, shifts, keys, base, device)

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
        base = self._columns(shapes, mean_grams[0].device)
        # copied by the solver: the caller may reuse the buffers the Grams view before launch()
        self.solver.keep_grams([mean_grams[l] for l in idx], [dd[l] for l in idx], idx, shapes, keys, base)

    def _check_keys(self, keys, L: int) -> None:
        if self.pool is not None and (keys is None or len(keys) != L):
            raise ValueError(f"keys: a noise pool needs one key per matrix ({L}), got "
                             f"{None if keys is None else len(keys)}")

    def _columns(self, shapes: list, dev) -> int:
        """Add a part's matrices (their parameter shapes) to the measurement's columns;
        returns the part's first column."""
        if self.device is None:
            self.device = dev
        base = len(self.shapes)
        self.shapes.extend(shapes)
        return base

    def _solve_kept(self) -> None:
        """The one solve of a measurement (module docstring): every owned matrix of every
        part (``ShareSolver.solve``); the deviation sums of every matrix fill rows q, a. On
        CUDA on the side stream. Runs once, from ``launch`` / ``vector``."""
        L = len(self.shapes)
        if L == 0 or self.solved:
            return
        self.solved = True
        qa = torch.stack([torch.cat(self.qa_q), torch.cat(self.qa_a)]) if self.qa_q else None
        self.qa_q, self.qa_a = [], []
        self.parts.append(self._run(qa, L, self.solver.solve))

    # ----------------------------------------------------------- sharing
    def vector(self) -> Optional[Tensor]:
        """The float64 rows x L vector of this rank ([noise (L), signal (L), used64 (L)],
        plus the rows of share_rows; None: no matrix), after the one solve
        (``_solve_kept``); on CUDA formed on the side stream the solve ran on."""
        if self.is_host():  # staged, solved on a host thread and waited for here
            self.stage()
            self.submit()
            part = self.part()
            return None if part is None else part.reshape(-1)
        self._solve_kept()
        if not self.parts:
            return None
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                return torch.cat(self.parts, dim=1).reshape(-1)
        return torch.cat(self.parts, dim=1).reshape(-1)

    def launch(self, group, all_reduce: Callable, lag: bool = False) -> None:
        """Solve this rank's share and form its vector (``vector``: the one solve of the
        measurement), then start the one share all-reduce (async; on CUDA on the side
        stream). With one rank nothing is sent. all_reduce: torch.distributed.all_reduce.

        The host route (``is_host``): the solve is staged and submitted to a host job
        (``stage``, ``submit``); lag=True (the hooks) returns then -- ``join`` finishes it
        later, at the next measurement, with that measurement's collective; lag=False waits
        for the job here and shares at once (``join``)."""
        if self.is_host():
            self.stage()
            if lag:
                return
            self.submit()
            self.join(group, all_reduce)
            return
        vec = self.vector()
        if vec is None:
            return
        self._share(vec, group, all_reduce)

    def _share(self, vec: Tensor, group, all_reduce: Callable) -> None:
        """Start the share all-reduce of ``vec`` (none with one rank); ``reduced`` = vec."""
        if self.world > 1:
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self.future = all_reduce(vec, group=group, async_op=True).get_future()
            else:
                self.future = all_reduce(vec, group=group, async_op=True).get_future()
        self.reduced = vec

    def is_host(self) -> bool:
        """Whether this share runs the host route (``config.hook_method``; no part: CPU)."""
        return hook_method(self.method, self.device if self.device is not None else "cpu") == "host"

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
