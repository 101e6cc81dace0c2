"""Rank-side code of test_loop_mistakes.py (issue 39): the README loops on DDP and FSDP2 with
one mistake each, on 2 gloo ranks, and the meshes the measurement refuses or must measure
over their data-parallel group only, on 4. Every scenario builds its own model and returns
what happened (the error's type and message, or what the loop measured); the loops that
are right run with gns_kernels' warnings turned into errors."""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk
from gns_kernels.distributed.fsdp import _param_groups
from _harness import run_scenarios


def _data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 12, generator=g)
    y = (x @ torch.randn(12, 4, generator=g) + 2.0 * torch.randn(n, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _wrap(model, kind, mesh=None, group=None):
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0], mesh=mesh); fully_shard(model[2], mesh=mesh); fully_shard(model, mesh=mesh)
        return model
    return DDP(model, process_group=group)


def _error(fn):
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the scenario reports what it raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, **(out or {})}


@contextlib.contextmanager
def _gns_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def _loop(coord, model, loader, steps, *, zero_grad=True, set_to_none=True, forward=None,
          own_no_sync=False, freeze_at=None, opts=None):
    """The README loop; the keyword arguments make one mistake each."""
    opts = opts or coord.optimizers
    forward = forward or model
    rows = []
    for batch in coord.batches(loader, max_steps=steps):
        if freeze_at is not None and batch.step == freeze_at:
            next(model.parameters()).requires_grad_(False)
        for x, y in batch:
            with (model.no_sync() if own_no_sync else contextlib.nullcontext()):
                (F.cross_entropy(forward(x), y) / len(batch)).backward()
        for o in opts:
            o.step()
        if zero_grad:
            for o in opts:
                o.zero_grad(set_to_none=set_to_none)
        rows.append(coord.metrics())
    return rows


def _coord(kind, *, B0=16, every=1, **kw):
    model = _model()
    wrapped = _wrap(model, kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    coord = gk.AdaptiveBatching(wrapped, opt, geometry="l1", every=every, micro_batch_size=4,
                                initial_batch_size=B0, max_batch_size=64, **kw)
    ds = _data()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)))
    return coord, wrapped, opt, loader


# ------------------------------------------------------------------------- scenarios (2 ranks)
def refused_then_retry(rank, world, kind):
    """Item 1: B_0 = 12 is not a multiple of R x b = 8; the refused constructor attaches
    nothing, and the retry with 16 runs."""
    model = _model()
    wrapped = _wrap(model, kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    kw = dict(geometry="l1", every=1, micro_batch_size=4, max_batch_size=64)
    first = _error(lambda: gk.AdaptiveBatching(wrapped, opt, initial_batch_size=12, **kw))
    hooks = len(getattr(wrapped, "_comm_hooks", []))
    from gns_kernels.distributed.fsdp import GNSReduceScatter
    installed = sum(isinstance(pg._reduce_scatter_comm, GNSReduceScatter)
                    for m in model.modules() if hasattr(m, "_get_fsdp_state")
                    for pg in _param_groups(m))
    untouched = (not opt._optimizer_step_post_hooks
                 and all(set(g) == set(opt.defaults) | {"params"} for g in opt.param_groups))
    coord = gk.AdaptiveBatching(wrapped, opt, initial_batch_size=16, **kw)
    ds = _data()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)))
    with _gns_warnings_are_errors():
        rows = _loop(coord, wrapped, loader, 3)
    return {"first": first["error"], "hooks_after_refusal": hooks, "installed_after_refusal": installed,
            "optimizer_untouched": untouched, "valid": [r["valid"] for r in rows],
            "world_size": coord.world_size}


def correct_loops(rank, world, kind):
    """The README loop (and zero_grad(set_to_none=False), every=2): no warning, valid GNS."""
    out = {}
    for name, kw in {"readme": {}, "zeros": dict(set_to_none=False)}.items():
        coord, wrapped, opt, loader = _coord(kind, every=2)
        with _gns_warnings_are_errors():
            rows = _loop(coord, wrapped, loader, 4, **kw)
        out[name] = [r["valid"] for r in rows if r["measured"]]
    return out


def zero_grad_forgotten(rank, world, kind):
    """Item 7: opt.zero_grad() left out; raised at the first measuring step after step 0."""
    def run():
        coord, wrapped, opt, loader = _coord(kind, every=2)
        return {"rows": _loop(coord, wrapped, loader, 4, zero_grad=False)}
    return _error(run)


def frozen_halfway(rank, world, kind):
    """Item 8: a parameter frozen at step 2."""
    coord, wrapped, opt, loader = _coord(kind, every=1)
    out = _error(lambda: _loop(coord, wrapped, loader, 4, freeze_at=2))
    out["step"] = coord.current_step
    return out


def own_no_sync(rank, world):
    """Item 10: the user's own no_sync() around every micro-batch (DDP)."""
    def run():
        coord, wrapped, opt, loader = _coord("ddp")
        _loop(coord, wrapped, loader, 2, own_no_sync=True)
    return _error(run)


def inner_forward(rank, world):
    """Item 10: the forward through the module DDP wraps."""
    def run():
        coord, wrapped, opt, loader = _coord("ddp")
        _loop(coord, wrapped, loader, 2, forward=wrapped.module)
    return _error(run)


