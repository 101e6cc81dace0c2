"""The aten ops and CPU time ONE rank spends on a nuclear (S1) measurement in the REAL DDP hook.

The 160M Llama shapes divided by 32 (84 matrices: 12 layers of q, k, v, o 768x768,
gate, up 2048x768, down 768x2048, each side / 32; the op count does not depend on the
sides), R = 8 ranks of which this process plays one (``--rank``) through torch's 'fake'
process group with ``dist.all_reduce`` replaced by a completed future (as
bench/gpu_window.py's S1 phase does), ``gk.ddp_gns_hook`` with its defaults ('gauss-sums'
dof, bias correction), the Newton solver (the GPU path, ``GNSHookState(method="newton")``)
on CPU tensors, pool on and off. ``bucket_cap_mb`` is one layer's matrices (about 12
buckets) or the whole model (1 bucket). The measurement's cost is the measuring step
(backward + the estimate's read) minus a non-measuring hooked step:

- aten ops: torch.profiler's count of ``aten::`` events (nested calls included, as the
  issue's and bench_share_gpu.py --count-ops's figures) of one warm step each;
- CPU time: the median over ``--reps`` steps of each kind (no profiler).

    python bench/bench_hook_ops.py                 # the table
    python bench/bench_hook_ops.py --check 100000  # exit 0 when the pooled 12-bucket
        # measurement takes at most 100000 aten ops; the counts are the last line
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_window import LLAMA, PER_LAYER, Matrices, _all_reduce  # noqa: E402


def _aten_ops(fn) -> tuple[int, collections.Counter]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = collections.Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})
    return sum(counts.values()), counts


def run(pooled: bool, buckets: str, rank: int = 0, R: int = 8, reps: int = 3, method: str = "newton",
        count: bool = True, tokens: int = 16, div: int = 32) -> dict:
    """{'ops', 'top', 'ms', 'buckets'} of rank ``rank``'s measurement (see the module docstring)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import gns_kernels as gk

    shapes = [(m // div, n // div) for m, n in LLAMA]
    B = 8 * R
    layer_mb = sum(m * n for m, n in shapes[:PER_LAYER]) * 4 / 2**20
    cap = layer_mb * 0.99 if buckets == "12" else 4 * layer_mb * len(shapes) / PER_LAYER
    dist.init_process_group("fake", rank=rank, world_size=R, store=FakeStore())
    real_all_reduce = dist.all_reduce
    dist.all_reduce = _all_reduce
    try:
        torch.manual_seed(0)
        model = Matrices(shapes)
        ddp = DDP(model, bucket_cap_mb=cap)
        state = gk.GNSHookState("nuclear", every=1, batch_size=B, params=list(model.parameters()),
                                pool_beta=0.9 if pooled else None, method=method)
        seen = set()

        def hook(st, bucket):
            seen.add(bucket.index())
            return gk.ddp_gns_hook(st, bucket)

        ddp.register_comm_hook(state, hook)
        x = torch.randn(tokens, shapes[0][1], generator=torch.Generator().manual_seed(rank))

        def step():
            ddp.zero_grad(set_to_none=True)
            ddp(x).backward()
            est = state.estimate  # the one read (the controller's)
            return est

        for _ in range(2):  # warm-up; the first backward also rebuilds the buckets
            step()
        seen.clear()

        def timed():
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0

        meas = [timed() for _ in range(reps)] if reps else [0.0]
        seen.clear()
        ops_m, top_m = _aten_ops(step) if count else (0, collections.Counter())
        nb = len(seen)
        est = state.estimate
        assert est is not None and est.valid, est
        state.every = 10**9
        state.step = 1
        step()
        plain = [timed() for _ in range(reps)] if reps else [0.0]
        ops_p, top_p = _aten_ops(step) if count else (0, collections.Counter())
        top = top_m.copy()
        top.subtract(top_p)
        return {"ops": ops_m - ops_p, "top": top, "buckets": nb,
                "ms": (statistics.median(meas) - statistics.median(plain)) * 1e3,
                "noise": est.noise, "pooled": est.noise_pooled, "signal": est.signal}
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()
        gc.collect()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--method", default="newton", choices=("newton", "eigh"))
    p.add_argument("--div", type=int, default=32,
                   help="the 160M shapes divided by this (32: sides 24-64; 8: 96-256)")
    p.add_argument("--check", type=int, default=None, metavar="N",
                   help="only the pooled 12-bucket count: exit 0 when it is at most N aten ops")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # one rank; 2 OpenMP threads on a loaded 2-core machine ran bmm 20x slower
    if a.check is not None:
        res = {pooled: run(pooled, "12", a.rank, a.ranks, reps=0, method=a.method) for pooled in (False, True)}
        ok = res[True]["ops"] <= a.check
        print(f"aten ops per measurement, rank {a.rank} of {a.ranks}, {res[True]['buckets']} buckets, "
              f"{a.method}: pool off {res[False]['ops']}, pool on {res[True]['ops']} "
              f"(bound {a.check}: {'ok' if ok else 'EXCEEDED'})")
        return 0 if ok else 1
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; rank {a.rank} of {a.ranks}, "
          f"84 matrices (160M / {a.div}), {a.method}")
    print("| pool | buckets | aten ops | CPU ms (extra per measuring step) | top ops |")
    print("|---|---:|---:|---:|---|")
    ms = {}
    for pooled in (False, True):
        for buckets in ("1", "12"):
            r = run(pooled, buckets, a.rank, a.ranks, a.reps, a.method, div=a.div)
            ms[pooled, buckets] = r["ms"]
            top = ", ".join(f"{k[6:]} {v}" for k, v in r["top"].most_common(6))
            print(f"| {'on' if pooled else 'off'} | {r['buckets']} | {r['ops']} | {r['ms']:.1f} | {top} |",
                  flush=True)
    for pooled in (False, True):
        print(f"pool {'on' if pooled else 'off'}: 12 buckets / 1 bucket CPU time "
              f"{ms[pooled, '12'] / ms[pooled, '1']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
