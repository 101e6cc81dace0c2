"""variance_norms: the C++ kernel vs the eager torch formulas (what an install without the
extension runs), float32 inputs on CPU, median of --repeats calls after a warm-up.

    python tools/time_eager_fallback.py --sizes 65536 1048576 16777216
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import gns_kernels as gk


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 24])
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    if not gk.ops.cpp_available():
        raise SystemExit("the C++ extension is not loaded: nothing to compare")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'elements':>10s} {'cpp ms':>9s} {'eager ms':>9s} {'eager/cpp':>9s}")
    g = torch.Generator().manual_seed(0)
    for n in args.sizes:
        d = torch.randn(n, generator=g)
        q = d * d + torch.rand(n, generator=g)
        cpp = _median_ms(lambda: gk.variance_norms(d, q, 2.0, backend="cpp"), args.repeats)
        eager = _median_ms(lambda: gk.variance_norms(d, q, 2.0, backend="eager"), args.repeats)
        print(f"{n:10d} {cpp:9.3f} {eager:9.3f} {eager / cpp:8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
