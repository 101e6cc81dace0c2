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
- solves: the solver AS BUILT (gns_kernels.spectral, counted by running it on CPU:
  ``solver_counts``, record_matmuls per product, non-view aten ops per launch): per Gram
  size ONE chain of float64 products (the positive-part sign steps, the scaled coupled
  Newton-Schulz steps at NOISE_NEWTON = (20 iterations, shift 1e-11), the shift
  correction) over the owned matrices' noise C, pooled P and signal Grams together, in
  chunks of chunk_size(m) matrices (16 at m = 768). The noise and signal traces are this
  term. Ranks share the matrices (both solves of a matrix on one rank) by the package's
  own greedy assignment by 2 m^3; the model takes the busiest rank's matrices (at 160M,
  R = 8: 11 of the 84, not 10.5).
- bias: the pair sum's float64 products per owned noise matrix (qhat(W) Horner, S, F_0's
  Taylor series, S^2 and K = pair_nodes(1e-11) = 30 squarings), counted likewise.
- dof (R >= 3, the default 'gauss-sums' degrees of freedom): the Gram d d^T of this rank's
  deviation d = G^j - G per matrix (2 m^2 n FLOPs) and its Frobenius norms.
- pool (the noise pool, on by default: gns_kernels.pooling): per owned matrix the EMA update
  of its pooled covariance P and the pair moments against it (elementwise over m^2: read C
  and P twice, write P; float64 moments; ~6 m^2 x 4 bytes), then P's trace and pair sum in
  the same chain (the solve and bias products again).
- launch floor: the chain's kernels (``solver_counts``: launches per chain, whatever the
  chunk's batch) x chunks x a per-launch host cost; the chain's time is max(GPU time,
  floor), the excess booked to the solves term.
- matmul floor: the chain's products at the matmul rate (``matmul_floor_s``): the time the
  solver as built cannot go below on this hardware model.
- TF32 (method 'newton-tf32', gk.nuclear_stats only: the hook states refuse it, the signal
  read 18% low on the hook benchmark in CPU emulation): the signal Grams in a TF32 chain
  (rounded operands, 15 guarded iterations after 21 sign steps), the noise and pooled
  matrices stay float64 (their pair sum needs S positive semidefinite to rounding). Its
  rows are what that solver would cost, not an option of the hooks.
- a pooled matrix's per-measurement noise solve is NOT cut: the estimate reports it
  (noise, noise_raw) and the pool's first measurement of a key uses it.
- host syncs: 1 per measurement (the estimate is materialized when read).

The host route (method 'host', issue 43; ``host_step``): the device forms per owned matrix
the mean gradient's Gram D D^T and C in float64 and the pool's P, and copies them to pinned
host memory on the copy engine (listed, overlapped, not added); the solves (float64
eigvalsh, sqrt-traces, pair sums) run on CPU threads: ``host_core_s``, from a solve MEASURED
on the machine that runs this script (``host_solve_s``, 1 thread), not an assumption. The
last line prints ``S1 per rank, 160M, R=8, pool on, H100: <x> ms GPU, <y> core-s host``.

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
import functools
from dataclasses import dataclass, field

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
    d2h_bw: float = 40e9  # bytes/s, device -> pinned host copy (copy engine; PCIe 5 x16 ~50 peak)

    def matmul_rate(self, precision: str) -> float:
        """Achieved matmul FLOP/s in ``precision`` ('fp32' FFMA, 'fp64', 'tf32' or 'bf16')."""
        return {"fp32": self.fp32_flops * self.fp32_eff,
                "fp64": self.fp64_flops * self.fp64_eff,
                "tf32": self.tf32_flops * self.tf32_eff,
                "bf16": self.bf16_flops * self.bf16_eff}[precision]

    def copy_rate(self) -> float:
        return self.hbm_bw * self.hbm_eff


