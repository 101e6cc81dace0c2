"""Rank-side code of the HSDP GNS tests (4 spawned gloo ranks).

Per scenario, the same MLP as _fsdp_workers (weights 24x13, 17x24, 5x17: uneven dim-0
shards, padding) is sharded three ways with the same weights, and every rank trains on the
same per-rank data (seeded by the global rank):
  - ``hsdp``: fully_shard on a 2 x 2 (replicate, shard) mesh, with gk.attach_fsdp_gns;
  - ``fsdp``: fully_shard on the 1-D mesh of the 4 ranks, with gk.attach_fsdp_gns (the
    expected value: the 1-D path, tested against gk.estimate in test_fsdp.py);
  - ``plain``: the same HSDP sharding without the hook (its gradients, bitwise).
Recorded per step: both estimates, gk.estimate on the all-gathered local gradients, the
hooked and plain HSDP gradients, and the dist calls of the hooked and plain HSDP backward.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _fsdp_workers import LOCAL_BATCH, _Counter, _batch, _est, _loss, _model
from _harness import gather_per_rank, run_scenarios

import gns_kernels as gk
from gns_kernels.distributed import GNSHookState
from gns_kernels.distributed.fsdp import attach_fsdp_gns, fsdp_gns_shard_placement


def _shard(model, mesh, placement: str, shard_size: int, mp: str = "none"):
    kw = {"mesh": mesh}
    if placement == "gns":
        kw["shard_placement_fn"] = lambda p: fsdp_gns_shard_placement(p, shard_size)
    if mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in (model.a, model.b):
        fully_shard(sub, **kw)
    fully_shard(model, **kw)
    return model


def run_hsdp(rank, world, *, meshes, geometry="l1", steps=3, every=1, pool=True, placement="default",
             method=None, signal="raw", mp="none", force_sum=False, frozen=False):
    """frozen: layer b's weight without a gradient (FSDP2 leaves it out of the reduce)."""
    hsdp_mesh, flat_mesh = meshes
    extra = {} if method is None else {"method": method}
    pool_kw = {} if pool else {"pool_beta": None}
    base = _model()
    if frozen:
        base.b.weight.requires_grad_(False)
    B = LOCAL_BATCH * world
    models, states = {}, {}
    for name, mesh, shard_size in (("hsdp", hsdp_mesh, 2), ("fsdp", flat_mesh, world),
                                   ("plain", hsdp_mesh, 2)):
        m = _shard(copy.deepcopy(base), mesh, placement, shard_size, mp)
        if force_sum:
            for sub in m.modules():
                if hasattr(sub, "set_force_sum_reduction_for_comms"):
                    sub.set_force_sum_reduction_for_comms(True)
        models[name] = m
        if name != "plain":
            st = GNSHookState(geometry, every=every, batch_size=B, signal=signal, **pool_kw, **extra)
            states[name] = (st, attach_fsdp_gns(m, st))
    local = copy.deepcopy(base)
    records = []
    for k in range(steps):
        for m in (*models.values(), local):
            for p in m.parameters():
                p.grad = None
        x, y = _batch(rank, k, 0)
        _loss(local, x, y).backward()
        rank_grads = gather_per_rank([p.grad.detach().clone() for p in local.parameters()
                                      if p.grad is not None])
        measuring = states["hsdp"][0].is_measurement_step()
        calls = {}
        for name in ("fsdp", "plain", "hsdp"):
            with _Counter() as c:
                _loss(models[name], x, y).backward()
            calls[name] = c.calls
        est = {name: _est(st.estimate) if measuring else None for name, (st, _h) in states.items()}
        ref = None
        if measuring:
            sel = [[g for g in rg if geometry != "nuclear" or g.dim() == 2] for rg in rank_grads]
            ref = _est(gk.estimate(sel, batch_size=B, geometry=geometry, signal=signal,
                                   nuclear_dof="columns"))
        hp, pp = list(models["hsdp"].parameters()), list(models["plain"].parameters())
        records.append({
            "measuring": measuring,
            "est": est,
            "ref": ref,
            "steps": {name: (st.estimate_step, st.step) for name, (st, _h) in states.items()},
            "grad_equal_plain": all(torch.equal(p.grad.to_local(), q.grad.to_local())
                                    for p, q in zip(hp, pp) if p.grad is not None),
            "calls": calls,
        })
    h = states["hsdp"][1]
    return {"records": records, "dp": (h.dp_size, h.dp_rank), "fsdp_dp": (states["fsdp"][1].dp_size,
                                                                        states["fsdp"][1].dp_rank)}


def run_many(rank, world, *, scenarios):
    hsdp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    flat_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return run_scenarios(lambda r, w, **kw: run_hsdp(r, w, meshes=(hsdp_mesh, flat_mesh), **kw),
                         rank, world, scenarios)


def run_refusals(rank, world):
    """The HSDP refusals: bf16 reduce dtype, a shard dimension of one rank, a
    post-accumulate-grad hook on a measured parameter."""
    out = {}
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    m = _model()
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.bfloat16))
    try:
        attach_fsdp_gns(m, GNSHookState("l1", batch_size=16))
    except ValueError as exc:
        out["bf16"] = str(exc)
    mesh1 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    m = _model()
    fully_shard(m, mesh=mesh1)
    try:
        attach_fsdp_gns(m, GNSHookState("l1", batch_size=16))
    except ValueError as exc:
        out["shard1"] = str(exc)
    # a post-accumulate-grad hook on a measured parameter: refused at the measurement (FSDP2
    # runs it on the reduced gradient before the statistics are read from it)
    m = _model()
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh)
    m.a.weight.register_post_accumulate_grad_hook(lambda p: None)
    attach_fsdp_gns(m, GNSHookState("l1", batch_size=16))
    x, y = _batch(rank, 0, 0)
    try:
        _loss(m, x, y).backward()
    except RuntimeError as exc:
        out["grad_hook"] = str(exc)
    # set_requires_all_reduce(False) on a measurement step: refused (the gradients are not
    # all-reduced across replicas)
    m = _model()
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh)
    attach_fsdp_gns(m, GNSHookState("l1", batch_size=16))
    m.set_requires_all_reduce(False)
    try:
        _loss(m, x, y).backward()
    except RuntimeError as exc:
        out["no_all_reduce"] = str(exc)
    dist.barrier()
    return out
