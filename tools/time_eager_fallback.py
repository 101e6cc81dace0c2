"""variance_norms: the C++ kernel vs the eager torch formulas (what an install without the
extension runs), float32 inputs on CPU: median and minimum of --repeats calls after a
warm-up (the minimum is the least disturbed by other load on a shared machine).

    python tools/time_eager_fallback.py --threads 1 --sizes 65536 1048576 16777216
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import gns_kernels as gk


def _times_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, min) in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 24])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not gk.ops.cpp_available():
        raise SystemExit("the C++ extension is not loaded: nothing to compare")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'elements':>10s} {'cpp ms (median / min)':>22s} {'eager ms (median / min)':>24s} {'eager/cpp (min)':>15s}")
    g = torch.Generator().manual_seed(0)
    for n in args.sizes:
        d = torch.randn(n, generator=g)
        q = d * d + torch.rand(n, generator=g)
        cpp = _times_ms(lambda: gk.variance_norms(d, q, 2.0, backend="cpp"), args.repeats)
        eager = _times_ms(lambda: gk.variance_norms(d, q, 2.0, backend="eager"), args.repeats)
        print(f"{n:10d} {cpp[0]:12.3f} / {cpp[1]:7.3f} {eager[0]:13.3f} / {eager[1]:8.3f} {eager[1] / cpp[1]:14.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
