"""Host-side Python time of the Triton multi-tensor ops (no kernel runs).

What it measures: the Python work a call does BEFORE its kernels run (argument checks,
grouping, tile plans, pointer tables, output allocation), per call, on the 160M Llama
matrices (12 x {q, k, v, o: 768x768; gate, up: 2048x768; down: 768x2048} = 84 tensors,
84.9M elements; the shapes are assumed, the paper lists none) plus optionally the 25 norm
vectors (768) of such a model. The tensors are CPU tensors; ``DualKernel.launch`` (the
boundary where a Triton kernel would be launched) is replaced by a no-op IN THIS SCRIPT
ONLY, so nothing is computed and the figures are host-side Python time, not GPU time and
not a speed of the ops. On a GPU the same Python runs before each launch, plus the launch
costs themselves (not measured here).

Run: ``python bench/bench_host_overhead.py [--repeat 200] [--norms]``; prints one line per
case: wall-clock and process-CPU microseconds per call (medians of 5 rounds of ``repeat``
calls).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

import gns_kernels as gk  # noqa: E402
from gns_kernels.triton import _runtime, fused  # noqa: E402

SHAPES_160M = ([(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]) * 12


def _per_call_us(fn, repeat: int, rounds: int = 5) -> tuple[float, float]:
    """(wall, process CPU) microseconds per call: medians over ``rounds`` of ``repeat`` calls.
    The CPU time is the steadier figure on a shared machine (waiting for a core is not in it)."""
    fn()
    fn()
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(repeat):
            fn()
        wall.append((time.perf_counter() - t0) / repeat * 1e6)
        cpu.append((time.process_time() - c0) / repeat * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--norms", action="store_true", help="add 25 norm vectors of 768")
    args = ap.parse_args(argv)
    shapes = list(SHAPES_160M) + ([(768,)] * 25 if args.norms else [])
    numels = [int(torch.Size(s).numel()) for s in shapes]
    # torch.empty: never touched (the launches are no-ops), so the pages are not committed
    ds = [torch.empty(n) for n in numels]
    qs = [torch.empty(n) for n in numels]
    prevs = [torch.empty(n) for n in numels]
    sqs = [torch.empty(n) for n in numels]
    pack = torch.empty(2 * sum(numels))
    outs, off = [], 0
    for n in numels:
        outs.append(pack[off:off + 2 * n])
        off += 2 * n

    _runtime.DualKernel.launch = lambda self, *a, **k: None  # no kernel runs (see docstring)
    cases = [
        ("gk.variance_norms_multi(backend='triton')",
         lambda: gk.variance_norms_multi(ds, qs, 2.0, backend="triton")),
        ("triton.fused.variance_norms_multi",
         lambda: fused.variance_norms_multi(ds, qs, 2.0)),
        ("gk.accumulate_sq_multi(backend='triton')",
         lambda: gk.accumulate_sq_multi(ds, prevs, sqs, backend="triton")),
        ("square_pack per tensor (loop of gk.square_pack, backend='triton')",
         lambda: [gk.square_pack(d, o, backend="triton") for d, o in zip(ds, outs)]),
    ]
    if hasattr(gk, "square_pack_multi"):
        cases.append(("gk.square_pack_multi(backend='triton')",
                      lambda: gk.square_pack_multi(ds, outs, backend="triton")))
    print(f"host-side Python time per call (launches replaced by a no-op), {len(shapes)} tensors, "
          f"{sum(numels) / 1e6:.1f}M elements, torch {torch.__version__}, {sys.platform}")
    print(f"  {'case':66s} {'wall us':>9s} {'CPU us':>9s}")
    for name, fn in cases:
        wall, cpu = _per_call_us(fn, args.repeat)
        print(f"  {name:66s} {wall:9.1f} {cpu:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
