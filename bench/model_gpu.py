"""Cost model (a PREDICTION, nothing here ran on a GPU) of one GNS measurement step on one rank.

What it predicts: the wall time a measurement step adds to a training step on ONE rank of
R data-parallel ranks (H100 SXM, NVLink), term by term, for the l1/l2 geometries and for
the nuclear (S1) geometry with the Newton path, plus the bytes moved, FLOPs and host syncs
of each term. Every efficiency factor is a named parameter of ``Hardware`` / ``Solver``
(printed with the table), so a measured factor can replace an assumed one.

Terms of the nuclear measurement (per rank, per measurement):
- pack: copy the bucket gradients into the float32 pack and the local Grams after them
  (HBM bandwidth: read + write).
- grams: the local Grams (G^j - S)(G^j - S)^T of every matrix on its smaller side m
  (2 m^2 n FLOPs, n the larger side, written once: 4 m^2 bytes), and after the all-reduce,
  only for the matrices whose two solves this rank owns (the busiest rank's), the Gram of the
  mean gradient G G^T (another 2 m^2 n) and C = scale (mean Gram - G G^T) (m^2
  elementwise: read 2 Grams, write 1).
- collective: the EXTRA bytes of the all-reduce over plain DDP's gradient all-reduce (the
  Grams, float32; plus the float32 widening of a bf16 gradient) with a ring all-reduce
  time  bytes * 2 (R - 1) / R / bus_bw  + latency, and one small collective that shares
  the solved traces (latency only). R = 1: no collective.
- solves: 2 sqrt-traces per owned matrix (noise tr C^{1/2}, signal ||G||_S1 = tr (G G^T)^{1/2}),
  each by the scaled coupled Newton-Schulz iteration (iters = newton_min_iters(1e-6) + 3
  = 12 + 3) x 3 batched matmuls of 2 m^3 FLOPs, plus the shift
  correction's 6 matmuls (W = e Z^2 and a degree-5 Horner polynomial); no positive-part
  projection (the nuclear path calls it with project=False). Ranks share the matrices
  (both solves of a matrix on one rank) by the package's own greedy assignment by 2 m^3;
  the model takes the busiest rank's matrices (at 160M, R = 8: 11 of the 84, not 10.5).
- bias: the bias correction's extra cost per noise matrix, counted from what
  gns_kernels.spectral.pairsum does: 8 float32 matmuls (qhat(W) by Horner and S = Y qhat)
  and 5 + K float64 matmuls (F_0's Taylor series, S^2, and K = 22 squarings at eps = 1e-6)
  of 2 m^3 each, float64 at the FP64 tensor-core rate; shared by ranks like the solves.
- dof (R >= 3, the default 'gauss-sums' degrees of freedom): the Gram d d^T of this rank's
  deviation d = G^j - G per matrix (2 m^2 n FLOPs) and its Frobenius norms.
- pool (the noise pool, on by default: gns_kernels.pooling): per owned matrix the EMA update
  of its pooled covariance P and the pair moments against it (elementwise over m^2: read C
  and P twice, write P; float64 moments; ~6 m^2 x 4 bytes), then one more sqrt-trace of P
  (a Newton solve as above) and its pair sum (the bias term's matmuls again).
- launch floor: the kernels the solves issue (per chunk of 16 matrices per iteration:
  ~10 launches) times a per-launch host cost; the solve term is max(GPU time, floor).
- host syncs: 1 per measurement (the estimate is materialized when read).

The old path (eigh): quoted, not modelled: batched cuSOLVER eigvalsh plus float64 refits is
latency-bound (FLOPs do not model it); the review predicts 2-8 s per measurement at 160M.

Run: ``python bench/model_gpu.py`` (prints the table in Markdown). Shapes: the 160M set
12 x {q, k, v, o: 768x768; gate, up: 2048x768; down: 768x2048} (ASSUMED: the paper lists no
shapes) and a 1B Llama-3-style model, 16 layers, width 2048, 8 KV heads of 64:
{q, o: 2048x2048; k, v: 512x2048; gate, up: 8192x2048; down: 2048x8192}.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace

SHAPES_160M = [(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]
SHAPES_1B = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048),
             (8192, 2048), (8192, 2048), (2048, 8192)]
MODELS = {"160M": (12, SHAPES_160M), "1B": (16, SHAPES_1B)}
OLD_PATH_S = (2.0, 8.0)  # the review's prediction for the eigh path (seconds), not modelled
TARGET_MS = 50.0  # at 160M, R = 8


@dataclass(frozen=True)
class Hardware:
    """H100 SXM figures and the efficiency factors applied to them (all assumptions)."""

    hbm_bw: float = 3.35e12  # bytes/s, peak
    hbm_eff: float = 0.80  # fraction of peak a streaming copy reaches
    fp32_flops: float = 67e12  # FFMA, dense
    fp32_eff: float = 0.70  # batched fp32 matmul (m >= 512) fraction of peak
    tf32_flops: float = 495e12  # tensor cores, dense
    tf32_eff: float = 0.50  # batched TF32 matmul fraction of peak at m = 512..2048
    bf16_flops: float = 990e12  # tensor cores, dense
    bf16_eff: float = 0.50
    fp64_flops: float = 67e12  # FP64 tensor cores (DGEMM), dense, vendor figure
    fp64_eff: float = 0.70
    bus_bw: float = 450e9  # bytes/s NCCL all-reduce bus bandwidth within one NVLink node
    coll_latency: float = 25e-6  # s per collective (15-30 us assumed)
    launch_s: float = 5e-6  # host cost per kernel launch (PyTorch eager)

    def matmul_rate(self, precision: str) -> float:
        """Achieved matmul FLOP/s in ``precision`` ('fp32' FFMA, 'fp64', 'tf32' or 'bf16')."""
        return {"fp32": self.fp32_flops * self.fp32_eff,
                "fp64": self.fp64_flops * self.fp64_eff,
                "tf32": self.tf32_flops * self.tf32_eff,
                "bf16": self.bf16_flops * self.bf16_eff}[precision]

    def copy_rate(self) -> float:
        return self.hbm_bw * self.hbm_eff


@dataclass(frozen=True)
class Solver:
    """Newton-Schulz settings (defaults: gns_kernels.spectral.newton at eps = 1e-6)."""

    iters: int = 15  # check_newton_args default: newton_min_iters(1e-6) + 3 = 12 + 3
    matmuls_per_iter: int = 3  # Z Y, Y T, T Z
    correction_matmuls: int = 6  # W = e Z^2, then 5 Horner steps
    chunk: int = 16  # matrices per batched iteration (_NEWTON_CHUNK)
    launches_per_iter: int = 10  # kernels per iteration and chunk (bmm x3, norm, where x2, ...)
    pair_fp32_matmuls: int = 8  # bias correction per noise matrix: qhat(W) Horner + S = Y qhat
    pair_fp64_matmuls: int = 27  # F_0 Taylor (4), S^2 (1), K = pair_nodes(1e-6) = 22 squarings
    dof_grams: bool = True  # the 'gauss-sums' deviation Gram at R >= 3
    pool: bool = True  # the noise pool (GNSHookState's default pool_beta = 0.9)
    precision: str = "fp32"  # matmul precision of the solves
    gram_precision: str = "fp32"  # matmul precision of the Grams


def gram_flops(a: int, b: int) -> int:
    """FLOPs of the Gram X X^T of an a x b matrix on its smaller side m: 2 m^2 n."""
    m, n = min(a, b), max(a, b)
    return 2 * m * m * n


def newton_flops(m: int, s: Solver) -> int:
    """FLOPs of one sqrt-trace of an m x m matrix: (iters x per-iteration + correction)
    matmuls of 2 m^3 each."""
    return (s.iters * s.matmuls_per_iter + s.correction_matmuls) * 2 * m ** 3


def busiest_rank_matrices(ms: list, ranks: int) -> list:
    """Indices of the matrices (Gram sides ms) the busiest of `ranks` ranks solves, by the
    package's own assignment (gns_kernels.distributed._share.assign_solves: a matrix's two
    solves together, greedy LPT by cost 2 m^3); every matrix for one rank."""
    if ranks <= 1:
        return list(range(len(ms)))
    from gns_kernels.distributed._share import assign_solves

    costs = [2 * m ** 3 for m in ms]
    owners = assign_solves(costs, [0] * ranks)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(ranks)]
    top = max(range(ranks), key=lambda r: (loads[r], -r))
    return [i for i, o in enumerate(owners) if o == top]


def allreduce_s(nbytes: float, ranks: int, hw: Hardware) -> float:
    """Ring all-reduce time: bytes * 2 (R-1)/R / bus bandwidth + latency (0 for R = 1)."""
    if ranks <= 1:
        return 0.0
    return nbytes * 2 * (ranks - 1) / ranks / hw.bus_bw + hw.coll_latency


@dataclass
class Terms:
    """One rank's added cost of a measurement: seconds, bytes, FLOPs per term."""

    seconds: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    flops: dict = field(default_factory=dict)
    host_syncs: int = 1

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def dominant(self) -> str:
        return max(self.seconds, key=self.seconds.get)


