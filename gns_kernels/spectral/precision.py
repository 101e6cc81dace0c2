"""Explicit matmul precision for the spectral package: every batched matmul the spectral
solvers issue goes through ``bmm(a, b, precision)``, which delivers the requested
precision whatever the process-wide settings say (``torch.set_float32_matmul_precision``,
``torch.backends.cuda.matmul.allow_tf32`` / ``fp32_precision``,
``torch.backends.mkldnn.matmul.fp32_precision``). Nothing here writes a process-global
flag: the flags are only read, at the moment the matmul is issued, to pick a route.

Precisions (unit roundoff u of the multiplied values; accumulation is float32 or wider):

    "ieee"     float32 products and sums (u = 2^-24). Route: a plain float32 bmm when the
               flag in effect for the device is "ieee" (set_float32_matmul_precision
               "highest"); otherwise the float32 operands are multiplied in float64 and the
               result rounded to float32 (exact products, float64 sums: at least as
               accurate as ieee float32, and a float64 matmul is never downgraded). On an
               H100 float64 matmuls run on the FP64 tensor cores at about the float32 FFMA
               rate (67 TF/s each, vendor figures; a prediction, not measured here).
    "tf32"     operands rounded to nearest with a 10-bit mantissa (u = 2^-11), products
               and sums float32. Route: round, then a float32 bmm (exact for tf32-rounded
               operands whether the flag says ieee or tf32); when the flag allows bf16
               (CPU oneDNN), the float64 route.
    "bf16"     operands rounded to nearest bf16 (8-bit mantissa, u = 2^-8), products and
               sums float32. Same routes as "tf32" (bf16 values are exact in tf32).
    "float64"  float64 operands, products and sums (u = 2^-53). Never downgraded.

Debugging: ``record_matmuls()`` is a context manager that records, per matmul issued on
the current thread (and context), a ``MatmulRecord(requested, route, flag, device,
shape)``: the precision asked for, the route taken ("float32", "float64" or
"rounded+float32") and the device flag that was in effect. ``check_record`` states
whether a route delivers the requested precision under that flag; tests assert it for
every matmul of a solve run under ``set_float32_matmul_precision("medium")``.
"""
from __future__ import annotations

import contextlib
import math
import contextvars
from typing import Iterator, NamedTuple

import torch

Tensor = torch.Tensor

PRECISIONS = ("ieee", "tf32", "bf16", "float64")
UNIT_ROUNDOFF = {"ieee": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8, "float64": 2.0**-53}
_MANTISSA_BITS = {"tf32": 10, "bf16": 7}


class MatmulRecord(NamedTuple):
    requested: str  # one of PRECISIONS
    route: str  # "float32" | "float64" | "rounded+float32"
    flag: str  # the device's fp32 matmul flag when issued: "ieee" | "tf32" | "bf16"
    device: str
    shape: tuple  # (B, m, k, n)


_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar("gns_kernels_matmul_records", default=None)


@contextlib.contextmanager
def record_matmuls() -> Iterator[list[MatmulRecord]]:
    """Collect a MatmulRecord for every spectral matmul issued inside the block (this thread
    and context only). Yields the list being filled."""
    log: list[MatmulRecord] = []
    token = _RECORDER.set(log)
    try:
        yield log
    finally:
        _RECORDER.reset(token)


def check_precision(precision: str, name: str = "precision", allowed=PRECISIONS) -> str:
    if precision not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(repr(p) for p in allowed)}, got {precision!r}")
    return precision


def fp32_matmul_flag(device: torch.device) -> str:
    """The float32 matmul precision torch would use on ``device`` right now: "ieee", "tf32"
    or "bf16" (read only). CUDA: torch.backends.cuda.matmul.fp32_precision (set by
    allow_tf32 and set_float32_matmul_precision); CPU: torch.backends.mkldnn.matmul's
    (set_float32_matmul_precision("medium") makes it "bf16"); "none" means the legacy
    global setting, resolved through get_float32_matmul_precision()."""
    if device.type == "cuda":
        flag = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
        if flag == "none":
            flag = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        mk = getattr(torch.backends.mkldnn, "matmul", None)
        flag = getattr(mk, "fp32_precision", "none") if mk is not None else "none"
    if flag == "none":
        flag = {"highest": "ieee", "high": "tf32", "medium": "bf16"}[torch.get_float32_matmul_precision()]
    return flag


