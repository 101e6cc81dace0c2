"""FSDP2 (``fully_shard``) gradient-noise-scale measurement inside the reduce-scatter.

Attach with ``handle = gk.attach_fsdp_gns(model, state)`` (state: a ``GNSHookState``,
the same object and semantics as ``ddp_gns_hook``). Every FSDP2 param group of ``model``
(every module ``fully_shard`` was applied to) gets its own ``GNSReduceScatter`` through
the public hook ``FSDPModule.set_custom_reduce_scatter``; ``handle.remove()`` puts the
previous reduce-scatter objects back.

What FSDP2 hands the reduce-scatter (torch 2.13, ``foreach_reduce``): ``input`` is this
rank's whole unsharded local gradient of the param group, in the reduce dtype, viewed as
R chunks of equal size; chunk r holds, back to back, the r-th shard of every parameter
that has a gradient: its dim-0 block padded to ceil(m/R) rows (``Shard(0)``, the
default), or its dim-d block (``Shard(d)``, d > 0, even sharding) made contiguous.
``output`` receives chunk r of the reduction on rank r. Rank j's local gradient g^j is
``input * a`` with a = FSDP's pre-divide factor (1 unless the reduce dtype is fp16).

Other steps (k % F != 0): the reduce-scatter object that was installed before (FSDP's
default) is called unchanged: no extra kernel, collective or memory. One Python
callback per synchronized backward is queued to count optimizer steps.

Measurement steps (k % F == 0), R ranks, B = state.batch_size, scale = B / (R - 1):

- l1 / l2 -- ONE reduce-scatter per param group, of a float32 buffer whose chunk r is
  [x_r, x_r^2] (``ops.square_pack`` per chunk, x = the input): each rank receives its
  shard of sum_j x^j and of sum_j (x^j)^2, with the op FSDP asked for (AVG, SUM or
  PREMUL_SUM), so the gradient half is reduced exactly as FSDP would reduce it (same
  values, same op, same owner of every element) and copied into ``output``.
  ``ops.variance_norms_multi`` on the shard (measured parameters only; padding is zero
  in both halves and contributes nothing) gives the shard's partial
  [||s||_1, ||g||_1, sum s2, ||g||_2^2]; these are sums over coordinates, so once every
  group of the backward is reduced ONE all-reduce of 4 float64 numbers (5 with the l1
  noise pool: this rank's part of the pooled noise, from its shard) per step turns
  the per-rank partials into the totals (paper Algorithm 2 all-reduces two scalars).
- nuclear -- for each measured 2-D parameter G (m x n) the Gram side is the one
  ``gk.estimate`` and ``ddp_gns_hook`` use: the smaller side (row G G^T when m <= n,
  else column G^T G). The two sides are NOT interchangeable for the noise term:
  mean_j G^j G^jT - D D^T and mean_j G^jT G^j - D^T D have different spectra in general
  (R > 2), so the side is fixed by the estimator and the transport adapts to it:
  * A sharded dimension whose blocks partition the Gram's summation index is
    "natural": for the column Gram, row blocks (Shard(0)): G^T G = sum_r G_r^T G_r; for
    the row Gram, column blocks (Shard(1)): G G^T = sum_r G_r G_r^T. Then rank j forms
    its local Gram G^jT G^j (or G^j G^jT) from its own input chunks (a batched Gram of
    its R blocks, summed), and the mean gradient's Gram from the shard it receives:
    D_r^T D_r, summed over ranks by the all-reduce below. No all-gather of D.
  * Otherwise (the common case of a wide or square weight under the default Shard(0):
    the row Gram D D^T needs products of rows held by different ranks) the blocks along
    the other dimension ride in the SAME reduce-scatter: chunk r also carries column
    block r of G^j (m x ceil(n/R), zero-padded), so rank r receives column block r of
    D and D D^T = sum_r D_{:,r} D_{:,r}^T again sums over ranks. This costs P_l extra
    elements in the reduce-scatter -- the same bytes as the paper's all-gather of the
    mean gradient, but inside the collective that runs anyway (no extra collective,
    no extra latency) and never a full copy of D on any rank. With
    ``shard_placement_fn=gk.fsdp_gns_shard_placement`` wide matrices are sharded on
    dim 1 instead and every measured matrix is natural (no extra payload).
  Right after the group's reduce-scatter ONE all-reduce of the group's local Grams and
  mean-gradient Gram partials (two k x k float32 matrices per measured matrix,
  k = min(m, n)) gives every rank the reduced Grams; each rank then solves only its share
  of the group's sqrt-traces tr(C^{1/2}) and ||G||_S1 (``spectral.
  nuclear_stats`` in its Gram form with a ``NuclearRequest``; which rank solves what is decided by cost, the same
  on every rank) and keeps 3 numbers per matrix, so the Grams of one param group (one
  layer) are alive at a time, not the whole model's (the paper's Table 10: O(m_l^2) per
  layer). After the last group one all-reduce of those numbers gives every rank all of
  them (identical on every rank).
  Bias correction uses the dimension not on the Gram side (from the parameter shape),
  as ``ddp_gns_hook`` does.

When the statistics are final: the first reduce-scatter of a synchronized backward
queues an autograd-engine final callback (``Variable._execution_engine.queue_callback``).
FSDP2's root queued its own post-backward callback at the start of backward (that one
runs the reduce-scatters of groups whose hook did not fire and waits for all of them),
so ours runs after every group of the backward has been reduced; it does the l1/l2 step's
one small all-reduce, sets ``state.estimate`` and advances ``state.step``. So, as with DDP,
``state.estimate`` is final when ``backward()`` returns and identical on every rank.

Gradient accumulation: ``model.set_requires_gradient_sync(False)`` on micro-steps means
no reduce-scatter (nothing is measured or counted); the synchronized step reduces the
accumulated local gradient, which is what is measured (loss divided by the number of
micro-steps, as with DDP no_sync()).

Non-finite gradients on any rank reach every rank through the reduce-scatter and the
final all-reduce: that measurement is invalid (valid=False) everywhere; the sharded
gradients are the NaN/inf ones plain FSDP2 would produce; the next measurement starts
afresh.

Dtypes: the packed buffer is float32 whatever the reduce dtype. With reduce_dtype float32
the sharded gradients are bitwise those of plain FSDP2; with a bf16 reduce dtype the
gradient half is reduced in float32 and rounded once to bf16 (plain FSDP2 reduces in
bf16), so they can differ by bf16 rounding (they are closer to the exact mean).

Collectives of a measurement step: one reduce-scatter per param group (as plain FSDP2,
larger payload) plus, l1/l2: one all-reduce of 4 float64 per step (5 with the l1 noise
pool); nuclear: one
all-reduce of the group's Grams per param group with measured matrices, and one
all-reduce of 3L float64 (4L with signal='debiased', +2L with the noise pool) per step
(L measured matrices; the
nuclear correction uses the 'columns' dof here: the default 'gauss-sums' one needs each
rank's deviation from the full mean gradient, which a rank holding a shard does not have):
every rank holds all the reduced
Grams but solves only its share of the 2L sqrt-traces (noise and signal per matrix,
assigned per matrix by cost 2 k^3, the same on every rank), and that all-reduce shares the results
and the eigensolver report (gns_kernels.distributed._share). The Grams themselves are
still all-reduced, not reduce-scattered to their solving rank: each rank receives every
Gram. No value is read on the host inside the backward: the statistics stay device
tensors until ``state.estimate`` is first read.

Memory of a measurement step: the packed input (2x the group's padded unsharded gradient
for l1/l2, float32; with a float32 reduce dtype FSDP's own input buffer is allocated as
its first half (``allocate``) and the pack is built in place, so the extra is only the
squares, 1x; 1x plus the other-dimension copies of non-natural matrices for nuclear, in
float32) and its shard-sized output, alive only during that group's reduce-scatter; for
nuclear, a float32 copy of a non-natural matrix's local gradient while its blocks are
packed, and the group's Grams (2 k^2 floats per matrix) until its statistics are done.

HSDP (FSDP2 on a 2-D (replicate, shard) mesh): the samples are all R = Rr x Rs
data-parallel ranks. FSDP2 reduce-scatters over the shard group, then all-reduces that
output across replicas. On a measurement step ``allocate`` hands FSDP2 an output
enlarged to [gradient shard | statistics] (float32: the squares for l1/l2, the
other-dimension blocks for nuclear), the packed reduce-scatter writes both, and FSDP2's
own replicate all-reduce sums both (no extra launch; twice its bytes for l1/l2). The
statistics are taken in the finishing callback, after FSDP2's root callback waited for
every reduce (``FSDPGNSHandle.defer``): l1/l2 the shard's partial sums, summed over the
shard group by the step's small all-reduce; nuclear the mean-gradient Gram partials
(1/Rr each: every replica holds the same shard) beside the local Grams, one Gram
all-reduce per group over all R ranks, solves shared by all R. Refused: a reduce dtype
other than float32 (the statistics would be summed in it), a one-rank shard dimension,
an all-reduce hook; ``set_requires_all_reduce(False)`` on a measurement step raises.
The groups: ``_fsdp_mesh.DPMesh``; the statistics: ``_fsdp_stats``.

FSDP2 x tensor parallelism (DTensor parameters of a 1-D tp mesh, ``parallelize_module``
before ``fully_shard`` over the dp mesh): R is the data-parallel size (the tp ranks of one
are one sample); FSDP2 reduce-scatters each tp rank's slice and the layout
(``_fsdp_layout``) knows the slicing: l1/l2 slices add up in the step's small all-reduce
over dp x tp (tp-replicated parameters on tp rank 0 only); nuclear Grams are the whole
matrix's, slices along the summation index adding up in the per-group Gram all-reduce (over
dp x tp), slices along the Gram's own dimension assembled by two all-gathers over tp per
param group (``tp_assemble``). HSDP x TP: the l1/l2 partials add over one replica's shard
x tp ranks, the Grams over all ranks (``DPMesh``).

Not supported (clear errors): ``state.shift`` (the squares are formed before the
reduce-scatter from the full local gradient, so a shift would have to be the full
unsharded tensor on every rank, while FSDP2 optimizer states are sharded), replicate-only
meshes (use DDP), ``MicroBatchGNS``.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .. import ops
from .. import spectral
from ._fsdp_layout import layout, local_matrix, tp_assemble, tp_placement
from ._fsdp_mesh import DPMesh, dp_mesh, effective_reduce_dtype, op_multiplier, reduce_factors
from ._measurement import Measurement, MeasurementPlan
from ._fsdp_stats import add_l_shard, add_nuclear_grams, finish, gram_offsets
from .state import GNSHookState


def _reduce_scatter(output, input, **kwargs):
    """``dist.reduce_scatter_single`` (torch 2.13 renamed ``reduce_scatter_tensor`` to it;
    the old name now warns), else ``dist.reduce_scatter_tensor`` (torch 2.8 - 2.12, which
    pyproject's torch>=2.8 admits). Looked up at each call, so a wrapper installed on
    ``dist`` (a test's collective counter) sees the call."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, **kwargs)


Tensor = torch.Tensor

__all__ = ["attach_fsdp_gns", "GNSReduceScatter", "FSDPGNSHandle", "fsdp_gns_shard_placement"]


def _fsdp_api():
    """The torch FSDP2 pieces used here (imported lazily: torch.distributed may be absent)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    return FSDPModule, ReduceScatter


_REGISTERED: list = []


def _reduce_scatter_class():
    """GNSReduceScatter, registered (once, on first use) as a virtual subclass of torch's
    FSDP2 ``ReduceScatter`` ABC, so ``isinstance(rs, ReduceScatter)`` holds. FSDP2 itself
    only duck-types the object (it calls ``allocate`` and ``__call__``); the class is not a
    real subclass so that ``import gns_kernels`` does not import torch.distributed.fsdp
    (seconds)."""
    if not _REGISTERED:
        _fsdp_api()[1].register(GNSReduceScatter)
        _REGISTERED.append(True)
    return GNSReduceScatter


class GNSReduceScatter:
    """``torch.distributed.fsdp`` ReduceScatter that measures the GNS on measurement steps.

    One per FSDP2 param group (made by ``attach_fsdp_gns``). ``allocate`` and the
    reduce-scatter of other steps are those of ``inner`` (the object installed before,
    FSDP's default). See the module docstring for the measurement.
    """

    def __init__(self, handle: "FSDPGNSHandle", param_group, inner):
        super().__init__()
        self._handle = handle
        self._param_group = param_group
        self.inner = inner
        self._stash: Optional[Tensor] = None  # 2n float32 buffer whose first n FSDP fills
        self._allocations = 0  # allocate() calls of this reduce: the input, then the output
        # the FSDPParams FSDP2 reduces in this backward (those with a gradient), noted by
        # the param group's post_backward just before it calls foreach_reduce
        self.with_grad: Optional[list] = None

    def allocate(self, size, *, dtype, device):
        """FSDP2 allocates the reduce-scatter input, then the output, then calls us.

        Input: on an l1/l2 measurement step with a float32 reduce dtype it is handed out
        as the first half of a 2n float32 buffer, so the packed [x_r, x_r^2] layout is
        built in place (no copy of x: the squares are the only extra).
        Output, HSDP measurement step: enlarged to [gradient shard | statistics] (float32),
        so FSDP2's own replicate all-reduce carries the statistics too."""
        self._allocations += 1
        h = self._handle
        if self._allocations > 1:  # the output
            if h.mesh is not None and h.mesh.hsdp and len(size) == 1:
                numel = self._hsdp_output_numel(int(size[0]), dtype)
                if numel is not None:
                    return torch.empty(numel, dtype=torch.float32, device=device)
            return self.inner.allocate(size, dtype=dtype, device=device)
        self._stash = None
        if (h.reuse_input and dtype == torch.float32 and len(size) == 1
                and h.state.geometry != "nuclear" and h._will_measure()):
            n = int(size[0])
            self._stash = torch.empty(2 * n, dtype=torch.float32, device=device)
            return self._stash[:n]
        return self.inner.allocate(size, dtype=dtype, device=device)

    def _hsdp_output_numel(self, chunk: int, dtype) -> Optional[int]:
        """HSDP: the enlarged output's numel on a measurement step that measures a
        parameter of this group (chunk + the statistics: the squares for l1/l2, the
        other-dimension blocks for nuclear), else None (FSDP's own output)."""
        h = self._handle
        ctx = h._begin(self._param_group._reduce_scatter_process_group)
        if ctx is None:
            return None
        Rs = dist.get_world_size(h.mesh.shard_group)
        segs, c, extra = layout(self._fsdp_params(chunk * Rs, Rs), Rs, ctx.state, ctx.plan, h.mesh)
        if not any(seg.measured for seg in segs):
            return None
        pg = self._param_group
        if not pg.all_reduce_grads or pg._partial_reduce_output is not None:
            raise RuntimeError(
                "attach_fsdp_gns: HSDP measurement step with set_requires_all_reduce(False) "
                "(this backward or an unreduced earlier one): its gradients are not all-reduced "
                "across replicas, so they are not the step's; accumulate with "
                "set_requires_gradient_sync(False) (no reduce at all) instead")
        if getattr(pg, "_all_reduce_hook", None) is not None:  # set after attaching
            raise RuntimeError(_ALL_REDUCE_HOOK)
        for seg in segs:
            if seg.measured and getattr(seg.param, "_post_accumulate_grad_hooks", None):
                raise RuntimeError(
                    "attach_fsdp_gns: HSDP with a post-accumulate-grad hook on a measured parameter "
                    f"(param group {pg._module_fqn!r}): FSDP2 runs it on the reduced gradient before "
                    "the measurement reads that gradient (after the replicate all-reduce), so an "
                    "in-place change (optimizer in backward, clipping) would change the statistics; "
                    "remove the hook, or measure on a 1-D mesh")
        if dtype != torch.float32:
            raise RuntimeError(
                f"attach_fsdp_gns: HSDP with reduce dtype {dtype}: the measurement's statistics "
                "ride in FSDP2's replicate all-reduce, in its dtype; use "
                "MixedPrecisionPolicy(reduce_dtype=torch.float32)")
        return c + self._statistics_numel(ctx.state, c, extra)

    @staticmethod
    def _statistics_numel(state, chunk: int, extra: int) -> int:
        """HSDP: the statistics part of the enlarged output (the squares for l1/l2, the
        other-dimension blocks for nuclear)."""
        return extra if state.geometry == "nuclear" else chunk

    # FSDP2 calls this once per param group per synchronized backward
    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group, op, async_op: bool = False):
        self._allocations = 0
        ctx = self._handle._begin(group)
        if ctx is None:
            return self.inner(output_tensor, input_tensor, group, op, async_op)
        return self._measure(ctx, output_tensor, input_tensor, group, op)

    # ------------------------------------------------------------------ internals
    def _fsdp_params(self, input_numel: int, world: int):
        """The FSDPParams this input holds: the whole group when the sizes add up (every
        parameter got a gradient), else those noted with a gradient (``with_grad``,
        FSDP2's ``fsdp_params_with_grad``), checked against the input size."""
        fps = self._param_group.fsdp_params
        for cand in (fps, self.with_grad):
            if cand is not None and sum(
                    torch.Size(fp.padded_sharded_param_size).numel() for fp in cand) * world == input_numel:
                return cand
        raise RuntimeError(
            "attach_fsdp_gns: could not match the reduce-scatter input "
            f"({input_numel} elements) to the parameters of FSDP param group "
            f"{self._param_group._module_fqn!r}")

    def _mean_multiplier(self, ctx: Measurement, group, op, inp: Tensor):
        """(a, mean_mult): the local gradient is g^j = a x^j (x: the reduce-scatter input)
        and (reduced buffer) * mean_mult = mean_j x^j over the R samples. On a 1-D mesh the
        buffer is our reduce-scatter's output; on HSDP it is FSDP2's after its replicate
        all-reduce and post-divide (both applied to the whole enlarged output)."""
        mesh = self._handle.mesh
        replicate = mesh.replicate_group if mesh.hsdp else None
        pre, rs_op, ar_op, post = reduce_factors(self._param_group, group, replicate, inp.dtype, inp.device)
        factor = self._param_group.gradient_divide_factor
        mult = op_multiplier(op, group.size(), factor, rs_op, "reduce-scatter")
        if replicate is not None:
            mult *= op_multiplier(ar_op, mesh.replicate_size, factor, ar_op, "all-reduce")
            if post is not None and post != 1:
                mult /= float(post)
        a = 1.0 if pre is None else float(pre)
        return a, 1.0 / (mult * ctx.num_samples)

    def _measure(self, ctx: Measurement, output: Tensor, inp: Tensor, group, op):
        st, h = ctx.state, self._handle
        Rs = group.size()  # chunks of the input (the shard group); ctx.num_samples: R
        a, mean_mult = self._mean_multiplier(ctx, group, op, inp)
        segs, chunk, extra = layout(self._fsdp_params(inp.numel(), Rs), Rs, st, ctx.plan, h.mesh)
        hsdp = h.mesh.hsdp
        if ctx.device is None:  # (also when this rank measures nothing here: under tensor
            ctx.device = inp.device  # parallelism the step's small all-reduce still runs)
            if st.pool is not None:  # a loaded pool moves here (the first group of the step)
                st.pool.to(inp.device)
        if not any(seg.measured for seg in segs):  # nothing to measure in this group
            self._stash = None
            return self.inner(output, inp, group, op, False)
        h.measured_on(self._param_group)
        stats = self._statistics_numel(st, chunk, extra) if hsdp else 0
        if chunk * Rs != inp.numel() or output.numel() != chunk + stats:
            raise RuntimeError(f"attach_fsdp_gns: reduce-scatter sizes {inp.numel()} -> {output.numel()} "
                               f"do not match the param group's layout ({chunk} per rank"
                               + (f" + {stats} statistics on HSDP)" if hsdp else ")"))
        x = inp.view(Rs, chunk)
        if st.geometry == "nuclear":
            return self._measure_nuclear(ctx, output, x, group, op, segs, chunk, extra, a, mean_mult)

        # ---- l1 / l2: chunk r of the pack = [x_r, x_r^2]
        stash, self._stash = self._stash, None
        if (stash is not None and inp.dtype == torch.float32 and stash.numel() == 2 * inp.numel()
                and inp.data_ptr() == stash.data_ptr()):
            # in place: move x_r to 2r*chunk (last first: targets never overlap unmoved
            # sources), then square into the gaps
            for r in range(Rs - 1, 0, -1):
                stash[2 * r * chunk:(2 * r + 1) * chunk].copy_(stash[r * chunk:(r + 1) * chunk])
            pack = stash.view(Rs, 2 * chunk)
            torch.mul(pack[:, :chunk], pack[:, :chunk], out=pack[:, chunk:])
            h.packed_in_place += 1
        else:
            pack = torch.empty((Rs, 2 * chunk), dtype=torch.float32, device=inp.device)
            for r in range(Rs):
                ops.square_pack(x[r], pack[r])
        del stash
        if hsdp:
            # straight into FSDP's enlarged output; its replicate all-reduce sums both
            # halves, the statistics are taken after it (the finishing callback)
            work = _reduce_scatter(output, pack.view(-1), op=op, group=group, async_op=False)
            h.defer(lambda: add_l_shard(ctx, segs, output[:chunk] * mean_mult,
                                        output[chunk:].mul_(mean_mult), a))
            return work
        out = torch.empty(2 * chunk, dtype=torch.float32, device=inp.device)
        work = _reduce_scatter(out, pack.view(-1), op=op, group=group, async_op=False)
        del pack
        output.copy_(out[:chunk].view_as(output))  # the reduction FSDP asked for
        out.mul_(mean_mult)  # -> mean_j x^j, mean_j (x^j)^2
        add_l_shard(ctx, segs, out[:chunk], out[chunk:], a)
        return work

    @staticmethod
    def _pack_extra(pack: Tensor, seg, full: Tensor, Rs: int) -> None:
        """Non-natural ``seg``: the blocks of ``full`` (its local gradient) along the Gram's
        own dimension into the extra part of every chunk (zero-padded), so rank r receives
        that block r of the mean gradient."""
        eb = seg.extra_block
        dst = pack[:, seg.extra_offset:seg.extra_offset + eb.numel()].view(Rs, *eb)
        dst.zero_()
        want = 1 if seg.side == "row" else 0
        step = eb[want]
        for r in range(Rs):
            lo = min(r * step, full.shape[want])
            hi = min(lo + step, full.shape[want])
            if hi > lo:
                dst[r].narrow(want, 0, hi - lo).copy_(full.narrow(want, lo, hi - lo))

    def _measure_nuclear(self, ctx, output, x, group, op, segs, chunk, extra, a, mean_mult):
        Rs = group.size()
        R = ctx.num_samples
        h = self._handle
        dev = x.device
        mats = [s for s in segs if s.measured]
        pack = torch.empty((Rs, chunk + extra), dtype=torch.float32, device=dev)
        pack[:, :chunk].copy_(x)
        # this group's Grams, one flat buffer: per matrix [local Gram / R, mean-Gram partial]
        ks = [s_.k for s_ in mats]
        offs = gram_offsets(ks)
        flat = torch.empty(sum(2 * k * k for k in ks), dtype=torch.float32, device=dev)
        slices = []  # tensor parallelism: local slices to assemble before their Gram
        for seg, k, q in zip(mats, ks, offs):
            blocks = pack[:, seg.offset:seg.offset + seg.numel].view(Rs, *seg.block)
            if seg.tp_zero:  # replicated over tp: tp rank 0's part counts, this one is zero
                if not seg.natural:
                    self._pack_extra(pack, seg, local_matrix(seg, blocks), Rs)
                flat[q:q + k * k].zero_()
                continue
            if seg.natural and not seg.tp_gather:
                # G^jT G^j = sum_r B_r^T B_r (row blocks) or G^j G^jT = sum_r B_r B_r^T (column blocks)
                G = torch.stack(spectral.gram(list(blocks.unbind(0)), side=seg.side)).sum(0)
            else:
                # this rank's local gradient (slice), then, non-natural, the blocks along the
                # other dimension go into the extra part of every chunk
                full = local_matrix(seg, blocks)
                if not seg.natural:
                    self._pack_extra(pack, seg, full, Rs)
                if seg.tp_gather:
                    slices.append(full.clone())
                    continue
                G = spectral.gram([full], side=seg.side)[0]
                del full
            torch.mul(G.view(-1), a * a / R, out=flat[q:q + k * k])  # sums to mean_j G^jT G^j
            del G
        if slices:  # the whole local gradients, assembled over tp; their Grams on tp rank 0
            gather = [(seg, k, q) for seg, k, q in zip(mats, ks, offs) if seg.tp_gather]
            wholes = tp_assemble(slices, [seg.tp_dim for seg, _k, _q in gather], h.mesh.tp_group,
                                 h.mesh.tp_size)
            for (seg, k, q), whole in zip(gather, wholes):
                if h.mesh.tp_rank == 0:
                    G = spectral.gram([whole], side=seg.side)[0]
                    torch.mul(G.view(-1), a * a / R, out=flat[q:q + k * k])
                else:
                    flat[q:q + k * k].zero_()
            del slices, wholes
        f = a * mean_mult  # reduced value * f = this shard of the mean gradient D
        if h.mesh.hsdp:
            # straight into FSDP's enlarged output; the mean-gradient Grams are formed after
            # its replicate all-reduce (the finishing callback); every replica holds the
            # same shard, so each adds 1 / Rr of its partial over all R ranks
            work = _reduce_scatter(output, pack.view(-1), op=op, group=group, async_op=False)
            h.defer(lambda: add_nuclear_grams(ctx, mats, ks, flat, output, f, h.mesh.replicate_size,
                                              h.mesh))
            return work
        out = torch.empty(chunk + extra, dtype=torch.float32, device=dev)
        work = _reduce_scatter(out, pack.view(-1), op=op, group=group, async_op=False)
        del pack
        output.copy_(out[:chunk].view_as(output))
        add_nuclear_grams(ctx, mats, ks, flat, out, f, 1, h.mesh)
        return work



# --------------------------------------------------------------------------- attach
class FSDPGNSHandle:
    """Returned by ``attach_fsdp_gns``: the installed ReduceScatter objects; ``remove()``;
    ``mesh``: the data-parallel mesh's groups (``DPMesh``); ``dp_size`` / ``dp_rank``: R,
    the samples of the GNS (the shard group on a 1-D mesh, replicate x shard on HSDP; not
    the world size when the world holds other dimensions), and this rank among them.

    ``packed_in_place`` (int) counts the measured reduce-scatters whose l1/l2 pack was built
    in FSDP's own (enlarged) input buffer without a copy: the float32-reduce fast path. It
    stays 0 with a bf16 reduce dtype or ``reuse_input=False``; a float32 run where it stays
    0 pays one extra pack buffer per group."""

    def __init__(self, state: GNSHookState, modules, reuse_input: bool = True):
        self.state = state
        self.reuse_input = reuse_input
        self.packed_in_place = 0  # reduce-scatters packed in FSDP's (enlarged) input buffer
        self.modules = modules
        self.reduce_scatters: list = []  # GNSReduceScatter objects
        self._pending = False  # a final callback is queued for the current backward
        self._task = -1  # autograd graph task id of that backward
        self._ctx: Optional[Measurement] = None
        self._group = None
        self._deferred: list = []  # HSDP: each measured group's statistics, taken in _end
        self._reduced: list = []  # the param groups whose reduce this measurement used
        # the data-parallel mesh (None: no FSDP2 param group): its ranks, all of them on
        # HSDP (replicate x shard), are the R samples of the GNS, whatever the world size
        self.mesh: Optional[DPMesh] = None

    @property
    def dp_size(self) -> Optional[int]:
        """R: the data-parallel ranks (the samples of the GNS)."""
        return None if self.mesh is None else self.mesh.dp_size

    @property
    def dp_rank(self) -> Optional[int]:
        """This rank among the R data-parallel ranks."""
        return None if self.mesh is None else self.mesh.dp_rank

    def defer(self, fn) -> None:
        """HSDP: run ``fn`` (a param group's statistics) once FSDP2's replicate all-reduces
        are done, in the finishing callback, before the step's small all-reduce."""
        self._deferred.append(fn)

    def measured_on(self, param_group) -> None:
        """Note a param group whose reduce this measurement used: the finishing callback
        makes the current stream wait for its reduce-scatter and all-reduce streams."""
        if param_group not in self._reduced:
            self._reduced.append(param_group)

    def _wait_reduce_streams(self) -> None:
        """The current stream waits for the side streams the measured reduces ran on
        (FSDP2's ``finalize_backward`` does so only on the last backward,
        ``set_is_last_backward``); no host synchronization. Nothing to do on CPU."""
        for pg in self._reduced:
            if pg.device.type == "cpu":
                continue
            cur = pg.device_handle.current_stream()
            cur.wait_stream(pg.comm_ctx.reduce_scatter_stream)
            cur.wait_stream(pg.comm_ctx.all_reduce_stream)

    def _will_measure(self) -> bool:
        """Whether the reduce-scatter about to be allocated belongs to a measurement."""
        if self._pending and torch._C._current_graph_task_id() == self._task:
            return self._ctx is not None
        return self.state.is_measurement_step()

    def _begin(self, group) -> Optional[Measurement]:
        """Called by every GNSReduceScatter; on the first call of a backward queue the
        finishing callback and, on a measurement step, open the measurement."""
        task = torch._C._current_graph_task_id()
        if task == -1:  # not inside a backward: nothing here can end the measurement
            raise RuntimeError(
                "attach_fsdp_gns: FSDP2 reduced gradients outside a backward pass (as "
                "torch.distributed.pipelining's perform_reduce_grad does for a pipeline "
                "stage): pipeline parallelism is not measured yet, and one stage's GNS is not "
                "the model's. Measure without pipeline parallelism (FSDP2, HSDP, FSDP2 x "
                "tensor parallelism, DDP)")
        if self._pending and task != self._task:
            # a backward that failed before our callback ran (the engine drops queued
            # callbacks on error): forget it, it was not an optimizer step
            self._pending = False
            self._ctx = None
            self._deferred = []
        if not self._pending:
            self._task = task
            st = self.state
            self._ctx = None
            self._group = group
            self._deferred = []
            self._reduced = []
            R, mesh = self.mesh.dp_size, self.mesh
            if st.is_measurement_step() and st.accepts_samples(R):
                # the state's plan is taken here, once per measurement; the dof is 'columns'
                # (a rank's deviation from the mean gradient needs the whole mean, and a
                # rank holds only its shard); R samples, the nuclear solves shared by the
                # ranks of the Gram all-reduces
                self._ctx = Measurement(st, mesh.gram_size, R, mesh.gram_rank, per_sample=False)
            # a measurement: an unread CPU measurement's hints apply to this one first
            st.begin_sync(self._ctx)
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
            self._pending = True
        elif self._group is not group and self._ctx is not None and group.size() != self._group.size():
            raise RuntimeError("attach_fsdp_gns: param groups reduce over different process groups")
        return self._ctx

    def _end(self) -> None:
        ctx, group, deferred = self._ctx, self._group, self._deferred
        self._pending = False
        self._ctx = None
        self._deferred = []
        self.state.end_sync()
        if ctx is not None:
            self._wait_reduce_streams()
            self._reduced = []
            for fn in deferred:  # HSDP: FSDP2's replicate all-reduces are done
                fn()
            # l1/l2: the ranks holding distinct shards (and tp slices); nuclear: the ranks
            # sharing the solves (DPMesh)
            finish(ctx, self.mesh.l_group, self.mesh.gram_group)

    def remove(self) -> None:
        """Restore the reduce-scatter objects that were installed before attaching."""
        for rs in self.reduce_scatters:
            pg = rs._param_group
            pg._reduce_scatter_comm = rs.inner
            pg.__dict__.pop("post_backward", None)  # the class's method again
        self.reduce_scatters = []
        _ATTACHED.discard(self.state)


# states attached to an FSDP2 model (one model per state at a time)
_ATTACHED: "weakref.WeakSet[GNSHookState]" = weakref.WeakSet()


def _note_grads(rs) -> None:
    """Make ``rs``'s param group note, at the start of each post_backward, which of its
    FSDPParams FSDP2 is about to reduce (by FSDP2's rule: an accumulated or new unsharded
    gradient, or reduce_scatter_unused_params and requires_grad). The reduce-scatter input
    carries only those; ``remove()`` drops the wrapper (an instance attribute)."""
    pg = rs._param_group
    post_backward = pg.post_backward

    def noting_post_backward(*args, **kwargs):
        rs._allocations = 0
        rs.with_grad = [fp for fp in pg.fsdp_params if _has_grad(pg, fp)]
        try:
            return post_backward(*args, **kwargs)
        finally:
            rs.with_grad = None

    pg.post_backward = noting_post_backward


def _has_grad(pg, fp) -> bool:
    if not hasattr(fp, "_unsharded_param"):
        return False
    if fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None:
        return True
    return bool(getattr(pg, "reduce_scatter_unused_params", False)) and fp.unsharded_param.requires_grad


def _param_groups(module) -> list:
    """The FSDPParamGroups of one FSDP2 module: torch 2.13's ``_fsdp_param_groups`` (one
    per mesh), or torch 2.8 - 2.12's single ``_fsdp_param_group`` (None: no parameters)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def _check_attach(model, state: GNSHookState) -> list:
    """The state and the model checks of ``attach_fsdp_gns`` (nothing installed): the
    FSDP2 modules of ``model``."""
    FSDPModule, _ = _fsdp_api()
    if not isinstance(state, GNSHookState):
        raise TypeError(f"state: expected a GNSHookState, got {type(state).__name__}")
    if state.micro_batch_samples:
        raise TypeError("state: MicroBatchGNS is not supported with FSDP2 (use a GNSHookState; "
                        "accumulate with set_requires_gradient_sync(False))")
    if state.geometry == "nuclear" and state.bias_correction and state.nuclear_dof == "gauss-sums":
        raise ValueError("state.nuclear_dof: 'gauss-sums' is not available under FSDP2 (it needs each "
                         "rank's deviation from the full mean gradient; a rank holds only its shard, "
                         "and gathering the mean would take an all-gather); use 'auto' or 'columns'")
    if state.shift is not None:
        raise ValueError("state.shift: not supported with FSDP2 (the squares are formed from the full "
                         "local gradient before the reduce-scatter, so the shift would have to be the "
                         "full unsharded tensor on every rank); use shift=None")
    if state in _ATTACHED:
        raise ValueError("state: already attached to an FSDP2 model; call handle.remove() first")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("model: no FSDP2 module found (apply torch.distributed.fsdp.fully_shard first)")
    chosen = [p for p in model.parameters() if state.measures(p)]
    if not chosen:
        raise ValueError(
            "state: none of this model's parameters is measured: fully_shard replaces a "
            "module's parameters with sharded ones, so GNSHookState(params=...) must be "
            "built from model.parameters() AFTER fully_shard (and for the nuclear GNS, "
            "shard_placement_fn=gk.fsdp_gns_shard_placement keeps wide matrices natural)")
    return modules


def attach_fsdp_gns(model: torch.nn.Module, state: GNSHookState, *, reuse_input: bool = True) -> FSDPGNSHandle:
    """Measure the GNS of an FSDP2 model inside its reduce-scatters.

    model: a module tree to which ``torch.distributed.fsdp.fully_shard`` was applied
        (the root and/or submodules), over a 1-D mesh or an HSDP 2-D (replicate, shard)
        mesh (float32 reduce dtype). Every FSDPModule in ``model.modules()`` gets a
        ``GNSReduceScatter`` through ``set_custom_reduce_scatter``; call this after all
        ``fully_shard`` calls and after any other ``set_custom_reduce_scatter``.
    state: GNSHookState (geometry, every=F, batch_size=B global, params, bias_correction,
        process_group is ignored: FSDP's reduce-scatter group is used). After the
        backward of an optimizer step k with k % F == 0, ``state.estimate`` is the
        GNSEstimate (same semantics as gk.estimate / ddp_gns_hook) on every rank.
    reuse_input: l1/l2 with a float32 reduce dtype: on measurement steps hand FSDP2 a
        reduce-scatter input with room for the squares and pack in place, so the only
        extra memory is the squares (1x the group's padded unsharded gradient) and the
        doubled output shard; False: pack into a separate 2x buffer (FSDP's input stays
        FSDP's, allocated by the previous comm object).
    Returns an FSDPGNSHandle (``.remove()`` detaches).
    """
    modules = _check_attach(model, state)
    handle, install = prepare_fsdp_gns(model, state, reuse_input=reuse_input, checked=modules)
    install()
    return handle


_ALL_REDUCE_HOOK = ("attach_fsdp_gns: HSDP with an all-reduce hook (set_all_reduce_hook): on "
                    "measurement steps the all-reduced buffer also carries the GNS statistics; "
                    "remove the hook to measure")


def _tp_mesh(pg, names: dict, state: GNSHookState):
    """The tensor-parallel meshes of a param group's DTensor parameters (``parallelize_module``
    before ``fully_shard``), each with FSDP2's (dp, tp) mesh: a list of (tp mesh, spmd mesh,
    where), empty without any; checked: a 1-D tp mesh, Shard(d) or Replicate() placements,
    even slices of the nuclear GNS's assembled matrices (sliced along their Gram's
    dimension). That they are one mesh is checked across the groups (prepare_fsdp_gns)."""
    found = []
    for fp in pg.fsdp_params:
        if not getattr(fp, "is_dtensor", False):
            continue
        name = names.get(id(fp.sharded_param), "?")
        spec = fp._unsharded_dtensor_spec
        where = (f"model: parameter {name!r} (placements {tuple(fp.sharded_param.placements)} on a "
                 f"mesh of shape {tuple(fp.sharded_param.device_mesh.shape)}, dims "
                 f"{fp.sharded_param.device_mesh.mesh_dim_names})")
        if len(spec.placements) != 1:
            raise ValueError(
                f"{where}: the GNS measures FSDP2 (or HSDP) x tensor parallelism over a 1-D tp "
                "mesh (parallelize_module, then fully_shard over the data-parallel mesh); "
                "expert parallelism and 2-D tp meshes are not supported")
        try:
            dim, _replicated = tp_placement(fp)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        size = spec.mesh.size()
        p = fp.sharded_param
        if (state.geometry == "nuclear" and dim is not None and p.dim() == 2 and state.measures(p)
                and dim == (0 if spectral.smaller_side(tuple(p.shape)) == "row" else 1)
                and p.shape[dim] % size):
            raise ValueError(f"{where}: the nuclear GNS assembles this matrix's tensor-parallel "
                             f"slices (they cut its Gram's dimension) and needs them even: dim {dim} "
                             f"of size {p.shape[dim]} over {size} tp ranks")
        found.append((spec.mesh, fp._spmd_mesh, where))
    return found


def _check_param_group(pg, names: dict, state: GNSHookState):
    """One FSDP2 param group's mesh, checked: a 1-D FSDP mesh (its parameters plain or
    DTensors of a 1-D tp mesh) or a 2-D HSDP (replicate, shard) mesh, no GNSReduceScatter
    installed; HSDP also needs a float32 reduce dtype (the statistics ride in its
    all-reduce). Returns (mesh_info, reduce-scatter group, its tp meshes: ``_tp_mesh``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    info = pg.mesh_info
    if not isinstance(info, FSDPMeshInfo):
        raise ValueError("model: a replicate-only mesh (DDPMeshInfo: every rank holds whole "
                         "parameters): measure it with DDP and gk.ddp_gns_hook; the FSDP2 hooks "
                         "measure FSDP2 over a 1-D mesh or HSDP over a 2-D (replicate, shard) mesh")
    hsdp = isinstance(info, HSDPMeshInfo)
    if info.mesh.ndim != (2 if hsdp else 1) or getattr(info, "is_spmd_mesh", False):
        raise ValueError(
            f"model: an FSDP2 mesh of shape {tuple(info.mesh.shape)} (dims "
            f"{info.mesh.mesh_dim_names}): the GNS hooks measure FSDP2 over a 1-D data-parallel "
            "mesh or HSDP over a 2-D (replicate, shard) mesh (or DDP)")
    tps = _tp_mesh(pg, names, state)
    if isinstance(pg._reduce_scatter_comm, _reduce_scatter_class()):
        raise ValueError("model: a GNSReduceScatter is already installed; remove() its "
                         "handle first (attach_fsdp_gns returned it; "
                         "gk.AdaptiveBatching(model, ...) keeps it as coord.fsdp_handle)")
    if hsdp:
        if info.shard_mesh_size < 2:
            raise ValueError(f"model: an HSDP mesh of shape {tuple(info.mesh.shape)} shards over one "
                             "rank: FSDP2 issues no reduce-scatter there, which is where the GNS is "
                             "measured; use a 1-D mesh, or DDP with gk.ddp_gns_hook")
        dtype = effective_reduce_dtype(pg)
        if dtype != torch.float32:
            raise ValueError(
                f"model: HSDP with reduce dtype {dtype} (param group {pg._module_fqn!r}): the GNS "
                "statistics ride in FSDP2's replicate all-reduce, in the reduce dtype, and the "
                "squared gradients lose the variance in it; use "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))")
        if getattr(pg, "_all_reduce_hook", None) is not None:
            raise ValueError(_ALL_REDUCE_HOOK)
    # torch >= 2.13 may give the reduce-scatter its own group (set_separate_reduce_scatter_group)
    group = getattr(info, "reduce_scatter_process_group", None) or info.shard_process_group
    return info, group, tps


def prepare_fsdp_gns(model, state: GNSHookState, *, reuse_input: bool = True, checked=None):
    """Every check of ``attach_fsdp_gns`` and the handle, with nothing installed yet:
    (handle, install), ``install()`` putting the GNSReduceScatter objects in place (what
    ``gk.AdaptiveBatching(model, ...)`` calls last, once every other argument passed).
    Refuses the meshes the measurement does not handle: replicate-only, a mesh of more
    dimensions than FSDP's 1 or HSDP's 2 (FSDP2 x tensor / expert parallelism: DTensor
    parameters on a larger mesh), HSDP with a reduce dtype other than float32 or an
    all-reduce hook, param groups over different meshes."""
    FSDPModule, _ = _fsdp_api()
    if checked is None:
        _check_attach(model, state)
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    else:
        modules = checked
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [_check_param_group(pg, names, state)
              for mod in modules for pg in _param_groups(mod)]
    tps = [t for _info, _group, found in groups for t in found]
    tp, spmd = tps[0][:2] if tps else (None, None)  # the model's tp mesh: one for all
    for t, _spmd, where in tps[1:]:
        if dist.get_process_group_ranks(t.get_group()) != dist.get_process_group_ranks(tp.get_group()):
            raise ValueError(f"{where}: parameters on different tensor-parallel meshes; the GNS "
                             "needs one")

    def ranks(info, group):
        rep = getattr(info, "replicate_process_group", None)
        return (dist.get_process_group_ranks(group), None if rep is None else dist.get_process_group_ranks(rep))

    mesh = None
    if groups:
        mesh = dp_mesh(groups[0][0], groups[0][1], tp, spmd)  # (flattened groups made once)
        if any(ranks(info, group) != ranks(groups[0][0], groups[0][1]) for info, group, _t in groups):
            raise ValueError("model: FSDP2 param groups reduce over different process groups "
                             "(or meshes); the GNS is measured over one data-parallel mesh")
    handle = FSDPGNSHandle(state, modules, reuse_input=bool(reuse_input))
    handle.mesh = mesh

    def install() -> None:
        GNSReduceScatter = _reduce_scatter_class()
        for mod in modules:
            groups = _param_groups(mod)
            if len(groups) == 1:
                rs = GNSReduceScatter(handle, groups[0], groups[0]._reduce_scatter_comm)
                mod.set_custom_reduce_scatter(rs)
                handle.reduce_scatters.append(rs)
            else:  # several groups (per-param meshes): set_custom_reduce_scatter refuses; one each
                for pg in groups:
                    rs = GNSReduceScatter(handle, pg, pg._reduce_scatter_comm)
                    pg._reduce_scatter_comm = rs
                    handle.reduce_scatters.append(rs)
        for rs in handle.reduce_scatters:
            _note_grads(rs)
        _ATTACHED.add(state)

    return handle, install


def fsdp_gns_shard_placement(param: torch.nn.Parameter, world_size: Optional[int] = None):
    """``shard_placement_fn`` for ``fully_shard`` that makes every 2-D weight natural for
    the nuclear GNS: Shard(1) for wide/square matrices (m <= n, row Gram) whose n divides
    by the world size, else Shard(0) (the default). Returns a ``Shard`` placement.

    world_size: the size of the dimension FSDP2 shards over (default:
        ``dist.get_world_size()``); under HSDP the shard group's, under tensor parallelism
        the data-parallel size (a DTensor's local slice is what FSDP2 shards: its width
        decides).
    """
    from torch.distributed.tensor import Shard

    if world_size is None:
        world_size = dist.get_world_size()
    if param.dim() == 2:
        m, n = param.shape  # the whole matrix's side decides
        # FSDP2 shards a tensor-parallel DTensor's local slice: its width must divide
        local_n = param.to_local().shape[1] if hasattr(param, "to_local") else n
        if m <= n and local_n % world_size == 0:
            return Shard(1)
    return Shard(0)
