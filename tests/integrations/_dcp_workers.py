"""Rank-side code of the DCP tests (runs in the spawned gloo processes): a small MLP under
DDP, FSDP2 or HSDP (FSDP2 on a 2 x (world / 2) replicate x shard mesh) with the coordinator built on the model (noise pool on), trained a few
steps, its state written with torch.distributed.checkpoint and read into fresh objects."""
from __future__ import annotations

import copy
import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.integrations.dcp import DCPState


def _data(n=512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 12, generator=g)
    y = (x @ torch.randn(12, 4, generator=g) + 2.0 * torch.randn(n, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _build(kind, geometry, world, B0=None, Bmax=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if kind in ("fsdp", "hsdp", "tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        place, shard = {}, world
        if kind == "hsdp":  # a 2 x (world / 2) (replicate, shard) mesh
            shard = world // 2
            place = {"mesh": init_device_mesh("cpu", (2, shard), mesh_dim_names=("replicate", "shard"))}
        if kind == "tp":  # a (world / 2) x 2 (dp, tp) mesh: tensor parallelism, then FSDP2 over dp
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            shard = world // 2
            mesh = init_device_mesh("cpu", (shard, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            place = {"mesh": mesh["dp"]}
        if geometry == "nuclear":
            from gns_kernels.distributed.fsdp import fsdp_gns_shard_placement
            place["shard_placement_fn"] = lambda p: fsdp_gns_shard_placement(p, shard)
        fully_shard(model[0], **place); fully_shard(model[2], **place); fully_shard(model, **place)
        wrapped = model
    elif kind == "ddp":
        wrapped = DDP(model)
    else:
        wrapped = model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    b = 4
    coord = AdaptiveBatching(wrapped, opt, geometry=geometry, every=2, micro_batch_size=b,
                             initial_batch_size=B0 or b * world * 2,
                             max_batch_size=Bmax or 96 * world)
    ds = _data()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=0)
    return model, wrapped, opt, coord, loader


def _train(wrapped, opt, coord, loader, steps):
    rows = []
    for batch in coord.batches(loader, max_steps=coord.current_step + steps):
        for x, y in batch:
            (F.cross_entropy(wrapped(x), y) / len(batch)).backward()
        opt.step(); opt.zero_grad()
        rows.append(coord.metrics())
    return rows


def flat(obj, prefix=""):
    """Every leaf of a nested state_dict as {path: bits} (tensors by dtype, shape and raw
    bytes; floats by hex, NaN as 'nan')."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}[{i}]"))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        out[prefix] = ("tensor", str(t.dtype), tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()).hex()
                       if t.numel() else "")
    elif isinstance(obj, float):
        out[prefix] = "nan" if math.isnan(obj) else obj.hex()
    else:
        out[prefix] = repr(obj)
    return out


def round_trip(rank, world, folder, kind="ddp", geometry="l1", steps=5, after=3):
    """Train ``steps`` steps, dcp.save the coordinator (wrapped in DCPState), load it into a
    freshly built one (model and optimizer copied in memory) and train both ``after`` more
    steps. Returns the flattened states before save / after load and both continuations."""
    model, wrapped, opt, coord, loader = _build(kind, geometry, world)
    first = _train(wrapped, opt, coord, loader, steps)
    before = flat(coord.state_dict())
    path = os.path.join(folder, f"ckpt_{kind}_{geometry}")
    dcp.save({"coord": DCPState(coord)}, checkpoint_id=path)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    model2, wrapped2, opt2, coord2, loader2 = _build(kind, geometry, world)
    fresh = flat(coord2.state_dict())
    model2.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dcp.load({"coord": DCPState(coord2)}, checkpoint_id=path)
    after_load = flat(coord2.state_dict())
    rows1 = _train(wrapped, opt, coord, loader, after)
    rows2 = _train(wrapped2, opt2, coord2, loader2, after)
    try:  # the coordinator handed to DCP unwrapped: refused, naming the fix
        dcp.save({"coord": coord}, checkpoint_id=path + "_plain")
        refused = None
    except (RuntimeError, CheckpointException) as exc:  # raised before DCP runs a collective
        refused = str(exc)
    return {"refused": refused, "before": before, "fresh": fresh, "after": after_load,
            "rows": [flat(r) for r in rows1], "rows_loaded": [flat(r) for r in rows2],
            "batch_sizes": [int(r["batch_size"]) for r in first + rows1],
            "warnings": [str(x.message) for x in w]}


def save_only(rank, world, folder, kind="ddp", steps=5):
    model, wrapped, opt, coord, loader = _build(kind, "l1", world, 24, 192)
    _train(wrapped, opt, coord, loader, steps)
    dcp.save({"coord": DCPState(coord)}, checkpoint_id=os.path.join(folder, "resize"))
    return {"state": flat(coord.state_dict()), "position": coord.sampler.position,
            "samples": coord.samples_seen, "batch": coord.batch_size}


def load_resized(rank, world, folder, kind="ddp", partial=False):
    """Load the checkpoint of ``save_only`` on this (other) world size."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    model, wrapped, opt, coord, loader = _build(kind, "l1", world, 24, 192)
    kw = {"planner": DefaultLoadPlanner(allow_partial_load=True)} if partial else {}
    missing = None
    if partial:  # without allow_partial_load DCP refuses the rank it has no share for
        try:
            dcp.load({"coord": DCPState(coord)}, checkpoint_id=os.path.join(folder, "resize"))
        except CheckpointException as exc:
            missing = str(exc)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dcp.load({"coord": DCPState(coord)}, checkpoint_id=os.path.join(folder, "resize"), **kw)
    pool = coord.state.pool
    entries = None if pool is None else len(pool.keys())
    samples, step = coord.samples_seen, coord.current_step
    rows = _train(wrapped, opt, coord, loader, 2)
    return {"warnings": [str(x.message) for x in w], "missing": missing, "samples": samples, "step": step,
            "warned_at": {str(x.message): x.filename for x in w},
            "pool_entries_at_load": entries,
            "rows": [flat(r) for r in rows]}
