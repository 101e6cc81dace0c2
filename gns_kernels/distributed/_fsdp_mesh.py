"""The data-parallel mesh an FSDP2 model reduces over, as the GNS measurement sees it.

``fully_shard(module, mesh=...)`` takes a 1-D mesh (FSDP: every data-parallel rank holds a
shard) or a 2-D (replicate, shard) mesh (HSDP: FSDP within each replica, gradients
all-reduced across replicas). Either way the GNS samples are ALL data-parallel ranks,
R = replicate x shard; ``DPMesh`` names the process groups the measurement uses:

- ``shard_group``: the reduce-scatter's (Rs ranks: the chunks of a reduce-scatter input);
- ``replicate_group``: the all-reduce's across replicas (Rr ranks), None on a 1-D mesh;
- ``dp_size``, ``dp_rank``: R = Rr x Rs, all data-parallel ranks, and this rank among them;
- ``l_group``, ``gram_group``: the groups the l1/l2 partial sums and the nuclear Grams add
  over (the shard group and every data-parallel rank; x tp under tensor parallelism);
- with tensor parallelism (DTensor parameters on a tp mesh, FSDP2 over the dp mesh):
  ``tp_group``, the ranks holding one sample's slices.

``reduce_factors`` gives the factors FSDP2's ``foreach_reduce`` applies (pre-divide,
reduce-scatter op, all-reduce op, post-divide) and ``op_multiplier`` what one reduction op
multiplies a sum by, so a transport recovers mean_j x^j from a reduced buffer.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = ["DPMesh", "dp_mesh", "reduce_factors", "op_multiplier", "effective_reduce_dtype"]


class DPMesh(NamedTuple):
    """The groups of one FSDP2 model's data-parallel mesh (module docstring).

    With tensor parallelism (FSDP2 over the dp mesh of DTensor parameters that
    ``parallelize_module`` made on a tp mesh) the tp ranks of a data-parallel rank read the
    same data and together are ONE sample: R stays the data-parallel size, and
    ``tp_group`` (tp_size ranks, this rank tp_rank) is where a parameter's slices add up.
    ``l_group``: the ranks whose l1/l2 partial sums add up to the totals (the shard group;
    x tp); ``gram_group``: the ranks the nuclear Gram all-reduces and shared solves run over
    (the shard group; every data-parallel rank on HSDP; x tp), ``gram_size`` / ``gram_rank``.
    """

    shard_group: object
    replicate_group: Optional[object]
    dp_size: int
    dp_rank: int
    tp_group: Optional[object]
    tp_size: int
    tp_rank: int
    l_group: object
    gram_group: object

    @property
    def hsdp(self) -> bool:
        return self.replicate_group is not None

    @property
    def tp(self) -> bool:
        return self.tp_group is not None

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def gram_size(self) -> int:
        return dist.get_world_size(self.gram_group)

    @property
    def gram_rank(self) -> int:
        return dist.get_rank(self.gram_group)


def _flat_group(mesh):
    """One process group of all ranks of ``mesh`` (a DeviceMesh): the world's when the
    mesh is the world, else the mesh flattened."""
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()


def _replica_group(spmd_mesh):
    """The ranks of this rank's replica in a (replicate, shard, tp) mesh (shard x tp), one
    process group (only its members create it)."""
    me = dist.get_rank()
    for block in spmd_mesh.mesh.unbind(0):  # one replica each
        ranks = block.flatten().tolist()
        if me in ranks:
            return dist.new_group(ranks, use_local_synchronization=True)
    raise RuntimeError("the tensor-parallel mesh does not hold this rank")


def dp_mesh(info, shard_group, tp_mesh=None, spmd_mesh=None) -> DPMesh:
    """The DPMesh of an FSDP2 param group's ``mesh_info`` (``FSDPMeshInfo`` or
    ``HSDPMeshInfo``); ``shard_group``: the group its reduce-scatter runs over; ``tp_mesh``:
    the 1-D tensor-parallel mesh of its DTensor parameters (None: no tensor parallelism)
    and ``spmd_mesh`` the (dp, tp) mesh FSDP2 concatenated from both."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    hsdp = isinstance(info, HSDPMeshInfo)
    dp = _flat_group(info.mesh) if hsdp else shard_group  # every data-parallel rank
    tp = None if tp_mesh is None else tp_mesh.get_group()
    if tp is None:  # the l1/l2 partials add over the shards, the Grams over every dp rank
        l_group, gram_group = shard_group, dp
    elif hsdp:  # (replicate, shard, tp): partials over one replica's shard x tp ranks
        l_group, gram_group = _replica_group(spmd_mesh), _flat_group(spmd_mesh)
    else:  # (dp, tp)
        l_group = gram_group = _flat_group(spmd_mesh)
    return DPMesh(shard_group, info.replicate_process_group if hsdp else None,
                  dist.get_world_size(dp), dist.get_rank(dp), tp,
                  1 if tp is None else dist.get_world_size(tp), 0 if tp is None else dist.get_rank(tp),
                  l_group, gram_group)


def effective_reduce_dtype(param_group) -> torch.dtype:
    """The dtype FSDP2 reduces a param group's gradients in: the mixed-precision policy's
    reduce dtype, else its param dtype, else the parameters' own."""
    mp = param_group.mp_policy
    if mp.reduce_dtype is not None:
        return mp.reduce_dtype
    if mp.param_dtype is not None:
        return mp.param_dtype
    return param_group.fsdp_params[0].sharded_param.dtype


def reduce_factors(param_group, shard_group, replicate_group, reduce_dtype: torch.dtype,
                   device: torch.device):
    """(pre_factor or None, reduce-scatter op, all-reduce op, post_factor or None) as
    FSDP2's ``foreach_reduce`` chooses them for this param group."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    pre, post, rs_op, ar_op = _get_gradient_divide_factors(
        shard_group, replicate_group, reduce_dtype, device.type,
        param_group.gradient_divide_factor, param_group.force_sum_reduction_for_comms)
    return pre, rs_op, ar_op, post


def op_multiplier(op, size: int, factor: Optional[float], predicted_op, what: str) -> float:
    """What the reduction ``op`` over ``size`` ranks multiplies their sum by: SUM 1, AVG
    1 / size, PREMUL_SUM 1 / factor (the param group's gradient divide factor, FSDP2's
    choice ``predicted_op`` confirming it). ``what`` names the collective in errors."""
    if op == dist.ReduceOp.SUM:
        return 1.0
    if op == dist.ReduceOp.AVG:
        return 1.0 / size
    if op == dist.ReduceOp.PREMUL_SUM:
        if factor is None or not (predicted_op == dist.ReduceOp.PREMUL_SUM):
            raise RuntimeError(f"attach_fsdp_gns: PREMUL_SUM {what} without a gradient divide "
                               "factor on the param group; cannot recover the mean")
        return 1.0 / float(factor)
    raise RuntimeError(f"attach_fsdp_gns: unsupported {what} op {op!r} (expected SUM, AVG or PREMUL_SUM)")
