"""Rank-side code of the pipeline-parallel refusal test (4 gloo ranks, a 2 x 2 (pp, dp)
mesh): a 2-stage torch.distributed.pipelining GPipe schedule whose stages are FSDP2 over
the dp mesh, the GNS hook attached to each stage."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from gns_kernels.distributed import GNSHookState
from gns_kernels.distributed.fsdp import attach_fsdp_gns


def pipeline(rank, world):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 5))
    stage_mod = full[:2] if pp == 0 else full[2:]
    fully_shard(stage_mod, mesh=mesh["dp"])
    state = GNSHookState("l1", every=1, batch_size=8)
    attach_fsdp_gns(stage_mod, state)
    stage = PipelineStage(stage_mod, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(dp)
    x, y = torch.randn(4, 13, generator=g), torch.randn(4, 5, generator=g)
    try:
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "state_step": state.step}
