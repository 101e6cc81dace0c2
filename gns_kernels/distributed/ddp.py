"""DDP communication hook that measures the gradient noise scale inside the all-reduce.

Register with ``ddp.register_comm_hook(state, gk.ddp_gns_hook)`` (state: GNSHookState or
MicroBatchGNS). DDP calls the hook once per gradient bucket per synchronized backward,
buckets in index order 0, 1, ..., last. The measurement itself (its plan, taken from the
state once per measurement; its sums; the shared nuclear solve) is the core's
(``_measurement.py``), shared with the FSDP2 and micro-batch transports; this module packs,
reduces and unpacks the buckets.

Other steps (k % F != 0): exactly DDP's default hook -- buffer /= R, one all-reduce of the
bucket buffer -- nothing else is computed, allocated or communicated.

Measurement steps (k % F == 0), still ONE all-reduce per bucket, with a larger float32
payload built by the fused ops (R ranks; B = state.batch_size; scale = B / (S-1), S the
number of samples: R, or R x A micro-batches for MicroBatchGNS):

- l1 / l2: per measured parameter x = g^j - S (shift S, or g^j) -> [x, x^2] with
  ``square_pack`` (unmeasured parameters of the bucket are copied), divided by R and
  all-reduced: the halves become mean_j x and mean_j x^2. ``variance_norms_multi`` then
  gives [||s||_1, ||g||_1, sum s2, ||g||_2^2] of each measured parameter (s2 = scale
  (mean x^2 - (mean x)^2), g = mean x + S), and the mean gradient is written back into
  the bucket. The parameters' terms are summed when the estimate is read, with exactly
  rounded sums (below, "Bucket layout").
- nuclear: the bucket's gradients (float32 copy) followed by each measured matrix's local
  Gram (G^j - S)(G^j - S)^T on its smaller side (``spectral.gram``); after the all-reduce
  this rank keeps, for the matrices of the bucket it owns (the ranks share the 2L
  sqrt-traces by cost, the same assignment on every rank: ``_share.py``), the mean Gram and
  the Gram of the mean gradient; after the last bucket it solves all of them ONCE (batched
  by Gram size: one solve per measurement, not per bucket), and ONE all-reduce of 3L float64 (L measured matrices; R > 1 only) gives
  every rank every value and the eigensolver report. With the 'gauss-sums' dof (the
  default at R >= 3 ranks; not with micro-batch samples) each rank also computes
  ||d d^T||_F^2 and ||d||_F^4 of its deviation d = G^j - G per matrix after the bucket's
  all-reduce, the same all-reduce carries them (8L float64 in all) and the corrected noise
  is formed after it on every rank; signal='debiased' adds L more (``_share_vector.py``); the
  noise pool (default) 4L more: the solving rank folds the matrix's covariance into the
  pool and shares the pooled sqrt-trace, pair sum, degrees of freedom and first-measurement
  flag, corrected after the all-reduce with the noise (gns_kernels.stats.pooled).
  An unshifted bucket (no micro-batches) is packed and unpacked by Gram group, not by
  matrix (``_NuclearLayout``, cached per layout: a function of the parameters' shapes
  alone): one Gram batch per (shape, side) -- the batches spectral.gram forms, from one
  view of the bucket when the group's matrices lie back to back --, ONE cat builds the
  pack, one subtraction gives the deviations of the bucket (or of each run of same-shape
  matrices), and views of the mean Grams and gradients are taken only for the matrices
  this rank solves (``SolveShare.add_part``). The values are those of the per-matrix path
  bit for bit (the same batches; every GEMM operand a fresh or 64-byte aligned tensor).
- l1 with the noise pool (default): each rank folds its 1/R slice of every measured
  parameter's s2 into the pool (``_unpack_l``) and after the last bucket ONE all-reduce of
  one float64 sums the ranks' pooled parts (R > 1 only; each rank sums its parts in the
  parameter order of the pool's keys).

Bucket layout. DDP lays out a fresh model's buckets in reverse registration order for its
first iteration and rebuilds them after it in the order the gradients became ready, so a
resumed run's first step sees other buckets, with the parameters in another order and at
other offsets, than the uninterrupted run did at that step. Nothing here depends on that:
l1 / l2 terms are per parameter and summed exactly, nuclear totals are exact sums of the
per-matrix values (``_share.py``), the l1 pool's parts are summed in key order, and the
CPU Grams do not depend on a view's address (``spectral.gram``). With 2 ranks the reduced
values do not depend on it either (a + b), so a resume continues bit for bit; with 3 or
more, DDP's own all-reduce sums each element in an order set by its position in the
bucket, and the first resumed step's gradients (DDP's, not the hook's) can differ in the
last bit (docs/coordinator.md, "Checkpoint and resume").

The bucket buffer is left holding the mean gradient as plain DDP would (for bf16 / fp16
buckets the mean is computed in float32 and rounded once to the bucket dtype; plain DDP
sums in the bucket dtype, so the two can differ by the rounding of that dtype; with a shift
the float32 mean is (mean x) + S, which can differ from the unshifted mean in the last
float32 bit). Per-bucket statistics are combined when the last bucket's all-reduce and
all earlier ones have completed: the last bucket's hook waits for all of them and then
launches the measurement's own all-reduce (nuclear share, l1 pool), on the thread running
backward, before it returns (never from a future's callback, which runs on another thread
at a time that differs between ranks: with ``find_unused_parameters=True`` DDP all-reduces
its used-parameter map right after the last hook returns, and the ranks must issue the two
in the same order; docs/distributed.md, "Unused parameters"). On gloo that wait is the
last bucket's all-reduce, which DDP waits for anyway; on CUDA it only orders the streams.
Nothing on this path reads a device value on the host: validity
flags and sums stay device tensors (on CUDA the nuclear solves run on a side stream), and
``state.estimate`` turns them into the GNSEstimate on its first read (one synchronization
per measurement), identical on every rank (every rank reduces the same numbers in the same
order). Non-finite gradients on any rank reach every rank through the all-reduce: that
measurement is invalid (valid=False) everywhere, and the gradients are the same NaN/inf
ones plain DDP would produce; the next measurement starts afresh.

Memory of a measurement step: one packed buffer in flight (2x the bucket's elements in
float32 for l1/l2; the bucket's elements plus the Grams for nuclear, which exist
separately for the moment they are copied in). Nuclear also holds, from each bucket's
statistics until the one solve after the last bucket, per matrix this rank owns (m x n,
k its Gram side) a float32 copy of its mean Gram (k x k) and of its mean gradient (m x n;
its Gram is formed at the solve) -- or, for a matrix wider than 4 k^2 elements (an
embedding), its D D^T (float64 on the Newton path) instead of the gradient; a shifted matrix also its signal
Gram (k x k float32). At the 160M shapes and R = 8 that is (84 x 768^2 + 85M) x 4 bytes /
8 = 67 MB per rank, freed when the estimate is read (CUDA: when the solve stream is done
with them); with 'gauss-sums' 2 float64 per matrix. Before packing a bucket the hook waits for
the previous measured bucket's all-reduce and statistics (gloo would otherwise queue the
packs of all the tail buckets at once); on CUDA that wait only orders the streams. So the
extra memory is bounded by the largest bucket (``bucket_cap_mb``), never by the model,
and other steps hold nothing extra.
"""
# No `from __future__ import annotations`: DDP compares the hook's annotations as objects.
from typing import Optional

