"""The pair sum P(A) = sum_{i,j} s_i s_j / (s_i + s_j), s_i = sqrt(max(lambda_i(A), 0)),
from the Newton-Schulz iterates, by matmuls only (no eigenvalues, no host sync): op
``gns_kernels::newton_sqrt_trace_pair`` and ``sqrt_trace_pair_sum``.

P is what the second-order bias correction of tr(C^{1/2}) needs besides the trace
(gns_kernels.bias.nuclear_sqrt_trace_corrected_from_sums). It is a double sum over
eigenvalue pairs, not a trace of one matrix function, but it is an integral of a squared
trace: with S = A_+^{1/2} and s_i s_j / (s_i + s_j) = int_0^inf s_i e^{-t s_i} s_j e^{-t s_j} dt,

    P = int_0^inf g(t)^2 dt,      g(t) = tr(S e^{-tS}) = sum_i s_i e^{-t s_i}.

1. S from Newton: after the coupled iteration on x + e I (x = A / c, ||x||_F = 1),
   S~ = Y qhat(W), W = e Z^2, with qhat the Taylor polynomial of sqrt(1 - w) to w^5 plus
   two terms that give qhat a double root at w = 1 (qhat(1) = qhat'(1) = 0). qhat >= 0 on
   [0, 1.6]: eigenvalues at the rounding level around 0 (either sign, |lambda| < 0.4 e)
   map to small non-negative values instead of signed ones, so e^{-tS~} cannot grow.
   (The trace keeps newton's own q, whose error near the shift is smaller.)
2. Quadrature in u = ln t: P = int g(e^u)^2 e^u du, trapezoidal with step h = ln 2 on the
   nodes t_k = t0 2^k, k = 0..K. Per pair the integrand is s_i s_j exp(u - a e^u),
   a = s_i + s_j, whose Fourier transform is s_i s_j a^{-(1 - i xi)} Gamma(1 - i xi); the
   trapezoidal rule's relative error is about 2 |Gamma(1 - 2 pi i / h)| = 1e-5 at
   h = ln 2, for every pair alike. The nodes come from repeated squaring:
   F_k = I - e^{-t_k S} satisfies F_{k+1} = 2 F_k - F_k^2 (one matmul per node, and no
   cancellation while t s is small), F_0 = 1 - e^{-t0 S} by its Taylor series (t0 = 2^-8,
   ||S||_2 <= 1: the degree-5 remainder is 5e-18), g(t_k) = tr S - <S, F_k>.
   Below t0 (k < 0) g is replaced by its Taylor expansion, g^2 = mu1^2 - 2 t mu1 mu2 +
   t^2 (mu2^2 + mu1 mu3) (mu_j = tr S^j), summed in closed form over the geometric
   nodes. Above t_K = 2^ceil(log2(10 / sqrt(eps))) every pair with s_i + s_j >= sqrt(eps)
   (the Newton shift's soft threshold) has decayed below e^-10 ... e^-20.
3. Precision: the squarings run in float64 (precision.bmm "float64"): in float32 the
   absolute error of F (~u sqrt(m)) enters g at every node, relative error of P up to
   ~4 u sqrt(m) m (3e-3 at m = 768); float64 matmuls run at the float32 FFMA rate on an
   H100's FP64 tensor cores (vendor figures; not measured here).
Cost per matrix, beyond the trace: 8 float32 matmuls (qhat, S~) and 5 + K float64
matmuls (K = 22 at eps = 1e-6).
"""
from __future__ import annotations

import math

import torch

from .newton import NEWTON_PRECISIONS, chunk_size, matrix_poly, newton_iterate, shift_correction, shift_w
from .precision import bmm, bmm_add, check_precision

Tensor = torch.Tensor

__all__ = ["sqrt_trace_pair_sum"]


def _qhat_coeffs() -> tuple:
    c = [1.0, -1 / 2, -1 / 8, -1 / 16, -5 / 128, -7 / 256]
    a = sum(c)
    b = sum(k * x for k, x in enumerate(c))
    c7 = 6 * a - b  # solves c6 + c7 = -a, 6 c6 + 7 c7 = -b
    return tuple(c + [-a - c7, c7])


_QHAT_COEFFS = _qhat_coeffs()
# the Newton precisions a pair sum may follow: not "tf32", whose iterates perturb the
# near-zero eigenvalues of S = A_+^{1/2} by ~2^-11 ||S||, below zero too, which the
# quadrature's e^{-tS} amplifies without bound (measured: pair sums of 1e169)
PAIR_PRECISIONS = ("ieee", "float64")
PAIR_T0_LOG2 = -8  # first node t0 = 2^-8 (||S||_2 <= 1)


