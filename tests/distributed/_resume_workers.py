"""Rank-side code of the DDP resume tests (runs inside the spawned gloo processes).

Each scenario trains a small MLP under DDP with the GNS hook and ``AdaptiveBatching``,
measuring at every step (F = 1). The uninterrupted run saves model, optimizer and
coordinator (``torch.save``) at the start of step ``save_at``; the resumed run builds
everything afresh (a new DDP model, whose first iteration uses DDP's initial bucket
layout), loads the checkpoint with ``torch.load(weights_only=True)`` and continues. Per
step it records the coordinator's metrics, the bucket layout the hook saw (parameter
positions per bucket) and, at the end, the weights and the sampler position.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook

# dims (32, 64, 64, 64, 10): the 10 x 64 weight is one of the matrices whose CPU Gram
# depends on its address modulo 16 bytes, and its offset in the bucket changes from the
# first iteration's layout to the rebuilt one. "permuted": layers registered in another
# order than the forward uses them, with small buckets, so the rebuilt buckets group the
# parameters differently (not only in another order).
SCENARIOS = {
    # the reported case: nuclear with the noise pool (the default), one bucket
    "nuclear": dict(geometry="nuclear"),
    "nuclear_buckets": dict(geometry="nuclear", permuted=True, bucket_cap_mb=0.02),
    "nuclear_micro": dict(geometry="nuclear", micro=True),
    "l1_buckets": dict(geometry="l1", permuted=True, bucket_cap_mb=0.02, signal="debiased"),
    "l2_buckets": dict(geometry="l2", permuted=True, bucket_cap_mb=0.02),
    # the model form: AdaptiveBatching(ddp, ...) builds and registers the hook, batches()
    "nuclear_model_form": dict(geometry="nuclear", model_form=True),
    # the host route (issue 43): the checkpoint is taken while the host job of the step
    # before is in flight (delayed), and the resumed run joins the recorded part
    "nuclear_host": dict(geometry="nuclear", method="host", delay=0.05),
    "nuclear_micro_host": dict(geometry="nuclear", micro=True, method="host", delay=0.05,
                               signal="debiased"),
}
DIMS = (32, 64, 64, 64, 10)


class _Permuted(torch.nn.Module):
    """Linear layers registered in the order 1, 2, ..., n-1, 0, applied in 0, 1, ..., n-1."""

    def __init__(self, dims):
        super().__init__()
        n = len(dims) - 1
        self.order = list(range(1, n)) + [0]
        self.layers = torch.nn.ModuleList([torch.nn.Linear(dims[i], dims[i + 1]) for i in self.order])
        self.pos = {i: j for j, i in enumerate(self.order)}

    def forward(self, x):
        n = len(self.order)
        for i in range(n):
            x = self.layers[self.pos[i]](x)
            if i < n - 1:
                x = torch.tanh(x)
        return x


def _data(n=1024, dim=DIMS[0], out=DIMS[-1]):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    y = (x @ torch.randn(dim, out, generator=g) + 2.0 * torch.randn(n, out, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _model(permuted: bool):
    torch.manual_seed(0)
    if permuted:
        return _Permuted(DIMS)
    mods = []
    for i in range(len(DIMS) - 1):
        mods += [torch.nn.Linear(DIMS[i], DIMS[i + 1]), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def run_one(rank, world, *, path, geometry, resume=False, micro=False, permuted=False,
            bucket_cap_mb=None, signal="raw", steps=6, save_at=3, prime=False, model_form=False,
            method=None, delay=None):
    """One scenario; returns {rows, layout, weights, position}. prime: before the hook is
    registered and the checkpoint loaded, one synchronized forward / backward on a zero
    batch, so that DDP rebuilds its buckets (in the order the gradients became ready)
    before the first resumed step (docs/coordinator.md). model_form: the coordinator is
    built on the DDP model and the loop is ``coord.batches`` (no layout is recorded).
    method: the hook state's; delay: seconds the host route's job sleeps before each
    matrix (spectral.host._DELAY) -- the result then also says whether that job was still
    in flight when the checkpoint was taken ("inflight_at_save") and whether the
    checkpoint recorded its part ("lagged_saved")."""
    from gns_kernels.spectral import host as _host

    _host._DELAY = None if delay is None else (lambda i: delay)
    try:
        return _run_one(rank, world, path=path, geometry=geometry, resume=resume, micro=micro,
                        permuted=permuted, bucket_cap_mb=bucket_cap_mb, signal=signal, steps=steps,
                        save_at=save_at, prime=prime, model_form=model_form, method=method)
    finally:
        _host._DELAY = None


def _run_one(rank, world, *, path, geometry, resume, micro, permuted, bucket_cap_mb, signal,
             steps, save_at, prime, model_form, method):
    model = _model(permuted)
    ddp = DDP(model, **({} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}))
    if prime:
        F.cross_entropy(ddp(torch.zeros(4, DIMS[0])), torch.zeros(4, dtype=torch.long)).backward()
        model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    B0 = 8 * world  # two micro-batches of 4 per rank
    if model_form:
        return _run_model_form(ddp, model, opt, B0, path, geometry, resume, steps, save_at)
    extra = {} if method is None else {"method": method}
    if micro:
        state = MicroBatchGNS(model.parameters(), geometry=geometry, every=1, batch_size=B0,
                              micro_batches=2, signal=signal, **extra)
    else:
        state = GNSHookState(geometry=geometry, every=1, batch_size=B0, signal=signal, **extra)
    names = {id(p): i for i, p in enumerate(model.parameters())}
    layout = []

    def hook(st, bucket):
        layout.append((st.step, bucket.index(), [names[id(p)] for p in bucket.parameters()]))
        return ddp_gns_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=B0,
                             max_batch_size=8 * B0, theta=0.3)
    loader = _resume_and_loader(coord, model, opt, path, resume)
    rows = []
    inflight = saved = None
    for k in coord.steps(max_steps=steps):
        if not resume and k == save_at:
            lagged = getattr(state, "_lagged", None)
            inflight = lagged is not None and lagged.share.job is not None and not lagged.share.job.done()
            ckpt = coord.state_dict()
            saved = "lagged" in ckpt["hook"]
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "coord": ckpt}, path)
        for (x, y), sync in coord.micro_batches(loader, ddp):
            with sync:
                (F.cross_entropy(ddp(x), y) / coord.accum_steps).backward()
        opt.step()
        opt.zero_grad()
        coord.step()
        rows.append(coord.metrics())
    return {"rows": rows, "layout": layout, "position": coord.sampler.position,
            "weights": [p.detach().clone() for p in model.parameters()],
            "inflight_at_save": inflight, "lagged_saved": saved}


def _resume_and_loader(coord, model, opt, path, resume):
    """Load model, optimizer and coordinator from ``path`` when resuming; the loader over
    the coordinator's sampler."""
    if resume:
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        coord.load_state_dict(ckpt["coord"])
    ds = _data()
    return DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=0)


def _run_model_form(ddp, model, opt, B0, path, geometry, resume, steps, save_at):
    coord = AdaptiveBatching(ddp, opt, micro_batch_size=4, initial_batch_size=B0,
                             max_batch_size=8 * B0, theta=0.3, every=1, geometry=geometry)
    loader = _resume_and_loader(coord, model, opt, path, resume)
    rows = []
    for batch in coord.batches(loader, max_steps=steps):
        for x, y in batch:
            (F.cross_entropy(ddp(x), y) / len(batch)).backward()
        opt.step()
        opt.zero_grad()
        rows.append(coord.metrics())
        if not resume and coord.current_step == save_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "coord": coord.state_dict()}, path)
    return {"rows": rows, "layout": None, "position": coord.sampler.position,
            "weights": [p.detach().clone() for p in model.parameters()]}


def run_many(rank, world, *, folder, names, resume=False, prime=False):
    """The scenarios ``names`` one after the other (checkpoints under ``folder``)."""
    return {name: run_one(rank, world, path=os.path.join(folder, f"{name}_rank{rank}.pt"),
                          resume=resume, prime=prime, **SCENARIOS[name])
            for name in names}
