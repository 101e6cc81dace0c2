"""Rank-side code of test_ddp_unused.py: DDP with ``find_unused_parameters=True`` and the GNS
comm hook (runs inside the spawned gloo processes).

The model has a branch ``d`` (a matrix and a bias) that a micro-batch takes or not, by a
per-(rank, step, micro-batch) rule (the data's branch), so that across the steps ``d`` is

  step 0: unused on rank 1 in every micro-batch (its .grad stays None there),
  step 1: unused on rank 1 in its last micro-batch only (the synchronized backward; its
          .grad holds the no_sync micro-batches' sum),
  step 2: unused on rank 1 in every micro-batch but the last,
  step 3: unused on every rank (DDP leaves .grad None everywhere),
  step 4: used everywhere,

and rank 0 takes it everywhere but at step 3. Every step is measured (every=1). Per step
it records the hook's estimate, gk.estimate on the all-gathered local gradients (float64;
a gradient a rank did not produce is zero, which is what DDP averages), the hooked model's
gradients against plain DDP's (same flag, no hook), and the thread that issued each of
the hook's all-reduces.
"""
from __future__ import annotations

import contextlib
import copy
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import gather_per_rank as _gather, run_scenarios
from _ddp_scenarios import (MID, OUT, LOCAL_BATCH, MICRO_ESTIMATE_KW, _Net, _batch, _est_tuple,
                            _loss, _pooled_reference)

import gns_kernels as gk
from gns_kernels.distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook


class _BranchNet(_Net):
    """The scenarios' _Net with a branch d beside c, used only when ``branch``."""

    def __init__(self):
        super().__init__()
        self.d = torch.nn.Linear(MID, OUT)  # the branch

    def forward(self, x, branch: bool):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        out = self.c(h)
        return out + self.d(h) if branch else out


def takes_branch(rank: int, step: int, micro: int, A: int) -> bool:
    if step == 3:
        return False
    if rank != 1:
        return True
    if step == 0:
        return False
    if step == 1:
        return micro < A - 1
    if step == 2:
        return micro == A - 1
    return True


def _zeros_for_none(params):
    return [torch.zeros(p.shape) if p.grad is None else p.grad.detach().float().clone()
            for p in params]