import torch
import torch.distributed as dist

from .. import ops
from .. import spectral
from ..spectral.grams import aligned_in_stack, gram_groups_cpu
from ..spectral.deviations import deviation_sums_parts
from ._measurement import Measurement
from ._stats import l1_signal_debiased_sum
from .state import GNSHookState

Tensor = torch.Tensor

__all__ = ["ddp_gns_hook"]


def _group(state: GNSHookState):
    return state.process_group if state.process_group is not None else dist.group.WORLD


def _default_allreduce(group, buf: Tensor) -> torch.futures.Future:
    """DDP's default: buffer /= R, all-reduce(sum), future of the buffer."""
    buf.div_(group.size())
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


class _Sync:
    """The hook's bookkeeping of one measured synchronized backward: the measurement (the
    core's ``Measurement``), the future of the last measured bucket (bounds the packs in
    flight) and every bucket's future."""

    __slots__ = ("m", "pending", "futures")

    def __init__(self, m: Measurement):
        self.m = m
        self.pending = None
        self.futures: list = []


def _finish(m: Measurement, group) -> None:
    """After the last bucket: nuclear -- the share all-reduce is launched (not waited
    for); l1 / l2 -- the per-parameter rows (summed exactly on the read) and the l1 pool's
    one all-reduce; the estimate is built from device tensors on its first read."""
    st = m.state
    if st.geometry == "nuclear":
        m.record_nuclear(group, dist.all_reduce)
        return
    width = 5 if st.l1_debiased else 4
    # [P, width]: summed on the host with exactly rounded sums (Sums.read)
    total = torch.stack(m.l_rows) if m.l_rows else torch.zeros(width, dtype=torch.float64)
    pooled = None
    if st.pool is not None:
        parts = [v for _, v in sorted(m.l_pool, key=lambda e: _key_order(e[0]))]
        pooled = _PooledSum(parts, m.device if m.device is not None else total.device,
                            group if m.world > 1 else None)
    m.record_l(total, pooled)


