"""The Python phases of the GPU window (bench/gpu_window.sh runs them, one process each).

    python bench/gpu_window.py smoke [--device cuda]          # import, one op of each kind
    python bench/gpu_window.py s1 [--device cuda] [--tiny]    # S1 per rank: accuracy, DDP hook, share
    python bench/gpu_window.py fused [--device cuda] [--tiny] # fused kernels against the floor

Each phase prints its full log and, as soon as a figure is known, one summary row per
figure: a line ``@@ | phase | measurement | value | target / paper |`` that the shell
script collects into the window's summary table (so a phase cut by the deadline keeps
the rows it printed). A part that the package at this commit does not offer, or that the
deadline leaves no time for, prints ``skipped: <what>: <why>`` (and a row saying so).

Deadline: GPU_WINDOW_END (epoch seconds, the whole window) and GPU_WINDOW_PHASE_END (this
phase's share) bound the loops; a part that would not fit is skipped, not cut.

The S1 phase (one GPU plays each of R = 8 ranks in turn; everything at the paper's 160M
Llama shapes, 84 matrices: 12 x q, k, v, o 768x768, gate, up 2048x768, down 768x2048):

- accuracy: the hooks' solver (``SolveShare``, 'gauss-sums' dof, bias correction, the
  device's default method: Newton on CUDA), every rank's share with a summing all-reduce,
  against ``gk.estimate(..., dtype=float64)`` on the same float32 rank gradients whose
  mean and deviations have steep singular spectra (6 decades); and through the real DDP
  hook on a 1-rank group (gloo / NCCL) with MicroBatchGNS over 8 micro-batches whose
  gradients are injected exactly, against gk.estimate(float64, 'columns' dof);
- the real DDP hook per rank: ``torch.distributed``'s 'fake' process group (world size R,
  this process as rank r; DDP's own collectives do nothing) and ``dist.all_reduce``
  replaced by a completed future, so ``gk.ddp_gns_hook`` packs the Grams, solves rank r's
  share and reads the estimate exactly as it would on rank r, with no network. A model
  holding the 84 matrices (a cheap forward through all of them) with ``bucket_cap_mb``
  set to one layer's matrices (about 12 buckets; the count is reported). Per rank: the
  measuring step's backward + estimate read minus a non-measuring hooked step's
  (``every`` = 1 vs never), median over the reps: one rank's measurement cost;
- the share alone (what bench/bench_share_gpu.py timed on the first H100 run), the
  matrices added bucket by bucket (one layer per bucket).
Pool on and off; float32, and TF32 where the package offers it (an option of
GNSHookState; otherwise the global ``allow_tf32`` flag, labelled so).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
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


def tf32_option():
    """(kwargs for GNSHookState, label) of the package's TF32 option, or None when
    GNSHookState has none (then only the global allow_tf32 flag exists)."""
    import gns_kernels as gk

    params = inspect.signature(gk.GNSHookState).parameters
    for name in ("precision", "matmul_precision", "solve_precision", "newton_precision"):
        if name in params:
            return {name: "tf32"}, f"{name}='tf32'"
    if "tf32" in params:
        return {"tf32": True}, "tf32=True"
    return None


@contextlib.contextmanager
def allow_tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def precisions(dev: str, phase: str):
    """[(label, GNSHookState kwargs, global allow_tf32)] for this device."""
    out = [("fp32", {}, False)]
    if dev != "cuda":
        skip(phase, "TF32 configurations", "TF32 needs a CUDA device")
        return out
    opt = tf32_option()
    if opt is None:
        print("note: GNSHookState has no TF32 option at this commit: the TF32 rows set the "
              "global torch.backends.cuda.matmul.allow_tf32 flag only", flush=True)
        out.append(("TF32 (global flag; no package option)", {}, True))
    else:
        out.append((f"TF32 ({opt[1]})", opt[0], True))
    return out


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
        from gns_kernels.pooling import NoisePool

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
    ref = gk.estimate([[x.cpu() for x in g] for g in ranks], batch_size=B, geometry="nuclear",
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
    ref = gk.estimate([[x.cpu() for x in g] for g in grads], batch_size=B, geometry="nuclear",
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


def hook_rank_times(dev, R, reps, shapes, tokens, pooled, state_kw, rank):
    """(measuring ms, non-measuring ms, buckets) of rank ``rank`` through the real DDP hook
    (fake process group of world size R, all-reduce replaced by a completed future)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import gns_kernels as gk

    B = 8 * R
    layer_mb = sum(m * n for m, n in shapes[:PER_LAYER]) * 4 / 2**20
    dist.init_process_group("fake", rank=rank, world_size=R, store=FakeStore())
    real_all_reduce = dist.all_reduce
    dist.all_reduce = _all_reduce
    try:
        torch.manual_seed(0)
        model = Matrices(shapes, dev)
        ddp = DDP(model, bucket_cap_mb=layer_mb * 0.99, device_ids=None)
        if "pool_beta" in inspect.signature(gk.GNSHookState).parameters:
            state_kw = {**state_kw, "pool_beta": 0.9 if pooled else None}
        state = gk.GNSHookState("nuclear", every=1, batch_size=B, params=list(model.parameters()), **state_kw)
        seen = set()

        def hook(st, bucket):
            seen.add(bucket.index())
            return gk.ddp_gns_hook(st, bucket)

        ddp.register_comm_hook(state, hook)
        x = torch.randn(tokens, shapes[0][1], device=dev, generator=torch.Generator(device=dev).manual_seed(rank))

        def step():
            ddp.zero_grad(set_to_none=True)
            sync(dev)
            t0 = time.perf_counter()
            ddp(x).backward()
            state.estimate  # the one read (the controller's)
            sync(dev)
            return time.perf_counter() - t0

        for _ in range(2):  # warm-up; the first backward also rebuilds the buckets
            step()
        seen.clear()
        meas = [step() for _ in range(reps)]
        nb = len(seen)
        state.every = 10**9
        state.step = 1
        step()
        plain = [step() for _ in range(reps)]
        return statistics.median(meas) * 1e3, statistics.median(plain) * 1e3, nb
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()
        gc.collect()  # DDP holds reference cycles: free this rank's model and buckets now
        if dev == "cuda":
            torch.cuda.empty_cache()


