"""The data-parallel mesh an FSDP2 model reduces over, as the GNS measurement sees it.

``fully_shard(module, mesh=...)`` takes a 1-D mesh (FSDP: every data-parallel rank holds a
shard) or a 2-D (replicate, shard) mesh (HSDP: FSDP within each replica, gradients
all-reduced across replicas). Either way the GNS samples are ALL data-parallel ranks,
R = replicate x shard; ``DPMesh`` names the process groups the measurement uses:

- ``shard_group``: the reduce-scatter's (Rs ranks: the chunks of a reduce-scatter input);
- ``replicate_group``: the all-reduce's across replicas (Rr ranks), None on a 1-D mesh;
- ``dp_group``: all R = Rr x Rs data-parallel ranks (the 1-D mesh's own group, or the
  2-D mesh flattened), the group of the nuclear Gram all-reduces and the shared solves;
- ``dp_size``, ``dp_rank``: R and this rank in ``dp_group``.

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
    """The groups of one FSDP2 model's data-parallel mesh (module docstring)."""

    shard_group: object
    replicate_group: Optional[object]
    dp_group: object
    dp_size: int
    dp_rank: int

    @property
    def hsdp(self) -> bool:
        return self.replicate_group is not None

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)


def dp_mesh(info, shard_group) -> DPMesh:
    """The DPMesh of an FSDP2 param group's ``mesh_info`` (``FSDPMeshInfo`` or
    ``HSDPMeshInfo``); ``shard_group``: the group its reduce-scatter runs over."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    if not isinstance(info, HSDPMeshInfo):
        return DPMesh(shard_group, None, shard_group, dist.get_world_size(shard_group),
                      dist.get_rank(shard_group))
    replicate = info.replicate_process_group
    mesh = info.mesh
    if mesh.size() == dist.get_world_size():
        dp = dist.group.WORLD  # the mesh is the world: no new group needed
    else:  # a data-parallel mesh inside a larger world: its ranks flattened into one group
        dp = mesh._flatten().get_group()
    return DPMesh(shard_group, replicate, dp, dist.get_world_size(dp), dist.get_rank(dp))


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
