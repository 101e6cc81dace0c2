"""GPU benchmark of the Triton fused-op kernels against eager, torch.compile and the floor.

Run on a machine with a CUDA GPU (from the repository root, package installed):

    python bench/bench_triton_gpu.py                      # float32, 2^25 elements
    python bench/bench_triton_gpu.py --dtype bfloat16     # bf16 gradients (sq/out stay float32)
    python bench/bench_triton_gpu.py --paper              # bytes and times at 3 TB/s only, no GPU

Candidates (the same as bench/bench_fused_cpu.py, with the Triton kernels in place of the
C++ ones, so the tables line up):
  floor     variance_norms: reading its inputs once (one .sum() per input);
            square_pack / accumulate_sq: Tensor.copy_ moving the same bytes (read + write);
  triton.*  gns_kernels.triton.fused (called directly, no dispatch);
  eager     the composite torch formula; torch.compile(formula) after warm-up;
  multi     variance_norms_multi over the paper's 160M Llama matrices (84 tensors, 84.9M
            elements) vs one .sum() per input tensor and vs the formula per tensor.
Each candidate is timed by triton.testing.do_bench (CUDA events, L2 flushed between
calls; return_mode="all"), which gives the median and minimum in the tables. Ratios of
medians are the result; speed is never asserted anywhere.

The GPU window (bash bench/gpu_window.sh, its fused phase) times these kernels against the
same floors in compact form, beside the CUDA C++ ones.

``--device cpu`` runs the same code on CPU tensors through Triton's interpreter with a
wall-clock timer (a smoke test of this script, not a benchmark).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fused_gpu_common import (  # noqa: E402  (the script's own folder, put on sys.path above)
    DTYPES, LLAMA_160M_SHAPES, Results, add_compiled, candidates, make_inputs, paper_table,
)


def _timer(device: str, rep_ms: int):
    """fn -> list of times in seconds."""
    if device == "cuda":
        import triton.testing

        def bench(fn):
            ms = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="all")
            return [t * 1e-3 for t in ms]
    else:
        def bench(fn):
            fn()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return ts
    return bench


def run(args) -> str:
    from gns_kernels.triton import fused

    dev, dt, n = args.device, DTYPES[args.dtype], args.n
    bench = _timer(dev, args.rep)
    shapes = LLAMA_160M_SHAPES if dev == "cuda" else [(7, 5), (33, 64), (0, 3)]
    x = make_inputs(n, dev, dt, shapes)
    d, q, s, scale = x.d, x.q, x.s, x.scale
    cands = candidates("triton.", {
        "variance_norms": lambda: fused.variance_norms(d, q, scale),
        "variance_norms (shift)": lambda: fused.variance_norms(d, q, scale, s),
        "square_pack": lambda: fused.square_pack(d, x.out),
        "square_pack (shift)": lambda: fused.square_pack(d, x.out, s),
        "accumulate_sq": lambda: fused.accumulate_sq(d, x.prev, x.sq),
        "variance_norms_multi": lambda: fused.variance_norms_multi(x.ds, x.qs, scale),
    }, x, n, dev)
    if args.compile:
        add_compiled(cands, x)

    r = Results({k: bench(fn) for k, fn in cands.items()})
    lines = [f"# device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (Triton interpreter)'}, "
             f"host {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
             f"# n = {n} {args.dtype} elements per tensor; multi: {len(x.ds)} tensors, {x.nm} elements"]
    lines += r.candidate_rows()
    extra = ([f"| torch.compile(formula) / floor | {r.ratio('torch.compile(formula)', 'floor: d.sum() + q.sum()')} "
              f"| (peer) |"] if args.compile else [])
    lines += r.ratio_rows("triton.", x.isz, compiled=args.compile, multi_note="(one launch vs 168)", extra=extra)
    lines += r.bandwidth_rows("triton.", n, x.nm, x.isz)
    lines += ["", paper_table()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Triton fused-op kernels vs eager, torch.compile and the floor")
    p.add_argument("--n", type=int, default=2**25, help="elements per tensor (default 2^25)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="gradient dtype")
    p.add_argument("--rep", type=int, default=500, help="do_bench time budget per candidate, ms (CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: Triton interpreter smoke run (not a benchmark)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    p.add_argument("--paper", action="store_true", help="print bytes and 3 TB/s times only (no GPU)")
    a = p.parse_args(argv)
    if a.paper:
        print(paper_table())
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --paper / --device cpu")
    print(run(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
