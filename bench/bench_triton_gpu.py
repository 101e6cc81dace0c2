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

``--device cpu`` runs the same code on CPU tensors through Triton's interpreter with a
wall-clock timer (a smoke test of this script, not a benchmark).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAPER_MODELS = {"160M": 160e6, "1B": 1e9}
BANDWIDTH = 3e12  # bytes/s (H100 SXM: about 3.35 TB/s)

# The paper's 160M Llama without embeddings (issue 6): 12 layers x (q, k, v, o: 768x768;
# gate, up: 2048x768; down: 768x2048).
LLAMA_160M_SHAPES = ([(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]) * 12


def op_bytes(op: str, n: int, itemsize: int, shift: bool = False) -> int:
    """Bytes an op must move for n elements of a gradient dtype of ``itemsize`` bytes."""
    if op == "variance_norms":  # read mean_grad, mean_sq (+ shift)
        return n * itemsize * (3 if shift else 2)
    if op == "square_pack":  # read grad (+ shift), write 2n float32
        return n * itemsize * (2 if shift else 1) + 8 * n
    if op == "accumulate_sq":  # read grad, prev, sq (float32); write sq, prev
        return n * (3 * itemsize + 8) if itemsize == 4 else n * (2 * itemsize + 4 + 4 + itemsize)
    raise ValueError(f"op: unknown {op!r}")


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


def eager_formula(d, q, scale: float):
    """The composite torch formula of variance_norms (float32, NaN-preserving clamp)."""
    d = d.float()
    q = q.float()
    s2 = scale * (q - d * d)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)
    return torch.stack([s2.sqrt().sum(), d.abs().sum(), s2.sum(), (d * d).sum()])


def eager_multi(ds, qs, scale: float):
    return sum(eager_formula(d, q, scale) for d, q in zip(ds, qs))