def run_unused(rank, world, *, geometry="l1", accumulate=1, micro=False, steps=5, as_view=False):
    torch.manual_seed(4321)  # identical on every rank
    base = _BranchNet()
    hooked, plain, local = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(find_unused_parameters=True, bucket_cap_mb=0.001,  # several buckets
              gradient_as_bucket_view=as_view)
    dh, dp = DDP(hooked, **kw), DDP(plain, **kw)
    hp = list(hooked.parameters())
    A = accumulate
    B = LOCAL_BATCH * world * A
    if micro:
        state = MicroBatchGNS(hp, geometry=geometry, every=1, batch_size=B, micro_batches=A)
    else:
        state = GNSHookState(geometry, every=1, batch_size=B)
    issued = []  # (thread ident, numel, dtype) of every all-reduce the hook issued
    orig = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        issued.append((threading.get_ident(), tensor.numel(), str(tensor.dtype)))
        return orig(tensor, *args, **kwargs)

    dh.register_comm_hook(state, ddp_gns_hook)
    me = threading.get_ident()
    records, history = [], []
    for k in range(steps):
        for m in (hooked, plain, local):
            for p in m.parameters():
                p.grad = None
        samples, acc = [], None
        for a in range(A):
            for p in local.parameters():
                p.grad = None
            x, y = _batch(rank, k, a, torch.float32)
            _loss(lambda t: local(t, takes_branch(rank, k, a, A)), x, y, 1.0 / A).backward()
            gs = _zeros_for_none(local.parameters())
            samples.append([A * t for t in gs])  # the micro-batch's mean gradient
            acc = gs if acc is None else [u + v for u, v in zip(acc, gs)]
        for model, ddp in ((plain, dp), (hooked, dh)):
            n0 = len(issued)
            dist.all_reduce = counting if ddp is dh else orig
            try:
                for a in range(A):
                    x, y = _batch(rank, k, a, torch.float32)
                    br = takes_branch(rank, k, a, A)
                    with ddp.no_sync() if a < A - 1 else contextlib.nullcontext():
                        _loss(lambda t: ddp(t, br), x, y, 1.0 / A).backward()
                    if micro and ddp is dh:
                        state.micro_step()
            finally:
                dist.all_reduce = orig
        payloads = [(n, d) for _, n, d in issued[n0:]]
        threads_ok = all(t == me for t, _, _ in issued[n0:])
        est = _est_tuple(state.estimate)
        if micro:
            allg = _gather([t for s in samples for t in s])
            n_p = len(hp)
            grads = [allg[j][a * n_p:(a + 1) * n_p] for j in range(world) for a in range(A)]
            ref = gk.estimate(grads, batch_size=B, geometry=geometry, **MICRO_ESTIMATE_KW)
        else:
            grads = _gather(acc)
            ref = gk.estimate(grads, batch_size=B, geometry=geometry)
        ref_pooled = None
        if state.pool is not None:
            history.append((grads, B) if ref.valid else None)
            ref_pooled = _pooled_reference(history, geometry, ref.noise)
        none_hooked = [p.grad is None for p in hooked.parameters()]
        none_plain = [p.grad is None for p in plain.parameters()]
        diff = max((float((p.grad - q.grad).abs().max()) for p, q in
                    zip(hooked.parameters(), plain.parameters())
                    if p.grad is not None and q.grad is not None), default=0.0)
        records.append({"est": est, "ref": _est_tuple(ref), "ref_pooled": ref_pooled,
                        "payloads": payloads, "threads_ok": threads_ok,
                        "none_hooked": none_hooked, "none_plain": none_plain,
                        "grad_vs_plain": diff, "step": k, "estimate_step": state.estimate_step})
    return {"records": records}


def run_many(rank, world, *, scenarios):
    return run_scenarios(run_unused, rank, world, scenarios)


def run_adaptive(rank, world, *, find_unused=True, steps=4, micro=False):
    """The gk.AdaptiveBatching loop (A = 2 micro-batches per rank, then more) under DDP with
    ``find_unused_parameters``: the README's model form (the coordinator attaches a
    GNSHookState), or MicroBatchGNS as the hook state (ranks x micro-batches); returns the
    per-step A and GNS and the final weights."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ddp = DDP(net, find_unused_parameters=find_unused)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 6, generator=g)
    ds = TensorDataset(x, (x @ torch.randn(6, 3, generator=g)
                           + torch.randn(512, 3, generator=g)).argmax(1))
    rows = []
    if micro:
        state = MicroBatchGNS(net.parameters(), geometry="l1", every=1, batch_size=16,
                              micro_batches=2)
        ddp.register_comm_hook(state, ddp_gns_hook)
        coord = gk.AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=16,
                                    max_batch_size=32)
    else:
        coord = gk.AdaptiveBatching(ddp, [opt], micro_batch_size=4, initial_batch_size=16,
                                    max_batch_size=32, every=1)
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=0)
    for _ in coord.steps(max_steps=steps):
        for (xb, yb), sync in coord.micro_batches(loader, ddp):
            with sync:
                (torch.nn.functional.cross_entropy(ddp(xb), yb) / coord.accum_steps).backward()
        A = coord.accum_steps
        opt.step()
        opt.zero_grad()
        coord.step()
        rows.append({"A": A, "gns": coord.metrics()["gns"]})
    return {"rows": rows, "weights": [p.detach().clone() for p in net.parameters()]}


def run_adaptive_both(rank, world, **kw):
    out = {}
    for micro in (False, True):
        for fu in (True, False):
            out[(micro, fu)] = run_adaptive(rank, world, find_unused=fu, micro=micro, **kw)
            dist.barrier()
    return out
