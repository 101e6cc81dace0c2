"""The steep-spectrum accuracy family of issue 43 item 5: the noise tr(C^{1/2}) of every
route ``gk.nuclear_stats`` offers the hooks, against float64 eigh of the same float32 inputs.

One case is one measurement of one layer: R samples G^j = G + H Z^j / sqrt(n) (k x n,
float64; G a mean whose ||G||_F is ``ratio`` times the noise's sqrt(tr Sigma), H = U
diag(lambda)^{1/2} so the population covariance has the prescribed eigenvalues lambda),
rounded to float32 the way a training step holds them: the float32 mean Gram A32 = mean_j
G^j G^jT (of the float32 samples) and the float32 mean gradient D32, scale = 8 R / (R - 1)
(a local batch of 8). Then

    C      = scale (mean_j G^j G^jT - D D^T)       from the float64 samples (before rounding)
    C_in   = scale (A32 - D32 D32^T)               formed in float64 from the float32 inputs
    t_in   = tr(C_in^{1/2}) by float64 eigvalsh    the reference of every route
    e_in   = |t_in - tr(C^{1/2})| / tr(C^{1/2})    what the float32 inputs already lost
    bound  = max(1e-3, 2 e_in)                      the issue's bound on |noise - t_in| / t_in

Spectra: lambda_i = i^-p (p uniform in [0.5, 3]) or log-uniform over 2-6 decades (random
draw); every fifth random case rank-deficient (lambda_i = 0 past k / 3); n = k x {1, 2, 3};
the signal ratio log-uniform in [0.3, 10]. The grid: every side x every R x ``--per``
random spectra, plus one corner case per (side, R) (i^-3, ratio 10, n = 3k; ``cases``).

Routes (the noise of one call, gradient form unless named):
    eigh         nuclear_stats(method="eigh") (the CPU default "auto"; D D^T and C formed
                 in float64, float32 eigvalsh with its bound and float64 fallback)
    eigh-grams   the Gram form with a float32 D D^T: not a route of its own but the input
                 the hooks' eigh path passes today (distributed._share_solve's
                 mean_grad_gram_op); shown because a float32 D D^T alone breaks the bound
    newton       nuclear_stats(method="newton") (the float64 chain NOISE_CHAIN)
    host         nuclear_stats(method="host") (float64 eigvalsh of C formed in float64)
newton-tf32 is documented as outside the bound and not run here.

    python bench/accuracy_family.py                        # sides 64-768, R = 2, 4, 8
    python bench/accuracy_family.py --sides 64,128 --per 1 --routes eigh,host
Prints one line per case (err / bound per route) and the worst err / bound per route.
The test at small sides: tests/spectral/test_accuracy_family.py.
"""
from __future__ import annotations

import argparse
import math
import platform
import sys
import time

import torch

import gns_kernels as gk
from gns_kernels.spectral.grams import grams_on_sides

ROUTES = ("eigh", "eigh-grams", "newton", "host")


def sqrt_trace64(M: torch.Tensor) -> float:
    """tr(M_+^{1/2}) by float64 eigvalsh of (M + M^T) / 2."""
    M = M.double()
    return torch.linalg.eigvalsh(0.5 * (M + M.T)).clamp_min(0).sqrt().sum().item()


