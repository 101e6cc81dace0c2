"""The host route of a measurement's shared nuclear solve (method "host";
gns_kernels.distributed._share): what the device forms and copies, and how the host's
results become this rank's part of the shared vector.

``stage_host`` runs where the other routes solve (``SolveShare._run``: on CUDA on the
share's side stream). From the matrices this rank owns (``ShareSolver.kept``) it forms,
per Gram size k (one stack each):

- the noise matrices C_l = scale (M_l - D_l D_l^T), float64 (M_l the mean Gram, D_l D_l^T
  formed with float64 products where the share kept D itself), as spectral's synchronous
  host route forms them (nuclear_solve._host_size);
- with a noise pool: the pooled matrices P_l, folded into the pool NOW (the pool's state
  after measurement k is the same whether or not its solve has finished), float32;
- the signal matrices G_l G_l^T (float64, or the float32 Gram of a shifted G), and with
  signal='debiased' G_l G_l^T - (scale / B)(M_l - D_l D_l^T) in float64;

and the rows the device knows now, in a rows x L float64 ``device`` part: q, a (the
'gauss-sums' deviation sums), pool_nu, pool_new (from the folds), used64 = 0. On CUDA the
stacks are copied to pinned host memory (non_blocking, on the side stream) and an event
is recorded after the copies: the host job waits for that event on its own thread, so
nothing here waits for the device. On CPU tensors the stacks are handed over as they are.

The job (spectral.host.HostJob, one background thread) computes [tr A_+^{1/2}, pair sum,
tr A, ||A||_F^2] of every matrix in float64 (host_eigen_sums). ``host_rows`` turns them
into this rank's host rows (CPU float64, rows x L): noise (raw, or corrected here for the
'columns' dof from the eigenvalues' sums, nuclear_sqrt_trace_corrected_from_sums; with
'gauss-sums' raw, its pair / trace / fro2 rows filled), signal, signal_deb, pool_tr,
pool_pair. Device and host parts have disjoint non-zero entries, so their sum is exact.

Validity: a non-finite matrix gives a NaN column on the host (and a non-finite covariance
a NaN pool_nu): NaN survives the sums, so the measurement is invalid on every rank.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

import torch

from .._validation import warn_user as _warn_user
from ..spectral.grams import grams64_on_sides
from ..spectral.host import HostJob
from ..stats.bias import nuclear_sqrt_trace_corrected_from_sums
from ..stats.pooled import pool_folder, pooled_sums
from ._share_solve import column_index

Tensor = torch.Tensor

__all__ = ["HostStaged", "stage_host", "host_rows", "HostRoute"]


class HostStaged(NamedTuple):
    """One staged host solve (module docstring).

    device: this rank's device rows (rows x L float64 on the measurement's device);
    items: the matrices for the job (CPU: pinned copies on CUDA, the stacks' views on CPU);
    pair: per item, whether the job computes its pair sum; spread: per item (kind, j),
      kind "n" noise, "p" pooled, "s" signal, "d" debiased signal, j its kept matrix;
    cols, ks, others: per kept matrix its column, Gram side and other dimension;
    event: a CUDA event recorded after the copies (None on CPU);
    inputs: the device tensors the staging read (the caller records them on its stream)."""

    device: Tensor
    items: list
    pair: list
    spread: list
    cols: list
    ks: list
    others: list
    event: object
    inputs: list


def _plain(t: Tensor) -> Tensor:
    return t.detach() if t.requires_grad else t


def stage_host(solver, qa: Optional[Tensor], L: int, dev) -> HostStaged:
    """Stage the host solve of every matrix ``solver`` (a ShareSolver) kept (module
    docstring); takes them from ``solver.kept``. qa: the deviation sums of every matrix
    (Tensor[2, L], 'gauss-sums'; None). No host synchronization."""
    rows = solver.rows
    kept, solver.kept = solver.kept, []
    dev = torch.device(dev)
    f64 = dict(device=dev, dtype=torch.float64)
    out = torch.zeros((len(rows), L), **f64)
    if qa is not None:
        out[rows["q"]:rows["q"] + 2] = qa.to(**f64)
    inputs = [e.gram for e in kept] + [t for e in kept for t in (e.dd, e.gg, e.grad) if t is not None]
    inputs += [] if qa is None else [qa]
    n = len(kept)
    if not n:
        return HostStaged(out, [], [], [], [], [], [], None, inputs)
    ks = [int(e.gram.shape[-1]) for e in kept]
    others = [e.shape[1] if e.shape[0] == k else e.shape[0] for e, k in zip(kept, ks)]
    # the kept D's Grams: float64 products, one batch per (shape, side)
    dd = [e.dd for e in kept]
    todo = [i for i, e in enumerate(kept) if e.dd is None]
    if todo:
        sides = ["row" if kept[i].shape[0] == ks[i] else "col" for i in todo]
        for i, G in zip(todo, grams64_on_sides([kept[i].grad for i in todo], sides)):
            dd[i] = G
    gg = [e.gg if e.gg is not None else dd[i] for i, e in enumerate(kept)]
    pair_noise = bool(solver.bias_correction)  # the correction ('columns') or the sums ('gauss-sums')
    debias = (solver.scale / float(solver.batch_size)) if "signal_deb" in rows else None
    fold = folds = None
    if solver.pool is not None:
        fold, folds = pool_folder(solver.pool, [e.key for e in kept], solver.num_samples, solver.grad_scale)
    by_k: dict = {}
    for j, k in enumerate(ks):
        if k:  # an empty side: noise 0, signal 0 (as spectral's solve)
            by_k.setdefault(k, []).append(j)
    stacks, pair, spread = [], [], []
    folded: list = []

    def add(t: Tensor, kind: str, js: list, want_pair: bool) -> None:
        stacks.append(t)
        pair.extend([want_pair] * len(js))
        spread.extend((kind, j) for j in js)

    for k, js in by_k.items():
        M64 = torch.stack([_plain(kept[j].gram) for j in js]).double()
        diff = M64.sub_(torch.stack([_plain(dd[j]) for j in js]).double())
        C = diff * solver.scale
        add(C, "n", js, pair_noise)
        if fold is not None:
            add(fold(js, C), "p", js, True)
            folded.extend(js)
        S = torch.stack([_plain(gg[j]) for j in js]).to(torch.float64)
        add(S, "s", js, False)
        if debias is not None:
            add(S - debias * diff, "d", js, False)
    if folds:
        # rows pool_nu, pool_new (the sums' rows 0, 1 come from the host)
        pool4 = pooled_sums(torch.zeros((2, n), **f64), folds, n, dev)
        p = torch.zeros((len(rows), n), **f64)
        i = rows["pool_tr"]
        p[i + 2:i + 4] = pool4[2:4]
        index = None if n == L else column_index([e.col for e in kept], L, dev)
        if index is not None:
            p = torch.cat([p, p.new_zeros((len(rows), 1))], dim=1).index_select(1, index)
        out = out + p
    event = None
    if dev.type == "cuda":
        host = []
        for t in stacks:  # pinned buffers, copied without blocking on this (the side) stream
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            host.append(buf)
        event = torch.cuda.Event(blocking=True)  # the worker sleeps on it, it does not spin
        event.record(torch.cuda.current_stream(dev))
        stacks = host
    elif dev.type != "cpu":
        stacks = [t.to("cpu") for t in stacks]
    items = [m for t in stacks for m in t.unbind(0)]
    return HostStaged(out, items, pair, spread, [e.col for e in kept], ks, others, event, inputs)


def host_rows(staged: HostStaged, sums: Tensor, rows: dict, L: int, *, correct: bool,
              gauss: bool, num_samples: int, batch_size: float) -> Tensor:
    """This rank's host rows (float64 CPU, rows x L) from the job's sums (float64 [4, N],
    one column per staged item; module docstring). correct: the noise is corrected here
    (bias correction with the 'columns' dof); gauss: the 'gauss-sums' rows (pair, trace,
    fro2; the noise raw)."""
    out = torch.zeros((len(rows), L), dtype=torch.float64)
    R = int(num_samples)
    for i, (kind, j) in enumerate(staged.spread):
        col = staged.cols[j]
        s = sums[:, i]
        if kind == "n":
            if gauss:
                out[rows["noise"], col] = s[0]
                p = rows["pair"]
                out[p:p + 3, col] = s[1:4]
            elif correct:
                out[rows["noise"], col] = nuclear_sqrt_trace_corrected_from_sums(
                    s[0], s[1], R, batch_size, gram_dim=staged.ks[j], other_dim=staged.others[j],
                    dof_model="columns")
            else:
                out[rows["noise"], col] = s[0]
        elif kind == "p":
            t = rows["pool_tr"]
            out[t:t + 2, col] = s[0:2]
        elif kind == "s":
            out[rows["signal"], col] = s[0]
        else:
            out[rows["signal_deb"], col] = s[0]
    return out


class HostRoute:
    """The host route's part of a measurement's shared solve (gns_kernels.distributed.
    _share.SolveShare, which inherits it): stage the owned matrices (``stage_host``),
    submit the host job, wait for it, form this rank's part (``host_rows``) and share it
    at the join. Reads SolveShare's fields (solver, rows, stream, device, method, the
    staged solve, the job, the part) and its ``_run`` / ``_share``."""

    def stage(self) -> None:
        """The host route's staging (gns_kernels.distributed._share_host.stage_host): the
        matrices this rank owns formed on the device (the noise pool folded now), copied to
        the host (CUDA: pinned memory, an event; no wait), the device rows formed. Once."""
        if self.solved:
            return
        self.solved = True
        self.hints = None  # the host route reports nothing for the eigenvalue path's hints
        L = len(self.shapes)
        if L == 0:
            return
        qa = torch.stack([torch.cat(self.qa_q), torch.cat(self.qa_a)]) if self.qa_q else None
        self.qa_q, self.qa_a = [], []
        self.staged = self._run(qa, L, self._stage_host)

    def _stage_host(self, qa, L: int, dev) -> tuple:
        staged = stage_host(self.solver, qa, L, dev)
        return staged, staged.inputs

    def submit(self) -> None:
        """Start the staged solve's host job (spectral.host.HostJob: one background thread,
        which waits for the copies' event itself); the monotonic time is ``submitted``."""
        st = self.staged
        if st is None or self.job is not None or self.full is not None:
            return
        self.job = HostJob(st.items, pair=st.pair, event=st.event,
                           device=st.device.device if st.event is not None else None)
        self.submitted = time.monotonic()
        self.staged = st._replace(items=[], inputs=[], event=None)  # the job holds the matrices

    def wait(self) -> float:
        """Wait for the host job (a no-op without one, or once done); seconds waited."""
        job = self.job
        if job is None:
            return 0.0
        t0 = time.monotonic()
        try:
            job.result()
        except Exception:  # handled (warned, NaN) by part()
            pass
        return time.monotonic() - t0

    def part(self) -> Optional[Tensor]:
        """This rank's full rows x L float64 part (device rows + host rows; None without
        a matrix), after the host job (waits for it). On CUDA formed on the side stream, the
        host rows copied from pinned memory without blocking. Computed once. A job that
        failed warns and gives NaN host rows: the measurement is invalid on every rank."""
        if self.full is not None:
            return self.full
        self.submit()  # a no-op once submitted
        st = self.staged
        if st is None:
            return None
        self.wait()
        host = None
        if self.job is not None:
            try:
                sums = self.job.result()
            except Exception as exc:  # as the other routes' solver failures: invalid, warned
                _warn_user(f"gns_kernels: the host solve of nuclear statistics failed ({exc!r}); "
                           "this measurement is marked invalid")
                sums = torch.full((4, len(st.spread)), float("nan"), dtype=torch.float64)
            self.job = None
            host = host_rows(st, sums, self.rows, st.device.shape[1],
                             correct=self.solver.bias_correction and not self.gauss, gauss=self.gauss,
                             num_samples=self.num_samples, batch_size=float(self.solver.batch_size))
        dev_part = st.device
        if host is None:
            self.full = dev_part
        elif dev_part.device.type == "cuda":
            # pinned and non-blocking (a pageable copy would synchronize the stream), on the
            # side stream when this share has one (a rank that owns no matrix has none)
            with torch.cuda.stream(self.stream if self.stream is not None
                                   else torch.cuda.current_stream(dev_part.device)):
                self.full = dev_part + host.pin_memory().to(dev_part.device, non_blocking=True)
        else:
            self.full = dev_part + host.to(dev_part.device)
        return self.full

    def restore(self, part: Tensor) -> None:
        """Take ``part`` (rows x L float64, a checkpoint's record of ``part()``) as this
        rank's full part: ``join`` then shares it as the saved run would have."""
        self.solved = True
        self.hints = None
        self.full = part

    def join(self, group, all_reduce: Callable, device=None) -> None:
        """Finish the host route: this rank's full part (``part``: waits for the host job),
        then the share all-reduce (async, as ``launch``'s; none with one rank). device: where
        a restored part goes (the joining measurement's device; default: where it is)."""
        vec = self.part()
        if vec is None:
            return
        if device is not None and vec.device != torch.device(device):  # a restored part
            dev = torch.device(device)
            vec = vec.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else vec.to(dev)
        self._share(vec.reshape(-1), group, all_reduce)
