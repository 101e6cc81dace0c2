"""DDP communication hook that measures the gradient noise scale inside the all-reduce.

Register with ``ddp.register_comm_hook(state, gk.ddp_gns_hook)`` (state: GNSHookState or
MicroBatchGNS). DDP calls the hook once per gradient bucket per synchronized backward,
buckets in index order 0, 1, ..., last.

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
  is formed after it on every rank; signal='debiased' adds L more (``_share.py``); the
  noise pool (default) 2L more: the solving rank folds the matrix's covariance into the
  pool and shares the pooled, corrected sqrt-trace (gns_kernels.pooling).
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
all earlier ones have completed: the last bucket's future waits for all of them (and
launches the nuclear share all-reduce), and DDP waits for every bucket's future before
``backward()`` returns. Nothing on this path reads a device value on the host: validity
flags and sums stay device tensors (on CUDA the nuclear solves run on a side stream), and
``state.estimate`` turns them into the GNSEstimate on its first read (one synchronization
per measurement), identical on every rank (every rank reduces the same numbers in the same
order). Non-finite gradients on any rank reach every rank through the all-reduce: that
measurement is invalid (valid=False) everywhere, and the gradients are the same NaN/inf
ones plain DDP would produce; the next measurement starts afresh.

Memory of a measurement step: one packed buffer in flight (2x the bucket's elements in
float32 for l1/l2; the bucket's elements plus the Grams for nuclear, which exist
separately for the moment they are copied in). Nuclear also holds, from each bucket's
statistics until the one solve after the last bucket, 2 k x k float32 per matrix this
rank owns (3 for a shifted matrix; k its Gram side): about 2 sum_l k_l^2 / R floats
(160M shapes, R = 8: 84 x 768^2 x 2 x 4 bytes / 8 = 50 MB per rank), freed when the
estimate is read (CUDA: when the solve stream is done with them), and with 'gauss-sums'
2 float64 per matrix. Before packing a bucket the hook waits for
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
from ._share import SolveShare
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


class _Measurement:
    """Statistics of one measurement backward (one per measured optimizer step)."""

    def __init__(self, state: GNSHookState, world: int, num_samples: int, rank: int = 0,
                 micro=None):
        self.state = state
        self.world = world
        self.num_samples = num_samples
        self.scale = float(state.batch_size) / (num_samples - 1)
        self.step = state.step
        self.micro = micro
        self.pending = None  # future of the last measured bucket (bounds packs in flight)
        self.futures: list = []
        # l1 / l2: one float64 row per measured parameter, [||s||_1, ||g||_1, sum s2,
        # ||g||_2^2] (and the debiased l1 signal sum with signal='debiased'), summed after
        # the last bucket with exactly rounded sums: a function of the parameters' values,
        # not of how DDP's bucket layout grouped and ordered them
        self.l_rows: list[Tensor] = []
        # l1 noise pool: this rank folds its 1/world slice of every measured parameter;
        # (pool key, float64 pooled, corrected ||s||_1 part), summed in key order
        self.rank = rank
        self.l_pool: list[tuple] = []
        self.device = None  # the buckets' device (set by the hook)
        # nuclear: the ranks share the sqrt-trace solves (_share.py); 'gauss-sums' dof when
        # each sample is one rank's gradient (its deviation from the mean is then known)
        self.dof = state.resolved_nuclear_dof(num_samples, per_sample=micro is None)
        self.share = SolveShare(world, rank, self.scale, state.bias_correction, num_samples,
                                float(state.batch_size), hints=state.eig_hints,
                                dof=self.dof or "columns", signal=state.signal,
                                pool=state.pool, grad_scale=state.grad_scale,
                                owners=state.pool_owners, method=state.method)

    def solve_nuclear(self, mean_grams, mean_grads, shifts, deviations=None, keys=None) -> None:
        """A bucket's reduced statistics: this rank solves its share of the bucket's
        sqrt-traces (on CUDA on a side stream); no host synchronization. deviations: this
        rank's G^j - G per matrix (dof 'gauss-sums'); keys: the noise pool's keys."""
        self.share.add_grads(mean_grams, mean_grads, shifts, deviations, keys)

    def finish(self, group) -> None:
        """After the last bucket: nuclear -- the share all-reduce is launched (not waited
        for); the estimate is built from device tensors on its first read."""
        st = self.state
        if st.geometry == "nuclear":
            self.share.launch(group, dist.all_reduce)
            reader = _ShareReader(self.share)
            st.record_measurement(self.num_samples, None, reader.noise, reader.signal, self.step,
                                  nuc_signal_debiased=reader.signal_deb, nuclear_dof=self.dof,
                                  noise_pooled=reader.pooled)
        else:
            width = 5 if st.signal == "debiased" and st.geometry == "l1" else 4
            # [P, width]: GNSHookState sums the rows on the host (exactly rounded)
            total = (torch.stack(self.l_rows) if self.l_rows
                     else torch.zeros(width, dtype=torch.float64))
            pooled = None
            if st.pool is not None:
                parts = [v for _, v in sorted(self.l_pool, key=lambda e: _key_order(e[0]))]
                pooled = _PooledSum(parts, self.device if self.device is not None else total.device,
                                    group if self.world > 1 else None)
            st.record_measurement(self.num_samples, total, None, None, self.step,
                                  noise_pooled=pooled)


def _key_order(key):
    """Sort key of a noise-pool key: positions in the parameter order first (the order a
    resumed run shares), then ("id", id) keys."""
    return (1, key[1]) if isinstance(key, tuple) else (0, key)


class _PooledSum:
    """The l1 noise pool's total over the ranks: this rank's partial sums (its slices of
    the parameters), summed across the ranks by one all-reduce of one float64, launched
    here (async) and waited for when called (GNSHookState.record_measurement's callable)."""

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


class _ShareReader:
    """noise() / signal() / signal_deb(): the totals of a SolveShare, read once (callables
    for GNSHookState.record_measurement; signal_deb None unless signal='debiased')."""

    def __init__(self, share: SolveShare):
        self.share = share
        self.values = None
        dev = share.device
        self.noise = _Value(self, 0, dev)
        self.signal = _Value(self, 1, dev)
        self.signal_deb = _Value(self, 2, dev) if share.signal == "debiased" else None
        self.pooled = _Value(self, 3, dev) if share.pool is not None else None


class _Value:
    def __init__(self, reader: _ShareReader, i: int, device):
        self.reader = reader
        self.i = i
        self.device_type = device.type if device is not None else "cpu"

    def __call__(self) -> float:
        r = self.reader
        if r.values is None:
            r.values = tuple(r.share.read()) + (r.share.pooled_total,)
        return r.values[self.i]


def _segments(bucket, state: GNSHookState):
    """[(offset, numel, param, measured)] in bucket-buffer order (params are packed back to
    back in the flat buffer, in bucket.parameters() order)."""
    out = []
    off = 0
    for p in bucket.parameters():
        n = p.numel()
        out.append((off, n, p, state.measures(p)))
        off += n
    return out


def _pack_l(buf: Tensor, segs, state: GNSHookState, micro):
    """Pack [x, x^2] per measured parameter (copies for the others). Returns (pack, plan)
    with plan = [(buf_off, n, pack_off, param, shift or None, measured)].

    The measured parameters of the bucket are packed by ONE square_pack_multi call and the
    unmeasured ones copied by one multi-tensor copy (micro-batch states pack per parameter:
    their squares come from the per-parameter accumulators)."""
    total = sum(2 * n if m else n for _, n, _, m in segs)
    pack = torch.empty(total, dtype=torch.float32, device=buf.device)
    plan = []
    grads, outs, shifts = [], [], []  # square_pack_multi arguments
    srcs, dsts = [], []  # plain copies
    q = 0
    for off, n, p, m in segs:
        src = buf[off:off + n]
        if m and micro is not None:
            # last micro-batch of this rank, then [local mean gradient, A * sum_a d_a^2]
            micro.accumulate_last(p, src)
            pack[q:q + n].copy_(src)
            torch.mul(micro.sq[id(p)].view(-1), float(micro.count), out=pack[q + n:q + 2 * n])
            plan.append((off, n, q, p, None, True))
            q += 2 * n
        elif m:
            s = state.shift_for(p)
            grads.append(src)
            outs.append(pack[q:q + 2 * n])
            shifts.append(None if s is None else s.view(-1))
            plan.append((off, n, q, p, s, True))
            q += 2 * n
        else:
            srcs.append(src)
            dsts.append(pack[q:q + n])
            plan.append((off, n, q, p, None, False))
            q += n
    if grads:
        any_shift = any(s is not None for s in shifts)
        ops.square_pack_multi(grads, outs, shifts if any_shift else None)
    if srcs:
        torch._foreach_copy_(dsts, srcs)
    return pack, plan


def _unpack_l(buf: Tensor, pack: Tensor, plan, ctx: _Measurement, index: int) -> Tensor:
    st = ctx.state
    ds, qs, shifts = [], [], []
    means, dsts, shifted, shift_vals = [], [], [], []
    for off, n, q, p, s, m in plan:
        mean = pack[q:q + n]
        if m:
            ds.append(mean)
            qs.append(pack[q + n:q + 2 * n])
            shifts.append(None if s is None else s.view(-1))
        if s is not None:
            shifted.append(mean)
            shift_vals.append(s.view(-1))
        means.append(mean)
        dsts.append(buf[off:off + n])
    if ds:
        deb = st.signal == "debiased" and st.geometry == "l1"
        for (off, n, q, p, s, m), d, sq, sh in zip([e for e in plan if e[5]], ds, qs, shifts):
            # per parameter, not per bucket (ctx.l_rows)
            row = ops.variance_norms_multi([d], [sq], ctx.scale, None if sh is None else [sh]).double()
            if deb:
                row = torch.cat([row, l1_signal_debiased_sum([d], [sq], [sh], ctx.scale,
                                                             float(st.batch_size)).reshape(1)])
            ctx.l_rows.append(row)
            if st.pool is not None:  # this rank's slice of every measured parameter
                lo, hi = ctx.rank * n // ctx.world, (ctx.rank + 1) * n // ctx.world
                if hi > lo:
                    key = st.pool_key(p)
                    ctx.l_pool.append((key, st.pool.fold_variance(key, d[lo:hi], sq[lo:hi], ctx.scale,
                                                                  ctx.num_samples, st.grad_scale)))
    if shifted:
        torch._foreach_add_(shifted, shift_vals)  # d + S: the mean gradient
    for (off, n, q, p, s, m), mean in zip(plan, means):
        if m:
            st.keep_mean(p, mean)
    torch._foreach_copy_(dsts, means)
    return buf


def _pack_nuclear(buf: Tensor, segs, state: GNSHookState, micro):
    """Pack [bucket gradients (float32), local Grams of the measured matrices] (the Grams
    copied in by one multi-tensor copy)."""
    n_buf = buf.numel()
    mats = [(off, n, p) for off, n, p, m in segs if m]
    shifts = [None if micro is not None else state.shift_for(p) for _, _, p in mats]
    if micro is not None:
        grams = [micro.accumulate_last_gram(p, buf[off:off + n].view(p.shape)) for off, n, p in mats]
    elif all(s is None for s in shifts):
        grams = spectral.gram([buf[off:off + n].view(p.shape) for off, n, p in mats])
    else:  # one shifted temporary G^j - S at a time
        grams = [spectral.gram([buf[off:off + n].view(p.shape) if s is None
                                else buf[off:off + n].view(p.shape).float() - s.float()])[0]
                 for (off, n, p), s in zip(mats, shifts)]
    total = n_buf + sum(G.numel() for G in grams)
    pack = torch.empty(total, dtype=torch.float32, device=buf.device)
    pack[:n_buf].copy_(buf)
    plan = []
    dsts = []
    q = n_buf
    for (off, n, p), s, G in zip(mats, shifts, grams):
        k = G.numel()
        dsts.append(pack[q:q + k])
        plan.append((off, n, p, s, q, G.shape))
        q += k
    if grams:
        torch._foreach_copy_(dsts, [G.reshape(-1) for G in grams])
    del grams
    return pack, plan


def _unpack_nuclear(buf: Tensor, pack: Tensor, plan, ctx: _Measurement, index: int) -> Tensor:
    st = ctx.state
    n_buf = buf.numel()
    if plan:
        mean_grams, mean_grads, shifts = [], [], []
        for off, n, p, s, q, gshape in plan:
            mean_grams.append(pack[q:q + gshape.numel()].view(gshape))
            G = pack[off:off + n].view(p.shape)
            mean_grads.append(G if s is None else G - s.float())  # D = G - S (shifted mean)
            shifts.append(s)
        any_shift = any(s is not None for s in shifts)
        devs = None
        if ctx.share.gauss:
            # this rank's deviation G^j - G: buf still holds the local gradient, the pack's
            # first part the mean (both unshifted; the shift cancels in the difference)
            devs = [buf[off:off + n].view(p.shape).float() - pack[off:off + n].view(p.shape)
                    for off, n, p, s, q, gshape in plan]
        # this rank's share of the solves; non-finite gradients on some rank give nan
        # statistics: this measurement is invalid everywhere
        keys = [st.pool_key(p) for off, n, p, s, q, gshape in plan] if st.pool is not None else None
        ctx.solve_nuclear(mean_grams, mean_grads, shifts if any_shift else None, devs, keys)
        for off, n, p, s, q, gshape in plan:
            st.keep_mean(p, pack[off:off + n])
    buf.copy_(pack[:n_buf])
    return buf


def ddp_gns_hook(state: GNSHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the default all-reduce, measuring the GNS at steps k % F == 0.

    See the module docstring. ``state`` is a GNSHookState (or MicroBatchGNS); after a
    measurement step's backward, ``state.estimate`` holds its GNSEstimate.
    """
    group = _group(state)
    buf = bucket.buffer()
    index = bucket.index()
    last = bucket.is_last()
    if index == 0:  # buckets are launched in index order: a new synchronized backward
        micro = state.micro_batches_for_sync()
        ctx = None
        if state.is_measurement_step():
            world = group.size()
            samples = world * (micro.count if micro is not None else 1)
            if state.accepts_samples(samples):
                ctx = _Measurement(state, world, samples, dist.get_rank(group=group), micro=micro)
                ctx.device = buf.device
                if state.pool is not None:  # a loaded pool moves here, not in a callback
                    state.pool.to(buf.device)
        state.begin_sync(ctx)
    ctx: Optional[_Measurement] = state.sync_context
    if ctx is None:
        if last:
            state.end_sync()
        return _default_allreduce(group, buf)

    micro = ctx.micro
    segs = _segments(bucket, state)
    if not any(m for *_, m in segs):
        fut = _default_allreduce(group, buf)
    else:
        if ctx.pending is not None:
            # at most one pack in flight: wait for the previous measured bucket's all-reduce
            # and statistics (its pack is freed then) before allocating this one. Gloo
            # otherwise queues the tail buckets' packs together (~2x the model in float32);
            # on CUDA, wait() only orders the streams.
            ctx.pending.wait()
        if state.geometry == "nuclear":
            pack, plan = _pack_nuclear(buf, segs, state, micro)
            unpack = _unpack_nuclear
        else:
            pack, plan = _pack_l(buf, segs, state, micro)
            unpack = _unpack_l
        pack.div_(ctx.world)
        work = dist.all_reduce(pack, group=group, async_op=True)

        def _done(f, buf=buf, pack=pack, plan=plan, index=index, unpack=unpack):
            f.value()
            return unpack(buf, pack, plan, ctx, index)

        fut = work.get_future().then(_done)
        ctx.pending = fut
        del pack, plan, work
    ctx.futures.append(fut)
    if not last:
        return fut

    state.end_sync()
    futures = list(ctx.futures)

    def _finalize(all_done, buf=buf, ctx=ctx, group=group):
        for f in all_done.value():
            f.value()  # re-raise a failure of any bucket
        ctx.finish(group)  # nuclear: launches the share all-reduce (before backward returns)
        return buf

    return torch.futures.collect_all(futures).then(_finalize)
