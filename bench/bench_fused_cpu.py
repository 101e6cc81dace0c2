"""Benchmark of the fused CPU ops against their peers, as ratios measured in one process.

    python bench/bench_fused_cpu.py [--n 33554432] [--reps 30] [--threads 2]

- variance_norms vs the bandwidth floor (a.sum() + b.sum(): reading its two inputs once),
  vs the eager composite formula, vs the same formula under torch.compile (after warm-up);
- square_pack and accumulate_sq vs Tensor.copy_ moving the same bytes (read + written).

Candidates are timed round-robin (one call of each per round) so that load from other
processes on a shared machine hits them alike; the table gives the median and the minimum
over the rounds, and ratios of medians. Also prints bytes per parameter of every op and the
implied time at 3 TB/s for the paper's 160M and 1B models. Speed is never asserted.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import gns_kernels as gk


def eager_formula(d: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """The composite torch formula of variance_norms (float32, NaN-preserving clamp)."""
    s2 = scale * (q - d * d)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)
    return torch.stack([s2.sqrt().sum(), d.abs().sum(), s2.sum(), (d * d).sum()])


def time_round_robin(cands: dict, rounds: int, warmup: int = 2) -> dict:
    for fn in cands.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in cands}
    for _ in range(rounds):
        for k, fn in cands.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 25, help="elements per tensor (float32)")
    ap.add_argument("--reps", type=int, default=30, help="rounds of the fast candidates")
    ap.add_argument("--eager-reps", type=int, default=5, help="rounds of the eager formula")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.n
    torch.manual_seed(0)
    d = torch.randn(n)
    q = d * d + torch.rand(n)
    s = torch.randn(n)
    scale = 3.0

    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"# n = {n} float32 elements per tensor ({n * 4 / 2**20:.0f} MiB)")

    compiled = torch.compile(eager_formula)
    for _ in range(3):
        compiled(d, q, scale)  # compile + warm-up

    vn = {
        "floor: d.sum() + q.sum()": lambda: (d.sum(), q.sum()),
        "gk.variance_norms": lambda: gk.variance_norms(d, q, scale),
        "torch.compile(formula)": lambda: compiled(d, q, scale),
        "floor (3 inputs): d,q,s .sum()": lambda: (d.sum(), q.sum(), s.sum()),
        "gk.variance_norms (shift)": lambda: gk.variance_norms(d, q, scale, s),
    }
    t_vn = time_round_robin(vn, args.reps)
    t_eager = time_round_robin({"eager formula": lambda: eager_formula(d, q, scale)}, args.eager_reps, warmup=1)
    t_vn.update(t_eager)

    # square_pack: reads 4n, writes 8n = 12n bytes -> copy_ of 1.5n floats (reads 6n, writes 6n)
    out = torch.empty(2 * n)
    src_sp, dst_sp = torch.randn(3 * n // 2), torch.empty(3 * n // 2)
    # with shift: reads 8n, writes 8n -> copy_ of 2n floats
    src_sp2, dst_sp2 = torch.randn(2 * n), torch.empty(2 * n)
    # accumulate_sq: reads grad, prev, sq (12n), writes sq, prev (8n) = 20n -> copy_ of 2.5n floats
    prev, sq = torch.randn(n), torch.zeros(n)
    src_acc, dst_acc = torch.randn(5 * n // 2), torch.empty(5 * n // 2)
    el = {
        "copy_ 1.5n floats (12n bytes)": lambda: dst_sp.copy_(src_sp),
        "gk.square_pack": lambda: gk.square_pack(d, out),
        "copy_ 2n floats (16n bytes)": lambda: dst_sp2.copy_(src_sp2),
        "gk.square_pack (shift)": lambda: gk.square_pack(d, out, s),
        "copy_ 2.5n floats (20n bytes)": lambda: dst_acc.copy_(src_acc),
        "gk.accumulate_sq": lambda: gk.accumulate_sq(d, prev, sq),
    }
    t_el = time_round_robin(el, args.reps)

    med = {k: statistics.median(v) for k, v in {**t_vn, **t_el}.items()}
    mn = {k: min(v) for k, v in {**t_vn, **t_el}.items()}
    print("\n| candidate | median ms | min ms | rounds |\n|---|---:|---:|---:|")
    for k, v in {**t_vn, **t_el}.items():
        print(f"| {k} | {med[k] * 1e3:.2f} | {mn[k] * 1e3:.2f} | {len(v)} |")

    def ratio(a, b):
        return f"{med[a] / med[b]:.2f} (min: {mn[a] / mn[b]:.2f})"

    print("\n| ratio (medians; minima in brackets) | value | target |\n|---|---:|---|")
    print(f"| variance_norms / floor | {ratio('gk.variance_norms', 'floor: d.sum() + q.sum()')} | <= 1.25 |")
    print(f"| variance_norms (shift) / 3-input floor | "
          f"{ratio('gk.variance_norms (shift)', 'floor (3 inputs): d,q,s .sum()')} | <= 1.25 |")
    print(f"| eager formula / variance_norms | {ratio('eager formula', 'gk.variance_norms')} | >= 20 |")
    print(f"| torch.compile(formula) / variance_norms | {ratio('torch.compile(formula)', 'gk.variance_norms')} | >= 1 |")
    print(f"| torch.compile(formula) / floor | {ratio('torch.compile(formula)', 'floor: d.sum() + q.sum()')} | (peer) |")
    print(f"| square_pack / copy_ same bytes | {ratio('gk.square_pack', 'copy_ 1.5n floats (12n bytes)')} | <= 1.5 |")
    print(f"| square_pack (shift) / copy_ same bytes | "
          f"{ratio('gk.square_pack (shift)', 'copy_ 2n floats (16n bytes)')} | <= 1.5 |")
    print(f"| accumulate_sq / copy_ same bytes | {ratio('gk.accumulate_sq', 'copy_ 2.5n floats (20n bytes)')} | <= 1.5 |")

    gbs = {k: b * n / med[k] / 1e9 for k, b in [("gk.variance_norms", 8), ("gk.square_pack", 12),
                                                 ("gk.accumulate_sq", 20), ("floor: d.sum() + q.sum()", 8)]}
    print("\n| effective bandwidth (median) | GB/s |\n|---|---:|")
    for k, v in gbs.items():
        print(f"| {k} | {v:.1f} |")

    print("\n| op (float32 gradients) | bytes / param | 160M @ 3 TB/s | 1B @ 3 TB/s |\n|---|---:|---:|---:|")
    for name, b in [("variance_norms", 8), ("variance_norms + shift", 12), ("square_pack", 12),
                    ("square_pack + shift", 16), ("accumulate_sq", 20)]:
        print(f"| {name} | {b} | {160e6 * b / 3e12 * 1e3:.2f} ms | {1e9 * b / 3e12 * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