def nuclear_step(shapes: list, ranks: int, hw: Hardware = Hardware(), s: Solver = Solver(),
                 grad_itemsize: int = 4) -> Terms:
    """Predicted added cost of one S1 measurement on one rank (see the module docstring).

    shapes: every measured matrix (a, b); ranks: R; grad_itemsize: bytes per element of the
    bucket (4 float32, 2 bf16).
    """
    t = Terms()
    n_param = sum(a * b for a, b in shapes)
    gram_elems = sum(min(a, b) ** 2 for a, b in shapes)
    # pack: read gradients (bucket dtype) + write float32; copy Grams in (read + write)
    t.bytes["pack"] = n_param * (grad_itemsize + 4) + gram_elems * 8
    t.seconds["pack"] = t.bytes["pack"] / hw.copy_rate()
    # the matrices this rank owns: the package's assignment (both solves of a matrix on one
    # rank, greedy LPT by 2 m^3), taking the busiest rank
    ms = [min(a, b) for a, b in shapes]
    owned = busiest_rank_matrices(ms, ranks)
    # Grams: the local ones of every matrix; the mean gradient's Gram and C (read 2 Grams,
    # write 1) only for the owned matrices
    local = sum(gram_flops(a, b) for a, b in shapes)
    t.flops["grams"] = local + sum(gram_flops(*shapes[i]) for i in owned)
    t.bytes["grams"] = gram_elems * 4 + sum(ms[i] ** 2 for i in owned) * 12
    t.seconds["grams"] = (t.flops["grams"] / hw.matmul_rate(s.gram_precision)
                          + t.bytes["grams"] / hw.copy_rate())
    # collective: the extra bytes over plain DDP (Grams; float32 widening of the gradients),
    # then one small collective sharing the per-matrix results (latency only)
    t.bytes["collective"] = gram_elems * 4 + n_param * (4 - grad_itemsize)
    t.seconds["collective"] = (allreduce_s(t.bytes["collective"], ranks, hw)
                               + (hw.coll_latency if ranks > 1 else 0.0))
    # solves: the owned matrices' two sqrt-traces each
    share = sum(2 * newton_flops(ms[i], s) for i in owned)
    t.flops["solves"] = int(share)
    gpu = share / hw.matmul_rate(s.precision)
    n_solves = 2 * len(owned)
    floor = math.ceil(n_solves / s.chunk) * (s.iters + 2) * s.launches_per_iter * hw.launch_s
    t.seconds["solves"] = max(gpu, floor)
    # bias correction: the pair sum's matmuls per owned noise matrix
    per32 = sum(s.pair_fp32_matmuls * 2 * ms[i] ** 3 for i in owned)
    per64 = sum(s.pair_fp64_matmuls * 2 * ms[i] ** 3 for i in owned)
    t.flops["bias"] = int(per32 + per64)
    t.seconds["bias"] = per32 / hw.matmul_rate(s.precision) + per64 / hw.matmul_rate("fp64")
    # gauss-sums dof (R >= 3): one deviation Gram per matrix, plus reading it for two norms
    if s.dof_grams and ranks >= 3:
        t.flops["dof"] = sum(gram_flops(a, b) for a, b in shapes)
        t.seconds["dof"] = (t.flops["dof"] / hw.matmul_rate(s.gram_precision)
                            + gram_elems * 4 / hw.copy_rate())
    else:
        t.flops["dof"] = 0
        t.seconds["dof"] = 0.0
    # noise pool: the owned matrices' pool update, one more sqrt-trace and pair sum each
    if s.pool:
        solve = sum(newton_flops(ms[i], s) for i in owned)
        t.bytes["pool"] = sum(ms[i] ** 2 for i in owned) * 24
        t.flops["pool"] = int(solve + per32 + per64)
        t.seconds["pool"] = ((solve + per32) / hw.matmul_rate(s.precision)
                             + per64 / hw.matmul_rate("fp64") + t.bytes["pool"] / hw.copy_rate())
    else:
        t.bytes["pool"] = t.flops["pool"] = 0
        t.seconds["pool"] = 0.0
    return t


