"""S1 (nuclear) GNS measurement cost: gns_kernels.spectral vs the eager loop a user writes.

One full S1 measurement on the paper's 160M Llama 3 shapes without embeddings
(12 layers x (q, k, v, o: 768x768; gate, up: 2048x768; down: 768x2048)), R ranks
(default 2), simulated in one process: every rank's local Grams (smaller side), the mean
Gram, C = B/(R-1) (mean Gram - G G^T), tr(C^{1/2}) and ||G||_S1 per matrix. The mean
gradient G itself is computed before the timed region for every peer: it is what DDP's
gradient all-reduce gives each rank whether or not the GNS is measured.

Peers, timed in the same process, interleaved (gk, eager32, eager64, then again), best of
--repeat:
  eager32  per-layer loop in float32: G_j @ G_j.T per rank, G @ G.T, eigvalsh(C) and
           eigvalsh(G G^T), clamp, sqrt, sum (the smaller side, as the paper's m <= n)
  eager64  the same loop in float64
  gk       gk.gram per rank (batched by shape) + gk.nuclear_stats(method="eigh")
Then per-size sqrt-trace cost of eigh vs newton, and FLOP counts with the implied H100
time (bench/RESULTS.md). Speed is reported as ratios; nothing here asserts a time.

    python bench/bench_spectral.py [--repeat 2] [--layers 12] [--ranks 2] [--json out.json]

``--share``: instead, R gloo processes (one thread each) run one rank's whole nuclear
measurement as the DDP hook does it, two paths interleaved (old, new, old, new, ...):
  old  every rank solves all 2L sqrt-traces (spectral.nuclear_stats, bias-corrected, with
       eigensolver hints, as the hook's default)
  new  each rank solves its share (gns_kernels.distributed._share: LPT by 2 k^3 per matrix) and one
       all-reduce of 3L float64 shares the results
Both include the rank's local Grams and the all-reduce of all Grams (the same work in
both paths); the mean gradient is reduced before the timed region (plain DDP does that).
Per repetition the measurement's time is the slowest rank's; reported: best of --repeat
per path, the ratio new / old per interleaved pair, the same for each rank's process CPU
time (the work, insensitive to waiting for cores on a loaded machine), the Gram part's
wall time, and the totals of both paths (they agree to rounding). The first pair pays the
eigensolver's float32 attempts before the hints exist; later pairs are the steady state.

    python bench/bench_spectral.py --share [--ranks 2] [--layers 12] [--repeat 2]

The machine this was written on has 2 cores shared with other jobs: run it once or twice.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import gns_kernels as gk
from gns_kernels import spectral as sp
from gns_kernels.spectral.grams import GRAM_BLOCK

SHAPES_160M = [(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]
H100_FP32 = 60e12  # FLOP/s, fp32 without tensor cores: the estimated H100 times below
H100_BF16 = 750e12
PAPER_STEP_S = 0.447  # 160M baseline s/step (paper Table 9)
PAPER_S1_OVERHEAD = 0.139  # +13.9% at F = 100


def make_grads(layers: int, R: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = SHAPES_160M * layers
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(R)]


def mean_gradients(rank_grads) -> list[torch.Tensor]:
    """The mean gradient per layer: what DDP's gradient all-reduce hands every rank, with or
    without a GNS measurement, so it is computed before the timed region of both peers."""
    R = len(rank_grads)
    return [sum(xs) / R for xs in zip(*rank_grads)]


def allreduce_mean(ts: list[torch.Tensor]) -> torch.Tensor:
    """The Grams' all-reduce (mean over ranks) simulated in place in the first rank's
    tensor, as the collective does; the same glue for every peer."""
    out = ts[0]
    for t in ts[1:]:
        out.add_(t)
    return out.div_(len(ts))


def eager_loop(rank_grads, mean_grads, B: float, dtype) -> tuple[float, float]:
    R = len(rank_grads)
    scale = B / (R - 1)
    noise = signal = 0.0
    for p in range(len(rank_grads[0])):
        xs = [rg[p].to(dtype) for rg in rank_grads]
        G = mean_grads[p].to(dtype)
        if xs[0].shape[0] > xs[0].shape[1]:
            xs = [x.T for x in xs]
            G = G.T
        mean_gram = allreduce_mean([x @ x.T for x in xs])
        GG = G @ G.T
        C = scale * (mean_gram - GG)
        noise += torch.linalg.eigvalsh(C).clamp_min(0).sqrt().sum()
        signal += torch.linalg.eigvalsh(GG).clamp_min(0).sqrt().sum()
    return float(noise), float(signal)


def gk_measure(rank_grads, mean_grads, B: float, method: str = "eigh") -> tuple[float, float]:
    R = len(rank_grads)
    local = [gk.gram(rg) for rg in rank_grads]  # each rank: its local Grams, batched by shape
    mean_grams = [allreduce_mean(list(gs)) for gs in zip(*local)]  # as in eager_loop
    del local  # the other ranks' Grams: on their own ranks in a real run
    n, s = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), method=method)
    return float(n.double().sum()), float(s.double().sum())


CPU_TIMES: dict = {}


def timeit(fn, repeat: int, label: str | None = None) -> tuple[float, object]:
    """Best wall time of ``repeat`` runs; the process CPU time of that run goes to CPU_TIMES
    (all threads: on a shared machine it shows the work done, the wall time the waiting)."""
    best, out = math.inf, None
    for _ in range(repeat):
        c = time.process_time()
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
        if dt < best:
            best = dt
            if label:
                CPU_TIMES[label] = time.process_time() - c
        print(f"  {label or fn.__name__}: {dt:.3f} s wall", flush=True)
    return best, out


def interleaved(fns: dict, repeat: int) -> dict:
    """{label: (best wall time, result)} with the peers run in turn, ``repeat`` rounds
    (peer A, peer B, ..., then again), so load drifts on a shared machine hit all alike."""
    best = {k: (math.inf, None) for k in fns}
    for _ in range(repeat):
        for label, fn in fns.items():
            c = time.process_time()
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            if dt < best[label][0]:
                best[label] = (dt, out)
                CPU_TIMES[label] = time.process_time() - c
            print(f"  {label}: {dt:.3f} s wall", flush=True)
    return best


def parts(rank_grads, mean_grads, B: float, repeat: int) -> dict:
    """Gram part and sqrt-trace part separately (float32 eager vs gk)."""
    R = len(rank_grads)

    def eager_grams():
        out = []
        for p in range(len(rank_grads[0])):
            tall = rank_grads[0][p].shape[0] > rank_grads[0][p].shape[1]
            xs = [rg[p].T if tall else rg[p] for rg in rank_grads]
            out.append(allreduce_mean([x @ x.T for x in xs]))
            G = mean_grads[p].T if tall else mean_grads[p]
            out.append(G @ G.T)
        return out

    def gk_grams():
        local = [gk.gram(rg) for rg in rank_grads]
        return gk.gram(mean_grads) + [allreduce_mean(list(gs)) for gs in zip(*local)]

    t_eg, mats = timeit(eager_grams, repeat, "grams_eager32")
    t_gg, _ = timeit(gk_grams, repeat, "grams_gk")
    stack = torch.stack(mats)
    t_ee, _ = timeit(lambda: [torch.linalg.eigvalsh(a).clamp_min(0).sqrt().sum() for a in mats], repeat,
                     "traces_eager32")
    t_ge, _ = timeit(lambda: gk.sqrt_trace(stack, "eigh"), repeat, "traces_gk_eigh")
    return {"grams_eager32_s": t_eg, "grams_gk_s": t_gg, "traces_eager32_s": t_ee, "traces_gk_eigh_s": t_ge,
            "n_traces": len(mats)}


def per_size(sizes, repeat: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(1)
    for m in sizes:
        b = 4 if m <= 256 else 2
        X = torch.randn(b, m, 2 * m, generator=g)
        A = X @ X.mT
        t_e, ve = timeit(lambda: gk.sqrt_trace(A, "eigh"), repeat)
        t_n, vn = timeit(lambda: gk.sqrt_trace(A, "newton"), 1)
        t_1, _ = timeit(lambda: [torch.linalg.eigvalsh(a) for a in A], repeat)
        rows.append({"m": m, "eigh_ms": 1e3 * t_e / b, "newton_ms": 1e3 * t_n / b,
                     "eager_eigvalsh32_ms": 1e3 * t_1 / b,
                     "newton_over_eigh": t_n / t_e,
                     "newton_rel_err": float(((vn.double() - ve.double()) / ve.double()).abs().max())})
    return rows


def flops(layers: int, R: int) -> dict:
    """FLOPs of one measurement (all ranks' Grams counted, as simulated here) and per rank."""
    gram_full = sum(2 * min(s) ** 2 * max(s) for s in SHAPES_160M) * layers  # one set of Grams
    k = 768
    n_mats = 2 * len(SHAPES_160M) * layers  # noise + signal
    nb = -(-k // GRAM_BLOCK)
    tri_cpu = nb * (nb + 1) / 2 / nb**2
    T = -(-k // 64)
    tri_gpu = (T + 1) / (2 * T)
    eig = n_mats * (4 / 3) * k**3  # tridiagonalization dominates eigenvalues-only syevd
    it = sp.newton_min_iters() + 3
    newton = n_mats * (3 * it + 7) * 2 * k**3
    per_rank_grams = 2 * gram_full * tri_gpu  # own local Grams + the mean gradient's Grams
    return {
        "grams_all_ranks_full": (R + 1) * gram_full,
        "grams_all_ranks_cpu_blocked": (R + 1) * gram_full * tri_cpu,
        "grams_per_rank_gpu_triangle": per_rank_grams,
        "eigh_all": eig, "newton_all": newton, "newton_iters": it,
        "h100_per_rank_newton_s": (per_rank_grams + newton) / H100_FP32,
        "h100_per_rank_grams_only_s": per_rank_grams / H100_FP32,
        "paper_s_per_measurement": PAPER_S1_OVERHEAD * PAPER_STEP_S * 100,
    }


def _share_rank(rank: int, world: int, folder: str, layers: int, B: float, repeat: int) -> None:
    """One rank of --share (a spawned process): results to folder/rank{r}.json."""
    import torch.distributed as dist

    from gns_kernels.distributed._share import SolveShare

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                            rank=rank, world_size=world)
    g = torch.Generator().manual_seed(100 + rank)
    local = [torch.randn(*s_, generator=g) for s_ in SHAPES_160M * layers]
    means = [t.clone() for t in local]
    for t in means:  # the gradient all-reduce of plain DDP: before the timed region
        dist.all_reduce(t)
        t.div_(world)
    scale = B / (world - 1)
    per_layer = len(SHAPES_160M)

    part_s = {}

    def grams():  # the rank's local Grams, then their all-reduce (both paths alike)
        t0 = time.perf_counter()
        gs = gk.gram(local)
        flat = torch.cat([x.reshape(-1) for x in gs])
        dist.all_reduce(flat)
        flat.div_(world)
        out, q = [], 0
        for x in gs:
            out.append(flat[q:q + x.numel()].view(x.shape))
            q += x.numel()
        part_s["grams"] = time.perf_counter() - t0
        return out

    hints_old, hints_new = sp.EigHints(), sp.EigHints()

    def old():
        mg = grams()
        n, s_ = sp.nuclear_stats(mg, means, scale=scale, bias_correction=True, num_samples=world,
                                 batch_size=B, eig_hints=hints_old)
        hints_old.apply()
        return float(n.double().sum()), float(s_.double().sum())

    def new():
        mg = grams()
        share = SolveShare(world, rank, scale, True, world, B, hints=hints_new)
        for i in range(0, len(mg), per_layer):  # one part per layer, as DDP buckets
            share.add_grads(mg[i:i + per_layer], means[i:i + per_layer], None)
        share.launch(dist.group.WORLD, dist.all_reduce)
        out = share.read()
        hints_new.apply()
        return out

    rows = []
    for _ in range(repeat):
        for label, fn in (("old", old), ("new", new)):
            dist.barrier()
            c = time.process_time()
            t = time.perf_counter()
            val = fn()
            dt = time.perf_counter() - t
            rows.append({"path": label, "s": dt, "cpu_s": time.process_time() - c,
                         "grams_s": part_s["grams"], "values": val})
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "rows": rows, "load_avg": os.getloadavg()}, f)
    dist.barrier()
    dist.destroy_process_group()