def _launch_counter():
    """A TorchDispatchMode counting the non-view aten ops run under it (``.n``): the
    kernels a GPU would launch for them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.__name__ not in ("detach.default", "lift_fresh.default"):
                self.n += 1
            return func(*args, **(kwargs or {}))

    return _Launches()


@functools.lru_cache(maxsize=None)
def solver_counts(precision: str = "float64") -> dict:
    """What the package's Newton chain issues, counted on CPU by running it (cached):
    trace (float64 or tf32 products per matrix for its sqrt-trace; trace_unprojected: a
    float64 signal Gram's, which skips the positive-part step), pair (extra float64
    products per matrix whose pair sum is needed), launches (non-view aten ops of one
    chain: a chunk, with and without pair rows; independent of the batch size), for
    ``precision`` "float64" (NOISE_NEWTON, the default chain) or "tf32" (the opt-in's
    signal chain, check_newton_args defaults)."""
    import torch

    from gns_kernels.spectral import precision as P
    from gns_kernels.spectral.newton import check_newton_args
    from gns_kernels.spectral.nuclear import NOISE_NEWTON
    from gns_kernels.spectral.pairsum import pair_impl

    it, ep = NOISE_NEWTON if precision == "float64" else check_newton_args(None, None, precision)
    A = (torch.eye(4, dtype=torch.float64) + 0.1).expand(2, 4, 4).contiguous()

    out = {}
    for rows, proj in ((0, -1), (2, -1), (0, 0)):
        with P.record_matmuls() as log, _launch_counter() as mode:
            pair_impl(A, it, ep, None, True, precision, "float64", rows, proj)
        out[rows, proj] = (len(log), mode.n)
    res = {"trace": out[0, -1][0], "pair": out[2, -1][0] - out[0, -1][0], "launches": out[0, -1][1],
           "launches_pair": out[2, -1][1], "iters": it,
           # a float64 signal Gram skips the positive-part step (spectral.nuclear)
           "trace_unprojected": out[0, 0][0] if precision == "float64" else out[0, -1][0]}
    return res


@dataclass(frozen=True)
class Solver:
    """The nuclear solver's products and launches. Defaults: the package's chain as built
    (``solver_counts``, counted on CPU when this module is imported)."""

    trace_products: int = field(default_factory=lambda: solver_counts()["trace"])  # per matrix
    pair_products: int = field(default_factory=lambda: solver_counts()["pair"])  # per noise / pooled matrix
    precision: str = "fp64"  # the chain's products
    signal_products: int = field(default_factory=lambda: solver_counts()["trace_unprojected"])  # per signal matrix
    signal_precision: str = "fp64"  # "tf32": the opt-in's separate signal chain
    launches_per_chain: int = field(default_factory=lambda: solver_counts()["launches_pair"])
    signal_launches_per_chain: int = 0  # > 0: the signal matrices run a chain of their own
    chunk_elems: int = field(default_factory=lambda: _package_chunk_elems())  # matrices per chain chunk x m^2
    dof_grams: bool = True  # the 'gauss-sums' deviation Gram at R >= 3
    pool: bool = True  # the noise pool (GNSHookState's default pool_beta = 0.9)
    gram_precision: str = "fp32"  # matmul precision of the Grams


def tf32_solver(**kw) -> Solver:
    """The opt-in (method 'newton-tf32'): signal matrices in their own TF32 chain."""
    c = solver_counts("tf32")
    return Solver(signal_products=c["trace"], signal_precision="tf32",
                  signal_launches_per_chain=c["launches"], **kw)


def gram_flops(a: int, b: int) -> int:
    """FLOPs of the Gram X X^T of an a x b matrix on its smaller side m: 2 m^2 n."""
    m, n = min(a, b), max(a, b)
    return 2 * m * m * n


def newton_flops(m: int, s: Solver) -> int:
    """FLOPs of one sqrt-trace of an m x m matrix in the chain: trace_products x 2 m^3."""
    return s.trace_products * 2 * m ** 3


def _package_chunk_elems() -> int:
    """spectral.newton's workspace per chain chunk (chunk_size(m) = this // m^2)."""
    from gns_kernels.spectral.newton import CHUNK_ELEMS

    return CHUNK_ELEMS