def l_step(shapes: list, ranks: int, hw: Hardware = Hardware(), grad_itemsize: int = 4,
           bf16_grad_half: bool = False, pool: bool = False) -> Terms:
    """Predicted added cost of one l1/l2 measurement on one rank: square_pack_multi (read
    the gradient, write [x, x^2] float32), the extra all-reduce bytes over plain DDP, and
    variance_norms_multi (read both halves). bf16_grad_half: the gradient half travels in
    the bucket's bf16 (the squares stay float32). pool: the l1 noise pool on this rank's 1/R
    slice (read both halves, s2 written and read, the pool read and written, its sqrt read:
    ~32 bytes per element of the slice, eager) and one more small all-reduce (latency)."""
    t = Terms()
    n_all = sum(a * b for a, b in shapes)
    t.bytes["pool"] = (n_all // max(ranks, 1)) * 32 if pool else 0
    t.seconds["pool"] = (t.bytes["pool"] / hw.copy_rate()
                         + (hw.coll_latency if pool and ranks > 1 else 0.0))
    n = sum(a * b for a, b in shapes)
    t.bytes["pack"] = n * (grad_itemsize + 8)
    t.seconds["pack"] = t.bytes["pack"] / hw.copy_rate()
    sent = n * (4 + (grad_itemsize if bf16_grad_half else 4))
    t.bytes["collective"] = sent - n * grad_itemsize
    t.seconds["collective"] = allreduce_s(t.bytes["collective"], ranks, hw)
    t.bytes["reduce"] = n * 8
    t.seconds["reduce"] = t.bytes["reduce"] / hw.copy_rate()
    return t


def table(hw: Hardware = Hardware(), ranks=(1, 2, 8)) -> str:
    """Markdown table of the predictions (nuclear: fp32 and TF32 matmuls; l1/l2)."""
    rows = ["| model | R | path | pack ms | Grams ms | extra collective ms | solves ms | bias ms "
            "| dof ms | pool ms | total ms (prediction) | dominant | extra bytes sent | solve+bias+pool TFLOP/rank "
            "| host syncs |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, (layers, per_layer) in MODELS.items():
        shapes = per_layer * layers
        for r in ranks:
            for prec in ("fp32", "tf32"):
                s = Solver(precision=prec, gram_precision=prec)
                t = nuclear_step(shapes, r, hw, s)
                ms = {k: v * 1e3 for k, v in t.seconds.items()}
                rows.append(
                    f"| {name} | {r} | S1 Newton, {prec} matmuls | {ms['pack']:.2f} | {ms['grams']:.2f} "
                    f"| {ms['collective']:.2f} | {ms['solves']:.1f} | {ms['bias']:.1f} | {ms['dof']:.2f} "
                    f"| {ms['pool']:.1f} | {t.total_s * 1e3:.1f} "
                    f"| {t.dominant()} | {t.bytes['collective'] / 1e6:.0f} MB "
                    f"| {(t.flops['solves'] + t.flops['bias'] + t.flops['pool']) / 1e12:.2f} | {t.host_syncs} |")
            for pool in (False, True):
                t = l_step(shapes, r, hw, pool=pool)
                ms = {k: v * 1e3 for k, v in t.seconds.items()}
                what = "l1 (pool)" if pool else "l1/l2 (float32 pack)"
                rows.append(
                    f"| {name} | {r} | {what} | {ms['pack']:.2f} | - | {ms['collective']:.2f} "
                    f"| - | - | - | {ms['pool']:.2f} | {t.total_s * 1e3:.2f} | {t.dominant()} "
                    f"| {t.bytes['collective'] / 1e6:.0f} MB | 0 | {t.host_syncs} |")
            if name == "160M":
                rows.append(f"| {name} | {r} | S1 eigh (old path, quoted, not modelled) | | | | | | | | "
                            f"{OLD_PATH_S[0] * 1e3:.0f}-{OLD_PATH_S[1] * 1e3:.0f} | cuSOLVER latency "
                            f"| | | one per matrix and bucket |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU cost model of one measurement step (prediction)")
    ap.parse_args(argv)
    hw = Hardware()
    s = Solver()
    print("PREDICTION (no GPU measurement): one measurement step, one rank, H100 SXM.")
    print(f"assumed: {hw}")
    print(f"solver: iters={s.iters} x {s.matmuls_per_iter} matmuls + {s.correction_matmuls} "
          f"correction matmuls of 2 m^3 FLOPs; bias correction {s.pair_fp32_matmuls} fp32 + "
          f"{s.pair_fp64_matmuls} fp64 matmuls per noise matrix; noise pool {'on' if s.pool else 'off'}")
    print(table(hw))
    for prec in ("fp32", "tf32"):
        t = nuclear_step(SHAPES_160M * 12, 8, hw, replace(s, precision=prec, gram_precision=prec))
        verdict = "meets" if t.total_s * 1e3 < TARGET_MS else "misses"
        print(f"160M, R = 8, {prec} matmuls: {t.total_s * 1e3:.1f} ms predicted, {verdict} the "
              f"{TARGET_MS:.0f} ms target; dominant term: {t.dominant()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