def _key_order(key):
    """Sort key of a noise-pool key: positions in the parameter order first (the order a
    resumed run shares), then ("id", id) keys."""
    return (1, key[1]) if isinstance(key, tuple) else (0, key)


class _PooledSum:
    """The l1 noise pool's total over the ranks: this rank's partial sums (its slices of
    the parameters), summed across the ranks by one all-reduce of one float64, launched
    here (async) and waited for when called (a callable of ``Sums``)."""

    def __init__(self, parts: list, device, group):
        part = (torch.stack(parts).sum() if parts
                else torch.zeros((), dtype=torch.float64, device=device)).reshape(1)
        self.value = part
        self.future = None
        self.device_type = part.device.type
        if group is not None:
            self.future = dist.all_reduce(part, group=group, async_op=True).get_future()

    def __call__(self) -> Tensor:
        if self.future is not None:
            self.future.wait()
            self.future = None
        return self.value.reshape(())


def _segments(bucket, m: Measurement):
    """[(offset, numel, param, ParamPlan)] in bucket-buffer order (params are packed back
    to back in the flat buffer, in bucket.parameters() order)."""
    out = []
    off = 0
    for p in bucket.parameters():
        n = p.numel()
        out.append((off, n, p, m.plan.of(p)))
        off += n
    return out


def _pack_l(buf: Tensor, segs, micro):
    """Pack [x, x^2] per measured parameter (copies for the others). Returns (pack, rows)
    with rows = [(buf_off, n, pack_off, param, ParamPlan)].

    The measured parameters of the bucket are packed by ONE square_pack_multi call and the
    unmeasured ones copied by one multi-tensor copy (micro-batch states pack per parameter:
    their squares come from the per-parameter accumulators; they have no shift)."""
    total = sum(2 * n if pp.measured else n for _, n, _, pp in segs)
    pack = torch.empty(total, dtype=torch.float32, device=buf.device)
    rows = []
    grads, outs, shifts = [], [], []  # square_pack_multi arguments
    srcs, dsts = [], []  # plain copies
    q = 0
    for off, n, p, pp in segs:
        src = buf[off:off + n]
        if pp.measured and micro is not None:
            # last micro-batch of this rank, then [local mean gradient, A * sum_a d_a^2]
            micro.accumulate_last(p, src)
            pack[q:q + n].copy_(src)
            torch.mul(micro.sq[id(p)].view(-1), float(micro.count), out=pack[q + n:q + 2 * n])
            rows.append((off, n, q, p, pp))
            q += 2 * n
        elif pp.measured:
            grads.append(src)
            outs.append(pack[q:q + 2 * n])
            shifts.append(None if pp.shift is None else pp.shift.view(-1))
            rows.append((off, n, q, p, pp))
            q += 2 * n
        else:
            srcs.append(src)
            dsts.append(pack[q:q + n])
            rows.append((off, n, q, p, pp))
            q += n
    if grads:
        any_shift = any(s is not None for s in shifts)
        ops.square_pack_multi(grads, outs, shifts if any_shift else None)
    if srcs:
        torch._foreach_copy_(dsts, srcs)
    return pack, rows