def pair_nodes(eps: float) -> int:
    """Number K of squarings: t_K = 2^ceil(log2(10 / sqrt(eps))) (22 at eps = 1e-6)."""
    return math.ceil(math.log2(10.0 / math.sqrt(eps))) - PAIR_T0_LOG2


def _pair_sum_normalized(S: Tensor, K: int, prec: str = "float64", eye: Tensor | None = None) -> Tensor:
    """P(S) for symmetric S (B, m, m) with spectrum in [~0, 1] by the module's quadrature
    (step 2), matmuls in ``prec``. Shape (B,), S's dtype for float64, float32 otherwise.
    eye: the identity expanded to S's shape, when the caller has it in the product's dtype."""
    dt = torch.float64 if prec == "float64" else torch.float32
    S = S if S.dtype == dt else S.to(dt)
    S = torch.add(S, S.mT).mul_(0.5)
    if eye is None or eye.dtype != dt or eye.shape != S.shape:
        eye = torch.eye(S.shape[-1], dtype=dt, device=S.device).expand_as(S)
    t0 = 2.0**PAIR_T0_LOG2
    h = math.log(2.0)
    S2 = bmm(S, S, prec)
    mu1 = torch.diagonal(S, dim1=-2, dim2=-1).sum(-1)
    mu2 = torch.diagonal(S2, dim1=-2, dim2=-1).sum(-1)
    mu3 = (S2 * S).sum((-2, -1))
    # F0 = 1 - exp(-T) = T (1 - T/2 (1 - T/3 (1 - T/4 (1 - T/5)))), T = t0 S
    inner = torch.add(eye, S, alpha=-t0 / 5.0)
    for d in (4.0, 3.0, 2.0):
        inner = bmm_add(eye, S, inner, prec, alpha=-t0 / d)
    F = bmm(S, inner, prec).mul_(t0)
    # nodes k < 0: sum_{k<0} t_k^{n+1} = t0^{n+1} / (2^{n+1} - 1)
    total = h * (mu1 * mu1 * t0 - 2.0 * mu1 * mu2 * t0**2 / 3.0 + (mu2 * mu2 + mu1 * mu3) * t0**3 / 7.0)
    # <S, F_k> per node k, stacked: the node sum is one vectorized expression after the loop
    sf = []
    for k in range(K + 1):
        sf.append((S * F).sum((-2, -1)))
        if k < K:
            F = bmm_add(F, F, F, prec, beta=2.0, alpha=-1.0)
    g = mu1.unsqueeze(-1) - torch.stack(sf, -1)  # (B, K + 1): g(t_k)
    # the node weights h t_k = h t0 2^k, formed on the device: a tensor built from a host
    # list is a pageable copy, a host synchronization inside the measurement (seen on an
    # H200: set_sync_debug_mode("error") raised here); exp2 of integers is exact
    w = torch.exp2(torch.arange(K + 1, dtype=g.dtype, device=g.device)).mul_(h * t0)
    return total + (g * g * w).sum(-1)


def pair_impl(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None, project: bool,
               prec: str, pair_prec: str, pair_rows: int = -1, project_rows: int = -1) -> tuple[Tensor, Tensor]:
    """(trace (B,), pair (B,)) of A (B, m, m); the pair sum only for the first pair_rows
    matrices (-1: all), 0 for the others (the chain shared by matrices that need it and
    matrices that do not: one chain, the pair's products only where used)."""
    Y, Z, e, c, eye = newton_iterate(A, iters, eps, ref_norm, project, prec, project_rows)
    sc = c.reshape(-1).sqrt()
    W = shift_w(Z, e, prec)
    trace = shift_correction(Y, Z, e, eye, prec, W).double() * sc
    B = A.shape[0]
    n = B if pair_rows < 0 else min(pair_rows, B)
    pair = torch.zeros_like(trace)
    if n:
        S = bmm(Y[:n], matrix_poly(W[:n], _QHAT_COEFFS, eye[:n], prec), prec)
        p = _pair_sum_normalized(S, pair_nodes(eps), pair_prec, eye[:n]).double() * sc[:n]
        pair = p if n == B else torch.cat([p, pair[n:]])
    return trace, pair



