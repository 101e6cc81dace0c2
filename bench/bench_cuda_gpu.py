"""GPU benchmark of the C++ CUDA fused-op kernels (csrc/cuda) against eager, torch.compile,
the Triton kernels and the bandwidth floor.

Run on a machine with a CUDA GPU, gns_kernels built with its CUDA branch (CUDA torch + nvcc,
`pip install --no-build-isolation -e .`), from the repository root:

    python bench/bench_cuda_gpu.py                      # float32, 2^25 elements
    python bench/bench_cuda_gpu.py --dtype bfloat16     # bf16 gradients (sq/out stay float32)
    python bench/bench_cuda_gpu.py --paper              # bytes, launch config, 3 TB/s times; no GPU
    python bench/bench_cuda_gpu.py --ptxas              # registers/spills/occupancy table (needs nvcc)

Candidates (the same as bench/bench_triton_gpu.py and bench/bench_fused_cpu.py, with the
CUDA kernels in place of theirs, so the tables line up):
  floor     variance_norms: reading its inputs once (one .sum() per input);
            square_pack / accumulate_sq: Tensor.copy_ moving the same bytes (read + write);
  cuda.*    torch.ops.gns_kernels.* on CUDA tensors (the kernels of csrc/cuda);
  triton.*  gns_kernels.triton.fused, when triton imports (peer in the same process);
  eager     the composite torch formula; torch.compile(formula) after warm-up;
  multi     variance_norms_multi over the paper's 160M Llama matrices (84 tensors, 84.9M
            elements) vs one .sum() per input tensor and vs the formula per tensor.
The GPU window (bash bench/gpu_window.sh, its fused phase) times the same kernels against
the same floors in compact form, with this timer, for float32 and bf16 in one call.
Timing: CUDA events around each call, the L2 cache flushed (a 256 MB buffer zeroed) before
each call, repeated for --rep milliseconds; tables give median and minimum. Ratios of
medians are the result; speed is never asserted anywhere.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fused_gpu_common import (  # noqa: E402,F401  (script folder on sys.path; op_bytes re-exported)
    DTYPES, LLAMA_160M_SHAPES, Results, add_compiled, candidates, make_inputs, op_bytes, paper_table,
)

REPO = Path(__file__).resolve().parents[1]

# Launch configuration of csrc/cuda (csrc/cuda/gns_cuda.h).
CHUNK = 65536  # elements per thread block (one reduction slot per block)
BLOCK_THREADS = 256
CLEANUP_THREADS = 512
TENSORS_PER_LAUNCH = 64


def blocks_for(numels) -> int:
    return sum(-(-int(n) // CHUNK) for n in numels)


def launch_table() -> str:
    """Grid sizes and slot buffers for the paper's models (one flat tensor, and the list)."""
    llama = [a * b for a, b in LLAMA_160M_SHAPES]
    cases = [("160M flat tensor", [int(160e6)]), ("1B flat tensor", [int(1e9)]),
             (f"160M Llama list ({len(llama)} tensors, {sum(llama) / 1e6:.1f}M)", llama)]
    rows = ["| input | thread blocks (= slots) | launches (+ 1 cleanup for variance_norms) | "
            "slot buffer | cleanup |",
            "|---|---:|---:|---:|---|"]
    for name, numels in cases:
        nb = blocks_for(numels)
        launches = -(-len(numels) // TENSORS_PER_LAUNCH)
        rows.append(f"| {name} | {nb} | {launches} | {4 * 8 * nb / 1024:.0f} KB (float64) | "
                    f"1 block x {CLEANUP_THREADS} threads |")
    return "\n".join(rows)


def occupancy(regs: int, threads: int = BLOCK_THREADS, smem: int = 0) -> int:
    """Resident blocks per SM on sm_80 / sm_90 (64K registers, 2048 threads, 32 blocks)."""
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    warps = threads // 32
    by_regs = (65536 // warp_regs) // warps
    by_smem = (164 * 1024) // smem if smem else 32
    return min(by_regs, 2048 // threads, 32, by_smem)


def ptxas_table() -> str:
    """Runs tools/check_cuda_build.sh and tabulates its ptxas report."""
    proc = subprocess.run(["bash", str(REPO / "tools" / "check_cuda_build.sh")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stdout + proc.stderr)
    rows = ["| kernel | types | arch | registers | stack B | spill B | smem B | blocks/SM (threads) |",
            "|---|---|---|---:|---:|---:|---:|---|"]
    arch = ""
    name = ""
    for line in proc.stdout.splitlines():
        m = re.match(r"== \S+ (sm_\d+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s+(?:void )?(?:gns_cuda::detail::\(anonymous namespace\)::)?(\w+)(<[^(]*>)?\(", line)
        if m:
            name = m.group(1)
            types = (m.group(2) or "").replace("__nv_bfloat16", "bf16").replace("__half", "fp16")
            types = types.replace("float", "fp32").replace(" ", "")
            continue
        m = re.search(r"Used (\d+) registers.*; (\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m and name:
            regs, stack, spill = int(m.group(1)), int(m.group(2)), int(m.group(3))
            sm = re.search(r"(\d+) bytes smem", line)
            smem = int(sm.group(1)) if sm else 0
            threads = CLEANUP_THREADS if "cleanup" in name else BLOCK_THREADS
            b = occupancy(regs, threads, smem)
            rows.append(f"| {name} | {types} | {arch} | {regs} | {stack} | {spill} | {smem} | "
                        f"{b} ({b * threads}) |")
            name = ""
    return proc.stdout.splitlines()[0] + "\n\n" + "\n".join(rows)


def _timer(rep_ms: int):
    """fn -> list of times in seconds (CUDA events, L2 flushed before every call)."""
    flush = torch.empty(256 * 1024 * 1024 // 4, device="cuda")

    def bench(fn):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        reps = max(10, min(2000, int(rep_ms / max(start.elapsed_time(end), 1e-3))))
        times = []
        for _ in range(reps):
            flush.zero_()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return times

    return bench


def _triton_fused():
    try:
        from gns_kernels.triton import fused
    except ImportError:
        return None
    return fused


def run(args) -> str:
    from gns_kernels import ops

    ops_ = torch.ops.gns_kernels
    if not ops.cpp_available() or "cuda/binding.cpp" not in torch._C._dispatch_dump(
        "gns_kernels::variance_norms"
    ):
        sys.exit("gns_kernels._C has no CUDA kernels from csrc/cuda: build it with a CUDA torch and "
                 "nvcc (pip install --no-build-isolation -e .)")
    dt, n = DTYPES[args.dtype], args.n
    bench = _timer(args.rep)
    x = make_inputs(n, "cuda", dt, LLAMA_160M_SHAPES)
    d, q, s, ds, qs, scale = x.d, x.q, x.s, x.ds, x.qs, x.scale
    cands = candidates("cuda.", {
        "variance_norms": lambda: ops_.variance_norms(d, q, scale, None),
        "variance_norms (shift)": lambda: ops_.variance_norms(d, q, scale, s),
        "square_pack": lambda: ops_.square_pack(d, x.out, None),
        "square_pack (shift)": lambda: ops_.square_pack(d, x.out, s),
        "accumulate_sq": lambda: ops_.accumulate_sq(d, x.prev, x.sq),
        "variance_norms_multi": lambda: ops_.variance_norms_multi(ds, qs, scale, []),
    }, x, n, "cuda")
    fused = _triton_fused() if args.triton else None
    if fused is not None:
        cands["triton.variance_norms"] = lambda: fused.variance_norms(d, q, scale)
        cands["triton.variance_norms_multi"] = lambda: fused.variance_norms_multi(ds, qs, scale)
    if args.compile:
        add_compiled(cands, x)

    r = Results({k: bench(fn) for k, fn in cands.items()})
    lines = [f"# device: {torch.cuda.get_device_name()}, host {platform.machine()} {os.cpu_count()} cpus, "
             f"torch {torch.__version__} (CUDA {torch.version.cuda})",
             f"# n = {n} {args.dtype} elements per tensor; multi: {len(ds)} tensors, {x.nm} elements"]
    lines += r.candidate_rows()
    extra = ([f"| triton.variance_norms / cuda.variance_norms | "
              f"{r.ratio('triton.variance_norms', 'cuda.variance_norms')} | (peer) |",
              f"| triton.variance_norms_multi / cuda.variance_norms_multi | "
              f"{r.ratio('triton.variance_norms_multi', 'cuda.variance_norms_multi')} | (peer) |"]
             if fused is not None else [])
    lines += r.ratio_rows("cuda.", x.isz, compiled=args.compile, multi_note="(2 launches + cleanup vs 168)",
                          extra=extra)
    lines += r.bandwidth_rows("cuda.", n, x.nm, x.isz)
    lines += ["", paper_table(), "", launch_table()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="CUDA fused-op kernels vs eager, torch.compile, Triton and the floor")
    p.add_argument("--n", type=int, default=2**25, help="elements per tensor (default 2^25)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="gradient dtype")
    p.add_argument("--rep", type=int, default=500, help="time budget per candidate, ms")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    p.add_argument("--no-triton", dest="triton", action="store_false", help="skip the Triton peer")
    p.add_argument("--paper", action="store_true", help="bytes, launch config and 3 TB/s times only (no GPU)")
    p.add_argument("--ptxas", action="store_true", help="registers/spills/occupancy table (needs nvcc, no GPU)")
    a = p.parse_args(argv)
    if a.paper:
        print(paper_table() + "\n\n" + launch_table())
        return 0
    if a.ptxas:
        print(ptxas_table())
        return 0
    if not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --paper / --ptxas")
    print(run(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