def _unpack_l(buf: Tensor, pack: Tensor, rows, m: Measurement) -> Tensor:
    st = m.state
    measured = []  # (param, ParamPlan, mean, mean of squares)
    means, dsts, shifted, shift_vals = [], [], [], []
    for off, n, q, p, pp in rows:
        mean = pack[q:q + n]
        if pp.measured:
            measured.append((p, pp, mean, pack[q + n:q + 2 * n]))
        if pp.shift is not None:
            shifted.append(mean)
            shift_vals.append(pp.shift.view(-1))
        means.append(mean)
        dsts.append(buf[off:off + n])
    deb = st.l1_debiased
    for p, pp, d, sq in measured:
        sh = None if pp.shift is None else pp.shift.view(-1)
        # per parameter, not per bucket (Measurement.l_rows)
        row = ops.variance_norms_multi([d], [sq], m.scale, None if sh is None else [sh]).double()
        if deb:
            row = torch.cat([row, l1_signal_debiased_sum([d], [sq], [sh], m.scale,
                                                         m.batch_size).reshape(1)])
        m.l_rows.append(row)
        if st.pool is not None:  # this rank's slice of every measured parameter
            n = d.numel()
            lo, hi = m.rank * n // m.world, (m.rank + 1) * n // m.world
            if hi > lo:
                m.l_pool.append((pp.key, st.pool.fold_variance(pp.key, d[lo:hi], sq[lo:hi], m.scale,
                                                               m.num_samples, st.grad_scale)))
    if shifted:
        torch._foreach_add_(shifted, shift_vals)  # d + S: the mean gradient
    for p, pp, mean, _ in measured:
        m.plan.keep_mean(p, pp, mean)
    torch._foreach_copy_(dsts, means)
    return buf


class _NuclearLayout:
    """Where everything of an unshifted nuclear bucket sits (no micro-batches): a function
    of the parameters' shapes and measured flags only (``_nuclear_layout``, cached), so a
    bucket is packed and unpacked with a few ops per Gram group, not per matrix.

    mats: per measured matrix (measured order): (segment index, buffer offset, numel,
    shape, Gram side k, pack offset of its Gram). groups: the Gram batches, spectral.gram's
    grouping by (shape, side) in order of first appearance: (shape, col, [measured
    indices], (a, b) when the members lie back to back in the buffer (one view) else None).
    pieces: the pack's Gram part in measured order as slices (group, i0, i1) of the
    groups' stacked Grams. dev_runs: the deviation sums' runs (spectral-consistent with
    ``spectral.deviations.deviation_sums``: consecutive measured matrices of one shape), as (j0, j1,
    (a, b) or None); dev_whole: every run lies back to back in the buffer at a 64-byte
    offset (a float32 deviation of the whole bucket then holds every run, aligned, as one
    of spectral.deviations.deviation_sums's fresh stacks would be)."""

    __slots__ = ("n_buf", "mats", "groups", "pieces", "joined", "dev_runs", "dev_whole", "ks", "shapes")

    def __init__(self, segs_shapes: tuple):
        n_buf = 0
        mats = []
        q_rel = 0
        for i, (n, shape, measured) in enumerate(segs_shapes):
            if measured:
                k = min(shape)
                mats.append((i, n_buf, n, shape, k, q_rel))
                q_rel += k * k
            n_buf += n
        self.n_buf = n_buf
        self.mats = [(i, off, n, shape, k, n_buf + q) for i, off, n, shape, k, q in mats]
        self.ks = [e[4] for e in mats]
        self.shapes = [e[3] for e in mats]
        where = {}  # (shape, col) -> group index
        groups: list = []
        pos = []  # measured index -> (group, index in the group)
        for j, (_, off, n, shape, _, _) in enumerate(self.mats):
            col = shape[0] > shape[1]  # spectral.smaller_side: 'col' when m > n
            g = where.setdefault((shape, col), len(groups))
            if g == len(groups):
                groups.append([shape, col, [], (off, off + n)])
            grp = groups[g]
            if grp[3] is not None and grp[3][1] == off:
                grp[3] = (grp[3][0], off + n)
            elif grp[2]:
                grp[3] = None
            pos.append((g, len(grp[2])))
            grp[2].append(j)
        self.groups = [tuple(g) for g in groups]
        pieces: list = []
        for g, i in pos:
            if pieces and pieces[-1][0] == g and pieces[-1][2] == i:
                pieces[-1][2] = i + 1
            else:
                pieces.append([g, i, i + 1])
        self.pieces = [tuple(pc) for pc in pieces]
        # the same pieces as row ranges of the groups' Grams stacked in group order (one
        # tensor when spectral.grams.gram_groups_cpu forms them together), merged
        starts, c = [], 0
        for grp in self.groups:
            starts.append(c)
            c += len(grp[2])
        joined: list = []
        for g, i0, i1 in self.pieces:
            a, b = starts[g] + i0, starts[g] + i1
            if joined and joined[-1][1] == a:
                joined[-1][1] = b
            else:
                joined.append([a, b])
        self.joined = [tuple(r) for r in joined]
        runs: list = []
        for j, (_, off, n, shape, _, _) in enumerate(self.mats):
            if runs and self.mats[runs[-1][0]][3] == shape:
                r = runs[-1]
                r[1] = j + 1
                r[2] = (r[2][0], off + n) if r[2] is not None and r[2][1] == off else None
            else:
                runs.append([j, j + 1, (off, off + n)])
        self.dev_runs = [tuple(r) for r in runs]
        self.dev_whole = all(r[2] is not None and (r[2][0] == 0 or aligned_in_stack(r[2][0])) for r in runs)