@torch.library.custom_op("gns_kernels::newton_sqrt_trace_pair", mutates_args=())
def _pair_op(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None, project: bool = True,
             precision: str = "ieee", pair_precision: str = "float64", pair_rows: int = -1,
             project_rows: int = -1) -> tuple[Tensor, Tensor]:
    """(tr(A_+^{1/2}), P(A)) per matrix of A (..., m, m): the Newton sqrt-trace (as
    newton_sqrt_trace, matmuls in ``precision``) and the pair sum (module docstring,
    squarings in ``pair_precision``), each of shape (...), float64 for float64 A, else
    float32. pair_rows >= 0: the pair sum of the first pair_rows matrices (of the
    flattened batch) only, 0 for the rest. project_rows >= 0 (with project): only the first
    project_rows matrices take the positive-part step (newton.newton_iterate). m = 0 gives
    zeros."""
    check_precision(precision, "precision", NEWTON_PRECISIONS if pair_rows == 0 else PAIR_PRECISIONS)
    check_precision(pair_precision, "pair_precision", ("ieee", "float64"))
    m = A.shape[-1]
    out_dtype = torch.float64 if A.dtype == torch.float64 else torch.float32
    if A.numel() == 0:
        z = A.new_zeros(A.shape[:-2], dtype=out_dtype)
        return z, z.clone()
    flat = A.reshape(-1, m, m)
    refs = None if ref_norm is None else ref_norm.reshape(-1)
    ch = chunk_size(m)
    nb = flat.shape[0]
    npair = nb if pair_rows < 0 else min(int(pair_rows), nb)
    nproj = nb if project_rows < 0 else min(int(project_rows), nb)
    res = [pair_impl(flat[i:i + ch], iters, eps, None if refs is None else refs[i:i + ch], project,
                      precision, pair_precision, max(0, min(ch, npair - i)), max(0, min(ch, nproj - i)))
           for i in range(0, nb, ch)]
    tr = res[0][0] if len(res) == 1 else torch.cat([r[0] for r in res])
    pr = res[0][1] if len(res) == 1 else torch.cat([r[1] for r in res])
    tr, pr = tr.reshape(A.shape[:-2]), pr.reshape(A.shape[:-2])
    return (tr if tr.dtype == out_dtype else tr.to(out_dtype)), (pr if pr.dtype == out_dtype else pr.to(out_dtype))


@_pair_op.register_fake
def _(A: Tensor, iters: int, eps: float, ref_norm: Tensor | None = None, project: bool = True,
      precision: str = "ieee", pair_precision: str = "float64", pair_rows: int = -1,
      project_rows: int = -1) -> tuple[Tensor, Tensor]:
    dt = torch.float64 if A.dtype == torch.float64 else torch.float32
    return A.new_empty(A.shape[:-2], dtype=dt), A.new_empty(A.shape[:-2], dtype=dt)


def sqrt_trace_pair_sum(
    A: Tensor,
    *,
    iters: int | None = None,
    eps: float | None = None,
    ref_norm: Tensor | None = None,
    project: bool = True,
    precision: str = "ieee",
    pair_precision: str = "float64",
) -> tuple[Tensor, Tensor]:
    """(tr(A_+^{1/2}), sum_{i,j} s_i s_j / (s_i + s_j)) of symmetric A (..., m, m), s_i =
    sqrt(max(lambda_i, 0)), by Newton-Schulz and matmul quadrature (no eigenvalues, no
    host synchronization). iters, eps: as sqrt_trace(method="newton") (defaults per
    ``precision``, "ieee" or "float64"); ref_norm (...), optional: the Frobenius norm the
    rounding noise of A is relative to (nuclear_stats passes ||scale * mean_gram||_F for a
    covariance formed by subtraction); project=False skips the positive-part step (for
    input PSD up to rounding). pair_precision: "float64" (default) or "ieee" for the
    squarings. Both results float64 for float64 A, else float32; shape (...). Pass them to
    gns_kernels.bias.nuclear_sqrt_trace_corrected_from_sums.
    Accuracy (tests/spectral/test_pairsum.py, against float64 eigvalsh): the trace as
    sqrt_trace(method="newton"); the pair sum within 1e-3 relative.
    """
    from ._checks import check_square
    from .newton import check_newton_args

    check_square(A, "A")
    check_precision(precision, "precision", PAIR_PRECISIONS)
    it, ep = check_newton_args(iters, eps, precision)
    if ref_norm is not None:
        if not isinstance(ref_norm, Tensor) or tuple(ref_norm.shape) != tuple(A.shape[:-2]):
            raise ValueError(f"ref_norm: expected a tensor of shape {tuple(A.shape[:-2])}, got "
                             f"{tuple(ref_norm.shape) if isinstance(ref_norm, Tensor) else type(ref_norm).__name__}")
    return torch.ops.gns_kernels.newton_sqrt_trace_pair(A, it, ep, ref_norm, bool(project), precision, pair_precision)