def chunk_size(m: int, s: Solver) -> int:
    return max(1, s.chunk_elems // max(1, m * m))


def matmul_floor_s(shapes: list, ranks: int, hw: "Hardware", s: Solver) -> float:
    """The solver's matmul floor on one rank: every product of its chain (noise, signal,
    pool traces; noise and pool pair sums) at the matmul rate, nothing else
    (``nuclear_step``'s ``matmul_s``)."""
    return nuclear_step(shapes, ranks, hw, s).matmul_s


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
    launches: int = 0  # kernels of the solver's chains
    matmul_s: float = 0.0  # the solver's chain at the matmul rate alone (its floor)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def dominant(self) -> str:
        return max(self.seconds, key=self.seconds.get)


def _rank_terms(t: "Terms", shapes: list, ranks: int, hw: "Hardware", s: "Solver",
                grad_itemsize: int) -> tuple:
    """The terms every S1 route pays on one rank, written into t: pack (read the gradients
    in the bucket's dtype, write float32; copy the Grams in: read + write), the collective
    (the extra bytes over plain DDP: the Grams, the float32 widening of the gradients; then
    one small collective sharing the per-matrix results, latency only) and the
    'gauss-sums' dof at R >= 3 (one deviation Gram per matrix, read for two norms).
    Returns (ms: the Gram sides, owned: the busiest rank's matrices by the package's
    assignment, gram_elems)."""
    n_param = sum(a * b for a, b in shapes)
    gram_elems = sum(min(a, b) ** 2 for a, b in shapes)
    t.bytes["pack"] = n_param * (grad_itemsize + 4) + gram_elems * 8
    t.seconds["pack"] = t.bytes["pack"] / hw.copy_rate()
    ms = [min(a, b) for a, b in shapes]
    owned = busiest_rank_matrices(ms, ranks)
    t.bytes["collective"] = gram_elems * 4 + n_param * (4 - grad_itemsize)
    t.seconds["collective"] = (allreduce_s(t.bytes["collective"], ranks, hw)
                               + (hw.coll_latency if ranks > 1 else 0.0))
    if s.dof_grams and ranks >= 3:
        t.flops["dof"] = sum(gram_flops(a, b) for a, b in shapes)
        t.seconds["dof"] = (t.flops["dof"] / hw.matmul_rate(s.gram_precision)
                            + gram_elems * 4 / hw.copy_rate())
    else:
        t.flops["dof"] = 0
        t.seconds["dof"] = 0.0
    return ms, owned, gram_elems


def nuclear_step(shapes: list, ranks: int, hw: Hardware = Hardware(), s: Solver = Solver(),
                 grad_itemsize: int = 4) -> Terms:
    """Predicted added cost of one S1 measurement on one rank (see the module docstring).

    shapes: every measured matrix (a, b); ranks: R; grad_itemsize: bytes per element of the
    bucket (4 float32, 2 bf16).
    """
    t = Terms()
    ms, owned, gram_elems = _rank_terms(t, shapes, ranks, hw, s, grad_itemsize)
    # Grams: the local ones of every matrix; the mean gradient's Gram and C (read 2 Grams,
    # write 1) only for the owned matrices
    local = sum(gram_flops(a, b) for a, b in shapes)
    t.flops["grams"] = local + sum(gram_flops(*shapes[i]) for i in owned)
    t.bytes["grams"] = gram_elems * 4 + sum(ms[i] ** 2 for i in owned) * 12
    t.seconds["grams"] = (t.flops["grams"] / hw.matmul_rate(s.gram_precision)
                          + t.bytes["grams"] / hw.copy_rate())
    # solves: the owned matrices' noise and signal traces (one chain per Gram size)
    noise = sum(newton_flops(ms[i], s) for i in owned)
    sig = sum(s.signal_products * 2 * ms[i] ** 3 for i in owned)
    t.flops["solves"] = int(noise + sig)
    t.seconds["solves"] = noise / hw.matmul_rate(s.precision) + sig / hw.matmul_rate(s.signal_precision)
    # bias correction: the pair sum's products per owned noise matrix
    pair = sum(s.pair_products * 2 * ms[i] ** 3 for i in owned)
    t.flops["bias"] = int(pair)
    t.seconds["bias"] = pair / hw.matmul_rate(s.precision)
    # noise pool: the owned matrices' pool update, their pooled trace and pair sum (same chain)
    if s.pool:
        t.bytes["pool"] = sum(ms[i] ** 2 for i in owned) * 24
        t.flops["pool"] = int(noise + pair)
        t.seconds["pool"] = (noise + pair) / hw.matmul_rate(s.precision) + t.bytes["pool"] / hw.copy_rate()
    else:
        t.bytes["pool"] = t.flops["pool"] = 0
        t.seconds["pool"] = 0.0
    # launch floor: chunks of each Gram size's chain (noise, pool, signal matrices together)
    own = s.signal_launches_per_chain == 0  # the signal matrices in the same chain
    per_k: dict = {}
    for i in owned:
        per_k[ms[i]] = per_k.get(ms[i], 0) + 1
    per = (2 if s.pool else 1) + (1 if own else 0)  # matrices per owned matrix in the chain
    t.launches = sum(math.ceil(per * n / chunk_size(k, s)) for k, n in per_k.items()) * s.launches_per_chain
    if not own:
        t.launches += sum(math.ceil(n / chunk_size(k, s)) for k, n in per_k.items()) * s.signal_launches_per_chain
    floor = t.launches * hw.launch_s
    gpu = t.seconds["solves"] + t.seconds["bias"] + t.seconds["pool"]
    t.matmul_s = gpu - t.bytes["pool"] / hw.copy_rate()
    if floor > gpu:
        t.seconds["solves"] += floor - gpu
    return t


@functools.lru_cache(maxsize=None)
def host_solve_s(m: int, pair: bool, reps: int = 3) -> float:
    """Seconds of ONE host solve on this machine's CPU, MEASURED (min of ``reps``): the
    package's own host route (gns_kernels.spectral.host.host_eigen_sums: float64 eigvalsh
    on the CPU, the sqrt-trace, and the pair sum when ``pair``) of one m x m symmetric
    matrix, on the calling thread with MKL's default thread count. A core-seconds figure
    only where that count is 1 (``main`` sets it)."""
    import time

    import torch

    from gns_kernels.spectral.host import host_eigen_sums

    g = torch.Generator().manual_seed(m)
    X = torch.randn(m, m + 7, dtype=torch.float64, generator=g)
    A = X @ X.T
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        host_eigen_sums([A], [pair])
        best = min(best, time.perf_counter() - t0)
    return best


def host_step(shapes: list, ranks: int, hw: Hardware = Hardware(), s: Solver = Solver(),
              grad_itemsize: int = 4, host_s=host_solve_s) -> Terms:
    """Predicted GPU cost of one S1 measurement on one rank on the HOST route (method
    'host'): the device forms what only it forms cheaply and copies it to pinned host
    memory; the O(k^3) solves run on CPU threads (``host_core_s``), off the GPU.

    GPU terms: pack, the local Grams, the collective and the dof as ``nuclear_step``; per
    owned matrix the mean gradient's Gram D D^T in float64 (2 m^2 n FP64 FLOPs) and C =
    scale (mean Gram - D D^T) in float64 (read 4 + 8, write 8 bytes per element); the pool
    (on) its EMA update of P in float64 (read C and P, write P: 24 bytes per element); no
    solve, no pair sum. ``copy``: the bytes copied to the host per owned matrix (C and the
    signal Gram float64, 8 m^2 each; the pooled P float32, 4 m^2), on the copy engine
    (overlapped with compute: listed, not added to the GPU total). Launches: the staging's
    aten ops as built (``staging_launches``, counted on CPU), booked at the launch cost."""
    t = Terms()
    ms, owned, gram_elems = _rank_terms(t, shapes, ranks, hw, s, grad_itemsize)
    local = sum(gram_flops(a, b) for a, b in shapes)
    dd = sum(gram_flops(*shapes[i]) for i in owned)
    t.flops["grams"] = local + dd
    t.bytes["grams"] = gram_elems * 4 + sum(ms[i] ** 2 for i in owned) * 20
    t.seconds["grams"] = (local / hw.matmul_rate(s.gram_precision) + dd / hw.matmul_rate("fp64")
                          + t.bytes["grams"] / hw.copy_rate())
    t.bytes["pool"] = sum(ms[i] ** 2 for i in owned) * 24 if s.pool else 0
    t.flops["pool"] = 0
    t.seconds["pool"] = t.bytes["pool"] / hw.copy_rate()
    t.flops["solves"] = t.flops["bias"] = 0
    t.seconds["solves"] = t.seconds["bias"] = 0.0
    # copied per owned matrix: C and the signal Gram (float64), the pooled P (float32)
    t.bytes["copy"] = sum(ms[i] ** 2 for i in owned) * (16 + (4 if s.pool else 0))
    t.launches = staging_launches(s.pool, len(owned), len({ms[i] for i in owned}))
    t.seconds["launch"] = t.launches * hw.launch_s
    return t


@functools.lru_cache(maxsize=None)
def staging_counts(pool: bool = True) -> tuple:
    """(per Gram size, per owned matrix): the non-view aten ops of the host route's
    staging AS BUILT, counted on CPU by running it (gns_kernels.distributed._share's
    ``SolveShare.add_grads`` + ``stage`` with method 'host', one rank, the 'columns' dof,
    raw signal; the noise pool on or off): the ops of one and of two owned matrices of one
    Gram size, so launches = a + b n per size. On CUDA the pinned copies add one copy per
    staged stack (not counted here: a copy engine transfer)."""
    import torch

    from gns_kernels.distributed._share import SolveShare
    from gns_kernels.stats.pool import NoisePool

    def count(n: int) -> int:
        g = torch.Generator().manual_seed(n)
        grads = [torch.randn(6, 9, generator=g) for _ in range(n)]
        grams = [(d @ d.T) for d in grads]
        share = SolveShare(1, 0, 3.0, True, 4, 8.0, method="host", dof="columns",
                           pool=NoisePool(0.9) if pool else None, owners={} if pool else None)
        with _launch_counter() as mode:
            share.add_grads(grams, grads, None, None, [(0, j) for j in range(n)] if pool else None)
            share.stage()
        return mode.n

    one, two = count(1), count(2)
    return one - (two - one), two - one


def staging_launches(pool: bool, n_owned: int = 1, sizes: int = 1) -> int:
    """Kernels of the host route's staging for ``n_owned`` owned matrices in ``sizes``
    Gram sizes (``staging_counts``, counted on CPU from the package)."""
    a, b = staging_counts(pool)
    return a * sizes + b * n_owned


def host_core_s(shapes: list, ranks: int, s: Solver = Solver(), host_s=host_solve_s) -> float:
    """CPU core-seconds of one measurement's host solves on the busiest rank, from
    ``host_s`` (measured on this machine): per owned matrix the noise C and the pooled P
    with their pair sums (bias correction, the pool), the signal without."""
    ms = [min(a, b) for a, b in shapes]
    owned = busiest_rank_matrices(ms, ranks)
    per = sum(host_s(ms[i], True) * (2 if s.pool else 1) + host_s(ms[i], False) for i in owned)
    return per


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
            for prec in ("fp64", "tf32"):
                s = Solver() if prec == "fp64" else tf32_solver(gram_precision="tf32")
                t = nuclear_step(shapes, r, hw, s)
                ms = {k: v * 1e3 for k, v in t.seconds.items()}
                rows.append(
                    f"| {name} | {r} | S1 Newton, {'as built (fp64 chain)' if prec == 'fp64' else 'TF32 (gk.nuclear_stats only; hooks refuse it)'} | {ms['pack']:.2f} | {ms['grams']:.2f} "
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
    c64, c32 = solver_counts("float64"), solver_counts("tf32")
    print("PREDICTION (no GPU measurement): one measurement step, one rank, H100 SXM.")
    print(f"assumed: {hw}")
    print(f"solver as built (counted on CPU from the package): float64 chain, {c64['iters']} coupled "
          f"iterations; {c64['trace']} products per matrix for its trace, {c64['pair']} more for a pair "
          f"sum, {c64['trace_unprojected']} for a signal Gram (no projection); {c64['launches_pair']} launches per chain chunk (chunk_size(768) = 16 matrices); "
          f"TF32 signal chain: {c32['trace']} products, {c32['launches']} launches; noise pool "
          f"{'on' if s.pool else 'off'}")
    print(table(hw))
    shapes = SHAPES_160M * 12
    for name, sv in (("as built (fp64 chain)", s), ("TF32 opt-in", tf32_solver(gram_precision="tf32"))):
        t = nuclear_step(shapes, 8, hw, sv)
        floor = matmul_floor_s(shapes, 8, hw, sv)
        verdict = "meets" if t.total_s * 1e3 < TARGET_MS else "misses"
        print(f"160M, R = 8, {name}: {t.total_s * 1e3:.1f} ms predicted ({verdict} the {TARGET_MS:.0f} ms "
              f"target); matmul floor of the solver {floor * 1e3:.1f} ms; launch floor "
              f"{t.launches * hw.launch_s * 1e3:.2f} ms ({t.launches} launches); dominant term: {t.dominant()}")
    import platform

    import torch

    torch.set_num_threads(1)  # one core per host solve: core-seconds
    t = host_step(shapes, 8, hw, s)
    core_s = host_core_s(shapes, 8, s)
    gpu_ms = t.total_s * 1e3
    print(f"160M, R = 8, host route (method 'host'): GPU {gpu_ms:.1f} ms predicted (pack "
          f"{t.seconds['pack'] * 1e3:.2f}, Grams + float64 D D^T and C {t.seconds['grams'] * 1e3:.2f}, "
          f"collective {t.seconds['collective'] * 1e3:.2f}, dof {t.seconds['dof'] * 1e3:.2f}, pool "
          f"{t.seconds['pool'] * 1e3:.2f}, launches {t.seconds['launch'] * 1e3:.2f} for {t.launches}); "
          f"copy to pinned host memory {t.bytes['copy'] / 1e6:.0f} MB on the copy engine "
          f"({t.bytes['copy'] / hw.d2h_bw * 1e3:.1f} ms at {hw.d2h_bw / 1e9:.0f} GB/s, overlapped); host "
          f"solves {core_s:.2f} core-s MEASURED on this CPU ({platform.processor() or platform.machine()}, "
          f"1 thread, float64 eigvalsh {host_solve_s(768, False) * 1e3:.1f} ms at k = 768, "
          f"+ pair sum {(host_solve_s(768, True) - host_solve_s(768, False)) * 1e3:.1f} ms)")
    print(f"S1 per rank, 160M, R=8, pool on, H100: {gpu_ms:.1f} ms GPU, {core_s:.2f} core-s host")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
