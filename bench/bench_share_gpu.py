"""One rank's share of an S1 (nuclear) measurement through the hooks' solver, per rank.

The paper's 160M Llama-3 shapes (84 matrices: 12 x q,k,v,o 768x768, gate/up 2048x768, down
768x2048), R simulated ranks (default 8) on one device: each rank's
``SolveShare.add_grads`` + ``launch`` + ``read`` as the DDP hook runs them with its defaults
('gauss-sums' dof, bias correction, Newton on CUDA), with and without the noise pool
(pool_beta 0.9), float32 matmuls with TF32 off and on. The share all-reduce is replaced by
a completed future (one device plays every rank), so the times are the solves plus the
host work, not the network. Wall time per rank measurement (synchronized before and after),
median over --reps measurements after 2 warm-up ones; the pool's owners are one global
assignment, as in the hooks.

    python bench/bench_share_gpu.py                       # a GPU
    python bench/bench_share_gpu.py --device cpu --tiny   # self-check of the script
    python bench/bench_share_gpu.py --device cpu --tiny --count-ops
        # the aten ops one rank's share runs per measurement (they do not depend on the
        # matrices' sides: the host-side cost the H100 run found the step bound by)
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the measurement lives in the GPU window (bench/gpu_window.py, its S1 phase); this script
# keeps the first H100 run's command and table
from gpu_window import LLAMA, Ranks as _Ranks, share_inputs as _inputs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small shapes (a self-check of the script)")
    p.add_argument("--count-ops", action="store_true",
                   help="count the torch ops of one rank's warm measurement instead of timing")
    a = p.parse_args()
    dev, R = a.device, a.ranks
    # --tiny: the 84 matrices at 1/32 of their sides (the same owners, the same op count)
    shapes = [(m // 32, n // 32) for m, n in LLAMA] if a.tiny else LLAMA
    B = 8 * R
    scale = B / (R - 1)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sets = [_inputs(shapes, s, dev) for s in range(3)]
    if a.count_ops:
        _count_ops(sets, R, B, scale)
        return
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}; {len(shapes)} matrices, R = {R}")
    print("| TF32 | pool | per-rank median ms (ranks 0..R-1) | busiest | mean |")
    print("|---|---|---|---:|---:|")
    for tf32 in ((False, True) if dev == "cuda" else (False,)):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            for pooled in (False, True):
                ranks = _Ranks(R, B, scale, pooled)
                times: dict[int, list[float]] = {r: [] for r in range(R)}
                for rep in range(a.reps + 2):
                    for r in range(R):
                        sync()
                        t0 = time.perf_counter()
                        ranks.measure(r, sets[rep % 3])
                        sync()
                        if rep >= 2:
                            times[r].append(time.perf_counter() - t0)
                med = [statistics.median(times[r]) * 1e3 for r in range(R)]
                print(f"| {'on' if tf32 else 'off'} | {'on' if pooled else 'off'} | "
                      f"{' '.join(f'{x:.1f}' for x in med)} | {max(med):.1f} | {statistics.mean(med):.1f} |",
                      flush=True)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old


def _count_ops(sets, R, B, scale) -> None:
    """torch.profiler's aten op counts (nested calls included, as in the GPU profile of
    bench/RESULTS.md) of rank 1's third measurement, with and without the pool, on the
    Newton path (CUDA's default) whatever the device."""
    from torch.profiler import ProfilerActivity, profile

    for pooled in (False, True):
        ranks = _Ranks(R, B, scale, pooled, method="newton")
        for rep in range(3):
            for r in range(R):
                if rep == 2 and r == 1:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        ranks.measure(r, sets[rep])
                    counts = collections.Counter({e.key: e.count for e in prof.key_averages()
                                                  if e.key.startswith("aten::")})
                    top = ", ".join(f"{k[6:]} {v}" for k, v in counts.most_common(8))
                    print(f"pool {'on' if pooled else 'off'}: {sum(counts.values())} aten ops ({top})")
                else:
                    ranks.measure(r, sets[rep])


if __name__ == "__main__":
    main()