def existing_comm_hook(rank, world):
    """Item 10: a DDP model that already has a comm hook (torch's 'can only be called
    once' before), with DDP's own hook and with a GNSHookState the user registered."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = {}
    ddp = DDP(_model())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    out["allreduce"] = _error(lambda: gk.AdaptiveBatching(ddp, opt, micro_batch_size=4,
                                                          initial_batch_size=16))["error"]
    ddp2 = DDP(_model())
    ddp2.register_comm_hook(gk.GNSHookState(geometry="l1", every=1, batch_size=16), gk.ddp_gns_hook)
    opt2 = torch.optim.AdamW(ddp2.parameters(), lr=3e-3)
    out["gns"] = _error(lambda: gk.AdaptiveBatching(ddp2, opt2, micro_batch_size=4,
                                                    initial_batch_size=16))["error"]
    return out


def fsdp_optimizer_before_shard(rank, world):
    """Item 10: FSDP2 optimizers built before fully_shard (the error named
    GNSHookState(params=...), which a README-form user never built)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _wrap(model, "fsdp")
    return _error(lambda: gk.AdaptiveBatching(model, opt, micro_batch_size=4, initial_batch_size=16))


def own_loader(rank, world, kind):
    """Item 9: the loader of the loop before the coordinator, batch 2 b, a kept
    DistributedSampler: refused at the first micro-batch, the coordinator unchanged."""
    coord, wrapped, opt, _ = _coord(kind)
    ds = _data()
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=8, sampler=sampler)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = _error(lambda: _loop(coord, wrapped, loader, 2))
    out["warnings"] = [str(w.message) for w in seen]
    out["state"] = (coord.current_step, coord.samples_seen)
    return out


def skipped_micro_batch(rank, world, kind):
    """The check's limit (docs/coordinator.md): rank 1 skips the backward of one
    micro-batch; its accumulated gradient averages A - 1 micro-batches, which the reduced
    gradients cannot reveal: the loop runs on without a word."""
    coord, wrapped, opt, loader = _coord(kind, every=1)
    rows = []
    with _gns_warnings_are_errors():
        for batch in coord.batches(loader, max_steps=2):
            for a, (x, y) in enumerate(batch):
                loss = F.cross_entropy(wrapped(x), y) / len(batch)
                if not (rank == 1 and batch.step == 1 and a == 0):
                    loss.backward()
            opt.step(); opt.zero_grad()
            rows.append(coord.metrics())
    return {"valid": [r["valid"] for r in rows]}


def run_many(rank, world, scenarios):
    return run_scenarios(lambda r, w, fn, **kw: globals()[fn](r, w, **kw), rank, world, scenarios)


# ------------------------------------------------------------------------- meshes (4 ranks)
def meshes(rank, world):
    """Item 11 on a 2 x 2 mesh: FSDP2 x TP (torchtitan's order: parallelize_module over
    tp, then fully_shard over dp) is measured over the 2 data-parallel ranks (issue 45; it
    was refused before, and before that measured wrong with R = 4); FSDP2 over the dp
    sub-mesh alone, and DDP over the dp group, measure over their 2 ranks (R = 2, not the
    world's 4)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gns_kernels.distributed.fsdp import GNSReduceScatter

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # measured since issue 45: R = 2 (the tp ranks of a dp rank are one sample), the data
    # sharded over the dp ranks
    coord = gk.AdaptiveBatching(model, opt, geometry="l1", every=1, micro_batch_size=4,
                                initial_batch_size=16, max_batch_size=64)
    ds = _data()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)))
    with _gns_warnings_are_errors():
        rows = _loop(coord, model, loader, 2)
    out["tp"] = {"world_size": coord.world_size, "rank": coord.rank,
                 "accum": [r["accum_steps"] for r in rows], "valid": [r["valid"] for r in rows],
                 "installed": sum(isinstance(pg._reduce_scatter_comm, GNSReduceScatter)
                                  for pg in _param_groups(model))}
    # the dp sub-mesh alone: R = 2 on a world of 4 (the tp ranks are independent replicas here)
    for kind in ("fsdp", "ddp"):
        model = _model()
        wrapped = _wrap(model, kind, mesh=mesh["dp"], group=mesh["dp"].get_group())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        coord = gk.AdaptiveBatching(wrapped, opt, geometry="l1", every=1, micro_batch_size=4,
                                    initial_batch_size=16, max_batch_size=64)
        ds = _data()
        loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)))
        with _gns_warnings_are_errors():
            rows = _loop(coord, wrapped, loader, 2)
        out[kind] = {"world_size": coord.world_size, "rank": coord.rank,
                     "accum": [r["accum_steps"] for r in rows], "valid": [r["valid"] for r in rows],
                     "wrong_world": _wrong_world(kind, mesh["dp"])}
    return out


def _wrong_world(kind, dp):
    model = _model()
    wrapped = _wrap(model, kind, mesh=dp, group=dp.get_group())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _error(lambda: gk.AdaptiveBatching(wrapped, opt, micro_batch_size=4, initial_batch_size=16,
                                              world_size=4))["error"]