def _view(t: Tensor, off: int, shape: tuple) -> Tensor:
    """t.reshape(-1)[off:off + numel].view(shape) of a contiguous tensor t, as one aten op
    (as_strided; a slice and a view are three). The layout path takes a few per bucket."""
    if not t.is_contiguous():
        n = 1
        for d in shape:
            n *= d
        return t.reshape(-1)[off:off + n].view(shape)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return torch.as_strided(t, shape, tuple(reversed(strides)), t.storage_offset() + off)


_LAYOUTS: dict = {}
_LAYOUTS_MAX = 512


def _nuclear_layout(segs) -> Optional[_NuclearLayout]:
    """The cached layout of an unshifted bucket (None when a measured matrix is shifted:
    those buckets go matrix by matrix)."""
    key = []
    for _, n, p, pp in segs:
        if pp.shift is not None:
            return None
        key.append((n, tuple(p.shape), pp.measured))
    key = tuple(key)
    lay = _LAYOUTS.get(key)
    if lay is None:
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        lay = _LAYOUTS[key] = _NuclearLayout(key)
    return lay


def _pack_nuclear(buf: Tensor, segs, micro):
    """Pack [bucket gradients (float32), local Grams of the measured matrices]. Returns
    (pack, rows): rows = (layout, [(param, ParamPlan)] of the measured matrices) on the
    layout path (unshifted, no micro-batches: one Gram batch per (shape, side) group, from
    one view of the bucket when its matrices lie back to back, and ONE cat builds the
    pack); else (None, [(buf_off, n, param, ParamPlan, pack_off, Gram shape)])."""
    lay = None if micro is not None else _nuclear_layout(segs)
    if lay is not None:
        mats = [(segs[i][2], segs[i][3]) for i, *_ in lay.mats]
        xs = []
        for shape, col, js, run in lay.groups:
            if run is not None:
                X = _view(buf, run[0], (len(js),) + shape)
            else:
                X = torch.stack([buf[lay.mats[j][1]:lay.mats[j][1] + lay.mats[j][2]].view(shape)
                                 for j in js])
            xs.append((X, col))
        # spectral.gram's batches (the same bits: on CPU each group's bmm on an aligned
        # stack, a function of the values alone); on CPU, groups of one Gram side
        # together (one symmetrization for the bucket)
        joined = gram_groups_cpu(xs) if buf.device.type == "cpu" else None
        flat = [buf]
        if joined is not None:
            for a, b in lay.joined:
                k2 = joined.shape[-1] * joined.shape[-2]
                flat.append(_view(joined, a * k2, ((b - a) * k2,)))
        else:
            stacks = [torch.ops.gns_kernels.gram_batched(X, col) for X, col in xs]
            for g, i0, i1 in lay.pieces:
                G = stacks[g]
                flat.append((G if i1 - i0 == G.shape[0] else G[i0:i1]).view(-1))
        pack = torch.cat(flat)  # float32 (a bf16 / fp16 bucket is promoted)
        del flat, joined
        return pack, (lay, mats)
    n_buf = buf.numel()
    mats = [(off, n, p, pp) for off, n, p, pp in segs if pp.measured]
    if micro is not None:
        grams = [micro.accumulate_last_gram(p, buf[off:off + n].view(p.shape)) for off, n, p, _ in mats]
    elif all(pp.shift is None for *_, pp in mats):
        grams = spectral.gram([buf[off:off + n].view(p.shape) for off, n, p, _ in mats])
    else:  # one shifted temporary G^j - S at a time
        grams = [spectral.gram([buf[off:off + n].view(p.shape) if pp.shift is None
                                else buf[off:off + n].view(p.shape).float() - pp.shift.float()])[0]
                 for off, n, p, pp in mats]
    total = n_buf + sum(G.numel() for G in grams)
    pack = torch.empty(total, dtype=torch.float32, device=buf.device)
    pack[:n_buf].copy_(buf)
    rows = []
    dsts = []
    q = n_buf
    for (off, n, p, pp), G in zip(mats, grams):
        k = G.numel()
        dsts.append(pack[q:q + k])
        rows.append((off, n, p, pp, q, G.shape))
        q += k
    if grams:
        torch._foreach_copy_(dsts, [G.reshape(-1) for G in grams])
    del grams
    return pack, (None, rows)