def share_bench(layers: int, world: int, B: float, repeat: int) -> dict:
    """--share: the two paths on ``world`` gloo processes (module docstring)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gns_share_") as folder:
        mp.start_processes(_share_rank, args=(world, folder, layers, B, repeat), nprocs=world,
                           join=True, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    n_rows = len(ranks[0]["rows"])
    # per repetition and path: the measurement ends when the slowest rank is done
    slowest = [max(rk["rows"][i]["s"] for rk in ranks) for i in range(n_rows)]
    paths = [ranks[0]["rows"][i]["path"] for i in range(n_rows)]
    best = {p: min(t for t, q in zip(slowest, paths) if q == p) for p in ("old", "new")}
    pairs = [slowest[i + 1] / slowest[i] for i in range(0, n_rows, 2)]
    # CPU time of each rank's process (one thread): the work done, insensitive to waiting
    # for the cores on a loaded machine
    cpu = [max(rk["rows"][i]["cpu_s"] for rk in ranks) for i in range(n_rows)]
    cpu_pairs = [cpu[i + 1] / cpu[i] for i in range(0, n_rows, 2)]
    grams = [max(rk["rows"][i]["grams_s"] for rk in ranks) for i in range(n_rows)]
    v_old = ranks[0]["rows"][0]["values"]
    v_new = ranks[0]["rows"][1]["values"]
    return {"layers": layers, "ranks": world, "matrices": len(SHAPES_160M) * layers,
            "per_rep_slowest_rank_s": list(zip(paths, slowest)),
            "per_rank_s": [[(row["path"], row["s"]) for row in rk["rows"]] for rk in ranks],
            "old_best_s": best["old"], "new_best_s": best["new"],
            "new_over_old_best": best["new"] / best["old"],
            "new_over_old_per_pair": pairs,
            "per_rep_max_cpu_s": list(zip(paths, cpu)), "cpu_new_over_old_per_pair": cpu_pairs,
            "per_rep_grams_s": list(zip(paths, grams)),
            "values_old": v_old, "values_new": v_new,
            "rel_diff": [abs(a - b) / abs(b) for a, b in zip(v_new, v_old)],
            "values_same_on_all_ranks": all(rk["rows"][1]["values"] == v_new for rk in ranks),
            "load_avg_end": [rk["load_avg"] for rk in ranks]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=float, default=32.0)
    ap.add_argument("--sizes", default="64,128,256,512,768")
    ap.add_argument("--skip-eager64", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--share", action="store_true",
                    help="ranks sharing the solves vs every rank solving all (gloo processes)")
    a = ap.parse_args(argv)
    if a.share:
        load0 = os.getloadavg()
        res = share_bench(a.layers, a.ranks, a.batch_size, a.repeat)
        res["load_avg_start"] = load0
        print(json.dumps(res, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    res: dict = {"threads": torch.get_num_threads(), "layers": a.layers, "ranks": a.ranks,
                 "load_avg_start": os.getloadavg()}
    grads = make_grads(a.layers, a.ranks)
    means = mean_gradients(grads)
    B = a.batch_size
    gk_measure(grads, means, B)  # warm-up (op registration)
    peers = {"gk": lambda: gk_measure(grads, means, B),
             "eager32": lambda: eager_loop(grads, means, B, torch.float32)}
    if not a.skip_eager64:
        peers["eager64"] = lambda: eager_loop(grads, means, B, torch.float64)
    best = interleaved(peers, a.repeat)
    (t_gk, v_gk), (t_e32, v_e32) = best["gk"], best["eager32"]
    res.update(gk_s=t_gk, eager32_s=t_e32, speedup_vs_eager32=t_e32 / t_gk, gk_values=v_gk, eager32_values=v_e32)
    if not a.skip_eager64:
        t_e64, v_e64 = best["eager64"]
        res.update(eager64_s=t_e64, speedup_vs_eager64=t_e64 / t_gk, eager64_values=v_e64,
                   rel_err_vs_eager64=[abs(x - y) / abs(y) for x, y in zip(v_gk, v_e64)])
    res["parts"] = parts(grads, means, B, a.repeat)
    res["per_size"] = per_size([int(s) for s in a.sizes.split(",")], a.repeat)
    res["flops"] = flops(a.layers, a.ranks)
    res["cpu_time_s"] = dict(CPU_TIMES)
    res["load_avg_end"] = os.getloadavg()
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
