"""Ranks share the nuclear sqrt-trace solves of a measurement.

After the Gram all-reduce every rank holds the same mean Grams, so solving all 2L
sqrt-traces (noise tr(C_l^{1/2}) and signal ||G_l||_S1 per matrix l) on every rank repeats
the work R times. Instead each rank solves its share and one small all-reduce shares the
results:

- assignment: every solve costs k^3 (k the side of its k x k eigenproblem). The solves
  of a bucket (DDP) or param group (FSDP2) are sorted by (cost descending, position) and
  each goes to the rank with the smallest running load (ties: the lowest rank); the loads
  carry over from one bucket to the next (greedy longest-processing-time). Every rank sees
  the same buckets in the same order, so every rank computes the same assignment without
  communicating.
- the shared vector (float64, 3L over the whole measurement, L its measured matrices in
  bucket order): [noise_l, signal_l, used64_l] where each rank writes the values it solved
  and 0 elsewhere. Its all-reduce (sum) gives every rank every value exactly (each entry
  has one non-zero contributor: x + 0 = x), so the totals are bitwise identical on every
  rank. used64_l (1.0: the eigenvalue solver needed float64 for matrix l) is the
  eigensolver hint report: every rank records the same report, so the hints stay
  identical on every rank.
- bias correction: the corrected noise is computed by the rank that solves it, from the
  eigenvalues of its own solve; the corrected value is what is shared.
- validity: a rank whose solved inputs are non-finite (non-finite gradients on some rank)
  writes NaN for the values it owns in that part; a solver failure likewise (with a
  warning). NaN survives the sum, so the measurement is invalid on every rank.

With one rank the solver runs everything and no collective is issued. Nothing here reads
a device value on the host: the totals stay device tensors until ``read()`` (called when
the estimate is first read).
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch

from ..spectral.nuclear import nuclear_stats_from_grams_select, nuclear_stats_select

Tensor = torch.Tensor

__all__ = ["assign_solves", "SolveShare", "share_totals", "solve_part"]


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


def _finite(tensors: Sequence[Tensor], device) -> Tensor:
    """0-d bool tensor: every element of every tensor is finite (no host read)."""
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def solve_part(solve: Callable, inputs: Sequence[Tensor], owned_n: Sequence[bool],
               owned_s: Sequence[bool], device) -> Tensor:
    """One part (bucket / param group) of a rank's share: float64 Tensor[3, L_part].

    solve(select) -> (noise[L], signal[L], used64[L] or None) solves the selected
    sqrt-traces (spectral.nuclear_stats_select / nuclear_stats_from_grams_select with
    record_hints=False). inputs: the tensors the owned solves read (checked for
    finiteness on the device). Rows: noise, signal (all NaN when an owned input is
    non-finite), used64 (0 / 1). Entries this rank does not own are 0.
    No host synchronization.
    """
    L = len(owned_n)
    out = torch.zeros((3, L), dtype=torch.float64, device=device)
    if not (any(owned_n) or any(owned_s)):
        return out
    noise, signal, used = solve((list(owned_n), list(owned_s)))
    ok = _finite(inputs, device)
    vals = torch.stack([noise, signal]).to(device=device, dtype=torch.float64)
    # non-finite owned inputs: the whole part is NaN on this rank (and, through the sum,
    # on every rank); entries not owned are 0 from the solver
    out[:2] = torch.where(ok, vals, torch.full_like(vals, float("nan")))
    if used is not None:
        out[2] = used.to(device=device, dtype=torch.float64)
    return out


def share_totals(vec: Tensor) -> Tensor:
    """float64 Tensor[2]: (sum_l noise_l, sum_l signal_l) of a reduced shared vector
    [noise (L), signal (L), used64 (L)] (one fixed order: identical on every rank)."""
    L = vec.numel() // 3
    return vec.view(3, L)[:2].sum(dim=1)


class SolveShare:
    """The shared nuclear solves of one measurement (module docstring).

    world, rank: of the process group; scale, bias_correction, num_samples, batch_size,
    hints: as spectral.nuclear_stats. Parts are added in the same order on every rank
    (``add_grads`` for DDP / MicroBatchGNS, ``add_grams`` for FSDP2), then ``vector()`` is
    all-reduced once (``launch``), and ``read()`` returns the totals on the host.
    """

    def __init__(self, world: int, rank: int, scale: float, bias_correction: bool,
                 num_samples: int, batch_size: float, hints=None, method: str = "auto"):
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
        self.device = None
        self.stream = None  # CUDA: the side stream the solves run on
        self.future = None  # of the share all-reduce (None: nothing to share / one rank)
        self.reduced: Optional[Tensor] = None
        self.failed = False

    # ----------------------------------------------------------- assignment
    def _owners(self, ks: Sequence[int]) -> tuple[list, list]:
        """(owned_n, owned_s) of this rank for matrices with Gram sides ks."""
        cost = [int(k) ** 3 for k in ks]
        owners = assign_solves(cost + cost, self.loads)
        L = len(ks)
        return ([o == self.rank for o in owners[:L]], [o == self.rank for o in owners[L:]])

    def _run(self, fn: Callable[[], Tensor], like: Tensor, inputs: Sequence[Tensor]) -> None:
        """Run fn (the part's solve) on a side stream on CUDA, inline elsewhere."""
        if self.device is None:
            self.device = like.device
        if like.device.type == "cuda":
            if self.stream is None:
                self.stream = torch.cuda.Stream(device=like.device)
            self.stream.wait_stream(torch.cuda.current_stream(like.device))
            with torch.cuda.stream(self.stream):
                part = fn()
            for t in inputs:  # the pack they view is freed by the caller's stream
                t.record_stream(self.stream)
        else:
            part = fn()
        self.parts.append(part)

    def _guard(self, fn: Callable[[], Tensor], L: int, device) -> Callable[[], Tensor]:
        def run() -> Tensor:
            try:
                return fn()
            except (RuntimeError, torch.linalg.LinAlgError) as exc:  # LinAlgError is a RuntimeError
                warnings.warn(f"gns_kernels: nuclear statistics failed ({exc}); this measurement "
                              "is marked invalid", RuntimeWarning, stacklevel=4)
                out = torch.zeros((3, L), dtype=torch.float64, device=device)
                out[:2] = float("nan")
                return out
        return run

    # ----------------------------------------------------------- parts
    def add_grads(self, mean_grams: Sequence[Tensor], mean_grads: Sequence[Tensor],
                  shifts: Optional[Sequence[Optional[Tensor]]]) -> None:
        """A DDP bucket: mean Grams (k x k), mean shifted gradients D (m x n), shifts."""
        mean_grams, mean_grads = list(mean_grams), list(mean_grads)
        L = len(mean_grams)
        if L == 0:
            return
        ks = [A.shape[-1] for A in mean_grams]
        own_n, own_s = self._owners(ks)
        shapes = [tuple(D.shape) for D in mean_grads]
        self.shapes.extend(shapes)
        dev = mean_grams[0].device
        inputs = [t for l in range(L) if own_n[l] or own_s[l] for t in (mean_grams[l], mean_grads[l])]

        def solve(select):
            return nuclear_stats_select(
                mean_grams, mean_grads, scale=self.scale, shifts=shifts,
                bias_correction=self.bias_correction, num_samples=self.num_samples,
                batch_size=self.batch_size, method=self.method, eig_hints=self.hints,
                select=select, record_hints=False)

        self._run(self._guard(lambda: solve_part(solve, inputs, own_n, own_s, dev), L, dev),
                  mean_grams[0], list(mean_grams) + list(mean_grads))

    def add_grams(self, mean_grams: Sequence[Tensor], mean_grad_grams: Sequence[Tensor],
                  shapes: Sequence[Sequence[int]]) -> None:
        """An FSDP2 param group: mean Grams, Grams of the mean gradient, parameter shapes."""
        mean_grams, dd = list(mean_grams), list(mean_grad_grams)
        L = len(mean_grams)
        if L == 0:
            return
        ks = [A.shape[-1] for A in mean_grams]
        own_n, own_s = self._owners(ks)
        shapes = [tuple(int(d) for d in s) for s in shapes]
        self.shapes.extend(shapes)
        dev = mean_grams[0].device
        inputs = [t for l in range(L) if own_n[l] or own_s[l] for t in (mean_grams[l], dd[l])]

        def solve(select):
            return nuclear_stats_from_grams_select(
                mean_grams, dd, scale=self.scale, shapes=shapes,
                bias_correction=self.bias_correction, num_samples=self.num_samples,
                batch_size=self.batch_size, method=self.method, eig_hints=self.hints,
                select=select, record_hints=False)

        self._run(self._guard(lambda: solve_part(solve, inputs, own_n, own_s, dev), L, dev),
                  mean_grams[0], list(mean_grams) + list(dd))

    # ----------------------------------------------------------- sharing
    def vector(self) -> Optional[Tensor]:
        """The float64 [noise (L), signal (L), used64 (L)] of this rank (None: no matrix)."""
        if not self.parts:
            return None
        return torch.cat(self.parts, dim=1).reshape(-1)

    def launch(self, group, all_reduce: Callable) -> None:
        """Start the one share all-reduce (async; on CUDA on the side stream). With one
        rank nothing is sent. all_reduce: torch.distributed.all_reduce."""
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

    def read(self) -> tuple[float, float]:
        """(noise total, signal total) on the host: waits for the share all-reduce and reads
        the reduced vector once; records and applies the eigensolver report to the hints."""
        if self.reduced is None:
            return float("nan"), float("nan")
        if self.future is not None:
            self.future.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.reduced.device).wait_stream(self.stream)
        vec = self.reduced
        L = vec.numel() // 3
        host = torch.cat([share_totals(vec), vec.view(3, L)[2]]).cpu()  # the one sync
        if self.hints is not None:
            self.hints.record(self.shapes, [bool(f > 0.5) for f in host[2:].tolist()])
        return float(host[0]), float(host[1])
