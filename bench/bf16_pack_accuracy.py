"""Accuracy of sending the gradient half of an l1/l2 measurement pack in bfloat16.

Question: a bf16 bucket's measurement pack carries [x, x^2] in float32 (x = g^j - S, the
rank's gradient minus the shift). If the x half travelled in bf16 instead (summed by the
collective in bf16, as plain DDP sums a bf16 bucket) while x^2 stays float32, how far are
the l1 / l2 noise and signal sums from float64?

Set-up (CPU, simulated ranks, fixed seed): n coordinates, R ranks; each rank's gradient
g^j = G + noise (noise std chosen so that the l2 noise/signal ratio tr(Sigma) / (B |G|^2)
has the stated value), rounded to bf16 (the bucket's dtype, identical in both paths).
Float64 reference: mean and mean square of x in float64. Float32 pack (today): both halves
float32, summed in float32. bf16 gradient half: x / R rounded to bf16, summed across ranks
in bf16 with a rounding after every addition (a ring all-reduce's partial sums), squares
float32. With a shift S (the previous step's mean, here G plus a small drift), x is the small
residual, which bf16 rounds relative to itself.

Run: ``python bench/bf16_pack_accuracy.py``; prints the worst relative error of the four
sums [sum s, sum |g|, sum s2, sum g^2] per case, against the budget 1e-3.
"""
from __future__ import annotations

import torch

from gns_kernels import reference as ref


def _ring_sum_bf16(xs: list) -> torch.Tensor:
    acc = xs[0].to(torch.bfloat16)
    for x in xs[1:]:
        acc = (acc.float() + x.to(torch.bfloat16).float()).to(torch.bfloat16)
    return acc.double()


def case(n: int, ranks: int, ratio: float, shift: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    B = 32 * ranks  # examples per step; each rank's gradient is a mean over B / R
    G = torch.randn(n, generator=g, dtype=torch.float64)
    # per-example noise std sigma: tr(Sigma) / (B |G|^2) = n sigma^2 / (B |G|^2) = ratio
    sigma = (ratio * B * float(G.pow(2).sum()) / n) ** 0.5
    per_rank = sigma / (B / ranks) ** 0.5
    grads = [(G + per_rank * torch.randn(n, generator=g, dtype=torch.float64)).to(torch.bfloat16).double()
             for _ in range(ranks)]
    S = (G + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)).to(torch.bfloat16).double() if shift else None
    xs = [gj - S if shift else gj for gj in grads]
    scale = B / (ranks - 1)
    # float64 reference
    d64 = sum(xs) / ranks
    q64 = sum(x * x for x in xs) / ranks
    want = ref.variance_norms(d64, q64, scale, S)
    # float32 pack: x, x^2 in float32, summed in float32 (x / R first, as the hook divides)
    xs32 = [x.float() for x in xs]
    d32 = sum(x / ranks for x in xs32)
    q32 = sum(x * x / ranks for x in xs32)
    got32 = ref.variance_norms(d32, q32, scale, None if S is None else S.float())
    # bf16 gradient half: x / R in bf16, bf16 ring sum; squares float32
    d16 = _ring_sum_bf16([x / ranks for x in xs32]).float()
    got16 = ref.variance_norms(d16, q32, scale, None if S is None else S.float())
    rel = lambda got: float(((got - want).abs() / want.abs()).max())  # noqa: E731
    return {"float32 pack": rel(got32), "bf16 gradient half": rel(got16)}


def main() -> int:
    n = 200_000
    print(f"n = {n} coordinates; worst relative error of [sum s, sum |g|, sum s2, sum g^2] vs float64 "
          "(budget 1e-3)")
    print("| R | l2 noise/signal | shift | float32 pack | bf16 gradient half |")
    print("|---|---|---|---|---|")
    for ranks in (2, 8):
        for ratio in (1.0, 1e-2, 1e-4):
            for shift in (False, True):
                r = case(n, ranks, ratio, shift)
                print(f"| {ranks} | {ratio:g} | {'yes' if shift else 'no'} | {r['float32 pack']:.1e} "
                      f"| {r['bf16 gradient half']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
