"""Nuclear (S1) statistics: batched Grams, tr(A^{1/2}), per-layer noise and signal.

Notation (DESIGN.md "The math"): per layer a gradient matrix G (m x n), samples
j = 1..R (ranks, or ranks x micro-batches), each the mean gradient over B/R examples.

    Gram           G G^T ('row', m x m) or G^T G ('col', n x n); 'auto' = the smaller side
    covariance     C = scale * (mean_j G^j G^jT - D D^T),  scale = B/(R-1),  D = mean_j G^j
                   (with a shift S identical on all samples: G^j - S and D = G - S)
    noise          tr(C^{1/2})           (units: gradient units x sqrt(examples))
    signal         ||G||_S1 = tr((G G^T)^{1/2})   (gradient units)

tr(C_row^{1/2}) == tr(C_col^{1/2}) and ||G||_S1 is the same on both sides, so any side is
exact; the smaller one is cheapest.

Public functions (re-exported as gns_kernels.gram / sqrt_trace / nuclear_stats):

- ``gram(tensors, side="auto") -> list[Tensor]``: float32 Grams, one batched op call per
  group of equal shapes (upper-triangle blocks only, mirrored), any float input dtype.
- ``sqrt_trace(A, method="auto") -> Tensor[...]``: tr(A^{1/2}) for symmetric PSD A,
  by "eigh" (float32 eigvalsh with a per-matrix float64 fallback chosen by an a-posteriori
  error bound) or "newton" (coupled Newton-Schulz in float32 with a relative shift, a
  spectral correction of the shift and a divergence guard; no host synchronization).
- ``nuclear_stats(mean_grams, mean_grads, scale, ...) -> (noise[L], signal[L])``.

The heavy parts are torch.library custom ops with fake kernels (torch.compile keeps each
as one opaque node): ``torch.ops.gns_kernels.gram_list`` / ``.gram_batched``, ``.psd_eigvalsh``,
``.newton_sqrt_trace``. See docs/spectral.md for accuracy, cost and the method choice.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from .reference import gram_side

Tensor = torch.Tensor

__all__ = [
    "gram",
    "sqrt_trace",
    "nuclear_stats",
    "psd_eigvalsh",
    "newton_min_iters",
    "NEWTON_EPS",
    "NEWTON_MAX_ITERS",
    "EIGH_TOL",
]

# ----------------------------------------------------------------------------- constants
U32 = 2.0**-24  # float32 unit roundoff
EIGH_TOL = 5e-4  # eigh: float64 fallback when the float32 error bound exceeds this (relative)
NEWTON_EPS = 1e-6  # newton: default relative shift (of A / ||A||_F); tuned, see docs/spectral.md
NEWTON_EPS_RANGE = (1e-6, 1e-2)
NEWTON_MAX_ITERS = 200
_FREEZE_SLACK = 1e-3  # newton guard: freeze when ||ZY - I||_F exceeds its minimum by this factor

_DEBUG_ENV = "GNS_KERNELS_VALIDATE"


def _validate_requested(validate: bool) -> bool:
    return bool(validate) or os.environ.get(_DEBUG_ENV, "") not in ("", "0")


# ----------------------------------------------------------------------------- threading
def _map_cpu(fn, items: list) -> list:
    """fn over items, one item per task on torch.get_num_threads() worker threads.

    LAPACK's eigvalsh at m <= ~1000 scales poorly with threads (measured 32 ms on one
    thread, 22 ms on two at m = 768), and small GEMMs likewise, so independent matrices on
    single-threaded workers beat one multi-threaded call. The intra-op thread count is set
    to 1 for the duration and restored afterwards (a process-wide setting: do not call
    concurrently with other torch work that relies on it). Results are bitwise the same as
    a serial loop under torch.set_num_threads(1).

    The workers live for one call only: idle threads that have run BLAS calls stay
    registered with GNU OpenMP, which then counts more threads than CPUs and throttles its
    spin-waiting, making every later multi-threaded LAPACK call in the process ~4x slower
    (measured: float32 eigvalsh at m = 768 on 2 threads, 19 ms -> 78 ms while a persistent
    pool of 2 such workers existed). Starting 2 threads per call costs ~0.1 ms.
    """
    n = torch.get_num_threads()
    if n <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    old = n
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=min(n, len(items)), thread_name_prefix="gns_spectral") as pool:
            return list(pool.map(fn, items))
    finally:
        torch.set_num_threads(old)


# ============================================================================== Gram
_GRAM_BLOCK = 64  # CPU: rows per strip of the upper-triangle Gram


def _gram_blocked_into(x: Tensor, out: Tensor) -> Tensor:
    """out (k, k) <- x x^T for x (k, n) float32 (any strides), upper triangle only.

    Row strips of ~64 rows: strip i is one GEMM x[rows_i] @ x[rows_i.start:]^T written
    straight into out[rows_i, rows_i.start:] (the diagonal block and everything right of
    it: (nb + 1) / (2 nb) of the FLOPs, 0.54 at k = 768); the part left of the diagonal is
    mirrored from the strips above, the diagonal block replaced by (blk + blk^T) / 2, so the
    result is exactly symmetric. Measured here on one thread (bench/RESULTS.md): 768 x 768
    6.8 ms vs 10.4 ms for the full GEMM, 768 x 2048 17.0 vs 25.7 ms, 256 x 1024 1.15 vs
    1.52 ms (square blocks of 128 rows: 7.4, 18.1, 1.32 ms; fewer, longer GEMMs win).
    """
    k = x.shape[0]
    nb = max(1, -(-k // _GRAM_BLOCK))
    e = [i * k // nb for i in range(nb + 1)]
    for i in range(nb):
        a, b = e[i], e[i + 1]
        torch.mm(x[a:b], x[a:].T, out=out[a:b, a:])
        d = out[a:b, a:b]
        d.copy_((d + d.T).mul_(0.5))
        if b < k:
            out[b:, a:b].copy_(out[a:b, b:].T)
    return out


def _gram_cpu(xs: Sequence[Tensor], col: bool) -> list[Tensor]:
    """Grams of equal-shape 2-D CPU tensors, float32, one (k, k) tensor each, no stacked copy
    of the inputs: one matrix per task on single-threaded workers (_map_cpu), the same
    scheme as the eigensolver; on par with one multi-threaded call per matrix (measured, 2
    threads, 48 Grams of 768 x 768 into preallocated outputs: 0.21 s on workers, 0.20 s
    serial with 2-thread MKL). Separate outputs rather than one (L, k, k) block: a fresh
    allocation of hundreds of MB is page-faulted on every call (~0.45 ms per MB here),
    per-matrix ones are recycled."""
    m, n = xs[0].shape
    k = n if col else m

    def one(x: Tensor) -> Tensor:
        x = x if x.dtype == torch.float32 else x.float()
        return _gram_blocked_into(x.mT if col else x, torch.empty((k, k), dtype=torch.float32))

    return _map_cpu(one, list(xs))


@torch.library.custom_op("gns_kernels::gram_list", mutates_args=())
def gram_list(xs: list[Tensor], col: bool) -> list[Tensor]:
    """Grams in float32 of equal-shape 2-D tensors: xs[l] (m, n) -> out[l] = xs[l] xs[l]^T
    (m, m), or xs[l]^T xs[l] (n, n) if col. Any floating input dtype, products accumulated
    in float32. CPU: per matrix, upper-triangle blocks (_gram_cpu); other devices: the
    stacked batch through gram_batched."""
    if xs[0].device.type == "cpu":
        return _gram_cpu(xs, col)
    return list(gram_batched(torch.stack(xs), col).unbind(0))


@gram_list.register_fake
def _(xs: list[Tensor], col: bool) -> list[Tensor]:
    m, n = xs[0].shape
    k = n if col else m
    return [x.new_empty((k, k), dtype=torch.float32) for x in xs]


@torch.library.custom_op("gns_kernels::gram_batched", mutates_args=())
def gram_batched(x: Tensor, col: bool) -> Tensor:
    """Batched Gram in float32: x (L, m, n) -> x x^T (L, m, m), or x^T x (L, n, n) if col.

    Any floating input dtype; products are accumulated in float32 (bf16/fp16 inputs are
    exact in float32, so this is the float32 Gram of the given values).
    """
    if x.device.type == "cpu":
        return torch.stack(_gram_cpu(list(x.unbind(0)), col))
    if x.device.type == "cuda" and x.dtype != torch.float64:
        tg = _triton_gram()
        if tg is not None:  # upper-triangle tiles only, bf16/fp16 read natively
            return tg(x, col)
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        xt = x.mT if col else x
        return torch.bmm(xt, xt.mT, out_dtype=torch.float32)
    xf = x if x.dtype == torch.float32 else x.float()
    if col:
        xf = xf.mT
    return torch.bmm(xf, xf.mT)


@gram_batched.register_fake
def _(x: Tensor, col: bool) -> Tensor:
    k = x.shape[-1] if col else x.shape[-2]
    return x.new_empty((x.shape[0], k, k), dtype=torch.float32)


_TRITON_GRAM: list = []


def _triton_gram():
    """gns_kernels.triton.gram.gram_upper, or None without triton (imported on first CUDA use)."""
    if not _TRITON_GRAM:
        try:
            from .triton.gram import gram_upper
        except ImportError:
            gram_upper = None
        _TRITON_GRAM.append(gram_upper)
    return _TRITON_GRAM[0]


def gram(tensors: Sequence[Tensor], side: str = "auto") -> list[Tensor]:
    """Per 2-D tensor G (m x n): its Gram G G^T ('row', m x m) or G^T G ('col', n x n).

    side: 'auto' (the smaller side: row when m <= n), 'row' or 'col'.
    Any floating dtype (bf16/fp16/fp32/fp64 gradients); the result is float32, accumulated
    in float32 (float64 inputs are rounded to float32 first). Tensors of equal shape, dtype
    and device go to one batched op call (torch.ops.gns_kernels.gram_list): on CPU without
    stacking them, one matrix per single-threaded worker, only upper-triangle blocks
    multiplied and mirrored; on CUDA stacked, a Triton kernel computing only upper-triangle
    tiles. Returns a list in input order.
    """
    tensors = list(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(tensors):
        if not isinstance(g, Tensor):
            raise ValueError(f"tensors[{i}]: expected a torch.Tensor, got {type(g).__name__}")
        if g.dim() != 2:
            raise ValueError(f"tensors[{i}]: expected a 2-D tensor (m, n), got shape {tuple(g.shape)}")
        if not g.is_floating_point():
            raise ValueError(f"tensors[{i}]: expected a floating dtype, got {g.dtype}")
        s = gram_side(g.shape, side)
        groups.setdefault((tuple(g.shape), g.dtype, g.device, s), []).append(i)
    out: list[Tensor | None] = [None] * len(tensors)
    for (_, _, _, s), idx in groups.items():
        res = torch.ops.gns_kernels.gram_list([tensors[i].detach() for i in idx], s == "col")
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]


# ============================================================================== eigh
def _eig_error_bound(lam: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """A-posteriori bound of |sum sqrt(lam+) - sum sqrt(true+)| for float32 eigenvalues.

    lam: (..., m) float32 eigenvalues of a symmetric matrix. Every computed eigenvalue is
    within delta = c(m) u lam_max of a true one (backward stability; c(m) = max(8, m/4)
    covers 3x the largest error measured here, ~0.08 m). Per eigenvalue the sqrt error is
    at most sqrt(2 delta) when lam_i <= delta, else delta / sqrt(lam_i). Returns
    (bound, trace) in units of sqrt(lam_max), float64, shape (...).
    """
    lam = lam.double()
    lmax = lam.abs().amax(-1, keepdim=True)
    safe = torch.where(lmax > 0, lmax, torch.ones_like(lmax))
    r = lam / safe
    delta = max(8.0, m / 4.0) * U32
    small = r <= delta
    err = torch.where(small, torch.full_like(r, math.sqrt(2 * delta)), delta / r.clamp_min(delta).sqrt())
    err = torch.where(lmax > 0, err, torch.zeros_like(err))
    return err.sum(-1), r.clamp_min(0).sqrt().sum(-1)


def _eig_batched(flat: Tensor, tol: float) -> Tensor:
    """(B, m, m) -> float64 eigenvalues (B, m): float32 eigvalsh of A / 2^e (a power of two
    near max|A_ij|: exact scaling, no under/overflow in LAPACK or in the bound), and
    float64 eigvalsh (of the same input values) for the matrices whose error bound exceeds
    tol: one host sync on devices other than the CPU (the size of that subset).
    Non-finite matrices -> NaN."""
    m = flat.shape[-1]
    wide = flat.dtype == torch.float64
    x = flat.double() if wide else flat.float()
    x = 0.5 * (x + x.mT)
    amax = x.abs().amax((-2, -1))
    finite = torch.isfinite(amax)  # NaN and inf propagate into the max
    amax = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
    scale = torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent)
    x = torch.where(finite[:, None, None], x, torch.zeros_like(x)) / scale[:, None, None]
    try:
        lam = torch.linalg.eigvalsh(x if not wide else x.float())
    except torch.linalg.LinAlgError:
        # float32 LAPACK/cuSOLVER can fail to converge (seen on Grams with many zero rows,
        # e.g. the embedding gradient of a short batch): solve the chunk in float64.
        lam = torch.linalg.eigvalsh(x.double())
    else:
        bound, tr = _eig_error_bound(lam, m)
        need = ~(bound <= tol * tr)  # also NaN: float32 LAPACK can return NaN silently
        lam = lam.double()
        idx = need.nonzero().squeeze(-1)
        if idx.numel():
            lam[idx] = torch.linalg.eigvalsh(x[idx].double())
    lam = lam * scale.double()[:, None]
    return torch.where(finite[:, None], lam, torch.full_like(lam, math.nan))


def _eig_cpu_one(A: Tensor, B: Tensor | None, scale: float, tol: float, wide: bool,
                 symmetrize: bool = False) -> tuple[Tensor, bool]:
    """(float64 eigenvalues (k,), solved in float64) of S = scale * (A - B) (B None: scale * A),
    one CPU matrix.

    The same method as _eig_batched (float32 eigvalsh of S / 2^e, float64 eigvalsh of the
    same values when the error bound exceeds tol) without its batch temporaries: S is
    formed once, scaled in place by scale / 2^e (exact: one rounding, as scale * (A - B)
    then / 2^e, and no overflow of scale * (A - B)), and the lower triangle is used (no
    symmetrization pass unless ``symmetrize``: A and B are symmetric). wide=True skips the
    float32 attempt (a caller's hint that it would fall back: same result as the fallback,
    without its cost).
    Non-finite input -> NaN eigenvalues.
    """
    k = A.shape[-1]
    f64 = A.dtype == torch.float64 or (B is not None and B.dtype == torch.float64)
    dt = torch.float64 if f64 else torch.float32
    x = A.to(dt, copy=True) if B is None else torch.sub(A.to(dt), B.to(dt))
    if symmetrize:  # psd_eigvalsh's contract: (S + S^T) / 2
        x = (x + x.mT).mul_(0.5)
    lo, hi = (float(v) for v in torch.aminmax(x))  # 18x faster than vector_norm(x, inf) here
    amax = math.nan if math.isnan(lo + hi) else max(-lo, hi) * abs(scale)
    if not math.isfinite(amax):
        return torch.full((k,), math.nan, dtype=torch.float64), False
    if amax == 0.0:
        return torch.zeros(k, dtype=torch.float64), False
    s2 = math.ldexp(1.0, math.frexp(amax)[1])
    x.mul_(scale / s2)
    if wide:
        return torch.linalg.eigvalsh(x.double()) * s2, True
    try:
        lam = torch.linalg.eigvalsh(x.float() if f64 else x)
    except torch.linalg.LinAlgError:  # float32 LAPACK non-convergence (see _eig_batched)
        return torch.linalg.eigvalsh(x.double()) * s2, True
    bound, tr = _eig_error_bound(lam, k)
    if not float(bound) <= tol * float(tr):  # also NaN: float32 LAPACK can return NaN silently
        return torch.linalg.eigvalsh(x.double()) * s2, True
    return lam.double() * s2, False


@torch.library.custom_op("gns_kernels::psd_eigvalsh_list", mutates_args=())
def _psd_eigvalsh_list_op(A: list[Tensor], B: list[Optional[Tensor]], scales: list[float], tol: float,
                          wide: list[bool]) -> tuple[Tensor, Tensor]:
    """Eigenvalues (L, k) float64 of S_l = scales[l] * (A[l] - B[l]) (B[l] None: scales[l] *
    A[l]), and a bool (L,) telling which were solved in float64. Every A[l], B[l] is k x k
    and symmetric (the lower triangle is used). Accuracy as psd_eigvalsh; wide[l] = True
    solves S_l in float64 directly (the float32 attempt is skipped). CPU: one matrix per
    single-threaded worker, S_l formed inside the worker (no stacked copy of the inputs);
    other devices: stacked, then _eig_batched (the hint is not used)."""
    if A[0].device.type == "cpu":
        res = _map_cpu(lambda l: _eig_cpu_one(A[l], B[l], scales[l], tol, wide[l]), list(range(len(A))))
        return torch.stack([r[0] for r in res]), torch.tensor([r[1] for r in res], dtype=torch.bool)
    f64 = any(a.dtype == torch.float64 for a in A) or any(b is not None and b.dtype == torch.float64 for b in B)
    dt = torch.float64 if f64 else torch.float32
    mats = torch.stack([(a.to(dt) if b is None else a.to(dt) - b.to(dt)) * sc for a, b, sc in zip(A, B, scales)])
    lam = _eig_batched(mats, tol)
    return lam, torch.zeros(len(A), dtype=torch.bool, device=lam.device)


@_psd_eigvalsh_list_op.register_fake
def _(A: list[Tensor], B: list[Optional[Tensor]], scales: list[float], tol: float,
      wide: list[bool]) -> tuple[Tensor, Tensor]:
    return (A[0].new_empty((len(A), A[0].shape[-1]), dtype=torch.float64),
            A[0].new_empty((len(A),), dtype=torch.bool))


def _psd_eigvalsh_impl(A: Tensor, tol: float) -> Tensor:
    m = A.shape[-1]
    batch = A.shape[:-2]
    flat = A.detach().reshape(-1, m, m)
    if flat.shape[0] == 0:
        return flat.new_empty((*batch, m), dtype=torch.float64)
    if flat.device.type == "cpu" and m >= 256:
        # one matrix per single-threaded worker (see _map_cpu), without batch temporaries
        res = _map_cpu(lambda a: _eig_cpu_one(a, None, 1.0, tol, False, symmetrize=True)[0], list(flat.unbind(0)))
        out = torch.stack(res)
    elif flat.device.type == "cpu" and m >= 32:
        # independent chunks on single-threaded workers, one per thread (per-call overhead)
        n_chunks = min(flat.shape[0], torch.get_num_threads())
        chunks = list(flat.chunk(n_chunks))
        out = torch.cat(_map_cpu(lambda c: _eig_batched(c, tol), chunks))
    else:
        # CUDA: batched float32, then float64 for the flagged subset; one host
        # synchronization (the subset's size); cuSOLVER's eigh syncs on its info anyway.
        out = _eig_batched(flat, tol)
    return out.reshape(*batch, m)


@torch.library.custom_op("gns_kernels::psd_eigvalsh", mutates_args=())
def _psd_eigvalsh_op(A: Tensor, tol: float) -> Tensor:
    return _psd_eigvalsh_impl(A, tol)


@_psd_eigvalsh_op.register_fake
def _(A: Tensor, tol: float) -> Tensor:
    return A.new_empty(A.shape[:-1], dtype=torch.float64)


def psd_eigvalsh(A: Tensor, tol: float = EIGH_TOL) -> Tensor:
    """Eigenvalues (float64, ascending, shape (..., m)) of symmetric A (..., m, m), accurate
    enough that sum_i sqrt(max(lambda_i, 0)) is within ``tol`` (relative) of the float64
    value: float32 eigvalsh of A / max|A_ij|, and float64 eigvalsh for the matrices whose
    a-posteriori error bound (see _eig_error_bound) exceeds tol. Non-finite matrices give
    NaN eigenvalues. A is symmetrized as (A + A^T)/2.
    """
    _check_square(A, "A")
    return torch.ops.gns_kernels.psd_eigvalsh(A, float(tol))


# ============================================================================== newton
def newton_min_iters(eps: float = NEWTON_EPS) -> int:
    """Smallest iteration count allowed for relative shift ``eps``: the coupled
    Newton-Schulz product p = y z of an eigenvalue eps/2 (eps halved by rounding noise)
    reaches 1 - 1e-7 (scalar recursion p <- p (3 - p)^2 / 4). 22 at eps = 1e-6."""
    p, k = eps / 2.0, 0
    while 1.0 - p > 1e-7 and k < NEWTON_MAX_ITERS:
        p = p * (3.0 - p) ** 2 / 4.0
        k += 1
    return k


# q(w) ~ sqrt(1 - w): Taylor coefficients to w^5, the w^6 coefficient makes q(1) = 0.
_Q_COEFFS = (1.0, -1 / 2, -1 / 8, -1 / 16, -5 / 128, -7 / 256)
_Q_COEFFS = _Q_COEFFS + (-sum(_Q_COEFFS),)


def _shift_correction(Y: Tensor, Z: Tensor, e: Tensor, eye: Tensor) -> Tensor:
    """tr(Y q(W)), W = e Z^2 (see _newton_impl step 3); Horner in W. Shape (B,)."""
    W = e * torch.bmm(Z, Z)
    Q = _Q_COEFFS[-1] * W + _Q_COEFFS[-2] * eye
    for c in reversed(_Q_COEFFS[:-2]):
        Q = torch.bmm(W, Q) + c * eye
    return (Y * Q.mT).sum((-2, -1))


def _newton_impl(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None,
                 every: bool = False) -> Tensor:
    """tr(A^{1/2}) by the coupled Newton-Schulz iteration, float32, fixed iteration count.

    1. Scale-safe normalization without squaring the raw entries: a = max|A_ij|,
       f = ||A/a||_F, M = A/(a f) + eps I  (||A/(a f)||_F = 1, so spec(M) in [eps-noise, 1+eps]).
       eps >> float32 rounding noise of A (~1e-8 relative), so M is positive definite even
       when A is PSD only up to rounding, and its condition is at most ~1/eps.
    2. Coupled Newton-Schulz (Higham, Functions of Matrices, eq. 6.35):
       Y0 = M, Z0 = I, T = (3I - Z Y)/2, Y <- Y T, Z <- T Z;  Y -> M^{1/2}, Z -> M^{-1/2}
       for spec(M) in (0, 3). Guard: per matrix, the iterate is frozen (torch.where, no
       sync) once r = ||Z Y - I||_F exceeds (1 + 1e-3) min(previous r) or is non-finite.
       In exact arithmetic r decreases monotonically for PSD M, so the guard only acts past
       convergence (rounding-level wobble; freezing there is harmless) or on inputs with
       negative eigenvalues below -eps (then it keeps the result finite).
    3. Undo the shift spectrally: with W = eps Z^2 (eigenvalues w = eps/(lambda + eps) in
       (0, 1]), sqrt(lambda) = sqrt(lambda + eps) sqrt(1 - w) = y sqrt(1 - w) ~ y q(w),
       q = Taylor polynomial of sqrt(1 - w) to w^5 plus a w^6 term making q(1) = 0.
       Eigenvalues >= 3 eps keep their sqrt to ~0.23 w^6 (5e-5 at 3 eps); exact zeros give
       0, and float32 rounding noise +-delta around them ~2.7 delta / sqrt(eps) (signed)
       instead of sqrt(delta): the shift acts as a soft threshold at ~eps ||A||_F.
    ref_norm (shape (...), optional): a Frobenius norm the rounding noise of A is relative
    to (e.g. the operands of the subtraction that formed A); the shift becomes
    eps * max(ref_norm, ||A||_F), i.e. the relative shift eps * ref_norm / ||A||_F clamped
    to [eps, 1].
    Returns sqrt(a f) tr(Y q(W)), float32, shape (...); with every=True, shape
    (iters, ...): the result after k = 1..iters iterations (for tests: the iteration is
    deterministic, so entry k-1 equals the result of iters=k).
    """
    m = A.shape[-1]
    batch = A.shape[:-2]
    x = A.detach().reshape(-1, m, m).float()
    x = 0.5 * (x + x.mT)
    amax = x.abs().amax((-2, -1), keepdim=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    x = x / amax
    f = torch.linalg.matrix_norm(x, keepdim=True)
    f = torch.where(f > 0, f, torch.ones_like(f))
    x = x / f
    e = torch.full_like(f, eps)
    if ref_norm is not None:
        rel = ref_norm.detach().reshape(-1, 1, 1).to(device=x.device, dtype=torch.float64) / (
            amax.double() * f.double())
        e = (eps * rel).clamp(eps, 1.0).float()
        e = torch.where(torch.isfinite(e), e, torch.full_like(e, eps))
    eye = torch.eye(m, dtype=x.dtype, device=x.device).expand_as(x)
    Y = x + e * eye
    Z = eye.clone()
    rmin = torch.full_like(f, float("inf"))
    active = torch.ones_like(f, dtype=torch.bool)
    out_scale = (amax * f).reshape(-1).sqrt()
    traj = []
    for _ in range(iters):
        P = torch.bmm(Z, Y)
        r = torch.linalg.matrix_norm(P - eye, keepdim=True)
        active = active & torch.isfinite(r) & (r <= rmin * (1.0 + _FREEZE_SLACK))
        rmin = torch.where(active, torch.minimum(rmin, r), rmin)
        T = 1.5 * eye - 0.5 * P
        Y = torch.where(active, torch.bmm(Y, T), Y)
        Z = torch.where(active, torch.bmm(T, Z), Z)
        if every:
            traj.append((_shift_correction(Y, Z, e, eye) * out_scale).reshape(batch))
    if every:
        return torch.stack(traj)
    return (_shift_correction(Y, Z, e, eye) * out_scale).reshape(batch)


_NEWTON_CHUNK = 16  # matrices per batched iteration: bounds the workspace (6 x 16 x m^2 floats)


@torch.library.custom_op("gns_kernels::newton_sqrt_trace", mutates_args=())
def _newton_op(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None) -> Tensor:
    m = A.shape[-1]
    flat = A.reshape(-1, m, m)
    refs = None if ref_norm is None else ref_norm.reshape(-1)
    if flat.shape[0] <= _NEWTON_CHUNK:
        return _newton_impl(flat, iters, eps, refs).reshape(A.shape[:-2])
    outs = [_newton_impl(flat[i:i + _NEWTON_CHUNK], iters, eps,
                         None if refs is None else refs[i:i + _NEWTON_CHUNK])
            for i in range(0, flat.shape[0], _NEWTON_CHUNK)]
    return torch.cat(outs).reshape(A.shape[:-2])


@_newton_op.register_fake
def _(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None) -> Tensor:
    return A.new_empty(A.shape[:-2], dtype=torch.float32)


# ============================================================================== sqrt_trace
def _check_square(A, name: str) -> None:
    if not isinstance(A, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(A).__name__}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name}: expected square matrices (..., m, m), got shape {tuple(A.shape)}")
    if not A.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {A.dtype}")


def _resolve_method(method: str, device: torch.device) -> str:
    if method not in ("auto", "eigh", "newton"):
        raise ValueError(f"method: expected 'auto', 'eigh' or 'newton', got {method!r}")
    if method != "auto":
        return method
    # CPU: eigh (measured 5x (m = 64) to 25x (m = 768) faster than newton, bench/RESULTS.md).
    # CUDA: newton (pure batched matmuls, no host sync, CUDA-graph safe; cuSOLVER's
    # per-matrix syevd is latency bound and syncs): see docs/spectral.md.
    return "eigh" if device.type == "cpu" else "newton"


def _check_newton_args(iters: int | None, eps: float | None) -> tuple[int, float]:
    eps = NEWTON_EPS if eps is None else float(eps)
    if not (NEWTON_EPS_RANGE[0] <= eps <= NEWTON_EPS_RANGE[1]):
        raise ValueError(f"eps: expected a relative shift in [{NEWTON_EPS_RANGE[0]:g}, "
                         f"{NEWTON_EPS_RANGE[1]:g}], got {eps!r}")
    kmin = newton_min_iters(eps)
    if iters is None:
        iters = kmin + 3
    if isinstance(iters, bool) or int(iters) != iters or not (kmin <= iters <= NEWTON_MAX_ITERS):
        raise ValueError(f"iters: expected an integer in [{kmin}, {NEWTON_MAX_ITERS}] for eps={eps:g}, "
                         f"got {iters!r}")
    return int(iters), eps


def sqrt_trace(
    A: Tensor,
    method: str = "auto",
    *,
    iters: int | None = None,
    eps: float | None = None,
    tol: float = EIGH_TOL,
    validate: bool = False,
) -> Tensor:
    """tr(A^{1/2}) = sum_i sqrt(max(lambda_i, 0)) for symmetric PSD A of shape (..., m, m).

    A is symmetrized as (A + A^T)/2; eigenvalues below 0 (rounding) count as 0.
    method:
      'eigh'   float32 eigvalsh of A / max|A_ij|, recomputed in float64 for each matrix whose
               a-posteriori error bound exceeds ``tol`` (relative). Within 1e-3 of float64
               eigvalsh of the same input.
      'newton' coupled Newton-Schulz in float32, ``iters`` fixed iterations (default
               newton_min_iters(eps) + 3 = 25; allowed [newton_min_iters(eps), 200]) on
               A/||A||_F + eps I, shift undone spectrally; no host sync (see _newton_impl).
               Eigenvalues below ~eps ||A||_F (float32 rounding noise included) are
               suppressed: on a float32 input that is rank-deficient only up to rounding
               this is closer to the exact value than float64 eigvalsh of the rounded input.
      'auto'   CPU: 'eigh'; CUDA: 'newton' (docs/spectral.md).
    Returns float64 for float64 input, else float32; shape (...). Non-finite matrices give
    NaN. validate=True (or env GNS_KERNELS_VALIDATE=1) checks finiteness and symmetry
    first (host sync).
    """
    _check_square(A, "A")
    meth = _resolve_method(method, A.device)
    if _validate_requested(validate):
        _validate_symmetric(A, "A")
    out_dtype = torch.float64 if A.dtype == torch.float64 else torch.float32
    if A.numel() == 0:
        return A.new_zeros(A.shape[:-2], dtype=out_dtype)
    if meth == "eigh":
        lam = torch.ops.gns_kernels.psd_eigvalsh(A, float(tol))
        return lam.clamp_min(0).sqrt().sum(-1).to(out_dtype)
    it, ep = _check_newton_args(iters, eps)
    return torch.ops.gns_kernels.newton_sqrt_trace(A, it, ep).to(out_dtype)


def _validate_symmetric(A: Tensor, name: str) -> None:
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"{name}: contains non-finite values")
    x = A.detach().double()
    asym = (x - x.mT).abs().amax()
    size = x.abs().amax()
    if float(asym) > 1e-3 * float(size):
        raise ValueError(f"{name}: expected symmetric matrices, max |A - A^T| = {float(asym):.3g} "
                         f"vs max |A| = {float(size):.3g}")


# ============================================================================== nuclear_stats
def _grams_on_sides(tensors: list[Tensor], sides: list[str]) -> list[Tensor]:
    """gram() of each tensor on its own side ('row' / 'col'), batched by shape per side."""
    out: list[Tensor | None] = [None] * len(tensors)
    for s in ("row", "col"):
        idx = [i for i, si in enumerate(sides) if si == s]
        if idx:
            for i, G in zip(idx, gram([tensors[i] for i in idx], side=s)):
                out[i] = G
    return out  # type: ignore[return-value]


def nuclear_stats(
    mean_grams: Sequence[Tensor],
    mean_grads: Sequence[Tensor] | None = None,
    scale: float = 1.0,
    shifts: Sequence[Tensor | None] | None = None,
    mean_grad_grams: Sequence[Tensor] | None = None,
    side: str = "auto",
    bias_correction: bool = False,
    num_samples: int | None = None,
    batch_size: float | None = None,
    *,
    signal_grams: Sequence[Tensor] | None = None,
    other_dims: Sequence[int | None] | None = None,
    dof_model: str = "columns",
    method: str = "auto",
    validate: bool = False,
    eig_float64: Sequence[bool] | None = None,
    eig_report: list | None = None,
) -> tuple[Tensor, Tensor]:
    """Per layer l: (noise tr(C_l^{1/2}), signal ||G_l||_S1); two float32 Tensor[L].

    C_l = scale * (mean_grams[l] - D_l D_l^T) on the Gram side of mean_grams[l] (k x k):
      mean_grams[l]  mean over samples of the (shifted) local Grams, k x k, e.g. the
                     all-reduced output of gram() divided by R;
      mean_grads[l]  D_l = mean over samples of G^j - S_l, 2-D (m x n). The side is that
                     of mean_grams[l] (k == m: row, k == n: col; ``side`` only breaks the
                     tie of a square matrix whose Grams were taken on the column side);
      shifts[l]      S_l or None: the signal is ||D_l + S_l||_S1;
      mean_grad_grams[l]  instead of mean_grads (FSDP2: only shards of D exist): the Gram
                     D_l D_l^T on the same side. The signal then uses signal_grams[l]
                     (the Gram of G_l = D_l + S_l) when given, else mean_grad_grams[l]
                     (correct when no shift was used).
    scale = B/(R-1) (global batch over samples minus one).
    bias_correction: False (default: the paper's raw tr(C^{1/2})) or True: the noise is
      gns_kernels.bias.nuclear_sqrt_trace_corrected(eigenvalues of C, num_samples,
      batch_size, other_dim=other_dims[l] (default: the other side of mean_grads[l]),
      dof_model=dof_model); needs num_samples (R) and uses eigenvalues (method 'eigh').
    method: sqrt-trace method for noise and signal ('auto' | 'eigh' | 'newton'), see
      sqrt_trace. With 'newton' the shift of C is relative to ||scale * mean_grams||_F
      (the subtraction's rounding level), not to ||C||_F.
    eig_float64 (method 'eigh', CPU): per layer, True solves its two eigenproblems in float64
      directly instead of float32 first. A cost hint only (the result is the one the
      float64 fallback would give): gradient Grams that fell back last time (typically
      rank-deficient ones: few tokens per sample) fall back again, and the float32 attempt
      (~2/3 of the float64 cost at m = 256) is wasted. eig_report: a list, filled with one
      bool per layer (either eigenproblem solved in float64) to feed the next call's hint
      (CPU; on other devices the batched path ignores the hint and reports False).
    C may come out slightly indefinite (float32 subtraction): eigenvalues below 0 count 0.
    Layers are batched by Gram size (one stacked op per size). No host synchronization
    unless validate=True (or env GNS_KERNELS_VALIDATE=1): then inputs are checked for
    finiteness and symmetry. Non-finite inputs give NaN for that layer.
    """
    mean_grams = list(mean_grams)
    L = len(mean_grams)
    if (mean_grads is None) == (mean_grad_grams is None):
        raise ValueError("mean_grads / mean_grad_grams: give exactly one of them")
    if mean_grads is not None:
        mean_grads = list(mean_grads)
        if len(mean_grads) != L:
            raise ValueError(f"mean_grads: expected {L} tensors (one per mean_grams entry), got {len(mean_grads)}")
    if mean_grad_grams is not None:
        mean_grad_grams = list(mean_grad_grams)
        if len(mean_grad_grams) != L:
            raise ValueError(f"mean_grad_grams: expected {L} tensors, got {len(mean_grad_grams)}")
        if shifts is not None and any(s is not None for s in shifts):
            raise ValueError("shifts: not used with mean_grad_grams; pass signal_grams (Gram of D + S) instead")
    if signal_grams is not None:
        if mean_grad_grams is None:
            raise ValueError("signal_grams: only with mean_grad_grams")
        signal_grams = list(signal_grams)
        if len(signal_grams) != L:
            raise ValueError(f"signal_grams: expected {L} tensors, got {len(signal_grams)}")
    if shifts is not None:
        shifts = list(shifts)
        if len(shifts) != L:
            raise ValueError(f"shifts: expected {L} entries (tensor or None), got {len(shifts)}")
    if side not in ("auto", "row", "col"):
        raise ValueError(f"side: expected 'auto', 'row' or 'col', got {side!r}")
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    if bias_correction and num_samples is None:
        raise ValueError("num_samples: bias_correction=True needs the number of samples R")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number (B/(R-1)), got {scale!r}")
    if L == 0:
        z = torch.zeros(0, dtype=torch.float32)
        return z, z.clone()
    meth = _resolve_method(method, mean_grams[0].device)
    if bias_correction:
        meth = "eigh"
    check = _validate_requested(validate)

    # ---- per layer: side, k, other dim
    sides: list[str] = []
    others: list[int | None] = []
    for l, A in enumerate(mean_grams):
        _check_square(A, f"mean_grams[{l}]")
        if A.dim() != 2:
            raise ValueError(f"mean_grams[{l}]: expected a 2-D k x k matrix, got shape {tuple(A.shape)}")
        k = A.shape[-1]
        if mean_grads is not None:
            D = mean_grads[l]
            if not isinstance(D, Tensor) or D.dim() != 2:
                raise ValueError(f"mean_grads[{l}]: expected a 2-D tensor, got "
                                 f"{tuple(D.shape) if isinstance(D, Tensor) else type(D).__name__}")
            m, n = D.shape
            if m == n == k:
                s = "col" if side == "col" else "row"
            elif m == k:
                s = "row"
            elif n == k:
                s = "col"
            else:
                raise ValueError(f"mean_grams[{l}]: {k}x{k} does not match either side of mean_grads[{l}] "
                                 f"of shape {(m, n)}")
            sides.append(s)
            others.append(n if s == "row" else m)
            if shifts is not None and shifts[l] is not None and tuple(shifts[l].shape) != (m, n):
                raise ValueError(f"shifts[{l}]: expected shape {(m, n)} like mean_grads[{l}], got "
                                 f"{tuple(shifts[l].shape)}")
        else:
            for name, lst in (("mean_grad_grams", mean_grad_grams), ("signal_grams", signal_grams)):
                if lst is not None and tuple(lst[l].shape) != (k, k):
                    raise ValueError(f"{name}[{l}]: expected shape {(k, k)} like mean_grams[{l}], got "
                                     f"{tuple(lst[l].shape)}")
            sides.append("row")
            others.append(None)
    if other_dims is not None:
        other_dims = list(other_dims)
        if len(other_dims) != L:
            raise ValueError(f"other_dims: expected {L} entries, got {len(other_dims)}")
        others = [o if o is not None else d for o, d in zip(other_dims, others)]

    if check:
        for l in range(L):
            _validate_symmetric(mean_grams[l], f"mean_grams[{l}]")
            if mean_grads is not None and not bool(torch.isfinite(mean_grads[l]).all()):
                raise ValueError(f"mean_grads[{l}]: contains non-finite values")
            if mean_grad_grams is not None:
                _validate_symmetric(mean_grad_grams[l], f"mean_grad_grams[{l}]")
            if signal_grams is not None:
                _validate_symmetric(signal_grams[l], f"signal_grams[{l}]")

    # ---- D D^T and G G^T, batched by shape (gram() groups equal shapes)
    if mean_grads is not None:
        dd = _grams_on_sides([mean_grads[l] for l in range(L)], sides)
        gg = list(dd)
        shifted = [l for l in range(L) if shifts is not None and shifts[l] is not None]
        if shifted:
            gs = _grams_on_sides([mean_grads[l].float() + shifts[l].float() for l in shifted],
                                 [sides[l] for l in shifted])
            for l, G in zip(shifted, gs):
                gg[l] = G
    else:
        dd = [g for g in mean_grad_grams]
        gg = list(signal_grams) if signal_grams is not None else list(dd)

    if eig_float64 is not None:
        hint = list(eig_float64)
        if len(hint) != L:
            raise ValueError(f"eig_float64: expected {L} bools (one per layer), got {len(hint)}")
    else:
        hint = [False] * L
    if eig_report is not None and not isinstance(eig_report, list):
        raise ValueError(f"eig_report: expected a list to fill, got {type(eig_report).__name__}")

    # ---- C per layer; group noise and signal matrices by size, one sqrt-trace call each
    cdt = torch.float64 if any(A.dtype == torch.float64 for A in mean_grams) else torch.float32
    noise: list = [None] * L
    signal: list = [None] * L
    by_k: dict[int, list[tuple[str, int]]] = {}
    for l in range(L):
        by_k.setdefault(mean_grams[l].shape[-1], []).extend([("n", l), ("s", l)])
    flagged: list[tuple[list, Tensor]] = []  # (items, solved-in-float64 flags) per size
    for k, items in by_k.items():
        if meth == "eigh":
            # C_l = scale * (mean_gram - D D^T) formed per matrix inside the op's workers
            lam, wide = torch.ops.gns_kernels.psd_eigvalsh_list(
                [(mean_grams[l] if w == "n" else gg[l]).detach() for w, l in items],
                [dd[l].detach() if w == "n" else None for w, l in items],
                [float(scale) if w == "n" else 1.0 for w, l in items], float(EIGH_TOL),
                [bool(hint[l]) for w, l in items])
            flagged.append((items, wide))
            res = lam.clamp_min(0).sqrt().sum(-1)
            for i, (w, l) in enumerate(items):
                if w == "n" and bias_correction:
                    from .bias import nuclear_sqrt_trace_corrected

                    noise[l] = nuclear_sqrt_trace_corrected(
                        lam[i], int(num_samples), batch_size, other_dim=others[l], dof_model=dof_model)
                elif w == "n":
                    noise[l] = res[i]
                else:
                    signal[l] = res[i]
            continue
        # newton: C_l = scale * (mean_gram - D D^T) written straight into the stacked batch
        mats = torch.empty((len(items), k, k), dtype=cdt, device=mean_grams[items[0][1]].device)
        for i, (w, l) in enumerate(items):
            if w == "n":
                torch.sub(mean_grams[l].detach().to(cdt), dd[l].detach().to(cdt), out=mats[i])
                mats[i].mul_(scale)
            else:
                mats[i].copy_(gg[l].detach())
        it, ep = _check_newton_args(None, None)
        # noise: shift relative to the subtraction's operand ||scale * mean_gram||_F
        # (its rounding level); signal Grams: relative to their own norm.
        ref = torch.stack([
            scale * torch.linalg.matrix_norm(mean_grams[l].detach().double()) if w == "n"
            else torch.zeros((), dtype=torch.float64, device=mats.device) for w, l in items])
        res = torch.ops.gns_kernels.newton_sqrt_trace(mats, it, ep, ref)
        for i, (w, l) in enumerate(items):
            (noise if w == "n" else signal)[l] = res[i]
    if eig_report is not None:  # reads the flags (not traceable by torch.compile)
        used64 = [False] * L
        for items, wide in flagged:
            for (w, l), f in zip(items, wide.tolist()):
                used64[l] = used64[l] or f
        eig_report[:] = used64
    return torch.stack([x.float() for x in noise]), torch.stack([x.float() for x in signal])
