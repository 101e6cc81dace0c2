"""Rank-side code of the FSDP2 GNS tests (runs inside the spawned gloo processes).

Each scenario runs a few steps of a small MLP (weights 24x13 tall, 17x24 and 5x17 wide:
uneven dim-0 shards, padding, an empty shard at 4 ranks) as three FSDP2 models
(``fully_shard`` on two layers and the root: three param groups) and records per step:
  - the hooked model's estimate (gk.attach_fsdp_gns), gk.estimate on the all-gathered
    local gradients of an unwrapped copy (the expected value, computed by the estimator,
    not by the hook), and, in float32 scenarios, the DDP hook's estimate on the same
    model, data and seed (gk.ddp_gns_hook);
  - the hooked model's sharded gradients against plain FSDP2's (no hook), bitwise;
  - collectives: the process group's sequence-number advance over the hooked and the
    plain step, and the reduce-scatter / all-reduce calls issued (dist wrapped).
The test module asserts on these records.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import collective_seq as _seq, gather_per_rank as _gather, run_scenarios

import gns_kernels as gk
from gns_kernels.distributed import GNSHookState, ddp_gns_hook
from gns_kernels.distributed.fsdp import _param_groups, attach_fsdp_gns, fsdp_gns_shard_placement

LOCAL_BATCH = 4
IN, HID, MID, OUT = 13, 24, 17, 5


class _Net(torch.nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(IN, HID)
        self.b = torch.nn.Linear(HID, MID)
        self.c = torch.nn.Linear(MID, OUT, bias=False)
        if unused:  # in the root's param group, never gets a gradient
            self.d = torch.nn.Linear(OUT, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _model(unused: bool = False):
    torch.manual_seed(1234)  # identical on every rank
    return _Net(unused)


def _batch(rank: int, step: int, micro: int, nan: bool = False):
    g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * micro + rank)
    x = torch.randn(LOCAL_BATCH, IN, generator=g)
    y = torch.randn(LOCAL_BATCH, OUT, generator=g)
    if nan:
        x[0, 0] = float("nan")
    return x, y


def _loss(model, x, y, scale: float = 1.0):
    return F.mse_loss(model(x).float(), y.float()) * scale


def _shard(model, *, mp, reshard, placement, world):
    kw = {"reshard_after_forward": reshard}
    if mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mp == "bf16_reduce_bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    elif mp == "fp16":  # fp16 reduce: FSDP2 pre-divides the input by a power of two
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    if placement == "gns":
        kw["shard_placement_fn"] = lambda p: fsdp_gns_shard_placement(p, world)
    for sub in (model.a, model.b):
        fully_shard(sub, **kw)
    fully_shard(model, **kw)
    return model


class _Counter:
    """Wraps dist.reduce_scatter_single and dist.all_reduce: (kind, numel, dtype) per call.
    (torch < 2.13 has no reduce_scatter_single, and FSDP2 calls reduce_scatter_tensor: the
    wrapper is installed under both names there, around the original reduce_scatter_tensor,
    and the new name removed after.)"""

    def __init__(self):
        self.calls = []
        self._had_rs = hasattr(dist, "reduce_scatter_single")
        self._rs = dist.reduce_scatter_single if self._had_rs else dist.reduce_scatter_tensor
        self._ar = dist.all_reduce

    def __enter__(self):
        rec = self

        def rs(output, input, *args, **kwargs):
            rec.calls.append(("reduce_scatter", input.numel(), str(input.dtype)))
            return rec._rs(output, input, *args, **kwargs)

        def ar(tensor, *args, **kwargs):
            rec.calls.append(("all_reduce", tensor.numel(), str(tensor.dtype)))
            return rec._ar(tensor, *args, **kwargs)

        dist.reduce_scatter_single = rs
        if not self._had_rs:
            dist.reduce_scatter_tensor = rs
        dist.all_reduce = ar
        return self

    def __exit__(self, *exc):
        if self._had_rs:
            dist.reduce_scatter_single = self._rs
        else:
            del dist.reduce_scatter_single
            dist.reduce_scatter_tensor = self._rs
        dist.all_reduce = self._ar






# Under FSDP2 the nuclear correction's dof is 'columns' (a rank holds only a shard of the
# mean gradient, so its deviation from it is unknown): gk.estimate and the DDP hook it is
# compared with are asked for the same.
_NUCLEAR_DOF = {"nuclear_dof": "columns"}


def _est(e):
    return None if e is None else (e.gns, e.noise, e.signal, e.valid, e.noise_pooled)


def run_fsdp(rank, world, *, geometry="l1", steps=3, every=1, mp="none", reshard=True,
             placement="default", accumulate=1, nan_at=None, subset=False, bias_correction=True,
             force_sum=False, ddp=True, unused=False, reuse_input=True,
             after_remove=False, signal="raw", method=None):
    """method: the hook states' (FSDP2's and the DDP comparison's; None: their default)."""
    extra = {} if method is None else {"method": method}
    base = _model(unused)
    local = copy.deepcopy(base)
    local_dtype = torch.float32
    if mp != "none":  # computes what FSDP2's low-precision unsharded parameters compute
        local_dtype = torch.float16 if mp == "fp16" else torch.bfloat16
        local = local.to(local_dtype)
    hooked = _shard(copy.deepcopy(base), mp=mp, reshard=reshard, placement=placement, world=world)
    plain = _shard(copy.deepcopy(base), mp=mp, reshard=reshard, placement=placement, world=world)
    if force_sum:
        for m in (hooked, plain):
            for sub in m.modules():
                if hasattr(sub, "set_force_sum_reduction_for_comms"):
                    sub.set_force_sum_reduction_for_comms(True)
    names = [n for n, _ in hooked.named_parameters()]
    hp = list(hooked.parameters())
    measured = [p for p in hp if p.dim() == 2] if subset else None
    B = LOCAL_BATCH * world * accumulate
    state = GNSHookState(geometry, every=every, batch_size=B, params=measured,
                         bias_correction=bias_correction, signal=signal, **extra)
    handle = attach_fsdp_gns(hooked, state, reuse_input=reuse_input)
    ddp_model = ddp_state = None
    if ddp:
        ddp_model = DDP(copy.deepcopy(base), bucket_cap_mb=0.001)
        dmeasured = [p for p in ddp_model.parameters() if p.dim() == 2] if subset else None
        ddp_state = GNSHookState(geometry, every=every, batch_size=B, params=dmeasured,
                                 bias_correction=bias_correction, signal=signal, **_NUCLEAR_DOF, **extra)
        ddp_model.register_comm_hook(ddp_state, ddp_gns_hook)
    groups = len(handle.reduce_scatters)
    hp_all = hp
    hp = [p for n, p in zip(names, hp_all) if not n.startswith("d.")]  # parameters with a gradient
    plain_params = [q for n, q in zip(names, plain.parameters()) if not n.startswith("d.")]
    records = []
    history = []  # (rank gradients, B) of every measurement (None: invalid), for the pool
    for k in range(steps):
        nan = nan_at is not None and k == nan_at and rank == world - 1
        for m in (hooked, plain, local):
            for p in m.parameters():
                p.grad = None
        # local copy: each rank's local (accumulated) mean gradient, for the expectation
        acc = None
        for a in range(accumulate):
            for p in local.parameters():
                p.grad = None
            x, y = _batch(rank, k, a, nan)
            _loss(local, x.to(local_dtype), y, 1.0 / accumulate).backward()
            gs = [p.grad.detach().clone() for p in local.parameters() if p.grad is not None]
            acc = gs if acc is None else [u + v for u, v in zip(acc, gs)]
        # plain FSDP2
        s0 = _seq()
        with _Counter() as plain_calls:
            for a in range(accumulate):
                plain.set_requires_gradient_sync(a == accumulate - 1)
                x, y = _batch(rank, k, a, nan)
                _loss(plain, x, y, 1.0 / accumulate).backward()
        plain_seq = _seq() - s0
        # hooked FSDP2
        measuring = state.is_measurement_step()
        s0 = _seq()
        with _Counter() as hooked_calls:
            for a in range(accumulate):
                hooked.set_requires_gradient_sync(a == accumulate - 1)
                x, y = _batch(rank, k, a, nan)
                _loss(hooked, x, y, 1.0 / accumulate).backward()
        hooked_seq = _seq() - s0
        est = _est(state.estimate) if measuring else None
        # DDP hook on the same data (float32 only)
        ddp_est = None
        if ddp_model is not None:
            for p in ddp_model.parameters():
                p.grad = None
            for a in range(accumulate):
                x, y = _batch(rank, k, a, nan)
                if a < accumulate - 1:
                    with ddp_model.no_sync():
                        _loss(ddp_model, x, y, 1.0 / accumulate).backward()
                else:
                    _loss(ddp_model, x, y, 1.0 / accumulate).backward()
            ddp_est = _est(ddp_state.estimate) if measuring else None
        # expectation from the gathered local gradients
        rank_grads = _gather(acc)
        idx = [i for i, p in enumerate(hp) if not subset or p.dim() == 2]
        ref = ref_pooled = None
        if measuring:
            sel = [[rg[i] for i in idx] for rg in rank_grads]
            ref = _est(gk.estimate(sel, batch_size=B, geometry=geometry, bias_correction=bias_correction,
                                   signal=signal, **_NUCLEAR_DOF))
            if state.pool is not None:
                from _ddp_scenarios import _pooled_reference
                history.append((sel, B) if ref[3] else None)
                ref_pooled = _pooled_reference(history, geometry, ref[1])
        mean64 = [torch.stack([rg[i].double() for rg in rank_grads]).mean(0) for i in range(len(hp))]
        full = [p.grad.full_tensor().double() for p in hp]
        records.append({
            "step": k,
            "measuring": measuring,
            "state_step": state.step,
            "estimate_step": state.estimate_step,
            "available_step": getattr(state, "estimate_available_step", None),
            "ddp_steps": None if ddp_state is None else (ddp_state.estimate_step,
                                                         getattr(ddp_state, "estimate_available_step", None)),
            "est": est,
            "ref": ref,
            "ref_pooled": ref_pooled,
            "ddp": ddp_est,
            "grad_equal_plain": all(torch.equal(p.grad.to_local(), q.grad.to_local())
                                    for p, q in zip(hp, plain_params)),
            "grad_vs_plain": max(float((p.grad.to_local().double() - q.grad.to_local().double()).abs().max())
                                 if p.grad.to_local().numel() else 0.0
                                 for p, q in zip(hp, plain_params)),
            "grad_vs_mean": max(float((f - m).abs().max()) for f, m in zip(full, mean64)),
            "grad_scale": max(float(m.abs().max()) for m in mean64),
            # max_i mean_j |g^j_i|: bounds the reassociation error of the R-term sum
            "abs_scale": max(float(torch.stack([rg[i].double().abs() for rg in rank_grads]).mean(0).max())
                             for i in range(len(hp))),
            "plain_seq": plain_seq,
            "hooked_seq": hooked_seq,
            "plain_calls": plain_calls.calls,
            "hooked_calls": hooked_calls.calls,
        })
    twice = None
    if after_remove:  # a state drives one model at a time
        try:
            attach_fsdp_gns(hooked, state)
        except ValueError as exc:
            twice = str(exc)
    handle.remove()
    after = None
    if after_remove:  # one more backward: plain FSDP2 again, the state untouched
        step_before = state.step
        for p in hooked.parameters():
            p.grad = None
        x, y = _batch(rank, steps, 0)
        with _Counter() as calls:
            _loss(hooked, x, y).backward()
        comms = [type(pg._reduce_scatter_comm).__name__ for m in hooked.modules()
                 if hasattr(m, "_get_fsdp_state") for pg in _param_groups(m)]
        wrapped = [m.__class__.__name__ for m in hooked.modules() if hasattr(m, "_get_fsdp_state")
                   for pg in _param_groups(m) if "post_backward" in vars(pg)]
        attach_fsdp_gns(hooked, state).remove()  # attachable again after remove()
        after = {"calls": calls.calls, "step_unchanged": state.step == step_before, "comms": comms,
                 "twice": twice, "wrapped_after_remove": wrapped}
    return {"after_remove": after, "records": records, "groups": groups, "names": names, "packed_in_place": handle.packed_in_place,
            "placements": [str(p.placements[0]) for p in hp_all],
            "unused_grad_is_none": all(p.grad is None for n, p in zip(names, hp_all) if n.startswith("d."))}


def run_many(rank, world, *, scenarios):
    return run_scenarios(run_fsdp, rank, world, scenarios)
