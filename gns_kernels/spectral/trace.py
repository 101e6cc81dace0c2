"""``sqrt_trace``: tr(A_+^{1/2}) of symmetric matrices by eigenvalues or by Newton-Schulz."""
from __future__ import annotations

import torch

from ._checks import check_square, validate_requested, validate_symmetric
from .eigh import EIGH_TOL
from .newton import NEWTON_PRECISIONS
from .precision import check_precision
# METHODS, NEWTON_METHODS and resolve_method live in solver.py; they are named here too
# because the hooks import them from this module (distributed.config, distributed._share)
from .solver import (METHODS, NEWTON_METHODS, EighConfig, HostConfig, NewtonConfig, SolverConfig, check_solver,
                     resolve_method)

Tensor = torch.Tensor

__all__ = ["sqrt_trace", "trace_solver", "METHODS", "NEWTON_METHODS", "resolve_method"]


def trace_solver(method, device: torch.device, *, iters: int | None = None, eps: float | None = None,
                 tol: float = EIGH_TOL, precision: str = "ieee") -> SolverConfig:
    """The solver config sqrt_trace runs: ``method`` itself when it is an EighConfig /
    NewtonConfig (then the loose keywords must keep their defaults: ValueError naming the
    first that does not), else the method string with the loose keywords of its route:
    'eigh' -> EighConfig(tol=tol), 'newton' -> NewtonConfig(iters=iters, eps=eps,
    precision=precision), 'newton-tf32' -> the same with precision "tf32", 'host' ->
    HostConfig(), 'auto' by device (solver.resolve_method). The keywords of the other
    routes are not read (``precision`` is checked whatever the route)."""
    if isinstance(check_solver(method), SolverConfig):
        for name, value, default in (("iters", iters, None), ("eps", eps, None), ("tol", tol, EIGH_TOL),
                                     ("precision", precision, "ieee")):
            if value != default:
                raise ValueError(f"{name}: set it in the solver config passed as method "
                                 f"({type(method).__name__}), not beside it")
        return method
    check_precision(precision, "precision", NEWTON_PRECISIONS)
    meth = resolve_method(method, device)
    if meth == "eigh":
        return EighConfig(tol=tol)
    if meth == "host":
        return HostConfig()
    return NewtonConfig(iters=iters, eps=eps, precision="tf32" if meth == "newton-tf32" else precision)


def sqrt_trace(
    A: Tensor,
    method: str | SolverConfig = "auto",
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
    method: an EighConfig / NewtonConfig (gns_kernels.spectral.solver; then leave iters,
      eps, tol and precision at their defaults), or a string that stands for one
      (trace_solver): 'eigh' -> EighConfig(tol=tol), 'newton' -> NewtonConfig(iters=iters,
      eps=eps, precision=precision), 'newton-tf32' -> NewtonConfig(iters=iters, eps=eps,
      precision="tf32"), 'auto' -> by device. The routes:
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
      'host'   float64 eigvalsh on the CPU of (A + A^T)/2 copied there (HostConfig;
               spectral.host): the float64 reference itself; one host sync off the CPU.
      'auto'   CPU: 'eigh'; CUDA: 'newton' (docs/spectral.md).
    iters, eps ('newton'): see NewtonConfig; tol ('eigh'): see EighConfig.
    precision ('newton'): the precision of its matmuls, "ieee" (float32, default),
      "tf32" (operands rounded to nearest to TF32, float32 sums; opt in) or
      "float64" (default shift 1e-12), delivered per call whatever
      torch.set_float32_matmul_precision / allow_tf32 say (spectral.precision.bmm).
    Returns float64 for float64 input, else float32; shape (...). Non-finite matrices give
    NaN; empty matrices (m = 0) give 0. validate=True (or env GNS_KERNELS_VALIDATE=1)
    checks finiteness and symmetry first (host sync).
    """
    check_square(A, "A")
    solver = trace_solver(method, A.device, iters=iters, eps=eps, tol=tol, precision=precision)
    if validate_requested(validate):
        validate_symmetric(A, "A")
    out_dtype = torch.float64 if A.dtype == torch.float64 else torch.float32
    if A.numel() == 0:
        return A.new_zeros(A.shape[:-2], dtype=out_dtype)
    if isinstance(solver, EighConfig):
        lam = torch.ops.gns_kernels.psd_eigvalsh(A, solver.tol)
        return lam.clamp_min(0).sqrt().sum(-1).to(out_dtype)
    if isinstance(solver, HostConfig):
        from .host import host_eigen_sums

        m = A.shape[-1]
        flat = A.detach().reshape(-1, m, m)
        tr = host_eigen_sums([0.5 * (a + a.mT) for a in flat.to(device="cpu", dtype=torch.float64).unbind(0)])[0]
        return tr.reshape(A.shape[:-2]).to(device=A.device, dtype=out_dtype)
    return torch.ops.gns_kernels.newton_sqrt_trace(A, solver.iters, solver.eps, None, True,
                                                   solver.precision).to(out_dtype)
