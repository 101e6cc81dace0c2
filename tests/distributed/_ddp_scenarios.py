"""Rank-side code of the DDP hook tests (runs inside the spawned gloo processes).

Each scenario trains nothing (no optimizer step unless stated): it runs a few steps of a
small MLP under DDP with ``gk.ddp_gns_hook`` and, side by side, the same steps under plain
DDP (no hook) and on an unwrapped local copy, and records per step:
  - the hook's estimate and gk.estimate on the all-gathered local gradients (the expected
    value, computed by the estimator, not by the hook),
  - the hooked model's gradients, plain DDP's gradients and the float64 mean of the local
    gradients,
  - collectives: the process group's sequence number advance over the whole step (counts
    every collective, including DDP's own C++ ones) for the hooked and the plain model,
    and the payloads of the all-reduces the hook issued (dist.all_reduce wrapped),
  - the buckets the hook saw (parameter shapes, dtype).
The test module asserts on these records.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import collective_seq as _seq, gather_per_rank as _gather, run_scenarios

import gns_kernels as gk
from gns_kernels.distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook
from gns_kernels.distributed import _share_solve

# The nuclear correction's dof: with ranks as samples the hook's default ('auto') is
# gk.estimate's default ('gauss-sums' at >= 3 samples, else 'columns'); with micro-batches
# as samples the hook keeps 'columns' (no per-micro-batch deviation). Compare like with like.
MICRO_ESTIMATE_KW = {"nuclear_dof": "columns"}

LOCAL_BATCH = 4
IN, HID, MID, OUT = 13, 24, 17, 5


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN, HID)
        self.b = torch.nn.Linear(HID, MID)
        self.c = torch.nn.Linear(MID, OUT, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _model(dtype):
    torch.manual_seed(1234)  # identical on every rank
    return _Net().to(dtype)


def _batch(rank: int, step: int, micro: int, dtype, nan: bool = False):
    g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * micro + rank)
    x = torch.randn(LOCAL_BATCH, IN, generator=g).to(dtype)
    y = torch.randn(LOCAL_BATCH, OUT, generator=g).to(dtype)
    if nan:
        x[0, 0] = float("nan")
    return x, y


def _loss(model, x, y, scale: float = 1.0):
    return F.mse_loss(model(x).float(), y.float()) * scale


class _Recorder:
    """Wraps dist.all_reduce (payloads), the hook (buckets) and the nuclear solver (the
    sqrt-traces this rank solved) for counting."""

    def __init__(self):
        self.payloads = []
        self.buckets = []
        self.solved = []  # per solver call: (noise solves, signal solves, matrices)
        self._orig = dist.all_reduce
        self._orig_solve = _share_solve.nuclear_stats

    def __enter__(self):
        rec = self

        def counting_all_reduce(tensor, *args, **kwargs):
            rec.payloads.append((tensor.numel(), str(tensor.dtype)))
            return rec._orig(tensor, *args, **kwargs)

        def counting_solve(mean_grams, *args, request=None, **kwargs):
            # the shared solves (the noise pool's pooled solves call stats.pooled's
            # nuclear_stats: not counted)
            L = len(mean_grams)
            select = None if request is None else request.select
            sel = select if select is not None else ([True] * L, [True] * L)
            rec.solved.append((sum(sel[0]), sum(sel[1]), L))
            return rec._orig_solve(mean_grams, *args, request=request, **kwargs)

        dist.all_reduce = counting_all_reduce
        _share_solve.nuclear_stats = counting_solve
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig
        _share_solve.nuclear_stats = self._orig_solve

    def hook(self, state, bucket):
        self.buckets.append({"index": bucket.index(), "numel": bucket.buffer().numel(),
                             "dtype": str(bucket.buffer().dtype),
                             "shapes": [tuple(p.shape) for p in bucket.parameters()],
                             "ids": [id(p) for p in bucket.parameters()]})
        return ddp_gns_hook(state, bucket)




def _est_tuple(e):
    if e is None:
        return None
    return (e.gns, e.noise, e.signal, e.valid, getattr(e, "nuclear_dof", None),
            getattr(e, "signal_raw", None), getattr(e, "noise_pooled", None))


def nuclear_ref64(samples, B, bias_correction=True) -> tuple:
    """An independent float64 reference of the nuclear noise and signal: samples[j][l] the
    2-D gradients of sample j; per matrix l on its smaller side, C_l = B / (R - 1) (mean_j
    G_j G_j^T - G G^T) and float64 eigvalsh; the noise corrected with the 'columns' dof
    (stats.bias.nuclear_sqrt_trace_corrected) when bias_correction; the signal the float64
    singular values of the mean G. Returns ((sum_l tr C_l^{1/2})^2, (sum_l ||G_l||_S1)^2)."""
    from gns_kernels.spectral import smaller_side
    from gns_kernels.stats.bias import nuclear_sqrt_trace_corrected

    R = len(samples)
    scale = B / (R - 1)
    nsum = ssum = 0.0
    for l in range(len(samples[0])):
        xs = [s_[l].double() for s_ in samples]
        row = smaller_side(tuple(xs[0].shape)) == "row"
        gram = (lambda x: x @ x.T) if row else (lambda x: x.T @ x)
        G = torch.stack(xs).mean(0)
        C = scale * (torch.stack([gram(x) for x in xs]).mean(0) - gram(G))
        lam = torch.linalg.eigvalsh(C)
        other = xs[0].shape[1] if row else xs[0].shape[0]
        if bias_correction:
            nsum += float(nuclear_sqrt_trace_corrected(lam, R, B, other_dim=other, dof_model="columns"))
        else:
            nsum += float(lam.clamp_min(0).sqrt().sum())
        ssum += float(torch.linalg.svdvals(G).sum())
    return nsum ** 2, ssum ** 2


def _pooled_reference(history, geometry, ref_noise):
    """The noise pool's expected noise_pooled after the measurements in ``history``
    (gns_kernels.reference.pooled_noise, float64, beta 0.9): l1 (sum of the per-parameter
    pooled ||s||_1)^2; nuclear (sum of the per-matrix pooled tr P^{1/2})^2, where a matrix
    without a pair yet (the first measurement) takes the measurement's own corrected
    noise (ref_noise: gk.estimate's, every matrix new at once)."""
    vals = gk.reference.pooled_noise(history, geometry, 0.9)[-1]
    if not vals:
        return float("nan")
    if geometry == "nuclear" and all(v != v for v in vals):
        return ref_noise
    return sum(vals) ** 2




def run_hook(rank, world, *, geometry="l1", dtype="float32", steps=4, every=2, shift=None,
             subset=False, bias_correction=True, bucket_cap_mb=0.001, accumulate=1,
             as_view=False, static_graph=False, nan_at=None, micro=False, nuclear_dof=None,
             signal="raw", method=None, delay=None):
    """method: the hook state's (None: its default); delay: seconds the host route's job
    sleeps before each matrix (spectral.host._DELAY; None: no delay), for the lag tests
    (tests/distributed/test_host_lag.py), whose records also carry the estimate's step and
    available step and a float64 reference (``ref64``)."""
    from gns_kernels.spectral import host as _host

    _host._DELAY = None if delay is None else (lambda i: delay)
    try:
        return _run_hook(rank, world, geometry=geometry, dtype=dtype, steps=steps, every=every,
                         shift=shift, subset=subset, bias_correction=bias_correction,
                         bucket_cap_mb=bucket_cap_mb, accumulate=accumulate, as_view=as_view,
                         static_graph=static_graph, nan_at=nan_at, micro=micro,
                         nuclear_dof=nuclear_dof, signal=signal, method=method)
    finally:
        _host._DELAY = None


def _run_hook(rank, world, *, geometry, dtype, steps, every, shift, subset, bias_correction,
              bucket_cap_mb, accumulate, as_view, static_graph, nan_at, micro, nuclear_dof,
              signal, method):
    dtype = getattr(torch, dtype)
    base = _model(dtype)
    hooked, plain, local = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    ddp_kw = dict(bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view, static_graph=static_graph)
    dh = DDP(hooked, **ddp_kw)
    dp = DDP(plain, **ddp_kw)
    hp = list(hooked.parameters())
    names = [n for n, _ in hooked.named_parameters()]
    measured = [p for n, p in zip(names, hp) if p.dim() == 2] if subset else None
    shift_tensors = None
    shift_spec = None
    if shift == "user":
        g = torch.Generator().manual_seed(77)  # identical on every rank
        shift_tensors = [0.05 * torch.randn(p.shape, generator=g).to(dtype) for p in hp]
        table = {p: s for p, s in zip(hp, shift_tensors)}
        shift_spec = lambda p: table.get(p)  # noqa: E731
    elif shift == "last":
        shift_spec = "last"
    B = LOCAL_BATCH * world * accumulate
    extra = dict(signal=signal)
    if nuclear_dof is not None:
        extra["nuclear_dof"] = nuclear_dof
    if method is not None:
        extra["method"] = method
    if micro:
        state = MicroBatchGNS(hp, geometry=geometry, every=every, batch_size=B,
                              micro_batches=accumulate, bias_correction=bias_correction, **extra)
    else:
        state = GNSHookState(geometry, every=every, batch_size=B, shift=shift_spec,
                             params=measured, bias_correction=bias_correction, **extra)
    rec = _Recorder()
    dh.register_comm_hook(state, rec.hook)
    records = []
    last_mean = None
    history = []  # (rank gradients, B) of every measurement (None: invalid), for the pool
    for k in range(steps):
        for m in (hooked, plain, local):
            for p in m.parameters():
                p.grad = None
        nan = nan_at is not None and k == nan_at and rank == world - 1
        # local copy: the per-rank (and per-micro-batch) gradients, for the expectation
        samples = []
        acc = None
        for a in range(accumulate):
            for p in local.parameters():
                p.grad = None
            x, y = _batch(rank, k, a, dtype, nan)
            _loss(local, x, y, 1.0 / accumulate).backward()
            gs = [p.grad.detach().clone() for p in local.parameters()]
            samples.append([accumulate * t.float() for t in gs])  # micro-batch mean gradient
            acc = gs if acc is None else [u + v for u, v in zip(acc, gs)]
        # plain DDP
        s0 = _seq()
        for a in range(accumulate):
            x, y = _batch(rank, k, a, dtype, nan)
            ctx = dp.no_sync() if a < accumulate - 1 else contextlib.nullcontext()
            with ctx:
                _loss(dp, x, y, 1.0 / accumulate).backward()
        plain_seq = _seq() - s0
        # hooked DDP
        measuring = state.is_measurement_step()
        n_buckets0, n_payload0, n_solved0 = len(rec.buckets), len(rec.payloads), len(rec.solved)
        s0 = _seq()
        with rec:
            for a in range(accumulate):
                x, y = _batch(rank, k, a, dtype, nan)
                ctx = dh.no_sync() if a < accumulate - 1 else contextlib.nullcontext()
                with ctx:
                    _loss(dh, x, y, 1.0 / accumulate).backward()
                if micro:
                    state.micro_step()
        hooked_seq = _seq() - s0
        buckets = rec.buckets[n_buckets0:]
        payloads = rec.payloads[n_payload0:]
        solved = rec.solved[n_solved0:]
        e = state.estimate if measuring else None  # the first read: after backward
        est = _est_tuple(e)
        est_steps = None if e is None else (e.step, e.available_step)
        # expectation from the gathered local gradients
        if micro:
            mine = [t for s in samples for t in s]
            allg = _gather(mine)
            n_p = len(hp)
            rank_grads = [allg[j][a * n_p:(a + 1) * n_p] for j in range(world) for a in range(accumulate)]
        else:
            rank_grads = _gather(acc)  # each rank's local (accumulated) mean gradient
        mean64 = [torch.stack([rg[p].double() for rg in rank_grads]).mean(0) for p in range(len(hp))]
        idx = [i for i, n in enumerate(names) if (not subset or hp[i].dim() == 2)]
        sel = [[rg[i] for i in idx] for rg in rank_grads]
        ref_shift = None
        if shift == "user":
            ref_shift = [shift_tensors[i] for i in idx]
        elif shift == "last" and last_mean is not None:
            ref_shift = [last_mean[i] for i in idx]
        ref = ref64 = None
        if measuring:
            try:
                kw = dict(MICRO_ESTIMATE_KW) if micro else ({"nuclear_dof": nuclear_dof} if nuclear_dof else {})
                ref = gk.estimate(sel, batch_size=B, geometry=geometry, bias_correction=bias_correction,
                                  shift=ref_shift, signal=signal, **kw)
            except Exception as exc:  # recorded, asserted in the parent
                ref = repr(exc)
            if method is not None and geometry == "nuclear" and ref_shift is None:
                ref64 = nuclear_ref64([[t for t in s_ if t.dim() == 2] for s_ in sel], B, bias_correction)
            if shift == "last":
                last_mean = [p.grad.detach().float().clone() for p in hp]
        ref_pooled = None
        if measuring and state.pool is not None and not isinstance(ref, str):
            history.append((sel, B) if ref.valid else None)
            ref_pooled = _pooled_reference(history, geometry, ref.noise)
        records.append({
            "ref_pooled": ref_pooled,
            "step": k,
            "measuring": measuring,
            "state_step": state.step,
            "estimate_step": state.estimate_step,
            "available_step": getattr(state, "estimate_available_step", None),
            "lagged_step": getattr(state, "lagged_step", None),
            "est": est,
            "est_steps": est_steps,
            "ref64": ref64,
            "solved": solved,
            "hints": state.eig_hints.state_dict() if measuring else None,
            "ref": _est_tuple(ref) if not isinstance(ref, str) and ref is not None else ref,
            "grad_vs_mean": max(float((p.grad.double() - m).abs().max()) for p, m in zip(hp, mean64)),
            "grad_scale": max(float(m.abs().max()) for m in mean64),
            "grad_vs_plain": max(float((p.grad.double() - q.grad.double()).abs().max())
                                 for p, q in zip(hp, plain.parameters())),
            "plain_seq": plain_seq,
            "hooked_seq": hooked_seq,
            "buckets": [{kk: v for kk, v in b.items() if kk != "ids"} for b in buckets],
            "measured_in_bucket": [[(not subset or s_ is None or len(s_) == 2) for s_ in b["shapes"]]
                                   for b in buckets],
            "payloads": payloads,
        })
    return {"records": records}


def run_many(rank, world, *, scenarios):
    """Run several run_hook scenarios in one process group: {name: result}."""
    return run_scenarios(run_hook, rank, world, scenarios)


class _LoggingMicroBatchGNS(MicroBatchGNS):
    """Logs the public hook-protocol calls the DDP hook makes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def micro_batches_for_sync(self):
        self.calls.append(("micro_batches_for_sync", self.step))
        return super().micro_batches_for_sync()

    def accepts_samples(self, num_samples):
        self.calls.append(("accepts_samples", self.step, num_samples))
        return super().accepts_samples(num_samples)

    def end_sync(self):
        self.calls.append(("end_sync", self.step))
        super().end_sync()

    def plan(self):
        if hasattr(self, "calls"):  # (the constructor asks for one too)
            self.calls.append(("plan", self.step))
        return super().plan()

    def record(self, sums):
        self.calls.append(("record", sums.step, sums.num_samples))
        super().record(sums)


def _protocol_calls(rank, A=2, steps=3):
    model = _model(torch.float32)
    ddp = DDP(model)
    mb = _LoggingMicroBatchGNS(list(model.parameters()), geometry="l2", every=2,
                               batch_size=LOCAL_BATCH * A, micro_batches=A)
    ddp.register_comm_hook(mb, ddp_gns_hook)
    for step in range(steps):
        ddp.zero_grad(set_to_none=True)
        for a in range(A):
            x, y = _batch(rank, step, a, torch.float32)
            with (ddp.no_sync() if a < A - 1 else contextlib.nullcontext()):
                _loss(ddp, x, y, 1.0 / A).backward()
            mb.micro_step()
    return mb.calls


def run_one_rank_edges(rank, world):
    """One rank: MicroBatchGNS with 1 micro-batch skips (warns), GNSHookState raises."""
    import warnings

    model = _model(torch.float32)
    ddp = DDP(model)
    mb = MicroBatchGNS(list(model.parameters()), geometry="l1", every=1, batch_size=LOCAL_BATCH,
                       micro_batches=1)
    ddp.register_comm_hook(mb, ddp_gns_hook)
    x, y = _batch(rank, 0, 0, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(ddp, x, y).backward()
        mb.micro_step()
    out = {"warned": [str(w.message) for w in caught if "1 sample" in str(w.message)],
           "estimate": mb.estimate, "step": mb.step}
    out["protocol"] = _protocol_calls(rank)
    plain = DDP(_model(torch.float32))
    plain.register_comm_hook(GNSHookState("l1", batch_size=LOCAL_BATCH), ddp_gns_hook)
    try:
        _loss(plain, x, y).backward()
        out["error"] = None
    except Exception as exc:  # the hook's ValueError, surfaced by DDP
        out["error"] = str(exc)
    return out


def run_micro_failure(rank, world, *, A=3, steps=3, fail_rank=1):
    """MicroBatchGNS as the DDP hook state; on ``fail_rank`` the first micro_step of step 0
    raises (a simulated out-of-memory in the accumulation op). Runs the same steps with a
    second, failure-free model for comparison; returns per step the estimates and the
    largest gradient difference between the two runs."""
    from gns_kernels import ops

    def run(fail: bool):
        model = _model(torch.float32)
        ddp = DDP(model)
        mb = MicroBatchGNS(list(model.parameters()), geometry="l1", every=1,
                           batch_size=LOCAL_BATCH * world * A, micro_batches=A)
        ddp.register_comm_hook(mb, ddp_gns_hook)
        real = ops.accumulate_sq_multi
        armed = [fail]

        def flaky(*args, **kwargs):
            if armed[0]:
                armed[0] = False
                raise RuntimeError("out of memory (simulated)")
            return real(*args, **kwargs)

        ops.accumulate_sq_multi = flaky
        records, raised = [], 0
        try:
            for step in range(steps):
                ddp.zero_grad(set_to_none=True)
                for a in range(A):
                    x, y = _batch(rank, step, a, torch.float32)
                    with (ddp.no_sync() if a < A - 1 else contextlib.nullcontext()):
                        _loss(ddp, x, y, 1.0 / A).backward()
                    try:
                        mb.micro_step()
                    except RuntimeError as exc:
                        assert "simulated" in str(exc)
                        raised += 1
                records.append({"est": _est_tuple(mb.estimate), "estimate_step": mb.estimate_step,
                                "step": mb.step,
                                "grads": [p.grad.detach().clone() for p in model.parameters()]})
        finally:
            ops.accumulate_sq_multi = real
        return records, raised

    failed, raised = run(rank == fail_rank)
    clean, _ = run(False)
    out = []
    for f, c in zip(failed, clean):
        diff = max(float((a - b).abs().max()) for a, b in zip(f["grads"], c["grads"]))
        out.append({"est": f["est"], "clean_est": c["est"], "estimate_step": f["estimate_step"],
                    "step": f["step"], "grad_diff": diff})
    return {"records": out, "raised": raised}
