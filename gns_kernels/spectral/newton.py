"""tr(A_+^{1/2}) by matrix iterations (matmuls only, no host synchronization): op
``gns_kernels::newton_sqrt_trace``.

A_+ = max(A, 0) is the positive part of symmetric A (its negative eigenvalues set to 0):
the same definition as the eigenvalue path, sum_i sqrt(max(lambda_i, 0)).

1. Scale: x = A / (2^e f) with 2^e a power of two near max|A_ij| (exact, in A's own
   precision: no underflow of float64 inputs far below float32's range) and
   f = ||A / 2^e||_F, so ||x||_F = 1 and spec(x) in [-1, 1]; then float32.
2. Positive part (``project=True``): the scaled Newton-Schulz sign iteration
   X0 = x, X <- (a_k / 2) X (3I - a_k^2 X^2) (module ``scaled_schedule``) takes every
   eigenvalue t of x with |t| >= eps / 2 to within 1e-7 of sign(t) in sign_iters(eps)
   steps; |x| = x X and x_+ = (x + |x|) / 2. Without it (``project=False``, for inputs
   that are PSD up to rounding, e.g. a covariance formed by a subtraction) negative
   eigenvalues below -eps are not clamped: the guard below only keeps the result finite.
3. Scaled coupled Newton-Schulz on M = x_+ / (1 + e) + e' I, e' = e / (1 + e) (spectrum in
   [e', 1]; the factor 1 + e joins c, and e' is the shift undone in step 4):
   Y0 = M, Z0 = I, T = (a_k / 2)(3I - a_k^2 Z Y), Y <- Y T, Z <- T Z;
   Y -> M^{1/2}, Z -> M^{-1/2} (Higham, Functions of Matrices, eq. 6.35, with the scale
   factors a_k >= 1 of Chen and Chow, "A stable scaled Newton-Schulz method for the matrix
   sign function", 2014: on the interval [l_k, 1] that bounds the square roots of the
   eigenvalues of Z Y, a_k = sqrt(3 / (1 + l_k + l_k^2)) maps both ends to the same value,
   the minimax choice for this cubic; l_0 = sqrt(eps / 2)), capped at SCALE_CAP = 1.532 so
   that no step computes 3 - a^2 s^2 by a near-total cancellation. Per step the smallest
   root grows about 2.3x instead of 1.5x, which roughly halves the iterations (12 instead
   of 22 at eps = 1e-6); once a_k < 1 + 1e-3 the plain step (a = 1) takes over. The ratio Y / Z = M
   is kept exactly by every step, so the limits are the same as the plain iteration's.
   Guard (per matrix, torch.where, no sync; r = ||Z Y - I||_F of the current iterate):
   during the scaled steps r <= sqrt(m) (1 - l_k^2 + 1e-3) holds whenever the eigenvalues
   of Z Y lie in [l_k^2, 1]. An eigenvalue of M below 0 (input indefinite beyond the
   shift, outside the ``project=False`` contract) is driven away from 1 and breaks it:
   that matrix goes back to its previous iterate and takes plain steps (a = 1) from there.
   During plain steps the matrix is frozen at its previous iterate once r exceeds
   (1 + 1e-3) min(previous plain r) (for positive definite M, r decreases monotonically
   in exact arithmetic, so this acts only past convergence: rounding-level wobble), and
   always once r is non-finite. For input outside the contract this keeps the result
   finite and bounded, not accurate.
4. Undo the shift spectrally: with W = e Z^2 (eigenvalues w = e/(lambda + e) in (0, 1]),
   sqrt(lambda) = sqrt(lambda + e) sqrt(1 - w) ~ y q(w), q = Taylor polynomial of
   sqrt(1 - w) to w^5 plus a w^6 term making q(1) = 0. Eigenvalues >= 3 e keep their
   square root to ~0.23 w^6 (5e-5 at 3 e); exact zeros give 0, and float32 rounding noise
   +-delta around them ~2.7 delta / sqrt(e) (signed) instead of sqrt(delta): the shift is
   a soft threshold at e ||A||_F.
Result: sqrt(2^e f) tr(Y q(W)), float64 for float64 input, else float32.

Precision: every matmul goes through precision.bmm with the precision passed per call
("ieee" float32 by default, or "float64"), never the process-wide float32 matmul setting;
the smallest allowed shift is tied to it (NEWTON_EPS_BY_PRECISION: 1e-6 for float32,
1e-12 for float64).
"""
from __future__ import annotations

