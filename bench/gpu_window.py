"""The Python phases of the GPU window (bench/gpu_window.sh runs them, one process each).

    python bench/gpu_window.py smoke [--device cuda]             # import, one op of each kind
    python bench/gpu_window.py s1 [--device cuda] [--tiny]       # S1 per rank through the DDP hook
    python bench/gpu_window.py fused [--device cuda] [--tiny]    # fused kernels against the floor
    python bench/gpu_window.py accuracy [--device cuda] [--tiny] # S1 against float64, steep spectra

Each phase prints its full log and, as soon as a figure is known, one summary row per
figure: a line ``@@ | phase | measurement | value | target / paper |`` that the shell
script collects into the window's summary table (so a phase cut by the deadline keeps
the rows it printed). A part that the package at this commit does not offer, or that the
deadline leaves no time for, prints ``skipped: <what>: <why>`` (and a row saying so).

Deadline: GPU_WINDOW_END (epoch seconds, the whole window) and GPU_WINDOW_PHASE_END (this
phase's share) bound the loops; a part that would not fit is skipped, not cut.

The S1 phase (one GPU plays each of R = 8 ranks in turn; the paper's 160M Llama shapes,
84 matrices: 12 x q, k, v, o 768x768, gate, up 2048x768, down 768x2048), the key figure
first:

1. the real DDP hook per rank, noise pool on, the device's default solver (Newton on
   CUDA): ``torch.distributed``'s 'fake' process group (world size R, this process as rank
   r; DDP's own collectives do nothing) and ``dist.all_reduce`` replaced by a completed
   future, so ``gk.ddp_gns_hook`` packs the Grams, solves rank r's share and reads the
   estimate exactly as it would on rank r, with no network. A model holding the 84
   matrices (a cheap forward through all of them) with ``bucket_cap_mb`` set to one
   layer's matrices (12 buckets; the count is reported). Per rank: the measuring step's
   backward + estimate read minus a non-measuring hooked step's (``every`` = 1 vs never),
   medians: GPU time by CUDA events, host time (synchronized wall clock) and peak memory;
   the busiest rank's host figure goes to Table 9's 8-rank prediction (``@@S1RANK``);
2. the same for every other solver the hook states accept (eigh on CUDA), then pool off;
3. the kernels' own time and count on the busiest rank (torch.profiler, one step);
4. the share alone (what bench/bench_share_gpu.py timed on the first H100 run).

The accuracy phase (last: the least urgent): the hooks' shared solve of 8 simulated ranks
and the real DDP hook on a 1-rank group with MicroBatchGNS over 8 micro-batches of
injected gradients, against ``gk.estimate(..., dtype=float64)`` on the same device, on
gradients whose singular values span 6 decades; ``gk.sqrt_trace`` with each method
('newton-tf32' included: the hooks refuse it) against float64 eigvalsh, timed; and
``gk.nuclear_stats`` with 'newton-tf32' against 'newton'.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fused_gpu_common import LLAMA_160M_SHAPES, copy_of, make_inputs, op_bytes  # noqa: E402

LLAMA = LLAMA_160M_SHAPES
PER_LAYER = 7  # matrices per layer: q, k, v, o, gate, up, down


# ----------------------------------------------------------------------------- plumbing
def left() -> float:
    """Seconds before the earlier of the window's and this phase's deadline."""
    ends = [float(os.environ[k]) for k in ("GPU_WINDOW_END", "GPU_WINDOW_PHASE_END") if os.environ.get(k)]
    return (min(ends) - time.time()) if ends else math.inf


def row(phase: str, what: str, value: str, target: str = "") -> None:
    """One summary row (collected by gpu_window.sh)."""
    print(f"@@ | {phase} | {what} | {value} | {target} |", flush=True)


def skip(phase: str, what: str, why: str) -> None:
    print(f"skipped: {what}: {why}", flush=True)
    row(phase, what, f"skipped: {why}")


def failed(phase: str, what: str, exc: BaseException) -> None:
    """A part that raised: its traceback in the log, a row, and the phase goes on."""
    import traceback

    traceback.print_exc()
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    print(f"FAILED: {what}: {type(exc).__name__}: {first}", flush=True)
    row(phase, what, f"FAILED: {type(exc).__name__}: {first}")


def fits(phase: str, what: str, need_s: float) -> bool:
    """False (with a skip line) when fewer than need_s seconds are left."""
    t = left()
    if t < need_s:
        skip(phase, what, f"deadline ({t:.0f} s left, needs about {need_s:.0f} s)")
        return False
    return True


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


# ----------------------------------------------------------------------------- smoke
def smoke(dev: str) -> int:
    """Import, then one op of each kind on ``dev`` against reference.py (float64)."""
    t0 = time.time()
    import gns_kernels as gk
    from gns_kernels import ops, reference, spectral

    print(f"import gns_kernels {getattr(gk, '__version__', '?')}: {time.time() - t0:.2f} s; "
          f"C++ extension: {ops.cpp_available()}", flush=True)
    cuda_cpp = ops.cpp_available() and "cuda/binding.cpp" in torch._C._dispatch_dump("gns_kernels::variance_norms")
    print(f"CUDA C++ kernels built in: {cuda_cpp}", flush=True)
    try:
        import triton
        print(f"triton {triton.__version__}", flush=True)
    except ImportError as exc:
        print(f"triton: not importable ({exc})", flush=True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    checks = []

    def check(name, fn):
        try:
            err = float(fn())
            ok = math.isfinite(err) and err < 1e-4
            checks.append(ok)
            print(f"{name}: {'ok' if ok else 'MISMATCH'} (rel err {err:.1e})", flush=True)
        except Exception as exc:  # noqa: BLE001  (a smoke test reports every failure)
            checks.append(False)
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})", flush=True)

    def err(a, b):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        return (a - b).norm() / b.norm().clamp_min(1e-300)

    d, q, s = rnd(1000), rnd(1000).abs() + 1, rnd(1000)
    check("variance_norms", lambda: err(gk.variance_norms(d, q, 3.0), reference.variance_norms(d, q, 3.0)))
    check("variance_norms_multi", lambda: err(
        gk.variance_norms_multi([d, s], [q, q], 3.0),
        reference.variance_norms(d, q, 3.0) + reference.variance_norms(s, q, 3.0)))
    out = torch.empty(2000, device=dev)
    check("square_pack", lambda: err(gk.square_pack(d, out, s), reference.square_pack(d, s)))

    def sp_multi():
        o1, o2 = torch.empty(2000, device=dev), torch.empty(2000, device=dev)
        gk.square_pack_multi([d, s], [o1, o2])
        return err(torch.cat([o1, o2]), torch.cat([reference.square_pack(d), reference.square_pack(s)]))

    check("square_pack_multi", sp_multi)

    def acc(multi):
        prev, sq = rnd(1000), rnd(1000).abs()
        want, _ = reference.accumulate_sq(d, prev, sq)
        if multi:
            gk.accumulate_sq_multi([d], [prev], [sq])
        else:
            gk.accumulate_sq(d, prev, sq)
        return err(sq, want)

    check("accumulate_sq", lambda: acc(False))
    check("accumulate_sq_multi", lambda: acc(True))
    G = rnd(48, 80)
    check("gram", lambda: err(gk.gram([G])[0], reference.gram(G)))
    A = G @ G.T / 80
    check("sqrt_trace", lambda: err(gk.sqrt_trace(A), reference.sqrt_trace(A)))
    samples = [rnd(24, 40) for _ in range(4)]
    mean = sum(samples) / 4
    grams = [sum(x @ x.T for x in samples) / 4]
    check("nuclear_stats", lambda: err(
        torch.stack(spectral.nuclear_stats(grams, [mean], 16 / 3)),
        torch.stack(reference.nuclear_stats([samples], 16))))
    rank_grads = [[rnd(30), rnd(6, 5)] for _ in range(4)]

    def est():
        a = gk.estimate(rank_grads, batch_size=16, geometry="l1", dtype=torch.float32)
        b = gk.estimate(rank_grads, batch_size=16, geometry="l1")
        return rel(a.gns, b.gns)

    check("estimate (l1, float32 vs float64)", est)
    n_ok = sum(checks)
    row("build", f"one op of each kind on {dev} vs reference.py", f"{n_ok}/{len(checks)} ok",
        f"all; CUDA C++ kernels built: {cuda_cpp}")
    return 0 if n_ok == len(checks) else 1


# ----------------------------------------------------------------------------- S1
class _Done:
    """A finished all-reduce: the tensor, unchanged."""

    def __init__(self, t):
        self.f = torch.futures.Future()
        self.f.set_result([t])

    def get_future(self):
        return self.f

    def wait(self):
        return True


def _all_reduce(t, group=None, async_op=True, **_):
    return _Done(t)


class _Summing:
    """An all-reduce over ranks played in turn: ``__call__`` keeps each rank's tensor and
    hands out a pending future; ``finish()`` sums them (in rank order), writes the sum
    into every rank's tensor (the real all-reduce is in place) and completes the futures."""

    def __init__(self):
        self.items = []

    def __call__(self, t, group=None, async_op=True, **_):
        f = torch.futures.Future()
        self.items.append((t, f))
        work = type("Work", (), {"get_future": lambda self_: f, "wait": lambda self_: True})()
        return work

    def finish(self, dev: str) -> None:
        sync(dev)
        total = sum(t for t, _ in self.items)
        for t, f in self.items:
            t.copy_(total)
            f.set_result([t])
        self.items = []


