"""Where each parameter sits in an FSDP2 reduce-scatter input, and its part in a measurement.

FSDP2 (torch 2.13, ``foreach_reduce``) hands the reduce-scatter this rank's unsharded local
gradient of a param group, viewed as Rs chunks: chunk r holds, back to back, the r-th FSDP
shard of every parameter with a gradient (its dim-0 block padded to ceil(m / Rs) rows, or
its dim-d block for Shard(d), d > 0). ``layout`` names each parameter's block (``Seg``)
and, for the nuclear GNS, how its Gram is formed:

- ``side``: the Gram side of the WHOLE matrix (the smaller side, as ``gk.estimate``);
  ``k``: its size;
- ``natural``: the FSDP shard dimension partitions the Gram's summation index (column
  Gram: row blocks; row Gram: column blocks), so the Grams of the shards add up; else the
  blocks along the other dimension ride in the reduce-scatter as ``extra`` (``extra_block``
  per chunk at ``extra_offset``);
- tensor parallelism (a DTensor parameter from ``parallelize_module``, FSDP2 over the dp
  mesh): FSDP2 reduces this tp rank's slice (``shape``, the local shape; ``full_shape`` the
  parameter's). A slice along the Gram's summation index (``tp_dim``) adds up across the tp
  ranks like a shard; a slice along the Gram's own dimension (``tp_gather``) has to be
  assembled: ``tp_assemble`` all-gathers the slices over the tp group, one collective for
  all of a group's such matrices. A parameter replicated over tp (``Replicate()``, or a plain
  tensor) is the same on every tp rank: only tp rank 0 measures it (``tp_zero`` elsewhere).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import spectral

Tensor = torch.Tensor

__all__ = ["Seg", "layout", "tp_placement", "local_matrix", "tp_assemble"]


class Seg:
    """One parameter's block inside every chunk of the reduce-scatter input."""

    __slots__ = ("fsdp_param", "param", "offset", "numel", "block", "shape", "full_shape", "dim",
                 "measured", "side", "k", "natural", "extra_offset", "extra_block", "tp_dim",
                 "tp_gather", "tp_zero")

    def __init__(self, fsdp_param, offset: int, numel: int, block: torch.Size, dim: int):
        self.fsdp_param = fsdp_param
        self.param = fsdp_param.sharded_param
        self.offset = offset
        self.numel = numel
        self.block = block  # shape of this parameter's block in one chunk
        self.shape = torch.Size(fsdp_param._orig_size)  # this tp rank's slice (all of it without tp)
        self.full_shape = torch.Size(self.param.shape)  # the parameter's (global) shape
        self.dim = dim  # FSDP's sharded dimension
        self.measured = False
        self.side = None  # nuclear: Gram side of the whole matrix ('row' | 'col')
        self.k = 0  # nuclear: its Gram's size
        self.natural = False  # nuclear: FSDP's blocks partition the Gram's summation index
        self.extra_offset = 0  # nuclear, non-natural: offset of the other-dim block in a chunk
        self.extra_block = None  # its shape
        self.tp_dim: Optional[int] = None  # the dimension tensor parallelism slices (None: not sliced)
        self.tp_gather = False  # nuclear: the tp slices must be assembled (tp_dim is the Gram's)
        self.tp_zero = False  # replicated over tp and this is not tp rank 0: contributes nothing


def tp_placement(fsdp_param):
    """(sliced dim or None, replicated): the tensor-parallel placement of an FSDP2
    parameter: ``(d, False)`` for ``Shard(d)`` on its tp mesh, ``(None, True)`` for a
    ``Replicate()`` DTensor or a plain tensor; raises for other placements."""
    if not getattr(fsdp_param, "is_dtensor", False):
        return None, True
    (p,) = fsdp_param._unsharded_dtensor_spec.placements
    if p.is_replicate():
        return None, True
    if p.is_shard():
        return p.dim, False
    raise ValueError(f"tensor-parallel placement {p!r}: expected Shard(d) or Replicate()")


def layout(fsdp_params, chunks: int, state, plan, mesh):
    """Segments of the chunk for ``fsdp_params`` (the params with a gradient, in order),
    the chunk numel of FSDP's part and the extra per-chunk numel (nuclear, non-natural);
    ``chunks``: Rs; which parameters are measured comes from the measurement's ``plan``
    and, with tensor parallelism, from ``mesh`` (tp-replicated ones on tp rank 0 only)."""
    segs = []
    off = 0
    tp_rank = mesh.tp_rank if mesh is not None else 0
    for fp in fsdp_params:
        block = torch.Size(fp.padded_sharded_param_size)
        n = block.numel()
        seg = Seg(fp, off, n, block, fp.fsdp_placement.dim)
        seg.tp_dim, replicated = tp_placement(fp)
        seg.tp_zero = replicated and tp_rank != 0
        # l1/l2: the sums just leave it out; nuclear: it keeps its place in the Gram
        # all-reduce (the same matrices on every rank of it) with zero parts
        seg.measured = plan.of(seg.param).measured and not (seg.tp_zero and state.geometry != "nuclear")
        segs.append(seg)
        off += n
    chunk = off
    extra = 0
    if state.geometry == "nuclear":
        for seg in segs:
            if not seg.measured:
                continue
            m, n = seg.shape
            seg.side = spectral.smaller_side(tuple(seg.full_shape))
            seg.k = seg.full_shape[0] if seg.side == "row" else seg.full_shape[1]
            # col Gram sums over rows: row blocks (dim 0) are natural; row Gram: column blocks
            want = 0 if seg.side == "col" else 1
            seg.natural = seg.dim == want
            seg.tp_gather = seg.tp_dim is not None and seg.tp_dim != want
            if not seg.natural:
                if want == 1:
                    seg.extra_block = torch.Size((m, -(-n // chunks)))
                else:
                    seg.extra_block = torch.Size((-(-m // chunks), n))
                seg.extra_offset = chunk + extra
                extra += seg.extra_block.numel()
    return segs, chunk, extra


def local_matrix(seg: Seg, blocks: Tensor) -> Tensor:
    """This rank's local gradient slice of ``seg`` (``seg.shape``) from its FSDP blocks
    (``blocks``: chunks x ``seg.block``): padding dropped; a view where it can be."""
    m, n = seg.shape
    if seg.dim == 0:
        return blocks.reshape(blocks.shape[0] * seg.block[0], n)[:m]
    return torch.cat(list(blocks.unbind(0)), dim=seg.dim)


def tp_assemble(slices: Sequence[Tensor], dims: Sequence[int], group, size: int) -> list:
    """The whole matrices of this rank's tensor-parallel ``slices`` (one per matrix, each
    sliced along ``dims[i]``, equal slices on every tp rank, in tp-rank order): ONE
    all-gather over ``group`` (``size`` ranks) of all of them, float32."""
    if not slices:
        return []
    flat = torch.cat([s.reshape(-1).to(torch.float32) for s in slices])
    out = torch.empty(size * flat.numel(), dtype=torch.float32, device=flat.device)
    dist.all_gather_into_tensor(out, flat, group=group)
    out = out.view(size, flat.numel())
    wholes, q = [], 0
    for s, d in zip(slices, dims):
        parts = out[:, q:q + s.numel()].reshape(size, *s.shape)
        wholes.append(torch.cat(list(parts.unbind(0)), dim=d))
        q += s.numel()
    return wholes
