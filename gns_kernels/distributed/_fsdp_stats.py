"""The statistics of an FSDP2 measurement from a param group's reduced buffer.

``fsdp.GNSReduceScatter`` moves the data (the packed reduce-scatter, on HSDP the enlarged
output FSDP2's replicate all-reduce carries); this module turns what a rank holds after
the reductions into its part of the measurement:

- ``add_l_shard``: l1 / l2, from this rank's shard of mean_j x^j and mean_j (x^j)^2 (x the
  reduce-scatter input, g^j = a x^j): the partial [||s||_1, ||g||_1, sum s2, ||g||_2^2]
  (+ the debiased l1 sum) and the l1 pool's part, accumulated on the Measurement;
- ``add_nuclear_grams``: nuclear, from the reduced shard of the mean gradient: the
  mean-gradient Gram partials next to the local Grams in the group's flat buffer, ONE
  all-reduce of it, this rank's share of the solves (``SolveShare.add_grams``);
- ``finish``: after the last group, the step's one small all-reduce and the record.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .. import ops
from .. import spectral
from ._fsdp_layout import tp_assemble
from ._measurement import Measurement
from ._stats import l1_signal_debiased_sum

Tensor = torch.Tensor

__all__ = ["gram_offsets", "add_l_shard", "add_nuclear_grams", "finish"]


def gram_offsets(ks: Sequence[int]) -> list:
    """Start of each matrix's [mean Gram, mean-Gram partial] pair in a group's flat buffer
    (k x k float32 each, k = min(m, n))."""
    out, q = [], 0
    for k in ks:
        out.append(q)
        q += 2 * k * k
    return out


def add_l_shard(ctx: Measurement, segs, d: Tensor, q: Tensor, a: float) -> None:
    """l1 / l2: this rank's shard of d = mean_j x^j and q = mean_j (x^j)^2 (1-D float32,
    the param group's chunk layout; g^j = a x^j) -> the Measurement's partial sums
    ``l_terms`` and, with a pool, this shard's pooled part in ``l_pool``. Padding is zero
    in both halves and contributes nothing."""
    st = ctx.state
    mats = [seg for seg in segs if seg.measured]
    ds = [d[seg.offset:seg.offset + seg.numel] for seg in mats]
    qs = [q[seg.offset:seg.offset + seg.numel] for seg in mats]
    if not ds:
        return
    if st.pool is not None:  # this rank's shard of every measured parameter
        # g = a d, s2 = a^2 s2(d): the pool folds gradient units (scale a^2)
        roots = [st.pool.fold_variance(ctx.plan.of(seg.param).key, d_, q_, ctx.scale * a * a,
                                       ctx.num_samples, st.grad_scale)
                 for seg, d_, q_ in zip(mats, ds, qs)]
        ctx.l_pool.append(torch.stack(roots).sum())
    terms = ops.variance_norms_multi(ds, qs, ctx.scale).to(torch.float64)
    if st.l1_debiased:  # this shard's part of the sum
        # g = a d, s2 = a^2 s2(d): the sum scales with a (applied below)
        deb = l1_signal_debiased_sum(ds, qs, [None] * len(ds), ctx.scale, ctx.batch_size)
        terms = torch.cat([terms, deb.to(terms.device).reshape(1)])
    if a != 1.0:  # s and g scale with a, s2 and g^2 with a^2 (the debiased sum with a)
        # scalar multiplies in place: a factor tensor built from a host list would be a
        # pageable copy to the GPU, a host synchronization inside the collective
        terms[:2].mul_(a)
        terms[2:4].mul_(a * a)
        terms[4:].mul_(a)
    ctx.l_terms = terms if ctx.l_terms is None else ctx.l_terms + terms


def add_nuclear_grams(ctx: Measurement, mats, ks, flat: Tensor, reduced: Tensor, f: float,
                      copies: int, mesh) -> None:
    """nuclear: ``flat`` holds, per measured matrix (``mats``, Gram sizes ``ks``), this
    rank's local Gram / R in its first k x k; ``reduced`` is this rank's reduced chunk
    (its natural blocks, the other-dimension blocks after them), ``reduced * f`` its shard
    D_r of the mean gradient. Writes the mean-gradient Gram partials D_r^T D_r (or
    D_r D_r^T) / ``copies`` (the number of ranks holding the same shard: the replicas of
    HSDP, 1 on a 1-D mesh), all-reduces ``flat`` over ``mesh.gram_group`` (the ranks whose
    partials sum to the totals) and hands the Grams to the share. Tensor parallelism: a
    matrix sliced along its Gram's dimension (``tp_gather``) has its D_r slices assembled
    over the tp group (one all-gather for the group's such matrices) and its partial
    written by tp rank 0."""
    offs = gram_offsets(ks)
    w = f * f / copies

    def shard(seg):
        if seg.natural:
            return reduced[seg.offset:seg.offset + seg.numel].view(seg.block)
        return reduced[seg.extra_offset:seg.extra_offset + seg.extra_block.numel()].view(seg.extra_block)

    gather = [i for i, seg in enumerate(mats) if seg.tp_gather]
    wholes = dict(zip(gather, tp_assemble([shard(mats[i]) for i in gather],
                                          [mats[i].tp_dim for i in gather], mesh.tp_group, mesh.tp_size)))
    for i, (seg, k, q) in enumerate(zip(mats, ks, offs)):
        if seg.tp_zero or (seg.tp_gather and mesh.tp_rank != 0):
            flat[q + k * k:q + 2 * k * k].zero_()
            continue
        Dr = wholes.get(i)
        P = spectral.gram([shard(seg) if Dr is None else Dr], side=seg.side)[0]
        torch.mul(P.view(-1), w, out=flat[q + k * k:q + 2 * k * k])  # sums to D^T D or D D^T
    # the group's one small all-reduce: local Grams and mean-Gram partials together
    dist.all_reduce(flat, group=mesh.gram_group)
    mean_grams = [flat[q:q + k * k].view(k, k) for q, k in zip(offs, ks)]
    dd = [flat[q + k * k:q + 2 * k * k].view(k, k) for q, k in zip(offs, ks)]
    # this rank's share of the group's sqrt-traces; non-finite gradients on some rank
    # give nan statistics: the measurement is invalid everywhere
    keys = [ctx.plan.of(s_.param).key for s_ in mats] if ctx.state.pool is not None else None
    ctx.share.add_grams(mean_grams, dd, [tuple(s_.full_shape) for s_ in mats], keys)


def finish(m: Measurement, l_group, nuclear_group) -> None:
    """After the last param group: the step's one small all-reduce (l1/l2: the four
    sums, and the l1 pool's part, over ``l_group``, the ranks holding distinct shards;
    nuclear: the shared sqrt-traces over ``nuclear_group``, the ranks sharing the
    solves), launched without a host read; the estimate is built on its first read."""
    st = m.state
    if st.geometry == "nuclear":
        # every param group solved its share after its Gram all-reduce
        m.record_nuclear(nuclear_group, dist.all_reduce)
        return
    # per-rank sums over its shards -> totals: the step's one small all-reduce
    width = 5 if st.l1_debiased else 4
    terms = m.l_terms if m.l_terms is not None else torch.zeros(
        width, dtype=torch.float64, device=m.device)
    if st.pool is not None:  # the pooled part rides last in the same all-reduce
        part = None
        for v in m.l_pool:  # the param groups' parts, in order
            part = v if part is None else part + v
        if part is None:
            part = torch.zeros((), dtype=torch.float64, device=terms.device)
        terms = torch.cat([terms, part.to(terms.device).reshape(1)])
    dist.all_reduce(terms, group=l_group)
    pooled = None
    if st.pool is not None:
        pooled, terms = terms[-1], terms[:-1]
    m.record_l(terms, pooled)