def _gram(x):
    return x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x


def share_inputs(shapes, seed, dev):
    """(mean Grams, mean gradients, this rank's deviations) of one measurement (timing data)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    Ds = [torch.randn(m, n, generator=g, device=dev) / n ** 0.5 for m, n in shapes]
    devs = [0.3 * torch.randn(m, n, generator=g, device=dev) / n ** 0.5 for m, n in shapes]
    return [_gram(D) + _gram(d) for D, d in zip(Ds, devs)], Ds, devs


class Ranks:
    """R simulated ranks of one configuration: each rank's noise pool (or none) and the one
    matrix -> owner assignment, kept across measurements as the hooks keep them.
    ``buckets``: the matrices are added in that many consecutive groups (DDP buckets)."""

    def __init__(self, R: int, B: int, scale: float, pooled: bool, method: str = "auto", buckets: int = 1):
        from gns_kernels.stats import NoisePool

        self.R, self.B, self.scale, self.method, self.buckets = R, B, scale, method, buckets
        self.owners = {} if pooled else None
        self.pools = [NoisePool(0.9) if pooled else None for _ in range(R)]

    def share(self, r: int, inputs, dof: str = "gauss-sums"):
        """Rank r's SolveShare with every bucket added (not launched)."""
        from gns_kernels.distributed._share import SolveShare

        mg, Ds, devs = inputs
        sh = SolveShare(self.R, r, self.scale, True, self.R, float(self.B), method=self.method,
                        dof=dof, pool=self.pools[r], owners=self.owners)
        L = len(mg)
        step = -(-L // self.buckets)
        for a in range(0, L, step):
            sh.add_grads(mg[a:a + step], Ds[a:a + step], None, devs[a:a + step], list(range(a, min(L, a + step))))
        return sh

    def measure(self, r: int, inputs) -> None:
        """Rank r's share of one measurement: add_grads, launch, read (the hooks' calls)."""
        sh = self.share(r, inputs)
        sh.launch(None, _all_reduce)
        sh.read()


def share_times(dev, R, reps, shapes, pooled, buckets=1, sets=None):
    """{rank: [seconds per measurement]} of R ranks played in turn (2 warm-up rounds)."""
    B = 8 * R
    ranks = Ranks(R, B, B / (R - 1), pooled, buckets=buckets)
    sets = sets or [share_inputs(shapes, s, dev) for s in range(3)]
    times = {r: [] for r in range(R)}
    for rep in range(reps + 2):
        for r in range(R):
            sync(dev)
            t0 = time.perf_counter()
            ranks.measure(r, sets[rep % len(sets)])
            sync(dev)
            if rep >= 2:
                times[r].append(time.perf_counter() - t0)
    return times


def _steep(m, n, gen, dev, decades):
    """An m x n float64 matrix with singular values 10^(-decades * i / (k - 1)), random
    singular vectors."""
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, device=dev, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, device=dev, dtype=torch.float64))
    s = 10.0 ** (-decades * torch.arange(k, device=dev, dtype=torch.float64) / max(k - 1, 1))
    return (U * s) @ V.T


