"""Rank-side code of the AdaptiveBatching gloo tests (runs inside the spawned processes):
a small MLP under DDP with the coordinator, eager or torch.compile'd, with GNSHookState
(ranks as samples) or MicroBatchGNS (ranks x micro-batches) as the hook state."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook


def _data(n=512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 12, generator=g)
    y = (x @ torch.randn(12, 4, generator=g) + 2.0 * torch.randn(n, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def run_model_form(rank, world, fsdp=False, steps=8):
    """The README loop: AdaptiveBatching built on the DDP / FSDP2 model itself (it makes and
    attaches the measurement), coord.batches(...), no coord.step()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
        wrapped = model
    else:
        wrapped = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    coord = AdaptiveBatching(wrapped, opt, geometry="l1", every=2, micro_batch_size=4,
                             initial_batch_size=16, max_batch_size=96)
    ds = _data()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=0)
    rows = []
    for batch in coord.batches(loader, max_steps=steps):
        for x, y in batch:
            (F.cross_entropy(wrapped(x), y) / len(batch)).backward()
        opt.step(); opt.zero_grad()
        rows.append(coord.metrics())
    weights = [p.full_tensor() if fsdp else p for p in model.parameters()]
    return {"rows": rows, "weights": [w.detach().clone() for w in weights]}


def run(rank, world, compiled=False, micro=False, steps=8, backend="inductor"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if micro:
        state = MicroBatchGNS(model.parameters(), geometry="l1", every=2, batch_size=16, micro_batches=2)
    else:
        state = GNSHookState(geometry="l1", every=2, batch_size=16)
    ddp.register_comm_hook(state, ddp_gns_hook)
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=16, max_batch_size=96)
    fwd = torch.compile(ddp, backend=backend) if compiled else ddp
    ds = _data()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=0)
    rows, seen = [], []
    for k in coord.steps(max_steps=steps):
        for (x, y), sync in coord.micro_batches(loader, ddp):
            with sync:
                (F.cross_entropy(fwd(x), y) / coord.accum_steps).backward()
            seen.append(x.shape[0])
        opt.step(); opt.zero_grad(); coord.step()
        rows.append(coord.metrics())
    return {"rows": rows, "micro_sizes": seen, "position": coord.sampler.position,
            "weights": [p.detach().clone() for p in model.parameters()]}


def run_fsdp(rank, world, compiled=False, steps=6, backend="inductor"):
    """FSDP2 (fully_shard on both layers and the root) with the coordinator on the handle."""
    from torch.distributed.fsdp import fully_shard

    from gns_kernels.distributed.fsdp import attach_fsdp_gns

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = GNSHookState(geometry="l1", every=2, batch_size=16)
    handle = attach_fsdp_gns(model, state)
    coord = AdaptiveBatching(handle, opt, micro_batch_size=4, initial_batch_size=16, max_batch_size=96)
    fwd = torch.compile(model, backend=backend) if compiled else model
    ds = _data()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=0)
    rows = []
    for k in coord.steps(max_steps=steps):
        for (x, y), sync in coord.micro_batches(loader, model):
            with sync:
                (F.cross_entropy(fwd(x), y) / coord.accum_steps).backward()
        opt.step(); opt.zero_grad(); coord.step()
        rows.append(coord.metrics())
    return {"rows": rows, "weights": [p.full_tensor().detach().clone() for p in model.parameters()]}


def run_fsdp_params_before_shard(rank, world):
    """GNSHookState(params=...) built from the parameters before fully_shard: attach refuses
    it naming the order (every measurement was silently invalid)."""
    from torch.distributed.fsdp import fully_shard

    from gns_kernels.distributed.fsdp import attach_fsdp_gns

    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    hidden = [model[0].weight, model[2].weight]           # collected too early
    state = GNSHookState(geometry="nuclear", every=1, batch_size=16, params=hidden)
    fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
    try:
        attach_fsdp_gns(model, state)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}