import math

import torch

from .precision import bmm, bmm_add, check_precision

Tensor = torch.Tensor

NEWTON_EPS = 1e-6  # default relative shift (of A / ||A||_F); docs/spectral.md gives the trade-off
NEWTON_EPS_RANGE = (1e-6, 1e-2)
# Precisions the iteration runs in (precision.bmm, passed per call) and the smallest shift
# each supports: the shift must stay above the rounding noise of the iterates, ~17 u
# (u = 2^-24 for float32 "ieee": 1e-6; 2^-53 for "float64": 1e-12, reached in
# newton_min_iters(1e-12) = 21 iterations, 24 by default; the hooks' noise chain runs at
# 1e-11, spectral.nuclear.NOISE_NEWTON). "tf32" (opt in, off by default): every
# product's operands rounded to nearest with a 10-bit mantissa (u = 2^-11), float32
# iterates and sums, the guarded iteration (its rounding reaches the shift); the shift
# stays 1e-6: eigenvalues perturbed below it are what the guard is for. Its trace error
# budget is TF32_TRACE_BUDGET (half of the 1e-3 end-to-end budget; the other half is the
# Grams'): measured in emulation 1.6e-4 - 3e-4 on sample covariances and i^-p spectra
# with p <= 1 (steeper spectra leave it: 1.2e-3 at i^-2, m = 33), where truncated operands (what a tensor core does to float32 inputs that were not
# rounded first) give 1.1e-3 - 1.3e-3 (tests/spectral/test_newton_tf32.py). Not measured
# on a GPU. bf16 (u = 2^-8): not offered.
NEWTON_PRECISIONS = ("ieee", "tf32", "float64")
NEWTON_EPS_BY_PRECISION = {"ieee": 1e-6, "tf32": 1e-6, "float64": 1e-12}
TF32_TRACE_BUDGET = 5e-4
NEWTON_MAX_ITERS = 200
_FREEZE_SLACK = 1e-3  # guard: freeze when ||ZY - I||_F exceeds its minimum by this factor
_BOUND_SLACK = 1e-3  # guard of the scaled steps: absolute slack on (1 - l_k^2)
_CONVERGED = 1e-7  # scalar convergence target of newton_min_iters and sign_iters


_SCALED_UNTIL = 1e-3  # scaled steps while a_k > 1 + this; plain steps (a = 1) after


# Cap on the scale factor: a (3 - a^2) / 2 = 1/2, i.e. a = 2 cos(40 deg) = 1.532. The
# uncapped minimax factor sqrt(3 / (1 + l + l^2)) ~ sqrt(3) sends s = 1 to ~2.6 l through
# 3 - a^2 s^2 ~ 3 - 3, a cancellation that float32 cannot afford (measured: a rank-1 input
# lost a quarter of its top eigenvalue in the positive-part step). With the cap the top
# maps to 1/2 (cancellation amplifies rounding at most 3 / (3 - a^2) = 4.6x) and the small
# end still grows 2.3x per step instead of 1.5x.
SCALE_CAP = 2.0 * math.cos(math.radians(40.0))


def scaled_schedule(lo: float) -> tuple[float, ...]:
    """Scale factors (a_0, a_1, ...) of the scaled Newton-Schulz sign map
    f_a(s) = (a / 2) s (3 - a^2 s^2) for values s in [lo, 1], 0 < lo <= 1:
    a_k = min(sqrt(3 / (1 + l_k + l_k^2)), SCALE_CAP), while a_k > 1 + 1e-3, with
    l_{k+1} = min(f(l_k), f(1)). The uncapped factor is Chen and Chow's (2014) minimax
    choice (both ends of [l_k, 1] map to the same value); for 1 < a <= sqrt(3) the map
    sends [l_k, 1] into [l_{k+1}, 1] (its maximum 1 is at s = 1 / a). a_k -> 1 as
    l_k -> 1. Host floats only."""
    return _scaled_steps(lo)[0]