def s1_accuracy(dev, R, shapes, decades=6.0):
    """Relative errors (noise, signal, gns) of the hooks' shared solve against
    gk.estimate(float64) on rank gradients with steep spectra."""
    import gns_kernels as gk

    gen = torch.Generator(device=dev).manual_seed(7)
    B = 8 * R
    signal = [_steep(m, n, gen, dev, decades) for m, n in shapes]
    ranks = [[(S + 0.3 * _steep(m, n, gen, dev, decades)).float() for S, (m, n) in zip(signal, shapes)]
             for _ in range(R)]
    ref = gk.estimate(ranks, batch_size=B, geometry="nuclear",  # float64 on the same device
                      bias_correction=True, dtype=torch.float64, nuclear_dof="gauss-sums")
    mean = [sum(g[l] for g in ranks) / R for l in range(len(shapes))]
    mgram = [sum(_gram(g[l]) for g in ranks) / R for l in range(len(shapes))]
    sim = Ranks(R, B, B / (R - 1), pooled=False, buckets=max(1, len(shapes) // PER_LAYER))
    red = _Summing()
    shares = []
    for r in range(R):
        sh = sim.share(r, (mgram, mean, [ranks[r][l] - mean[l] for l in range(len(shapes))]))
        sh.launch(None, red)
        shares.append(sh)
    red.finish(dev)
    noise, sig, _ = shares[0].read()
    got_gns = noise ** 2 / sig ** 2
    return rel(noise, math.sqrt(ref.noise)), rel(sig, math.sqrt(ref.signal)), rel(got_gns, ref.gns)


class _Injected(torch.nn.Module):
    """Matrices whose gradient on micro-batch a is exactly grads[a] (loss sum(W * grads[a]))."""

    def __init__(self, shapes, grads, device):
        super().__init__()
        self.mats = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(m, n, device=device))
                                            for m, n in shapes])
        self.grads = grads

    def forward(self, a: int):
        return sum((W * G).sum() for W, G in zip(self.mats, self.grads[a]))