def check_record(rec: MatmulRecord) -> bool:
    """True when rec's route delivers rec.requested under rec.flag: float64 always;
    rounded operands + float32 when the flag is not coarser than the rounding; a plain
    float32 matmul for "ieee" only under the "ieee" flag."""
    if rec.route == "float64":
        return True
    if rec.route == "float32":
        return rec.requested == "ieee" and rec.flag == "ieee"
    if rec.route == "rounded+float32":
        return rec.requested in ("tf32", "bf16") and (rec.flag != "bf16" or rec.requested == "bf16")
    return False


def round_mantissa(x: Tensor, bits: int) -> Tensor:
    """float32 x rounded to nearest (ties to even) with a ``bits``-bit mantissa (10: tf32,
    7: bf16), exponent range unchanged; inf/NaN pass through. Same dtype as x (float32)."""
    x = x.float().contiguous()
    i = x.view(torch.int32)
    drop = 23 - bits
    half = (1 << (drop - 1)) - 1
    lsb = (i >> drop) & 1
    r = ((i + half + lsb) >> drop) << drop
    out = r.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


def round_to(x: Tensor, precision: str) -> Tensor:
    """x as the operand of a ``precision`` matmul: rounded for tf32 / bf16, float32 for
    ieee, float64 for float64."""
    if precision in _MANTISSA_BITS:
        return round_mantissa(x, _MANTISSA_BITS[precision])
    return x.double() if precision == "float64" else x.float()


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in ``dtype``, with no op issued when it already is (a no-op ``.to`` is still an
    aten op per call: the Newton loops issue hundreds)."""
    return x if x.dtype == dtype else x.to(dtype)


def bmm(a: Tensor, b: Tensor, precision: str) -> Tensor:
    """a @ b (batched, (B, m, k) x (B, k, n)) in ``precision`` (module docstring), whatever
    the process-wide matmul flags say. Result float64 for "float64", else float32."""
    return bmm_add(None, a, b, precision)


def bmm_add(c: Tensor | None, a: Tensor, b: Tensor, precision: str, beta: float = 1.0,
            alpha: float = 1.0) -> Tensor:
    """beta c + alpha (a @ b) in one launch (torch.baddbmm; c None: alpha a @ b by bmm), the
    product in ``precision`` as ``bmm`` (c, beta and alpha in the result's dtype: float64 for
    "float64", else float32; the term beta c is not rounded to the product's precision).
    Recorded by ``record_matmuls`` like ``bmm``."""
    log = _RECORDER.get()
    # the process flag only matters to float32 requests (a float64 product is never lowered):
    # read it (torch.backends lookups, ~5 us) only for them or for the recorder
    flag = fp32_matmul_flag(a.device) if precision != "float64" or log is not None else "ieee"
    if precision == "float64":
        route, dt = "float64", torch.float64
        a, b = _as(a, dt), _as(b, dt)
    elif precision == "ieee":
        a, b = _as(a, torch.float32), _as(b, torch.float32)
        if flag == "ieee":
            route, dt = "float32", torch.float32
        else:
            route, dt = "float64", torch.float64
            a, b = a.double(), b.double()
    elif precision in _MANTISSA_BITS:
        a, b = round_to(a, precision), round_to(b, precision)
        if flag == "bf16" and precision != "bf16":
            route, dt = "float64", torch.float64
            a, b = a.double(), b.double()
        else:
            route, dt = "rounded+float32", torch.float32
    else:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if c is None:
        out = torch.bmm(a, b) if alpha == 1.0 else torch.baddbmm(
            torch.empty((), dtype=dt, device=a.device), a, b, beta=0.0, alpha=alpha)
    else:
        out = torch.baddbmm(_as(c, dt), a, b, beta=beta, alpha=alpha)
    if dt == torch.float64 and precision != "float64":
        out = out.float()
    if log is not None:
        log.append(MatmulRecord(precision, route, flag, a.device.type, (a.shape[0], a.shape[1], a.shape[2], b.shape[2])))
    return out


# ---------------------------------------------------------------------------------------
# Gram precision: which tensor-core mode keeps the noise tr(C^{1/2}) and the signal within
# the end-to-end budget (docs/spectral.md, "Precision").
#
# Error model. With operands rounded to nearest (unit u_p) and float32 accumulation, each
# sample Gram is that of G_j + E_j, |E_j| <= u_p |G_j| entrywise with independent signs,
# and the mean-gradient Gram that of D + E_D. C = scale (mean_j G_j G_j^T - D D^T) is a
# difference whose operands are rho = ||mean Gram||_F / ||mean Gram - D D^T||_F times
# larger than the result, and the rounding of G_j and of D does not cancel in it, so
#     |delta tr(C^{1/2})| / tr(C^{1/2}) <= kappa u_p rho,
# kappa a constant below 1 because the first-order change (1/2) tr(C^{-1/2} delta C) sums
# independent signs; it grows with the sqrt-trace's sensitivity to C's small eigenvalues
# (delta lambda / (2 sqrt(lambda))), without bound for a rank-deficient C. Measured (float64
# emulation of tf32 Grams, 12 seeds each, bench/RESULTS.md): kappa <= 0.07 for C well
# conditioned (m, n in [33, 128], R in {2, 4}, (R-1) n > m, with and without a shift),
# 0.31 for R = 2 and a square gradient (C = E E^T, E 48 x 48: eigenvalues near 0). The rule
# takes kappa = GRAM_KAPPA = 0.5 and half the budget (the other half is the solver's):
# tensor cores only where GRAM_KAPPA u_p rho <= 5e-4, i.e. rho <= 2.05 for tf32: when the
# noise part of the mean Gram is at least as large as the signal part D D^T. The signal's
# error is u_p-level with no amplification. Float32 ("ieee") Grams: the error comes from
# float32 accumulation (~u sqrt(n) per entry), 1.8e-4 measured at rho = 1.5e4, m = 64,
# n = 96, but up to 0.95 u rho over 300 seeds at m = 33, n = 128, R = 2 (1.1e-3 at rho =
# 2.2e4): beyond rho ~ 1e4 no Gram precision keeps the noise within the budget, and the
# rule's ieee answer means "the best there is" (tests/spectral/test_precision.py).
GRAM_BUDGET = 1e-3
GRAM_KAPPA = 0.5
GRAM_PRECISIONS = ("ieee", "tf32", "bf16")


def max_subtraction_condition(precision: str) -> float:
    """Largest rho for which ``precision`` Grams keep the noise within half the budget:
    GRAM_BUDGET / (2 GRAM_KAPPA u_p). ieee: 1.7e4, tf32: 2.05, bf16: 0.26
    (never: rho >= 1 always) for operands that must be rounded."""
    return GRAM_BUDGET / (2.0 * GRAM_KAPPA * UNIT_ROUNDOFF[check_precision(precision, "precision", GRAM_PRECISIONS)])


def subtraction_condition(mean_gram: Tensor, mean_grad_gram: Tensor) -> Tensor:
    """rho = ||mean_gram||_F / ||mean_gram - mean_grad_gram||_F (float64, shape (...)):
    how much larger the operands of C's subtraction are than C. inf where C = 0. No sync."""
    a = mean_gram.detach().double()
    num = torch.linalg.matrix_norm(a)
    den = torch.linalg.matrix_norm(a - mean_grad_gram.detach().double())
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.full_like(num, float("inf")))


def gram_precision_rule(rho: float | None, input_dtype: torch.dtype = torch.float32) -> str:
    """The Gram precision for the next measurement of a layer: "bf16" when the gradient is
    already bfloat16 (its products are exact in float32: no rounding at all), "tf32" when
    the previous measurement's subtraction condition rho (subtraction_condition) is at
    most max_subtraction_condition("tf32") (2.05), else "ieee". rho None (no previous
    measurement) or non-finite: "ieee"."""
    if input_dtype == torch.bfloat16:
        return "bf16"
    if rho is None or not math.isfinite(float(rho)):
        return "ieee"
    return "tf32" if float(rho) <= max_subtraction_condition("tf32") else "ieee"
