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
Timing: CUDA events around each call, the L2 cache flushed (a 256 MB buffer zeroed) before
each call, repeated for --rep milliseconds; tables give median and minimum. Ratios of
medians are the result; speed is never asserted anywhere.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAPER_MODELS = {"160M": 160e6, "1B": 1e9}
BANDWIDTH = 3e12  # bytes/s (H100 SXM: about 3.35 TB/s)

# Launch configuration of csrc/cuda (csrc/cuda/gns_cuda.h).
CHUNK = 65536  # elements per thread block (one reduction slot per block)
BLOCK_THREADS = 256
CLEANUP_THREADS = 512
TENSORS_PER_LAUNCH = 64

# The paper's 160M Llama without embeddings (issue 6): 12 layers x (q, k, v, o: 768x768;
# gate, up: 2048x768; down: 768x2048).
LLAMA_160M_SHAPES = ([(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]) * 12


def op_bytes(op: str, n: int, itemsize: int, shift: bool = False, prev_itemsize: int | None = None) -> int:
    """Bytes an op must move for n elements of a gradient dtype of ``itemsize`` bytes."""
    if op == "variance_norms":  # read mean_grad, mean_sq (+ shift)
        return n * itemsize * (3 if shift else 2)
    if op == "square_pack":  # read grad (+ shift), write 2n float32
        return n * itemsize * (2 if shift else 1) + 8 * n
    if op == "accumulate_sq":  # read grad, prev, sq (float32); write sq, prev
        p = itemsize if prev_itemsize is None else prev_itemsize
        return n * (itemsize + 2 * p + 8)
    raise ValueError(f"op: unknown {op!r}")


def blocks_for(numels) -> int:
    return sum(-(-int(n) // CHUNK) for n in numels)


def paper_table() -> str:
    rows = ["| op | gradient dtype | bytes / param | 160M @ 3 TB/s | 1B @ 3 TB/s |",
            "|---|---|---:|---:|---:|"]
    for name, op, shift in [("variance_norms", "variance_norms", False),
                            ("variance_norms + shift", "variance_norms", True),
                            ("square_pack", "square_pack", False),
                            ("square_pack + shift", "square_pack", True),
                            ("accumulate_sq", "accumulate_sq", False)]:
        for dt, size in (("float32", 4), ("bfloat16", 2)):
            b = op_bytes(op, 1, size, shift)
            t = [op_bytes(op, int(p), size, shift) / BANDWIDTH * 1e3 for p in PAPER_MODELS.values()]
            rows.append(f"| {name} | {dt} | {b} | {t[0]:.3f} ms | {t[1]:.3f} ms |")
    return "\n".join(rows)


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


def eager_formula(d, q, scale: float):
    """The composite torch formula of variance_norms (float32, NaN-preserving clamp)."""
    d = d.float()
    q = q.float()
    s2 = scale * (q - d * d)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)
    return torch.stack([s2.sqrt().sum(), d.abs().sum(), s2.sum(), (d * d).sum()])


def eager_multi(ds, qs, scale: float):
    return sum(eager_formula(d, q, scale) for d, q in zip(ds, qs))


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
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(n, generator=gen).to("cuda", dt)
    q = (d.float() ** 2 + 1).to(dt)
    s = torch.randn(n, generator=gen).to("cuda", dt)
    prev = torch.randn(n, generator=gen).to("cuda", dt)
    sq = torch.zeros(n, device="cuda")
    out = torch.empty(2 * n, device="cuda")
    isz = d.element_size()
    scale = 3.0
    ds = [torch.randn(*sh, generator=gen).to("cuda", dt) for sh in LLAMA_160M_SHAPES]
    qs = [(x.float() ** 2 + 1).to(dt) for x in ds]
    nm = sum(x.numel() for x in ds)

    def copy_of(nbytes):
        m = max(1, nbytes // 8)  # float32 copy_: 4 bytes read + 4 written per element
        src, dst = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        return lambda: dst.copy_(src)

    c_sp = f"copy_ ({op_bytes('square_pack', 1, isz)}n bytes)"
    c_sp2 = f"copy_ ({op_bytes('square_pack', 1, isz, True)}n bytes)"
    c_acc = f"copy_ ({op_bytes('accumulate_sq', 1, isz)}n bytes)"
    cands = {
        "floor: d.sum() + q.sum()": lambda: (d.sum(), q.sum()),
        "cuda.variance_norms": lambda: ops_.variance_norms(d, q, scale, None),
        "floor (3 inputs): d,q,s .sum()": lambda: (d.sum(), q.sum(), s.sum()),
        "cuda.variance_norms (shift)": lambda: ops_.variance_norms(d, q, scale, s),
        "eager formula": lambda: eager_formula(d, q, scale),
        c_sp: copy_of(op_bytes("square_pack", n, isz)),
        "cuda.square_pack": lambda: ops_.square_pack(d, out, None),
        c_sp2: copy_of(op_bytes("square_pack", n, isz, True)),
        "cuda.square_pack (shift)": lambda: ops_.square_pack(d, out, s),
        c_acc: copy_of(op_bytes("accumulate_sq", n, isz)),
        "cuda.accumulate_sq": lambda: ops_.accumulate_sq(d, prev, sq),
        "multi floor: .sum() per input": lambda: [(x.sum(), y.sum()) for x, y in zip(ds, qs)],
        "cuda.variance_norms_multi": lambda: ops_.variance_norms_multi(ds, qs, scale, []),
        "multi eager formula": lambda: eager_multi(ds, qs, scale),
    }
    fused = _triton_fused() if args.triton else None
    if fused is not None:
        cands["triton.variance_norms"] = lambda: fused.variance_norms(d, q, scale)
        cands["triton.variance_norms_multi"] = lambda: fused.variance_norms_multi(ds, qs, scale)
    if args.compile:
        comp = torch.compile(eager_formula)
        comp_multi = torch.compile(eager_multi)
        for _ in range(3):  # compile + warm-up outside the timing
            comp(d, q, scale)
            comp_multi(ds, qs, scale)
        cands["torch.compile(formula)"] = lambda: comp(d, q, scale)
        cands["multi torch.compile(formula)"] = lambda: comp_multi(ds, qs, scale)

    times = {k: bench(fn) for k, fn in cands.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    mn = {k: min(v) for k, v in times.items()}
    lines = [f"# device: {torch.cuda.get_device_name()}, host {platform.machine()} {os.cpu_count()} cpus, "
             f"torch {torch.__version__} (CUDA {torch.version.cuda})",
             f"# n = {n} {args.dtype} elements per tensor; multi: {len(ds)} tensors, {nm} elements",
             "", "| candidate | median ms | min ms | rounds |", "|---|---:|---:|---:|"]
    for k, v in times.items():
        lines.append(f"| {k} | {med[k] * 1e3:.3f} | {mn[k] * 1e3:.3f} | {len(v)} |")

    def ratio(a, b):
        return f"{med[a] / med[b]:.2f} (min: {mn[a] / mn[b]:.2f})"

    lines += ["", "| ratio (medians; minima in brackets) | value | target |", "|---|---:|---|",
              f"| variance_norms / floor | {ratio('cuda.variance_norms', 'floor: d.sum() + q.sum()')} | <= 1.25 |",
              f"| variance_norms (shift) / 3-input floor | "
              f"{ratio('cuda.variance_norms (shift)', 'floor (3 inputs): d,q,s .sum()')} | <= 1.25 |",
              f"| eager formula / variance_norms | {ratio('eager formula', 'cuda.variance_norms')} | >= 20 (CPU target) |"]
    if args.compile:
        lines += [f"| torch.compile(formula) / variance_norms | "
                  f"{ratio('torch.compile(formula)', 'cuda.variance_norms')} | >= 1 |"]
    if fused is not None:
        lines += [f"| triton.variance_norms / cuda.variance_norms | "
                  f"{ratio('triton.variance_norms', 'cuda.variance_norms')} | (peer) |",
                  f"| triton.variance_norms_multi / cuda.variance_norms_multi | "
                  f"{ratio('triton.variance_norms_multi', 'cuda.variance_norms_multi')} | (peer) |"]
    lines += [f"| square_pack / copy_ same bytes | {ratio('cuda.square_pack', c_sp)} | <= 1.5 |",
              f"| square_pack (shift) / copy_ same bytes | {ratio('cuda.square_pack (shift)', c_sp2)} | <= 1.5 |",
              f"| accumulate_sq / copy_ same bytes | {ratio('cuda.accumulate_sq', c_acc)} | <= 1.5 |",
              f"| variance_norms_multi / multi floor | "
              f"{ratio('cuda.variance_norms_multi', 'multi floor: .sum() per input')} | (2 launches + cleanup vs 168) |",
              f"| multi eager / variance_norms_multi | {ratio('multi eager formula', 'cuda.variance_norms_multi')} | |"]
    if args.compile:
        lines.append(f"| multi torch.compile / variance_norms_multi | "
                     f"{ratio('multi torch.compile(formula)', 'cuda.variance_norms_multi')} | >= 1 |")
    lines += ["", "| effective bandwidth (median) | GB/s |", "|---|---:|"]
    for k, b in [("cuda.variance_norms", op_bytes("variance_norms", n, isz)),
                 ("cuda.square_pack", op_bytes("square_pack", n, isz)),
                 ("cuda.accumulate_sq", op_bytes("accumulate_sq", n, isz)),
                 ("floor: d.sum() + q.sum()", op_bytes("variance_norms", n, isz)),
                 ("cuda.variance_norms_multi", op_bytes("variance_norms", nm, isz))]:
        lines.append(f"| {k} | {b / med[k] / 1e9:.1f} |")
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