def hook_accuracy(dev, shapes, A=8, decades=6.0):
    """Relative errors (noise, signal, gns) of the real DDP hook's estimate on a 1-rank
    group (gloo on CPU, NCCL on CUDA) with MicroBatchGNS over A micro-batches whose
    gradients are injected exactly (steep spectra), against gk.estimate(float64) over the
    same micro-batch gradients ('columns' dof, as MicroBatchGNS)."""
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gns_kernels as gk

    gen = torch.Generator(device=dev).manual_seed(11)
    signal = [_steep(m, n, gen, dev, decades) for m, n in shapes]
    grads = [[(S + 0.3 * _steep(m, n, gen, dev, decades)).float() for S, (m, n) in zip(signal, shapes)]
             for _ in range(A)]
    B = 8 * A
    ref = gk.estimate(grads, batch_size=B, geometry="nuclear",  # float64 on the same device
                      bias_correction=True, dtype=torch.float64, nuclear_dof="columns")
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl" if dev == "cuda" else "gloo", init_method=f"file://{folder}/store",
                                rank=0, world_size=1)
        try:
            model = _Injected(shapes, grads, dev)
            ddp = DDP(model, bucket_cap_mb=sum(m * n for m, n in shapes) * 4 / 2**20 / 2)
            mb = gk.MicroBatchGNS(list(model.parameters()), geometry="nuclear", every=1, batch_size=B,
                                  micro_batches=A)
            ddp.register_comm_hook(mb, gk.ddp_gns_hook)
            for a in range(A):
                with ddp.no_sync() if a < A - 1 else contextlib.nullcontext():
                    (ddp(a) / A).backward()
                mb.micro_step()
            est = mb.estimate
        finally:
            dist.destroy_process_group()
    return rel(est.noise ** 0.5, ref.noise ** 0.5), rel(est.signal ** 0.5, ref.signal ** 0.5), rel(est.gns, ref.gns)


class Matrices(torch.nn.Module):
    """The 84 matrices of the 160M Llama in 12 layers (no embeddings, norms or attention):
    a cheap forward that gives every matrix a gradient."""

    def __init__(self, shapes, device=None):
        super().__init__()
        self.mats = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(m, n, device=device) / n ** 0.5) for m, n in shapes])

    def forward(self, x):
        W = list(self.mats)
        for i in range(0, len(W), PER_LAYER):
            q, k, v, o, gate, up, down = W[i:i + PER_LAYER]
            x = x + (x @ q.T * torch.sigmoid(x @ k.T) + x @ v.T) @ o.T
            x = x + (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
            x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) * x.shape[-1] ** 0.5
        return x.square().mean()


def _kernel_time(dev, fn):
    """(kernel ms, kernel count) of one call of ``fn`` by torch.profiler: the sum of the
    CUDA kernels' own durations (GPU busy time, not the span); on the CPU the same
    profiler run finds no CUDA kernel: (0.0, 0)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(dev)
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kern) / 1e3, len(kern)


def hook_rank_times(dev, R, reps, shapes, tokens, pooled, state_kw, rank, profile_it=False):
    """Rank ``rank``'s cost through the real DDP hook (fake process group of world size R,
    all-reduce replaced by a completed future): a dict of medians over ``reps`` steps,
    measuring and not (``every`` = 1, then never): host ms (synchronized wall clock of
    backward + estimate read), GPU ms (CUDA events around the same; None on CPU), peak
    memory above the step's start (bytes; None on CPU), the bucket count, and with
    ``profile_it`` the kernels' own ms and count of one step of each kind."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import gns_kernels as gk

    B = 8 * R
    layer_mb = sum(m * n for m, n in shapes[:PER_LAYER]) * 4 / 2**20
    dist.init_process_group("fake", rank=rank, world_size=R, store=FakeStore())
    real_all_reduce = dist.all_reduce
    dist.all_reduce = _all_reduce
    cuda = dev == "cuda"
    try:
        torch.manual_seed(0)
        model = Matrices(shapes, dev)
        ddp = DDP(model, bucket_cap_mb=layer_mb * 0.99, device_ids=None)
        state_kw = {**state_kw, "pool_beta": 0.9 if pooled else None}
        state = gk.GNSHookState("nuclear", every=1, batch_size=B, params=list(model.parameters()), **state_kw)
        seen = set()

        def hook(st, bucket):
            seen.add(bucket.index())
            return gk.ddp_gns_hook(st, bucket)

        ddp.register_comm_hook(state, hook)
        x = torch.randn(tokens, shapes[0][1], device=dev, generator=torch.Generator(device=dev).manual_seed(rank))

        def run():
            ddp(x).backward()
            state.estimate  # the one read (the controller's)

        def step():
            ddp.zero_grad(set_to_none=True)
            sync(dev)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            run()
            if cuda:
                e1.record()
            sync(dev)
            host = (time.perf_counter() - t0) * 1e3
            if not cuda:
                return host, None, None
            return host, e0.elapsed_time(e1), torch.cuda.max_memory_allocated() - base

        for _ in range(2):  # warm-up; the first backward also rebuilds the buckets
            step()
        seen.clear()
        meas = [step() for _ in range(reps)]
        nb = len(seen)
        prof_meas = _kernel_time(dev, run) if profile_it else (None, None)
        state.every = 10**9
        state.step = 1
        step()
        plain = [step() for _ in range(reps)]
        prof_plain = _kernel_time(dev, run) if profile_it else (None, None)

        def med(xs, i):
            v = [x[i] for x in xs]
            return None if v[0] is None else statistics.median(v)

        return {"host": med(meas, 0), "host_plain": med(plain, 0), "gpu": med(meas, 1),
                "gpu_plain": med(plain, 1), "mem": med(meas, 2), "mem_plain": med(plain, 2),
                "buckets": nb, "kernel_ms": prof_meas[0], "kernels": prof_meas[1],
                "kernel_ms_plain": prof_plain[0], "kernels_plain": prof_plain[1]}
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()
        gc.collect()  # DDP holds reference cycles: free this rank's model and buckets now
        if cuda:
            torch.cuda.empty_cache()


