"""Eigenvalues for sqrt-traces: float32 eigvalsh with an a-posteriori bound and a float64 fallback.

``psd_eigvalsh(A)`` and the ops ``gns_kernels::psd_eigvalsh`` / ``::psd_eigvalsh_list``
return float64 eigenvalues accurate enough that sum_i sqrt(max(lambda_i, 0)) is within
``tol`` (relative) of the float64 value: each matrix is scaled by an exact power of two
near max|A_ij|, solved by float32 eigvalsh, and re-solved in float64 when the error bound
of _eig_error_bound exceeds tol (or float32 LAPACK fails or returns NaN).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._checks import check_square
from ._workers import _map_cpu

Tensor = torch.Tensor

U32 = 2.0**-24  # float32 unit roundoff
EIGH_TOL = 5e-4  # float64 fallback when the float32 error bound exceeds this (relative)


def _eig_error_bound(lam: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """A-posteriori bound of |sum sqrt(lam+) - sum sqrt(true+)| for float32 eigenvalues.

    lam: (..., m) float32 eigenvalues of a symmetric matrix. Every computed eigenvalue is
    within delta = c(m) u lam_max of a true one (backward stability; c(m) = max(8, m/4),
    3x the largest error measured, about 0.08 m). Per eigenvalue the sqrt error is at most
    sqrt(2 delta) when lam_i <= delta, else delta / sqrt(lam_i). Returns (bound, trace) in
    units of sqrt(lam_max), float64, shape (...).
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
    formed once, in float64 when B is given or either is float64 (A - B of float32
    operands is then exact, and its cancellation costs nothing; issue 43 item 5), scaled
    in place by scale / 2^e (exact: one rounding, as scale * (A - B) then / 2^e, and no
    overflow of scale * (A - B)), and the lower triangle is used (no
    symmetrization pass unless ``symmetrize``: A and B are symmetric). wide=True skips the
    float32 attempt (the result is the one the fallback would give, without its cost).
    Non-finite input -> NaN eigenvalues; k = 0 -> an empty result.
    """
    k = A.shape[-1]
    if k == 0:
        return torch.zeros(0, dtype=torch.float64), False
    f64 = A.dtype == torch.float64 or B is not None
    dt = torch.float64 if f64 else torch.float32
    x = A.to(dt, copy=True) if B is None else torch.sub(A.to(dt), B.to(dt))
    if symmetrize:  # psd_eigvalsh's contract: (S + S^T) / 2
        x = (x + x.mT).mul_(0.5)
    lo, hi = (float(v) for v in torch.aminmax(x))
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
    and symmetric (the lower triangle is used). S_l is formed in float64 where B[l] is
    given (the difference of float32 operands exactly), then rounded to float32 for the
    float32 attempt. Accuracy as psd_eigvalsh; wide[l] = True solves S_l in float64
    directly (the float32 attempt is skipped). CPU: one matrix per single-threaded worker,
    S_l formed inside the worker (no stacked copy of the inputs); other devices: stacked
    (float64 when any B[l] is given), then _eig_batched (wide is not used; the flags are
    False)."""
    if A[0].device.type == "cpu":
        res = _map_cpu(lambda l: _eig_cpu_one(A[l], B[l], scales[l], tol, wide[l]), list(range(len(A))))
        return torch.stack([r[0] for r in res]), torch.tensor([r[1] for r in res], dtype=torch.bool)
    f64 = any(a.dtype == torch.float64 for a in A) or any(b is not None for b in B)
    dt = torch.float64 if f64 else torch.float32
    mats = torch.stack([(a.to(dt) if b is None else a.to(dt) - b.to(dt)) * sc for a, b, sc in zip(A, B, scales)])
    lam = _eig_batched(mats, tol) if mats.shape[-1] else mats.new_zeros((len(A), 0), dtype=torch.float64)
    return lam, torch.zeros(len(A), dtype=torch.bool, device=lam.device)


@_psd_eigvalsh_list_op.register_fake
def _(A: list[Tensor], B: list[Optional[Tensor]], scales: list[float], tol: float,
      wide: list[bool]) -> tuple[Tensor, Tensor]:
    return (A[0].new_empty((len(A), A[0].shape[-1]), dtype=torch.float64),
            A[0].new_empty((len(A),), dtype=torch.bool))


def _psd_eigvalsh_impl(A: Tensor, tol: float) -> Tensor:
    m = A.shape[-1]
    batch = A.shape[:-2]
    if A.numel() == 0:
        return A.new_zeros((*batch, m), dtype=torch.float64)
    flat = A.detach().reshape(-1, m, m)
    if flat.device.type == "cpu" and m >= 256:
        # one matrix per single-threaded worker (see _map_cpu), without batch temporaries
        res = _map_cpu(lambda a: _eig_cpu_one(a, None, 1.0, tol, False, symmetrize=True)[0], list(flat.unbind(0)))
        out = torch.stack(res)
    elif flat.device.type == "cpu" and m >= 32:
        # independent chunks on single-threaded workers, one per thread
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
    value: float32 eigvalsh of A / 2^e (2^e near max|A_ij|), and float64 eigvalsh for the
    matrices whose a-posteriori error bound (see _eig_error_bound) exceeds tol. Non-finite
    matrices give NaN eigenvalues. A is symmetrized as (A + A^T)/2.
    """
    check_square(A, "A")
    return torch.ops.gns_kernels.psd_eigvalsh(A, float(tol))
