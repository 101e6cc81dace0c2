"""``sqrt_trace``: tr(A_+^{1/2}) of symmetric matrices by eigenvalues or by Newton-Schulz."""
from __future__ import annotations

import torch

from ._checks import check_square, validate_requested, validate_symmetric
from .eigh import EIGH_TOL
from .newton import NEWTON_PRECISIONS, check_newton_args
from .precision import check_precision

Tensor = torch.Tensor

# "newton-tf32": the Newton path with TF32 products (operands rounded to nearest), opt in
# (newton.NEWTON_PRECISIONS) of sqrt_trace / nuclear_stats; the hook states refuse it
# (distributed.state.check_hook_method: it left the hooks' signal 18% low in emulation)
METHODS = ("auto", "eigh", "newton", "newton-tf32")
NEWTON_METHODS = ("newton", "newton-tf32")


def newton_precision(method: str) -> str:
    """The Newton chain's matmul precision of a resolved method of the nuclear solves:
    "tf32" for 'newton-tf32', else "float64" (the noise chain, NOISE_NEWTON)."""
    return "tf32" if method == "newton-tf32" else "float64"


def resolve_method(method: str, device: torch.device) -> str:
    """'auto' -> 'eigh' on CPU, 'newton' elsewhere (docs/spectral.md); others validated."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    if method != "auto":
        return method
    return "eigh" if device.type == "cpu" else "newton"


def sqrt_trace(
    A: Tensor,
    method: str = "auto",
    *,
    iters: int | None = None,
    eps: float | None = None,
    tol: float = EIGH_TOL,
    validate: bool = False,
    precision: str = "ieee",
) -> Tensor:
    """tr(A_+^{1/2}) = sum_i sqrt(max(lambda_i, 0)) for symmetric A of shape (..., m, m).

    A is symmetrized as (A + A^T)/2; negative eigenvalues count as 0 (A_+ is the positive
    part of A) with either method.
    method:
      'eigh'   float32 eigvalsh of A / 2^e (2^e near max|A_ij|), recomputed in float64 for
               each matrix whose a-posteriori error bound exceeds ``tol`` (relative).
               Within 1e-3 of float64 eigvalsh of the same input.
      'newton' matmul iterations in float32 (gns_kernels.spectral.newton): the positive
               part by the scaled Newton-Schulz sign iteration (sign_iters(eps) = 21
               steps at eps = 1e-6), then scaled coupled Newton-Schulz, ``iters`` fixed
               iterations (default newton_min_iters(eps) + 3 = 15; allowed
               [newton_min_iters(eps), 200]) on
               A_+/||A||_F + eps I, the shift undone spectrally; no host sync.
               Eigenvalues below ~eps ||A||_F (float32 rounding noise included) are
               suppressed: on a float32 input that is rank-deficient only up to rounding
               this is closer to the exact value than float64 eigvalsh of the rounded
               input. Within 1e-3 of tr(|A|^{1/2}) (for PSD A: of the result) of float64
               eigvalsh.
      'newton-tf32'  'newton' with precision "tf32" (opt in; trace within
               newton.TF32_TRACE_BUDGET = 5e-4 in emulation, not measured on a GPU).
      'auto'   CPU: 'eigh'; CUDA: 'newton' (docs/spectral.md).
    precision ('newton'): the precision of its matmuls, "ieee" (float32, default),
      "tf32" (operands rounded to nearest to TF32, float32 sums; opt in) or
      "float64" (default shift 1e-12), delivered per call whatever
      torch.set_float32_matmul_precision / allow_tf32 say (spectral.precision.bmm).
    Returns float64 for float64 input, else float32; shape (...). Non-finite matrices give
    NaN; empty matrices (m = 0) give 0. validate=True (or env GNS_KERNELS_VALIDATE=1)
    checks finiteness and symmetry first (host sync).
    """
    check_square(A, "A")
    check_precision(precision, "precision", NEWTON_PRECISIONS)
    meth = resolve_method(method, A.device)
    if validate_requested(validate):
        validate_symmetric(A, "A")
    out_dtype = torch.float64 if A.dtype == torch.float64 else torch.float32
    if A.numel() == 0:
        return A.new_zeros(A.shape[:-2], dtype=out_dtype)
    if meth == "eigh":
        lam = torch.ops.gns_kernels.psd_eigvalsh(A, float(tol))
        return lam.clamp_min(0).sqrt().sum(-1).to(out_dtype)
    if meth == "newton-tf32":
        precision = "tf32"
    it, ep = check_newton_args(iters, eps, precision)
    return torch.ops.gns_kernels.newton_sqrt_trace(A, it, ep, None, True, precision).to(out_dtype)