def _unpack_nuclear(buf: Tensor, pack: Tensor, rows, m: Measurement) -> Tensor:
    lay, rows = rows
    if lay is not None:
        return _unpack_nuclear_layout(buf, pack, lay, rows, m)
    n_buf = buf.numel()
    if rows:
        mean_grams, mean_grads, shifts = [], [], []
        for off, n, p, pp, q, gshape in rows:
            mean_grams.append(pack[q:q + gshape.numel()].view(gshape))
            G = pack[off:off + n].view(p.shape)
            s = None if m.micro is not None else pp.shift
            mean_grads.append(G if s is None else G - s.float())  # D = G - S (shifted mean)
            shifts.append(s)
        any_shift = any(s is not None for s in shifts)
        devs = None
        if m.share.gauss:
            # this rank's deviation G^j - G: buf still holds the local gradient, the pack's
            # first part the mean (both unshifted; the shift cancels in the difference)
            devs = [buf[off:off + n].view(p.shape).float() - pack[off:off + n].view(p.shape)
                    for off, n, p, pp, q, gshape in rows]
        # this rank's share of the solves (solved once, after the last bucket);
        # non-finite gradients on some rank give nan statistics: this measurement is
        # invalid everywhere
        keys = [pp.key for _, _, _, pp, _, _ in rows] if m.state.pool is not None else None
        m.share.add_grads(mean_grams, mean_grads, shifts if any_shift else None, devs, keys)
        for off, n, p, pp, q, gshape in rows:
            if pp.keep:
                m.plan.keep_mean(p, pp, pack[off:off + n])
    buf.copy_(pack[:n_buf])
    return buf


def _unpack_nuclear_layout(buf: Tensor, pack: Tensor, lay: _NuclearLayout, mats, m: Measurement) -> Tensor:
    """The layout path of ``_unpack_nuclear``: the deviation sums from one subtraction per
    run of same-shape matrices, and views of the mean Grams and gradients only for the
    matrices this rank solves (``SolveShare.add_part``)."""
    qa = None
    mean = _view(pack, 0, (lay.n_buf,))  # the bucket's mean gradient
    if m.share.gauss:
        # this rank's deviation G^j - G per run: buf still holds the local gradient, the
        # pack's first part the mean. One fresh (aligned) tensor per run, the values of
        # spectral.deviations.deviation_sums's stack of the per-matrix deviations
        runs = []
        whole = None
        if lay.dev_whole:  # one subtraction for the bucket, the runs its views
            x = buf if buf.dtype == torch.float32 else buf.float()
            whole = torch.sub(x, mean)
        for j0, j1, ab in lay.dev_runs:
            shape = lay.mats[j0][3]
            if whole is not None:
                runs.append(_view(whole, ab[0], (j1 - j0,) + shape))
            elif ab is not None:
                a, b = ab
                x = buf[a:b]
                runs.append(torch.sub(x if x.dtype == torch.float32 else x.float(), pack[a:b])
                            .view((j1 - j0,) + shape))
            else:
                runs.append(torch.stack([buf[off:off + n].view(shape).float() - pack[off:off + n].view(shape)
                                         for _, off, n, _, _, _ in lay.mats[j0:j1]]))
        qa = deviation_sums_parts(runs)

    def owned(idx):
        grams, grads = [], []
        for j in idx:
            _, off, n, shape, k, q = lay.mats[j]
            grams.append(_view(pack, q, (k, k)))
            grads.append(_view(pack, off, shape))
        return grams, grads

    keys = [pp.key for _, pp in mats] if m.state.pool is not None else None
    m.share.add_part(lay.ks, lay.shapes, owned, qa, keys, buf.device)
    for (_, off, n, _, _, _), (p, pp) in zip(lay.mats, mats):
        if pp.keep:
            m.plan.keep_mean(p, pp, mean[off:off + n])
    buf.copy_(mean)
    return buf