def s1(dev: str, tiny: bool, R: int, reps: int) -> int:
    shapes = [(m // 32, n // 32) for m, n in LLAMA] if tiny else LLAMA
    size = "1/32 of the 160M sides (toy)" if tiny else "160M shapes"
    print(f"# S1 phase on {dev}: {len(shapes)} matrices ({size}), R = {R}, method: the device default "
          f"({'Newton' if dev == 'cuda' else 'eigh'})", flush=True)
    precs = precisions(dev, "S1")
    import gns_kernels as gk

    hook_params = inspect.signature(gk.GNSHookState).parameters
    pools = (True, False) if "pool_beta" in hook_params else (False,)
    if len(pools) == 1:
        skip("S1", "pool on", "GNSHookState has no pool_beta at this commit")
    try:
        from gns_kernels.distributed._share import SolveShare  # noqa: F401
        from gns_kernels.pooling import NoisePool  # noqa: F401
        have_share = True
    except ImportError as exc:
        have_share = False
        skip("S1", "accuracy and share alone", f"the hooks' SolveShare is not importable ({exc})")

    # 1. accuracy against float64, steep spectra (one layer's 7 matrices)
    for label, kw, flag in (precs if have_share else ()):
        if not fits("S1", f"accuracy vs float64 ({label})", 10):
            break
        if kw:
            skip("S1", f"accuracy vs float64 ({label})", "the SolveShare path takes no precision option")
            continue
        try:
            with allow_tf32(flag) if dev == "cuda" else contextlib.nullcontext():
                en, es, eg = s1_accuracy(dev, R, shapes[:PER_LAYER])
        except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
            failed("S1", f"accuracy vs float64 ({label})", exc)
            continue
        print(f"accuracy ({label}): noise {en:.2e}, signal {es:.2e}, gns {eg:.2e}", flush=True)
        row("S1", f"accuracy vs float64, steep spectra (6 decades), shared solve of 8 ranks, one layer, {label}",
            f"noise {en:.1e}, signal {es:.1e}, gns {eg:.1e}", "fp32 < 1e-3; TF32 near 3e-4")

    # 1b. accuracy through the real DDP hook (one rank x 8 micro-batches)
    for label, kw, flag in precs:
        what = f"accuracy vs float64 through the DDP hook, 1 rank x 8 micro-batches, one layer, {label}"
        if not fits("S1", what, 10):
            break
        if kw:
            skip("S1", what, "MicroBatchGNS takes no precision option here")
            continue
        try:
            with allow_tf32(flag) if dev == "cuda" else contextlib.nullcontext():
                en, es, eg = hook_accuracy(dev, shapes[:PER_LAYER])
        except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
            failed("S1", what, exc)
            continue
        print(f"{what}: noise {en:.2e}, signal {es:.2e}, gns {eg:.2e}", flush=True)
        row("S1", what, f"noise {en:.1e}, signal {es:.1e}, gns {eg:.1e}", "fp32 < 1e-3; TF32 near 3e-4")

    # 2. the real DDP hook, per rank
    tokens = 16 if tiny else 512
    hook_reps = min(reps, 3)  # 8 ranks x 4 configurations x (2 warm-up + 2 x reps + 1) steps
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
        have_fake = True
    except ImportError as exc:
        have_fake = False
        skip("S1", "DDP hook per rank", f"torch has no 'fake' process group ({exc})")
    first = None
    for pooled in (pools if have_fake else ()):
        for label, kw, flag in precs:
            what = f"DDP hook per rank, pool {'on' if pooled else 'off'}, {label}"
            if not fits("S1", what, 12 if dev == "cuda" else 3):
                continue
            res = {}
            try:
                with allow_tf32(flag) if dev == "cuda" else contextlib.nullcontext():
                    for r in range(R):
                        if left() < 5:
                            break
                        res[r] = hook_rank_times(dev, R, hook_reps, shapes, tokens, pooled, kw, r)
            except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
                failed("S1", what, exc)
                continue
            if not res:
                skip("S1", what, "deadline")
                continue
            extra = {r: m - p for r, (m, p, _) in res.items()}
            nb = max(b for _, _, b in res.values())
            print(f"{what}: buckets {nb}; per rank measuring / non-measuring / extra ms: "
                  + "; ".join(f"r{r} {m:.1f}/{p:.1f}/{extra[r]:.1f}" for r, (m, p, _) in res.items()), flush=True)
            busiest = max(extra.values())
            ranks_note = "" if len(res) == R else f" ({len(res)} of {R} ranks: deadline)"
            row("S1", what + f" ({nb} buckets)",
                f"extra per measuring step: busiest rank {busiest:.1f} ms, "
                f"mean {statistics.mean(extra.values()):.1f} ms"
                + ranks_note, "first H100 run, share alone: 91.9 ms (pool off), 126.5 (on)")
            if pooled and not kw and not flag and first is None:
                first = busiest
                print(f"@@S1RANK {busiest:.3f}", flush=True)

    # 3. the share alone (bench_share_gpu's measurement: all matrices in one part, as on
    # the first H100 run, so the figures compare)
    sets = None
    for pooled in (sorted(pools) if have_share else ()):
        for label, kw, flag in precs:
            what = f"share alone per rank (one part, as the first H100 run), pool {'on' if pooled else 'off'}, {label}"
            if kw:
                skip("S1", what, "the SolveShare path takes no precision option")
                continue
            if not fits("S1", what, 10 if dev == "cuda" else 3):
                continue
            sets = sets or [share_inputs(shapes, s, dev) for s in range(3)]
            try:
                with allow_tf32(flag) if dev == "cuda" else contextlib.nullcontext():
                    times = share_times(dev, R, reps, shapes, pooled, buckets=1, sets=sets)
            except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
                failed("S1", what, exc)
                continue
            med = [statistics.median(times[r]) * 1e3 for r in range(R)]
            print(f"{what}: per rank ms " + " ".join(f"{x:.1f}" for x in med), flush=True)
            row("S1", what, f"busiest {max(med):.1f} ms, mean {statistics.mean(med):.1f} ms",
                "first H100 run: 91.9 / 126.5 ms (fp32, pool off / on)")
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
            ratios = {}
            for op, fn in kern.items():
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
    p.add_argument("phase", choices=("smoke", "s1", "fused"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes (the CPU dry run)")
    p.add_argument("--ranks", type=int, default=8, help="R (S1)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (S1; default 5, --tiny 2)")
    p.add_argument("--n", type=int, default=None, help="elements per single tensor (fused; default 2^26, --tiny 4099)")
    p.add_argument("--rep-ms", type=int, default=100, help="CUDA timing budget per candidate, ms (fused)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if a.phase == "smoke":
        return smoke(a.device)
    if a.phase == "s1":
        return s1(a.device, a.tiny, a.ranks, a.reps or (2 if a.tiny else 5))
    return fused(a.device, a.tiny, a.n or (4099 if a.tiny else 2**26), a.rep_ms)


if __name__ == "__main__":
    raise SystemExit(main())
