"""Typed solver configurations of the sqrt-trace tr(A_+^{1/2}): one frozen dataclass per
route, validated once when it is made, and the method strings mapped onto them.

Routes (A symmetric, (..., m, m); A_+ its positive part):

    EighConfig(tol=5e-4)
        eigenvalues (eigh.py): float32 eigvalsh of A / 2^e (2^e a power of two near
        max|A_ij|), re-solved in float64 for each matrix whose a-posteriori bound of the
        sqrt-trace error exceeds ``tol`` (relative, dimensionless); sum_i sqrt(max(lambda_i, 0)).
    NewtonConfig(iters=None, eps=None, precision="ieee")
        coupled Newton-Schulz (newton.py) on A_+ / ||A||_F + eps I after the positive-part
        sign iteration, ``iters`` fixed iterations, every matmul in ``precision`` ("ieee":
        float32, "tf32": operands rounded to TF32, "float64"); the shift eps (relative to
        ||A||_F) is undone spectrally. No host synchronization. None fills the defaults:
        eps = NEWTON_EPS_BY_PRECISION[precision] (1e-6 for "ieee" / "tf32", 1e-12 for
        "float64"), iters = newton_min_iters(eps) + 3; allowed eps in
        [NEWTON_EPS_BY_PRECISION[precision], 1e-2], iters in [newton_min_iters(eps), 200].
    HostConfig(max_pending=1)
        the host route (host.py): the matrices (C formed in float64 where it is a
        difference) copied to the CPU, float64 eigvalsh there (LAPACK with MKL's default
        thread count), sum_i sqrt(max(lambda_i, 0)) and the pair sums from the eigenvalues.
        ``sqrt_trace`` / ``nuclear_stats`` run it synchronously (one host sync: the copy);
        the hook states run it lagged (docs/distributed.md, "The host route") and read
        max_pending, which they accept at 1 only (one job in flight).

Method strings (``gk.sqrt_trace(A, method=...)``, ``gk.nuclear_stats(..., method=...)``,
the hook states' ``method``): METHODS = ("auto", "eigh", "newton", "newton-tf32", "host"). Each
entry point says which config each string stands for (``routes`` of ``resolve_solver``):
``sqrt_trace``'s "newton" is NewtonConfig() (float32), ``nuclear_stats``'s is its float64
noise chain NOISE_CHAIN (nuclear.py). "auto" is no config: it resolves by device, the
entry point's "eigh" config on CPU and its "newton" config on any other device
(docs/spectral.md, '"auto"').
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Union

import torch

from .eigh import EIGH_TOL
from .newton import NEWTON_PRECISIONS, check_newton_args
from .precision import check_precision

__all__ = ["SolverConfig", "EighConfig", "NewtonConfig", "HostConfig", "METHODS", "NEWTON_METHODS",
           "resolve_method", "resolve_solver", "check_solver"]

# "newton-tf32": the Newton path with TF32 products (operands rounded to nearest), opt in
# (newton.NEWTON_PRECISIONS) of sqrt_trace / nuclear_stats; the hook states refuse it
# (distributed.config.check_hook_method: it left the hooks' signal 18% low in emulation);
# "host": float64 eigvalsh on the CPU (HostConfig; the hook states run it lagged)
METHODS = ("auto", "eigh", "newton", "newton-tf32", "host")
NEWTON_METHODS = ("newton", "newton-tf32")


@dataclass(frozen=True)
class SolverConfig:
    """Base of the sqrt-trace solver configurations (EighConfig, NewtonConfig, HostConfig):
    a frozen dataclass whose fields are checked once, in ``__post_init__``. Not made
    itself; each route's config has a ``method`` property, its method string ('eigh',
    'newton', 'newton-tf32' or 'host')."""

    def __post_init__(self) -> None:
        if type(self) is SolverConfig:
            raise TypeError("SolverConfig: make an EighConfig, a NewtonConfig or a HostConfig")


@dataclass(frozen=True, kw_only=True)
class EighConfig(SolverConfig):
    """The eigenvalue route (module docstring). tol: the relative bound on the float32
    sqrt-trace error above which a matrix is re-solved in float64 (default EIGH_TOL =
    5e-4), a finite number >= 0 (0: every matrix whose bound is not exactly 0 is solved in
    float64)."""

    tol: float = EIGH_TOL

    def __post_init__(self) -> None:
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
            raise ValueError(f"tol: expected a finite number >= 0 (relative error bound), got {tol!r}")
        object.__setattr__(self, "tol", float(tol))

    @property
    def method(self) -> str:
        return "eigh"


@dataclass(frozen=True, kw_only=True)
class NewtonConfig(SolverConfig):
    """The coupled Newton-Schulz route (module docstring). Fields after construction are
    the resolved values: NewtonConfig() == NewtonConfig(iters=15, eps=1e-6,
    precision="ieee"). A bad field raises ValueError naming it (precision first, then eps,
    then iters, whose range depends on eps)."""

    iters: int | None = None
    eps: float | None = None
    precision: str = "ieee"

    def __post_init__(self) -> None:
        check_precision(self.precision, "precision", NEWTON_PRECISIONS)
        for name, v in (("eps", self.eps), ("iters", self.iters)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name}: expected a number or None, got {v!r}")
        iters, eps = check_newton_args(self.iters, self.eps, self.precision)
        object.__setattr__(self, "iters", iters)
        object.__setattr__(self, "eps", eps)

    @property
    def method(self) -> str:
        return "newton-tf32" if self.precision == "tf32" else "newton"


@dataclass(frozen=True, kw_only=True)
class HostConfig(SolverConfig):
    """The host route (module docstring; spectral/host.py): float64 eigvalsh on the CPU of
    the matrices copied there, C formed in float64 on the inputs' device first. The
    reference the steep-spectrum bound is measured against (float64 eigh of C formed in
    float64 from the float32 inputs), so within rounding of it.

    max_pending: the number of host solves a hook state may have in flight before the
      next measurement waits for the oldest (an int >= 1; default 1). The hook states
      accept 1 only (their back-up policy: the join of measurement k waits for its job at
      the next measurement; a deeper queue is not built) and refuse others at
      construction; ``sqrt_trace`` and ``nuclear_stats`` solve synchronously and do not
      read it.
    A bad field raises ValueError naming it."""

    max_pending: int = 1

    def __post_init__(self) -> None:
        v = self.max_pending
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"max_pending: expected an int >= 1 (host solves in flight), got {v!r}")

    @property
    def method(self) -> str:
        return "host"


def resolve_method(method: str, device: torch.device) -> str:
    """'auto' -> 'eigh' on CPU, 'newton' elsewhere (docs/spectral.md); others validated."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    if method != "auto":
        return method
    return "eigh" if device.type == "cpu" else "newton"


def check_solver(method) -> Union[str, SolverConfig]:
    """``method`` if it is a SolverConfig or one of METHODS, else ValueError naming it."""
    if isinstance(method, SolverConfig) or (isinstance(method, str) and method in METHODS):
        return method
    raise ValueError(f"method: expected one of {', '.join(repr(m) for m in METHODS)} or an "
                     f"EighConfig / NewtonConfig / HostConfig, got {method!r}")


def resolve_solver(method, device: torch.device, routes: Mapping[str, SolverConfig]) -> SolverConfig:
    """The solver config of ``method`` on ``device``: a SolverConfig is returned as it is;
    a method string maps through ``routes`` ('eigh', 'newton', 'newton-tf32', 'host' ->
    the entry point's configs), 'auto' by device (resolve_method)."""
    if isinstance(check_solver(method), SolverConfig):
        return method
    return routes[resolve_method(method, device)]
