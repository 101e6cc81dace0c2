"""Measured bias of the raw and corrected noise estimators (docs/estimators.md tables).

    python bench/bias_table.py [--draws 4000] [--model-draws 300]
    python bench/bias_table.py --speed      # cost of the nuclear correction vs eigvalsh

Prints markdown tables of E[estimate] / truth (mean over draws, +- one standard error):
  l1:      ||s||_1 raw and / c4(R)                         (truth ||sigma||_1)
  nuclear: tr(C^1/2) raw, 'columns' dof, 'rank_one' dof, data dof (R >= 4; gk.estimate's
           default 'auto' = data for R >= 4, columns below), and the fraction of the raw
           bias each removes.
Problems: Gaussian matrix noise and least squares (gns_kernels.demo.synthetic) with
(m, n) = (12, 32) at local batch b = 24, 8, 4 (the last two: b < m); the built-in MLP and
attention block (sum over layers, exact truth from per-example gradients).
"""
from __future__ import annotations

import argparse
import math

import torch

import gns_kernels as gk
from gns_kernels import bias
from gns_kernels.demo import synthetic as syn


def _ms(x: torch.Tensor, truth: float) -> tuple[float, float]:
    return float(x.mean()) / truth, float(x.std()) / math.sqrt(x.numel()) / truth


def matrix_rows(problem, name: str, b: int, draws: int, seed: int):
    rows = []
    for R in (2, 4, 8):
        G = problem.draw(R, b, draws, torch.Generator().manual_seed(seed + R))
        B = R * b
        dev = G - G.mean(dim=1, keepdim=True)
        s2 = B / (R * (R - 1)) * (dev * dev).sum(dim=1)
        l1 = s2.sqrt().sum(dim=(-2, -1))
        C = B / (R * (R - 1)) * (dev @ dev.mT).sum(dim=1)
        ev = torch.linalg.eigvalsh(C)
        raw = ev.clamp_min(0).sqrt().sum(-1)
        col = bias.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=problem.n)
        r1 = bias.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=problem.n, dof_model="rank_one")
        data = (bias.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=bias.nuclear_dof_from_samples(G) / (R - 1))
                if R >= 4 else None)
        T1, TN = problem.sigma_l1(), problem.sqrt_trace()
        rows.append((name, b, R, _ms(l1, T1), _ms(l1 / bias.c4(R), T1), _ms(raw, TN), _ms(col, TN), _ms(r1, TN),
                     _ms(data, TN) if data is not None else None))
    return rows


def model_rows(kind: str, draws: int, seed: int):
    model = syn.make_model(kind, seed=0)
    X, Y = syn.make_data(kind, 2048, seed=1)
    pe = syn.per_example_grads(model, X, Y)
    truth = syn.ground_truth(pe)
    T1, TN = math.sqrt(truth.noise("l1")), math.sqrt(truth.noise("nuclear"))
    rows = []
    b = 16
    for R in (2, 4, 8):
        sim = syn.simulate_ranks_batched(pe, R, R * b, draws, torch.Generator().manual_seed(seed + R))
        names = list(sim)
        v = {k: [] for k in ("l1r", "l1", "nr", "nc", "n1", "nd")}
        for t in range(draws):
            rg = [[sim[k][t, j] for k in names] for j in range(R)]
            e1 = gk.estimate(rg, R * b, "l1")
            v["l1r"].append(math.sqrt(e1.noise_raw))
            v["l1"].append(math.sqrt(e1.noise))
            ec = gk.estimate(rg, R * b, "nuclear", nuclear_dof="columns")
            v["nr"].append(math.sqrt(ec.noise_raw))
            v["nc"].append(math.sqrt(ec.noise))
            v["n1"].append(math.sqrt(gk.estimate(rg, R * b, "nuclear", nuclear_dof="rank_one").noise))
            if R >= 4:
                v["nd"].append(math.sqrt(gk.estimate(rg, R * b, "nuclear", nuclear_dof="data").noise))
        t = {k: torch.tensor(x, dtype=torch.float64) for k, x in v.items()}
        rows.append((kind, b, R, _ms(t["l1r"], T1), _ms(t["l1"], T1), _ms(t["nr"], TN), _ms(t["nc"], TN),
                     _ms(t["n1"], TN), _ms(t["nd"], TN) if R >= 4 else None))
    return rows


def speed() -> None:
    """Time of nuclear_sqrt_trace_corrected relative to the eigvalsh that precedes it."""
    import time

    print("| m | matrices | eigvalsh (s) | correction (s) | correction / eigvalsh |")
    print("|---|---|---|---|---|")
    for m, L in ((768, 4), (256, 16), (64, 64)):
        A = torch.randn(L, m, m, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
        C = A @ A.mT / m
        best_e = best_c = math.inf
        for _ in range(3):
            t = time.perf_counter()
            ev = torch.linalg.eigvalsh(C)
            best_e = min(best_e, time.perf_counter() - t)
            t = time.perf_counter()
            bias.nuclear_sqrt_trace_corrected(ev, 4, 64, other_dim=2 * m)
            best_c = min(best_c, time.perf_counter() - t)
        print(f"| {m} | {L} | {best_e:.4f} | {best_c:.4f} | {best_c / best_e:.3f} |")


def _fmt(ms):
    return "–" if ms is None else f"{ms[0]:.3f} ± {ms[1]:.3f}"


def _removed(raw, cor):
    if cor is None or raw[0] >= 1:
        return "–"
    return f"{100 * (cor[0] - raw[0]) / (1 - raw[0]):.0f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--model-draws", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speed", action="store_true", help="time the nuclear correction instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.speed:
        speed()
        return 0
    rows = []
    for b in (24, 8, 4):
        rows += matrix_rows(syn.GaussianMatrixNoise(12, 32, seed=3), "gaussian", b, args.draws, args.seed)
        rows += matrix_rows(syn.LeastSquares(12, 32, seed=4), "least squares", b, args.draws, args.seed)
    for kind in ("mlp", "attention"):
        rows += model_rows(kind, args.model_draws, args.seed)
    print("| problem | b | R | l1 raw | l1 / c4 | nuclear raw | columns (removed) | rank_one (removed) | data, R>=4 (removed) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, b, R, l1r, l1c, nr, nc, n1, nd in rows:
        print(f"| {name} | {b} | {R} | {_fmt(l1r)} | {_fmt(l1c)} | {_fmt(nr)} | {_fmt(nc)} ({_removed(nr, nc)}) | "
              f"{_fmt(n1)} ({_removed(nr, n1)}) | {_fmt(nd)} ({_removed(nr, nd)}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
