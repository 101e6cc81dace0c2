"""Measured bias of the raw and corrected noise estimators (docs/estimators.md tables).

    python bench/bias_table.py [--draws 4000] [--model-draws 300]
    python bench/bias_table.py --speed      # cost of the nuclear correction vs eigvalsh
    python bench/bias_table.py --extra      # more structures: heavy tails, spiky, low rank

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
from gns_kernels import stats
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
        col = stats.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=problem.n)
        r1 = stats.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=problem.n, dof_model="rank_one")
        data = (stats.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=stats.nuclear_dof_from_samples(G) / (R - 1))
                if R >= 4 else None)
        T1, TN = problem.sigma_l1(), problem.sqrt_trace()
        rows.append((name, b, R, _ms(l1, T1), _ms(l1 / stats.c4(R), T1), _ms(raw, TN), _ms(col, TN), _ms(r1, TN),
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
            stats.nuclear_sqrt_trace_corrected(ev, 4, 64, other_dim=2 * m)
            best_c = min(best_c, time.perf_counter() - t)
        print(f"| {m} | {L} | {best_e:.4f} | {best_c:.4f} | {best_c / best_e:.3f} |")


class _Extra:
    """Single-example noise L Z / sqrt(n) (m x n) with non-Gaussian or unusual structure.

    kind 'student3': Z entries Student-t with 3 dof (unit variance, infinite kurtosis);
    'scale_mix': Z Gaussian times one sqrt(Exp(1)) factor per example (heavy-tailed whole
    matrices); 'spiky': Gaussian, eigenvalues (100, 30, 10, 1e-3 x 9); 'rank3': Gaussian,
    eigenvalues (1, 0.5, 0.25, 0 x 9). Truth tr(C_b^{1/2}) = sum sqrt(tau) / sqrt(b).
    """

    def __init__(self, kind: str, m: int = 12, n: int = 32, seed: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.kind, self.m, self.n = kind, m, n
        Q, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
        if kind == "spiky":
            tau = torch.tensor([100.0, 30.0, 10.0] + [1e-3] * (m - 3), dtype=torch.float64)
        elif kind == "rank3":
            tau = torch.tensor([1.0, 0.5, 0.25] + [0.0] * (m - 3), dtype=torch.float64)
        else:
            tau = 1.0 / torch.arange(1, m + 1, dtype=torch.float64)
        self.tau, self.L = tau, Q * tau.sqrt()

    def draw(self, R: int, b: int, draws: int, gen: torch.Generator) -> torch.Tensor:
        shape = (draws, R, b, self.m, self.n)
        if self.kind == "student3":
            # t_3 = N / sqrt(chi2_3 / 3), variance 3: scale to 1
            z = torch.randn(shape, generator=gen, dtype=torch.float64)
            chi = (torch.randn((3,) + shape, generator=gen, dtype=torch.float64) ** 2).sum(0) / 3.0
            Z = z / chi.sqrt() / math.sqrt(3.0)
        elif self.kind == "scale_mix":
            u = torch.rand(draws, R, b, 1, 1, generator=gen, dtype=torch.float64)
            Z = torch.randn(shape, generator=gen, dtype=torch.float64) * (-torch.log(u)).sqrt()
        else:
            Z = torch.randn(shape, generator=gen, dtype=torch.float64)
        return (self.L @ Z).mean(dim=2) / math.sqrt(self.n)

    def truth(self, b: int) -> float:
        return float(self.tau.sqrt().sum()) / math.sqrt(b)


def extra(draws: int, seed: int) -> None:
    print("| structure | b | R | nuclear raw | columns (removed) | data, R>=4 (removed) |")
    print("|---|---|---|---|---|---|")
    for kind in ("student3", "scale_mix", "spiky", "rank3"):
        p = _Extra(kind)
        b = 4
        for R in (2, 4, 8):
            G = p.draw(R, b, draws, torch.Generator().manual_seed(seed + R))
            dev = G - G.mean(dim=1, keepdim=True)
            C = (dev @ dev.mT).sum(dim=1) / (R - 1)  # covariance of a b-mean (scale cancels)
            ev = torch.linalg.eigvalsh(C)
            T = p.truth(b)
            raw = _ms(ev.clamp_min(0).sqrt().sum(-1), T)
            col = _ms(stats.nuclear_sqrt_trace_corrected(ev, R, other_dim=p.n), T)
            data = (_ms(stats.nuclear_sqrt_trace_corrected(ev, R, dof_per_sample=stats.nuclear_dof_from_samples(G) / (R - 1)), T)
                    if R >= 4 else None)
            print(f"| {kind} | {b} | {R} | {_fmt(raw)} | {_fmt(col)} ({_removed(raw, col)}) | {_fmt(data)} ({_removed(raw, data)}) |")


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
    ap.add_argument("--extra", action="store_true", help="heavy-tailed / spiky / low-rank structures")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.speed:
        speed()
        return 0
    if args.extra:
        extra(args.draws, args.seed)
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
