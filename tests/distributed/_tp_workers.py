"""Rank-side code of the FSDP2 x tensor-parallel GNS tests (4 spawned gloo ranks, a 2 x 2
(dp, tp) mesh; ranks 2 d and 2 d + 1 are data-parallel rank d, reading the same data).

The net (``_TPNet``) covers each way a weight meets tensor parallelism, for the nuclear
GNS's Gram side (the smaller side of the whole weight):
  a 24x13 colwise   tall, column Gram, rows sliced: slices add up (natural)
  b 16x24 rowwise   wide, row Gram, columns sliced: natural; its bias Replicate()
  c  8x16 colwise   wide, row Gram, rows sliced: assembled over tp (tp_gather)
  d 20x8  rowwise   tall, column Gram, columns sliced: assembled over tp
  e  5x20 plain     not parallelized: the same on both tp ranks (tp rank 0 counts it)
Per scenario the same weights are sharded two ways: ``tp`` (parallelize_module over the
tp mesh, then fully_shard over the dp mesh, with gk.attach_fsdp_gns) and ``flat`` (the
1-D FSDP2 run on the 2 data-parallel ranks of each tp column, with the hook: the
expected value), plus ``plain`` (the tp model without the hook: its gradients).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _fsdp_workers import _Counter, _est
from _harness import gather_per_rank, run_scenarios

import gns_kernels as gk
from gns_kernels.distributed import GNSHookState
from gns_kernels.distributed.fsdp import attach_fsdp_gns

B_LOCAL = 4


class _TPNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(13, 24)
        self.b = torch.nn.Linear(24, 16)
        self.c = torch.nn.Linear(16, 8)
        self.d = torch.nn.Linear(8, 20)
        self.e = torch.nn.Linear(20, 5)

    def forward(self, x):
        x = torch.tanh(self.b(torch.tanh(self.a(x))))
        x = torch.tanh(self.d(torch.tanh(self.c(x))))
        return self.e(x)


PLAN = {"a": ColwiseParallel(), "b": RowwiseParallel(), "c": ColwiseParallel(), "d": RowwiseParallel()}


def _base():
    torch.manual_seed(4321)
    return _TPNet()


def _data(dp_rank: int, step: int):
    g = torch.Generator().manual_seed(20_000 + 100 * step + dp_rank)
    return torch.randn(B_LOCAL, 13, generator=g), torch.randn(B_LOCAL, 5, generator=g)


def _shard(model, dp_mesh, mp=False):
    kw = {"mesh": dp_mesh}
    if mp:  # bf16 compute, float32 reduce
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in (model.a, model.b, model.c, model.d):
        fully_shard(sub, **kw)
    fully_shard(model, **kw)
    return model


def _tp(base, mesh, mp=False):
    return _shard(parallelize_module(copy.deepcopy(base), mesh["tp"], PLAN), mesh["dp"], mp)


def run_tp(rank, world, *, mesh, hsdp_mesh=None, geometry="l1", steps=2, every=1, pool=True,
           method=None, signal="raw", accumulate=1, mp=False, frozen=False):
    """accumulate: micro-steps per optimizer step (set_requires_gradient_sync(False) on all
    but the last); mp: bf16 parameters, float32 reduce; frozen: layer c's weight without a
    gradient (FSDP2 leaves it out of the reduce-scatter). hsdp_mesh: a (replicate, shard,
    tp) mesh with the same ranks as ``mesh`` (dp, tp): the tp model is HSDP x TP over it."""
    extra = {} if method is None else {"method": method}
    pool_kw = {} if pool else {"pool_beta": None}
    dp = mesh["dp"].get_local_rank()
    R = mesh["dp"].size()
    base = _base()
    B = B_LOCAL * R
    if frozen:
        base.c.weight.requires_grad_(False)
    tp_dp = mesh["dp"] if hsdp_mesh is None else hsdp_mesh["replicate", "shard"]

    def tp_model():
        return _shard(parallelize_module(copy.deepcopy(base), mesh["tp"], PLAN), tp_dp, mp)

    models = {"tp": tp_model(), "flat": _shard(copy.deepcopy(base), mesh["dp"], mp), "plain": tp_model()}
    states = {}
    for name in ("tp", "flat"):
        st = GNSHookState(geometry, every=every, batch_size=B, signal=signal, **pool_kw, **extra)
        states[name] = (st, attach_fsdp_gns(models[name], st))
    local = copy.deepcopy(base)
    records = []
    for k in range(steps):
        for m in (*models.values(), local):
            for p in m.parameters():
                p.grad = None
        batches = [_data(dp, k * accumulate + a) for a in range(accumulate)]
        for x, y in batches:
            (F.mse_loss(local(x), y) / accumulate).backward()
        rank_grads = gather_per_rank([p.grad.detach().clone() for p in local.parameters()
                                      if p.grad is not None])
        measuring = states["tp"][0].is_measurement_step()
        calls = {}
        for name in ("flat", "plain", "tp"):
            with _Counter() as c:
                for a, (x, y) in enumerate(batches):
                    models[name].set_requires_gradient_sync(a == accumulate - 1)
                    (F.mse_loss(models[name](x).float(), y) / accumulate).backward()
            calls[name] = c.calls
        est = {name: _est(st.estimate) if measuring else None for name, (st, _h) in states.items()}
        ref = None
        if measuring:  # the data-parallel ranks' local gradients (tp rank 0 of each)
            sel = [[g for g in rg if geometry != "nuclear" or g.dim() == 2]
                   for rg in rank_grads[::mesh["tp"].size()]]
            ref = _est(gk.estimate(sel, batch_size=B, geometry=geometry, signal=signal,
                                   nuclear_dof="columns"))
        tp_p, plain_p = list(models["tp"].parameters()), list(models["plain"].parameters())
        records.append({"measuring": measuring, "est": est, "ref": ref, "calls": calls,
                        "grad_equal_plain": all(torch.equal(p.grad.to_local(), q.grad.to_local())
                                                for p, q in zip(tp_p, plain_p) if p.grad is not None)})
    h = states["tp"][1]
    return {"records": records, "dp": (h.dp_size, h.dp_rank), "tp": (h.mesh.tp_size, h.mesh.tp_rank),
            "hsdp": h.mesh.hsdp}


def run_many(rank, world, *, scenarios, hsdp=False):
    """world // 2 data-parallel ranks x 2 tp ranks; hsdp: the tp model's data-parallel ranks
    as 2 replicas x world // 4 shards (HSDP x TP)."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    hsdp_mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("replicate", "shard", "tp")) \
        if hsdp else None
    return run_scenarios(lambda r, w, **kw: run_tp(r, w, mesh=mesh, hsdp_mesh=hsdp_mesh, **kw),
                         rank, world, scenarios)