def ddp_gns_hook(state: GNSHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the default all-reduce, measuring the GNS at steps k % F == 0.

    See the module docstring. ``state`` is a GNSHookState (or MicroBatchGNS); after a
    measurement step's backward, ``state.estimate`` holds its GNSEstimate.
    """
    group = _group(state)
    buf = bucket.buffer()
    last = bucket.is_last()
    if bucket.index() == 0:  # buckets are launched in index order: a new synchronized backward
        micro = state.micro_batches_for_sync()
        sync = None
        if state.is_measurement_step():
            world = group.size()
            samples = world * (micro.count if micro is not None else 1)
            if state.accepts_samples(samples):
                # the state's plan is taken here, once per measurement
                m = Measurement(state, world, samples, dist.get_rank(group=group),
                                per_sample=micro is None, micro=micro)
                m.device = buf.device
                if state.pool is not None:  # a loaded pool moves here, not in a callback
                    state.pool.to(buf.device)
                sync = _Sync(m)
        state.begin_sync(sync)
    sync: Optional[_Sync] = state.sync_context
    if sync is None:
        if last:
            state.end_sync()
        return _default_allreduce(group, buf)

    m = sync.m
    segs = _segments(bucket, m)
    if not any(pp.measured for *_, pp in segs):
        fut = _default_allreduce(group, buf)
    else:
        if sync.pending is not None:
            # at most one pack in flight: wait for the previous measured bucket's all-reduce
            # and statistics (its pack is freed then) before allocating this one. Gloo
            # otherwise queues the tail buckets' packs together (~2x the model in float32);
            # on CUDA, wait() only orders the streams.
            sync.pending.wait()
        if state.geometry == "nuclear":
            pack, rows = _pack_nuclear(buf, segs, m.micro)
            unpack = _unpack_nuclear
        else:
            pack, rows = _pack_l(buf, segs, m.micro)
            unpack = _unpack_l
        pack.div_(m.world)
        work = dist.all_reduce(pack, group=group, async_op=True)

        def _done(f, buf=buf, pack=pack, rows=rows, unpack=unpack):
            f.value()
            return unpack(buf, pack, rows, m)

        fut = work.get_future().then(_done)
        sync.pending = fut
        del pack, rows, work
    sync.futures.append(fut)
    if not last:
        return fut

    state.end_sync()
    # The last bucket: wait here, on the thread running backward, for every bucket's
    # all-reduce and statistics (gloo: this rank's last pack; CUDA: stream order only), then
    # launch the measurement's own collective (nuclear share, l1 pool) from this thread too.
    # Never from a future's callback: that runs on whichever thread completes the future (a
    # gloo worker), at a time that differs between ranks, and DDP issues its own collectives
    # on the same process group right after this hook returns (find_unused_parameters: the
    # all-reduce of its used-parameter map) -- the ranks would issue them in different
    # orders (a gloo size mismatch, SIGABRT; or a hang). Here every rank issues, in order:
    # the buckets' all-reduces, this one, then DDP's.
    torch.futures.wait_all(list(sync.futures))  # re-raises a failure of any bucket
    _finish(m, group)
    return fut