def _scaled_steps(lo: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(a_0, a_1, ...) of ``scaled_schedule(lo)`` and the lower bounds (l_0, l_1, ..., l_K)
    before each step and after the last (K = number of scaled steps)."""
    lo = float(lo)
    if not 0.0 < lo <= 1.0:
        raise ValueError(f"lo: expected a lower bound in (0, 1], got {lo!r}")
    alphas: list[float] = []
    lows = [lo]
    while len(alphas) < NEWTON_MAX_ITERS:
        a = min(math.sqrt(3.0 / (1.0 + lo + lo * lo)), SCALE_CAP)
        if a <= 1.0 + _SCALED_UNTIL:
            break
        alphas.append(a)
        lo = min(0.5 * a * lo * (3.0 - a * a * lo * lo), 0.5 * a * (3.0 - a * a))
        lows.append(lo)
    return tuple(alphas), tuple(lows)


def _sign_steps_to_converge(lo: float, power: int) -> int:
    """Steps of the scaled-then-plain sign map that take s = lo to 1 - s^power <= 1e-7."""
    alphas, lows = _scaled_steps(lo)
    s, k = lows[-1], len(alphas)
    while 1.0 - s ** power > _CONVERGED and k < NEWTON_MAX_ITERS:
        s = 0.5 * s * (3.0 - s * s)
        k += 1
    return k


def newton_min_iters(eps: float = NEWTON_EPS) -> int:
    """Smallest iteration count allowed for relative shift ``eps``: the scaled coupled
    Newton-Schulz product p = y z of an eigenvalue eps/2 (eps halved by rounding noise)
    reaches 1 - 1e-7 (scalar recursion on s = sqrt(p), ``scaled_schedule(sqrt(eps/2))``,
    then plain steps). 12 at eps = 1e-6 (the unscaled iteration needs 22)."""
    return _sign_steps_to_converge(math.sqrt(eps / 2.0), 2)


def sign_iters(eps: float = NEWTON_EPS) -> int:
    """Iterations of the scaled Newton-Schulz sign step (positive part) for relative shift
    ``eps``: s = eps/2 reaches 1 - 1e-7 under the ``scaled_schedule(eps/2)``
    steps, then plain steps s <- s (3 - s^2) / 2. 21 at eps = 1e-6 (unscaled: 40)."""
    return _sign_steps_to_converge(eps / 2.0, 1)


def check_newton_args(iters: int | None, eps: float | None, precision: str = "ieee") -> tuple[int, float]:
    """(iters, eps) with defaults (newton_min_iters(eps) + 3 = 15 at eps = 1e-6, NEWTON_EPS_BY_PRECISION[precision]),
    validated: eps in [NEWTON_EPS_BY_PRECISION[precision], 1e-2]."""
    check_precision(precision, "precision", NEWTON_PRECISIONS)
    lo = NEWTON_EPS_BY_PRECISION[precision]
    eps = lo if eps is None else float(eps)
    if not (lo <= eps <= NEWTON_EPS_RANGE[1]):
        raise ValueError(f"eps: expected a relative shift in [{lo:g}, "
                         f"{NEWTON_EPS_RANGE[1]:g}] for precision {precision!r}, got {eps!r}")
    kmin = newton_min_iters(eps)
    if iters is None:
        iters = kmin + 3
    if isinstance(iters, bool) or int(iters) != iters or not (kmin <= iters <= NEWTON_MAX_ITERS):
        raise ValueError(f"iters: expected an integer in [{kmin}, {NEWTON_MAX_ITERS}] for eps={eps:g}, "
                         f"got {iters!r}")
    return int(iters), eps


# q(w) ~ sqrt(1 - w): Taylor coefficients to w^5, the w^6 coefficient makes q(1) = 0.
_Q_COEFFS = (1.0, -1 / 2, -1 / 8, -1 / 16, -5 / 128, -7 / 256)
_Q_COEFFS = _Q_COEFFS + (-sum(_Q_COEFFS),)


def matrix_poly(W: Tensor, coeffs: tuple, eye: Tensor, prec: str) -> Tensor:
    """sum_k coeffs[k] W^k by Horner (len(coeffs) - 2 matmuls, each with its added
    constant in the same launch: c I + W Q)."""
    Q = torch.add(coeffs[-2] * eye, W, alpha=coeffs[-1])
    for c in reversed(coeffs[:-2]):
        Q = bmm_add(eye, W, Q, prec, beta=c)
    return Q


def shift_correction(Y: Tensor, Z: Tensor, e: Tensor, eye: Tensor, prec: str = "ieee",
                      W: Tensor | None = None) -> Tensor:
    """tr(Y q(W)), W = e Z^2 (module docstring, step 4); Horner in W. Shape (B,).
    W: that matrix when the caller formed it already."""
    if W is None:
        W = shift_w(Z, e, prec)
    Q = matrix_poly(W, _Q_COEFFS, eye, prec)
    return (Y * Q.mT).sum((-2, -1))


def shift_w(Z: Tensor, e: Tensor, prec: str) -> Tensor:
    """W = e Z^2 (e per matrix, (B, 1, 1))."""
    return bmm(Z, Z, prec).mul_(e)


def _normalize(flat: Tensor) -> tuple[Tensor, Tensor]:
    """(x (B, m, m) in flat's precision (float32 for half inputs) symmetric with ||x||_F = 1, c float64 (B, 1, 1)) with x = A / c.

    c = 2^e f: 2^e a power of two near max|A_ij| (exact division in A's precision, float32
    for half inputs), then f = ||A / 2^e||_F. Zero matrices: x = 0 and c = 0, so every
    result scaled by sqrt(c) is exactly 0. Non-finite matrices give a non-finite x."""
    a = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    a = 0.5 * (a + a.mT)
    amax = a.abs().amax((-2, -1), keepdim=True)
    one = torch.ones_like(amax)
    ok = torch.isfinite(amax) & (amax > 0.0)
    p2 = torch.ldexp(one, torch.frexp(torch.where(ok, amax, one)).exponent)
    a = a / p2
    f = torch.linalg.matrix_norm(a, keepdim=True)
    f = torch.where(f > 0.0, f, one)
    c = torch.where(amax == 0.0, 0.0, p2).double() * f.double()
    return (a / f), c


def _positive_part(x: Tensor, eps: float, eye: Tensor, prec: str = "ieee") -> Tensor:
    """x_+ = (x + x sign(x)) / 2 for symmetric x with spec(x) in [-1, 1] (module step 2).
    A step X <- (1.5 a) X - (0.5 a^3) X X^2 is two launches (bmm, baddbmm)."""
    X = x
    sched = scaled_schedule(eps / 2.0)
    for k in range(sign_iters(eps)):
        a = sched[k] if k < len(sched) else 1.0
        X = bmm_add(X, X, bmm(X, X, prec), prec, beta=1.5 * a, alpha=-0.5 * a ** 3)
    H = bmm(x, X, prec)
    return torch.add(H, H.mT).mul_(0.25).add_(x, alpha=0.5)


def _lean(prec: str, project: bool) -> bool:
    """Whether the coupled iteration runs without the per-iteration guard (module step 3):
    float64 matmuls after the positive-part projection. M = x_+ / (1 + e) + e' I is then
    positive definite up to float64 rounding of the projection (~1e-15 relative, far
    below the smallest shift 1e-12), i.e. inside the contract of the scaled steps, so the
    guard could only act on non-finite input, which gives NaN either way. A step is
    three launches (bmm and two baddbmm). Everything else (float32 / tf32 matmuls, whose
    rounding reaches the shift, or input without the projection) keeps the guard."""
    return prec == "float64" and project


def _coupled_lean(x: Tensor, e: Tensor, eye: Tensor, iters: int, eps: float, prec: str) -> tuple[Tensor, Tensor]:
    """(Y, Z) after ``iters`` scaled-then-plain coupled steps on Y0 = x + e I, Z0 = I, no
    guard (``_lean``): P = Z Y, Y <- (1.5 a) Y - (0.5 a^3) Y P, Z <- (1.5 a) Z - (0.5 a^3) P Z.
    The first step uses Z0 = I (P = Y0): one product instead of three."""
    sched = scaled_schedule(math.sqrt(eps / 2.0))
    Y = torch.addcmul(x, e, eye)
    a = sched[0] if sched else 1.0
    b, c = 1.5 * a, -0.5 * a ** 3
    Z = torch.add(b * eye, Y, alpha=c)
    Y = bmm_add(Y, Y, Y, prec, beta=b, alpha=c)
    for k in range(1, iters):
        a = sched[k] if k < len(sched) else 1.0
        b, c = 1.5 * a, -0.5 * a ** 3
        P = bmm(Z, Y, prec)
        Y, Z = bmm_add(Y, Y, P, prec, beta=b, alpha=c), bmm_add(Z, P, Z, prec, beta=b, alpha=c)
    return Y, Z


def newton_iterate(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None, project: bool,
                    prec: str, project_rows: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(Y, Z, e, c, eye) of the coupled iteration on x_+ + e I, x = A / c (module steps 1-3),
    matmuls in ``prec``; Y, Z float32 ("ieee") or float64 ("float64"). project_rows >= 0
    (with project): only the first project_rows matrices take the positive-part step; the
    others must be positive semidefinite up to the iteration's rounding (float64 Grams of
    float32 data on the float64 path) -- the hooks' signal Grams, which skip its 77
    products per matrix."""
    m = A.shape[-1]
    x, c = _normalize(A.detach())
    x = x.double() if prec == "float64" else x.float()
    e = torch.full((x.shape[0], 1, 1), eps, dtype=x.dtype, device=x.device)
    if ref_norm is not None:
        rel = ref_norm.detach().reshape(-1, 1, 1).to(device=x.device, dtype=torch.float64) / c
        e = (eps * rel).clamp(eps, 1.0).to(x.dtype)
        e = torch.where(torch.isfinite(e), e, torch.full_like(e, eps))
    eye = torch.eye(m, dtype=x.dtype, device=x.device).expand_as(x)
    if project:
        B = x.shape[0]
        pr = B if project_rows < 0 else min(int(project_rows), B)
        if pr == B:
            x = _positive_part(x, eps, eye, prec)
        elif pr > 0:
            x = torch.cat([_positive_part(x[:pr], eps, eye[:pr], prec), x[pr:]])
    # ||x_+||_2 <= ||x||_F = 1, so spec(x_+ + e I) is in [e, 1 + e]: iterate on
    # x_+ / (1 + e) + e' I with e' = e / (1 + e) (spectrum in [e', 1]) and fold 1 + e into c
    top = 1.0 + e
    x = x / top
    e = e / top
    c = c * top.double()
    if _lean(prec, project):
        Y, Z = _coupled_lean(x, e, eye, iters, eps, prec)
        return Y, Z, e, c, eye
    Y = x + e * eye
    Z = eye.clone()
    sched, lows = _scaled_steps(math.sqrt(eps / 2.0))
    # residual bounds of the scaled steps: every eigenvalue p of Z Y in [l_k^2, 1] gives
    # ||Z Y - I||_F <= sqrt(m) (1 - l_k^2); 1e-3 absolute slack for rounding and lag
    bounds = [math.sqrt(m) * (1.0 - lo * lo + _BOUND_SLACK) for lo in lows[:len(sched)]]
    rmin = torch.full_like(e, float("inf"))
    active = torch.ones_like(e, dtype=torch.bool)  # not frozen
    scaled = torch.ones_like(e, dtype=torch.bool)  # still taking the scaled steps
    Yp, Zp, Pp = Y, Z, Y  # previous iterate and its product Z Y (Z0 = I)
    for k in range(iters):
        P = bmm(Z, Y, prec)
        r = torch.linalg.matrix_norm(P - eye, keepdim=True)
        finite = torch.isfinite(r)
        if k >= len(sched):
            # plain steps: no matrix is scaled or demoted any more, so the guard below
            # reduces to this (the same values, about a dozen fewer launches per step)
            ok = finite & (r <= rmin * (1.0 + _FREEZE_SLACK))
            back = active & ~ok
            Y = torch.where(back, Yp, Y)
            Z = torch.where(back, Zp, Z)
            active = active & ok
            rmin = torch.where(active, torch.minimum(rmin, r), rmin)
            T = 1.5 * eye - 0.5 * P
            Yp, Zp = Y, Z
            Y = torch.where(active, bmm(Y, T, prec), Y)
            Z = torch.where(active, bmm(T, Z, prec), Z)
            continue
        in_bound = r <= bounds[k]
        # a scaled matrix out of its bound falls back to its previous iterate and takes
        # plain steps from there (an eigenvalue of M below 0: the plain step drives it
        # away from 1 more slowly, and the plain guard below then freezes it)
        demote = active & scaled & finite & ~in_bound
        scaled = scaled & in_bound
        plain_ok = r <= rmin * (1.0 + _FREEZE_SLACK)
        ok = finite & (scaled | demote | plain_ok)
        # a failed check freezes the matrix at the last iterate that passed
        back = active & (demote | ~ok)
        Y = torch.where(back, Yp, Y)
        Z = torch.where(back, Zp, Z)
        active = active & ok
        rmin = torch.where(active & ~scaled & ~demote, torch.minimum(rmin, r), rmin)
        a = torch.where(scaled, torch.full_like(r, sched[k]), torch.ones_like(r))
        P = torch.where(demote, Pp, P)  # the restored iterate's product
        T = (1.5 * a) * eye - (0.5 * a ** 3) * P
        Yp, Zp, Pp = Y, Z, P
        Y = torch.where(active, bmm(Y, T, prec), Y)
        Z = torch.where(active, bmm(T, Z, prec), Z)
    return Y, Z, e, c, eye


def _newton_impl(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None,
                 project: bool = True, prec: str = "ieee") -> Tensor:
    """tr(A_+^{1/2}) of A (B, m, m), m >= 1 (module docstring). ref_norm (B,), optional: a
    Frobenius norm the rounding noise of A is relative to (e.g. the operands of the
    subtraction that formed A); the shift becomes eps * max(ref_norm, ||A||_F), i.e. the
    relative shift eps * ref_norm / ||A||_F clamped to [eps, 1]. Returns shape (B,)."""
    Y, Z, e, c, eye = newton_iterate(A, iters, eps, ref_norm, project, prec)
    out = shift_correction(Y, Z, e, eye, prec).double() * c.reshape(-1).sqrt()
    return out if A.dtype == torch.float64 else out.float()


# matrices per batched iteration: as many as keep the workspace (~8 iterates of the chunk)
# within that of 16 matrices of side 768 (all of a small model's matrices in one chain)
CHUNK_ELEMS = 16 * 768 * 768


def chunk_size(m: int) -> int:
    """Matrices of side m per batched Newton chain: max(1, 16 x 768^2 // m^2)."""
    return max(1, CHUNK_ELEMS // max(1, m * m))


@torch.library.custom_op("gns_kernels::newton_sqrt_trace", mutates_args=())
def _newton_op(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None,
               project: bool = True, precision: str = "ieee") -> Tensor:
    """tr(A_+^{1/2}) per matrix of A (..., m, m) by _newton_impl, in chunks of chunk_size(m)
    matrices, matmuls in ``precision`` (NEWTON_PRECISIONS, see precision.bmm); shape
    (...), float64 for float64 A, else float32. m = 0 gives 0."""
    check_precision(precision, "precision", NEWTON_PRECISIONS)
    m = A.shape[-1]
    out_dtype = torch.float64 if A.dtype == torch.float64 else torch.float32
    if A.numel() == 0:
        return A.new_zeros(A.shape[:-2], dtype=out_dtype)
    flat = A.reshape(-1, m, m)
    refs = None if ref_norm is None else ref_norm.reshape(-1)
    ch = chunk_size(m)
    outs = [_newton_impl(flat[i:i + ch], iters, eps,
                         None if refs is None else refs[i:i + ch], project, precision)
            for i in range(0, flat.shape[0], ch)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(A.shape[:-2])


@_newton_op.register_fake
def _(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None, project: bool = True,
      precision: str = "ieee") -> Tensor:
    return A.new_empty(A.shape[:-2], dtype=torch.float64 if A.dtype == torch.float64 else torch.float32)