def _fmt(v, unit="ms", scale=1.0):
    return "n/a (CPU)" if v is None else f"{v * scale:.1f} {unit}"


def hook_routes(dev):
    """[(label, GNSHookState kwargs)]: the device's default route first ("auto"), then
    every other solver the hook states accept that is not the default's."""
    from gns_kernels.distributed.config import hook_method
    from gns_kernels.distributed.state import HOOK_METHODS

    default = hook_method("auto", dev)  # the hooks' device choice ('host' on CUDA)
    out = [(f"method auto (= {default})", {})]
    out += [(f"method {m}", {"method": m}) for m in HOOK_METHODS if m not in ("auto", default)]
    return out


def s1(dev: str, tiny: bool, R: int, reps: int) -> int:
    """S1 per rank through the real DDP hook, the key figure first (module docstring)."""
    shapes = [(m // 32, n // 32) for m, n in LLAMA] if tiny else LLAMA
    size = "1/32 of the 160M sides (toy)" if tiny else "160M shapes"
    routes = hook_routes(dev)
    print(f"# S1 phase on {dev}: {len(shapes)} matrices ({size}), R = {R}; routes: "
          + ", ".join(r for r, _ in routes), flush=True)
    tokens = 16 if tiny else 512
    hook_reps = min(reps, 3)
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (present?)
    except ImportError as exc:
        skip("S1", "DDP hook per rank", f"torch has no 'fake' process group ({exc})")
        return 1
    target = "goal 20 ms GPU time per rank; model (H100): 96.1 ms"
    order = list(range(R))
    busiest = None
    configs = [(True, routes[0])] + [(True, r) for r in routes[1:]] + [(False, routes[0])]
    for i, (pooled, (label, kw)) in enumerate(configs):
        what = f"DDP hook per rank, R = {R}, {size}, pool {'on' if pooled else 'off'}, {label}"
        if not fits("S1", what, 12 if dev == "cuda" else 3):
            continue
        res = {}
        try:
            for r in order:  # the busiest rank first once known (a deadline keeps it)
                if res and left() < 6:
                    break
                res[r] = hook_rank_times(dev, R, hook_reps, shapes, tokens, pooled, kw, r)
        except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
            failed("S1", what, exc)
            continue
        extra = {r: v["host"] - v["host_plain"] for r, v in res.items()}
        gpu = {r: v["gpu"] - v["gpu_plain"] for r, v in res.items() if v["gpu"] is not None}
        mem = {r: v["mem"] - v["mem_plain"] for r, v in res.items() if v["mem"] is not None}
        nb = max(v["buckets"] for v in res.values())
        key = max(gpu, key=gpu.get) if gpu else max(extra, key=extra.get)
        print(f"{what}: buckets {nb}; per rank host extra / GPU extra / peak-memory extra: "
              + "; ".join(f"r{r} {extra[r]:.1f} / {_fmt(gpu.get(r))} / {_fmt(mem.get(r), 'MB', 2**-20)}"
                          for r in res), flush=True)
        ranks_note = "" if len(res) == R else f"; {len(res)} of {R} ranks (deadline)"
        row("S1", what + f" ({nb} buckets)",
            f"busiest rank r{key}: GPU {_fmt(gpu.get(key))} (CUDA events), host {extra[key]:.1f} ms, "
            f"peak memory +{_fmt(mem.get(key), 'MB', 2**-20)}; mean over ranks: GPU "
            f"{_fmt(statistics.mean(gpu.values()) if gpu else None)}, host {statistics.mean(extra.values()):.1f} ms"
            + ranks_note, target)
        if i == 0:
            busiest = key
            order = [key] + [r for r in range(R) if r != key]
            print(f"@@S1RANK {extra[key]:.3f}", flush=True)
    # the kernels' own time and count on the busiest rank (profiler): GPU busy time, which
    # the events' span exceeds where the host is slower than the kernels
    if busiest is not None and fits("S1", "kernel time of the busiest rank (profiler)", 15 if dev == "cuda" else 3):
        label, kw = routes[0]
        try:
            v = hook_rank_times(dev, R, 1, shapes, tokens, True, kw, busiest, profile_it=True)
            row("S1", f"kernels of the busiest rank r{busiest}, pool on, {label} (profiler, one step each)",
                f"measuring {v['kernel_ms']:.1f} ms in {v['kernels']} kernels; not measuring "
                f"{v['kernel_ms_plain']:.1f} ms in {v['kernels_plain']}; extra "
                f"{v['kernel_ms'] - v['kernel_ms_plain']:.1f} ms, {v['kernels'] - v['kernels_plain']} kernels"
                + ("" if dev == "cuda" else " (CPU: no CUDA kernels)"),
                "model (H100): 96.1 ms; 939 launches")
        except Exception as exc:  # noqa: BLE001
            failed("S1", "kernel time of the busiest rank (profiler)", exc)
    # the share alone (bench_share_gpu's measurement: all matrices in one part, as on the
    # first H100 run, so the figures compare), pool on
    what = "share alone per rank (one part, as the first H100 run), pool on"
    try:
        from gns_kernels.distributed._share import SolveShare  # noqa: F401
        from gns_kernels.stats import NoisePool  # noqa: F401
    except ImportError as exc:
        skip("S1", what, f"the hooks' SolveShare is not importable ({exc})")
        return 0
    if fits("S1", what, 10 if dev == "cuda" else 3):
        try:
            times = share_times(dev, R, reps, shapes, True, buckets=1)
            med = [statistics.median(times[r]) * 1e3 for r in range(R)]
            print(f"{what}: per rank ms " + " ".join(f"{x:.1f}" for x in med), flush=True)
            row("S1", what, f"busiest {max(med):.1f} ms, mean {statistics.mean(med):.1f} ms (host, synchronized)",
                "first H100 run: 126.5 ms (fp32, pool on)")
        except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
            failed("S1", what, exc)
    return 0


def _steep_psd(m, count, gen, dev, decades):
    """count PSD m x m float64 matrices with eigenvalues over ``decades`` decades."""
    out = []
    for _ in range(count):
        U, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, device=dev, dtype=torch.float64))
        lam = 10.0 ** (-decades * torch.arange(m, device=dev, dtype=torch.float64) / max(m - 1, 1))
        out.append((U * lam) @ U.T)
    return torch.stack(out)