def run(args) -> str:
    from gns_kernels.triton import fused

    dev, dt, n = args.device, DTYPES[args.dtype], args.n
    bench = _timer(dev, args.rep)
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(n, generator=gen).to(dev, dt)
    q = (d.float() ** 2 + 1).to(dt)
    s = torch.randn(n, generator=gen).to(dev, dt)
    prev = torch.randn(n, generator=gen).to(dev, dt)
    sq = torch.zeros(n, device=dev)
    out = torch.empty(2 * n, device=dev)
    isz = d.element_size()
    scale = 3.0
    shapes = LLAMA_160M_SHAPES if dev == "cuda" else [(7, 5), (33, 64), (0, 3)]
    ds = [torch.randn(*sh, generator=gen).to(dev, dt) for sh in shapes]
    qs = [(x.float() ** 2 + 1).to(dt) for x in ds]
    nm = sum(x.numel() for x in ds)

    def copy_of(nbytes):
        m = max(1, nbytes // 8)  # float32 copy_: 4 bytes read + 4 written per element
        src, dst = torch.empty(m, device=dev), torch.empty(m, device=dev)
        return lambda: dst.copy_(src)

    cands = {
        "floor: d.sum() + q.sum()": lambda: (d.sum(), q.sum()),
        "triton.variance_norms": lambda: fused.variance_norms(d, q, scale),
        "floor (3 inputs): d,q,s .sum()": lambda: (d.sum(), q.sum(), s.sum()),
        "triton.variance_norms (shift)": lambda: fused.variance_norms(d, q, scale, s),
        "eager formula": lambda: eager_formula(d, q, scale),
        f"copy_ ({op_bytes('square_pack', 1, isz)}n bytes)": copy_of(op_bytes("square_pack", n, isz)),
        "triton.square_pack": lambda: fused.square_pack(d, out),
        f"copy_ ({op_bytes('square_pack', 1, isz, True)}n bytes)": copy_of(op_bytes("square_pack", n, isz, True)),
        "triton.square_pack (shift)": lambda: fused.square_pack(d, out, s),
        f"copy_ ({op_bytes('accumulate_sq', 1, isz)}n bytes)": copy_of(op_bytes("accumulate_sq", n, isz)),
        "triton.accumulate_sq": lambda: fused.accumulate_sq(d, prev, sq),
        "multi floor: .sum() per input": lambda: [(x.sum(), y.sum()) for x, y in zip(ds, qs)],
        "triton.variance_norms_multi": lambda: fused.variance_norms_multi(ds, qs, scale),
        "multi eager formula": lambda: eager_multi(ds, qs, scale),
    }
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
    lines = [f"# device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (Triton interpreter)'}, "
             f"host {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
             f"# n = {n} {args.dtype} elements per tensor; multi: {len(ds)} tensors, {nm} elements",
             "", "| candidate | median ms | min ms | rounds |", "|---|---:|---:|---:|"]
    for k, v in times.items():
        lines.append(f"| {k} | {med[k] * 1e3:.3f} | {mn[k] * 1e3:.3f} | {len(v)} |")

    def ratio(a, b):
        return f"{med[a] / med[b]:.2f} (min: {mn[a] / mn[b]:.2f})"

    c_sp, c_sp2, c_acc = (f"copy_ ({op_bytes('square_pack', 1, isz)}n bytes)",
                          f"copy_ ({op_bytes('square_pack', 1, isz, True)}n bytes)",
                          f"copy_ ({op_bytes('accumulate_sq', 1, isz)}n bytes)")
    lines += ["", "| ratio (medians; minima in brackets) | value | target |", "|---|---:|---|",
              f"| variance_norms / floor | {ratio('triton.variance_norms', 'floor: d.sum() + q.sum()')} | <= 1.25 |",
              f"| variance_norms (shift) / 3-input floor | "
              f"{ratio('triton.variance_norms (shift)', 'floor (3 inputs): d,q,s .sum()')} | <= 1.25 |",
              f"| eager formula / variance_norms | {ratio('eager formula', 'triton.variance_norms')} | >= 20 (CPU target) |"]
    if args.compile:
        lines += [f"| torch.compile(formula) / variance_norms | "
                  f"{ratio('torch.compile(formula)', 'triton.variance_norms')} | >= 1 |",
                  f"| torch.compile(formula) / floor | {ratio('torch.compile(formula)', 'floor: d.sum() + q.sum()')} | (peer) |"]
    lines += [f"| square_pack / copy_ same bytes | {ratio('triton.square_pack', c_sp)} | <= 1.5 |",
              f"| square_pack (shift) / copy_ same bytes | {ratio('triton.square_pack (shift)', c_sp2)} | <= 1.5 |",
              f"| accumulate_sq / copy_ same bytes | {ratio('triton.accumulate_sq', c_acc)} | <= 1.5 |",
              f"| variance_norms_multi / multi floor | "
              f"{ratio('triton.variance_norms_multi', 'multi floor: .sum() per input')} | (one launch vs 168) |",
              f"| multi eager / variance_norms_multi | {ratio('multi eager formula', 'triton.variance_norms_multi')} | |"]
    if args.compile:
        lines.append(f"| multi torch.compile / variance_norms_multi | "
                     f"{ratio('multi torch.compile(formula)', 'triton.variance_norms_multi')} | >= 1 |")
    lines += ["", "| effective bandwidth (median) | GB/s |", "|---|---:|"]
    for k, b in [("triton.variance_norms", op_bytes("variance_norms", n, isz)),
                 ("triton.square_pack", op_bytes("square_pack", n, isz)),
                 ("triton.accumulate_sq", op_bytes("accumulate_sq", n, isz)),
                 ("floor: d.sum() + q.sum()", op_bytes("variance_norms", n, isz)),
                 ("triton.variance_norms_multi", op_bytes("variance_norms", nm, isz))]:
        lines.append(f"| {k} | {b / med[k] / 1e9:.1f} |")
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