def measurement(gen: torch.Generator, k: int, n: int, R: int, spec: str, p: float, decades: float,
                ratio: float, rank_def: bool) -> dict:
    """One layer's measurement (module docstring): A32 (k x k), D32 (k x n) float32, scale,
    C_in (float64 k x k), t_in = tr(C_in^{1/2}) (float64 eigh), e_in (relative)."""
    lam = (torch.arange(1, k + 1, dtype=torch.float64) ** (-p) if spec == "power" else
           (10.0 ** (-decades * torch.rand(k, generator=gen, dtype=torch.float64))).sort(descending=True).values)
    if rank_def:
        lam[max(1, k // 3):] = 0
    U, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
    half = U * lam.sqrt()
    G = torch.randn(k, n, generator=gen, dtype=torch.float64)
    G = G / G.norm() * ratio * lam.sum().sqrt()  # ||G||_F = ratio x the noise's scale
    samples = [G + half @ torch.randn(k, n, generator=gen, dtype=torch.float64) / math.sqrt(n)
               for _ in range(R)]
    scale = 8.0 * R / (R - 1)
    mean = torch.stack(samples).mean(0)
    C = scale * (torch.stack([x @ x.T for x in samples]).mean(0) - mean @ mean.T)
    s32 = [x.float() for x in samples]
    A32 = torch.stack([x @ x.T for x in s32]).mean(0)
    D32 = torch.stack(s32).mean(0)
    C_in = scale * (A32.double() - D32.double() @ D32.double().T)
    truth, t_in = sqrt_trace64(C), sqrt_trace64(C_in)
    return dict(A32=A32, D32=D32, scale=scale, C_in=C_in, t_in=t_in, e_in=abs(t_in - truth) / truth)


def cases(seed: int, sides, Rs, per: int, corners: bool = True) -> list:
    """The family's parameters: every side x every R x ``per`` random spectra, seeded, and
    (corners) one steep corner case per (side, R): i^-3, signal ratio 10, n = 3k, where a
    float32 D D^T lost most."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    i = 0
    for k in sides:
        for R in Rs:
            if corners:
                out.append(dict(k=k, n=3 * k, R=R, spec="power", p=3.0, decades=0.0, ratio=10.0, rank_def=False,
                                seed=seed * 100003 + 50000 + len(out)))
            for _ in range(per):
                n = k * int(torch.randint(1, 4, (1,), generator=gen))
                p = 0.5 + 2.5 * torch.rand(1, generator=gen).item()
                decades = 2.0 + 4.0 * torch.rand(1, generator=gen).item()
                ratio = 0.3 * (10.0 / 0.3) ** torch.rand(1, generator=gen).item()
                out.append(dict(k=k, n=n, R=R, spec="power" if i % 2 == 0 else "decades", p=p,
                                decades=decades, ratio=ratio, rank_def=i % 5 == 4, seed=seed * 100003 + i))
                i += 1
    return out


def make(case: dict) -> dict:
    """The measurement of one case of ``cases`` (its own generator: cases are independent)."""
    gen = torch.Generator().manual_seed(case["seed"])
    keys = ("k", "n", "R", "spec", "p", "decades", "ratio", "rank_def")
    return measurement(gen, *(case[x] for x in keys))


def route_noise(m: dict, route: str) -> float:
    """The noise of ``route`` (module docstring) on measurement m."""
    A32, D32, scale = m["A32"], m["D32"], m["scale"]
    if route == "eigh-grams":
        dd = grams_on_sides([D32], ["row"])
        noise, _ = gk.nuclear_stats([A32], mean_grad_grams=dd, scale=scale, method="eigh")
    else:
        noise, _ = gk.nuclear_stats([A32], [D32], scale=scale, method=route)
    return noise[0].item()


def evaluate(m: dict, routes) -> dict:
    """{route: (relative error against t_in, bound max(1e-3, 2 e_in))}."""
    bound = max(1e-3, 2.0 * m["e_in"])
    return {r: (abs(route_noise(m, r) - m["t_in"]) / m["t_in"], bound) for r in routes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", default="64,96,128,192,256,384,512,768", help="Gram sides k, comma-separated")
    ap.add_argument("--R", default="2,4,8", help="numbers of samples, comma-separated")
    ap.add_argument("--per", type=int, default=2, help="random spectra per (side, R)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated subset of {ROUTES}")
    ap.add_argument("--no-corners", action="store_true", help="only the random spectra")
    args = ap.parse_args(argv)
    sides = [int(s) for s in args.sides.split(",")]
    Rs = [int(s) for s in args.R.split(",")]
    routes = [r for r in args.routes.split(",") if r]
    for r in routes:
        if r not in ROUTES:
            ap.error(f"--routes: unknown route {r!r} (expected a subset of {ROUTES})")
    print(f"machine: {platform.machine()} {platform.processor() or ''} | torch {torch.__version__} | "
          f"threads {torch.get_num_threads()} | python {platform.python_version()}")
    print(f"family: sides {sides}, R {Rs}, {args.per} spectra each, seed {args.seed}")
    worst = {r: (0.0, None) for r in routes}
    fails = {r: 0 for r in routes}
    t0 = time.perf_counter()
    family = cases(args.seed, sides, Rs, args.per, corners=not args.no_corners)
    for c in family:
        n_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the float64 samples: small products, slow multi-threaded under load
        try:
            m = make(c)
        finally:
            torch.set_num_threads(n_threads)
        res = evaluate(m, routes)
        desc = (f"k={c['k']:4d} n={c['n']:5d} R={c['R']} "
                + (f"i^-{c['p']:.2f}" if c["spec"] == "power" else f"{c['decades']:.1f} dec")
                + (" rank-def" if c["rank_def"] else "") + f" ratio={c['ratio']:.2f} e_in={m['e_in']:.1e}")
        cols = []
        for r in routes:
            err, bound = res[r]
            q = err / bound
            if not q <= 1.0:
                fails[r] += 1
            if not q <= worst[r][0]:
                worst[r] = (q, desc + f" err={err:.2e}")
            cols.append(f"{r} {q:.2e}")
        print(desc + " | err/bound: " + ", ".join(cols), flush=True)
    print(f"{len(family)} cases in {time.perf_counter() - t0:.0f} s")
    for r in routes:
        q, where = worst[r]
        print(f"worst err/bound {r:10s} {q:.3e} ({fails[r]} of {len(family)} over the bound) at {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