def _timed(dev, fn, reps=3):
    """(result, median ms) of fn: CUDA events on the GPU, a wall clock on the CPU."""
    out = fn()
    ts = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        ts.append((time.perf_counter() - t0) * 1e3)
    return out, statistics.median(ts)


def accuracy(dev: str, tiny: bool, R: int) -> int:
    """S1 against float64 on steep spectra (run last: the window's least urgent figures).

    1. the hooks' shared solve (SolveShare, 8 ranks summed) and the real DDP hook (1 rank x
       8 micro-batches) against gk.estimate in float64 on the same device;
    2. gk.sqrt_trace with each method, 'newton-tf32' included, on steep PSD matrices of the
       768 side (11 of them: the busiest rank's share at 160M shapes), against float64
       eigvalsh, with its time; and gk.nuclear_stats with 'newton-tf32' against 'newton'."""
    import gns_kernels as gk

    shapes = [(m // 32, n // 32) for m, n in LLAMA] if tiny else LLAMA
    one_layer = shapes[:PER_LAYER]
    for what, fn in (
            ("accuracy vs float64, steep spectra (6 decades), shared solve of 8 ranks, one layer",
             lambda: s1_accuracy(dev, R, one_layer)),
            ("accuracy vs float64 through the DDP hook, 1 rank x 8 micro-batches, one layer",
             lambda: hook_accuracy(dev, one_layer))):
        if not fits("S1", what, 8 if dev == "cuda" else 2):
            break
        try:
            en, es, eg = fn()
        except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
            failed("S1", what, exc)
            continue
        print(f"{what}: noise {en:.2e}, signal {es:.2e}, gns {eg:.2e}", flush=True)
        row("S1", what, f"noise {en:.1e}, signal {es:.1e}, gns {eg:.1e}", "< 1e-3")
    m = 768 // 32 if tiny else 768
    gen = torch.Generator(device=dev).manual_seed(5)
    A64 = _steep_psd(m, 11, gen, dev, 6.0)
    ref = torch.linalg.eigvalsh(A64).clamp_min(0).sqrt().sum(-1)
    A32 = A64.float()
    for method in ("eigh", "newton", "newton-tf32", "host"):
        what = f"gk.sqrt_trace(method={method!r}), 11 PSD {m}x{m}, eigenvalues over 6 decades"
        if not fits("S1", what, 4 if dev == "cuda" else 1):
            break
        try:
            got, ms = _timed(dev, lambda: gk.sqrt_trace(A32, method=method))
            err = ((got.double() - ref).abs() / ref).max().item()
        except Exception as exc:  # noqa: BLE001
            failed("S1", what, exc)
            continue
        print(f"{what}: worst relative error {err:.2e}, {ms:.2f} ms", flush=True)
        row("S1", what, f"worst relative error {err:.1e}; {ms:.2f} ms for the batch",
            "< 1e-3 ('newton-tf32': budget 5e-4)")
    what = "gk.nuclear_stats(method='newton-tf32') vs 'newton', one layer, steep spectra"
    if fits("S1", what, 5 if dev == "cuda" else 1):
        try:
            g2 = torch.Generator(device=dev).manual_seed(9)
            means = [_steep(a, b, g2, dev, 6.0).float() for a, b in one_layer]
            grams = [_gram(x) + 0.1 * _gram(_steep(*x.shape, g2, dev, 6.0).float()) for x in means]
            (n1, s1_), t1 = _timed(dev, lambda: gk.nuclear_stats(grams, means, 16 / 7, method="newton"))
            (n2, s2), t2 = _timed(dev, lambda: gk.nuclear_stats(grams, means, 16 / 7, method="newton-tf32"))
            en = rel(float(n2.double().sum()), float(n1.double().sum()))
            es = rel(float(s2.double().sum()), float(s1_.double().sum()))
            print(f"{what}: noise {en:.2e}, signal {es:.2e}; {t1:.2f} / {t2:.2f} ms", flush=True)
            row("S1", what, f"relative difference: noise {en:.1e}, signal {es:.1e}; time newton {t1:.2f} ms, "
                f"newton-tf32 {t2:.2f} ms", "hooks refuse newton-tf32 (signal 18% low in CPU emulation)")
        except Exception as exc:  # noqa: BLE001
            failed("S1", what, exc)
    return 0


# ----------------------------------------------------------------------------- fused
def _short(op: str) -> str:
    """vn, sp, acc (+ _multi): the op names of the summary row."""
    return op.replace("variance_norms", "vn").replace("square_pack", "sp").replace("accumulate_sq", "acc")


def fused(dev: str, tiny: bool, n: int, rep_ms: int) -> int:
    """The fused ops against their floors: variance_norms against reading its inputs once
    (one .sum() each), square_pack / accumulate_sq against a float32 copy_ moving the same
    bytes; single tensors of n elements and the 84-tensor Llama list (multi, floors over
    the same total bytes); float32 and bfloat16 gradients; each backend present."""
    from gns_kernels import ops

    backends = []
    if dev == "cuda":
        if ops.cpp_available() and "cuda/binding.cpp" in torch._C._dispatch_dump("gns_kernels::variance_norms"):
            backends.append(("CUDA C++", "cpp"))
        else:
            skip("fused", "CUDA C++ kernels", "the extension was built without csrc/cuda")
    else:
        if ops.cpp_available():
            backends.append(("CPU C++", "cpp"))
    try:
        from gns_kernels.triton import fused as _tf  # noqa: F401
        if dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            backends.append(("Triton" + ("" if dev == "cuda" else " (interpreter)"), "triton"))
        else:
            skip("fused", "Triton on CPU", "needs TRITON_INTERPRET=1")
    except ImportError as exc:
        skip("fused", "Triton kernels", f"not importable ({exc})")
    if dev == "cuda":  # CUDA events, the L2 cache flushed before every call
        from bench_cuda_gpu import _timer
        bench = _timer(rep_ms)
    else:  # a wall clock, 3 calls after one (a check of the phase, not a benchmark)
        from bench_triton_gpu import _timer
        bench = _timer("cpu", rep_ms)
    shapes = [(m // 32, n_ // 32) for m, n_ in LLAMA] if tiny else LLAMA
    print(f"# fused phase on {dev}: n = {n} elements per single tensor; multi: {len(shapes)} tensors; "
          f"backends: {', '.join(b for b, _ in backends) or 'none'}", flush=True)
    for dname, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if not fits("fused", f"{dname} inputs", 8 if dev == "cuda" else 2):
            break
        x = make_inputs(n, dev, dt, shapes)
        isz, nm, scale = x.isz, x.nm, x.scale
        ds, qs = x.ds, x.qs
        outs = [torch.empty(2 * t.numel(), device=dev) for t in ds]
        prevs = [t.clone() for t in ds]
        sqs = [torch.zeros(t.numel(), device=dev) for t in ds]
        flat_d = torch.empty(nm, device=dev, dtype=dt)
        flat_q = torch.empty(nm, device=dev, dtype=dt)
        floors = {
            "variance_norms": lambda: (x.d.sum(), x.q.sum()),
            "square_pack": copy_of(op_bytes("square_pack", n, isz), dev),
            "accumulate_sq": copy_of(op_bytes("accumulate_sq", n, isz), dev),
            "variance_norms_multi": lambda: (flat_d.sum(), flat_q.sum()),
            "square_pack_multi": copy_of(op_bytes("square_pack", nm, isz), dev),
            "accumulate_sq_multi": copy_of(op_bytes("accumulate_sq", nm, isz), dev),
        }
        floor_t = {k: statistics.median(bench(f)) for k, f in floors.items()}
        for bname, b in backends:
            kern = {
                "variance_norms": lambda: ops.variance_norms(x.d, x.q, scale, backend=b),
                "square_pack": lambda: ops.square_pack(x.d, x.out, backend=b),
                "accumulate_sq": lambda: ops.accumulate_sq(x.d, x.prev, x.sq, backend=b),
                "variance_norms_multi": lambda: ops.variance_norms_multi(ds, qs, scale, backend=b),
                "square_pack_multi": lambda: ops.square_pack_multi(ds, outs, backend=b),
                "accumulate_sq_multi": lambda: ops.accumulate_sq_multi(ds, prevs, sqs, backend=b),
            }
            # the first call of each op apart (Triton: the JIT compile on a cold cache, as on
            # a bare machine; CUDA C++: module load), so the timings below exclude it
            first = {}
            for op, fn in kern.items():
                sync(dev)
                t0 = time.perf_counter()
                try:
                    fn()
                    sync(dev)
                except Exception:  # noqa: BLE001  (the timing below reports it)
                    pass
                first[op] = time.perf_counter() - t0
            print(f"{bname} {dname}: first calls (compile / load) " + ", ".join(
                f"{op} {v:.2f} s" for op, v in first.items()), flush=True)
            row("fused", f"{bname}, {dname}: first call of the 6 ops (compile / load), not in the ratios",
                f"{sum(first.values()):.1f} s in all, slowest {max(first.values()):.2f} s", "")
            ratios = {}
            for op, fn in kern.items():
                if not fits("fused", f"{bname} {op} {dname}", 1):
                    ratios[op] = float("nan")
                    continue
                try:
                    t = statistics.median(bench(fn))
                except Exception as exc:  # noqa: BLE001  (report and go on)
                    print(f"{bname} {op} {dname}: FAILED ({type(exc).__name__}: {exc})", flush=True)
                    ratios[op] = float("nan")
                    continue
                ratios[op] = t / floor_t[op]
                print(f"{bname} {op} {dname}: {t * 1e3:.4f} ms, floor {floor_t[op] * 1e3:.4f} ms, "
                      f"ratio {ratios[op]:.2f}", flush=True)
            worst = max((v for v in ratios.values() if v == v), default=float("nan"))
            row("fused", f"{bname}, {dname}: ratio to floor (single / multi)",
                "; ".join(f"{_short(op)} {v:.2f}" for op, v in ratios.items()) + f"; worst {worst:.2f}",
                "<= 1.18 each" + ("" if dev == "cuda" else " (CPU toy sizes: not a measurement)"))
        del x, outs, prevs, sqs, flat_d, flat_q
        if dev == "cuda":
            torch.cuda.empty_cache()
    return 0


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("smoke", "s1", "fused", "accuracy"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes (the CPU dry run)")
    p.add_argument("--ranks", type=int, default=8, help="R (s1, accuracy)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (s1; default 3, --tiny 2)")
    p.add_argument("--n", type=int, default=None, help="elements per single tensor (fused; default 2^26, --tiny 4099)")
    p.add_argument("--rep-ms", type=int, default=100, help="CUDA timing budget per candidate, ms (fused)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if a.phase == "smoke":
        return smoke(a.device)
    if a.phase == "s1":
        return s1(a.device, a.tiny, a.ranks, a.reps or (2 if a.tiny else 3))
    if a.phase == "accuracy":
        return accuracy(a.device, a.tiny, a.ranks)
    return fused(a.device, a.tiny, a.n or (4099 if a.tiny else 2**26), a.rep_ms)


if __name__ == "__main__":
    raise SystemExit(main())
