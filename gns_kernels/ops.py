"""Fused one-pass ops for the l1 / l2 gradient-noise statistics (Python faces + dispatch).

The ops (see docs/fused_ops.md; float64 oracle in gns_kernels.reference):

- ``variance_norms(mean_grad, mean_sq, scale, shift=None) -> Tensor[4]`` (float32)
      d = mean_grad, q = mean_sq, g = d + shift (d when shift is None),
      s2 = max(scale * (q - d^2), 0)   (NaN stays NaN), s = sqrt(s2),
      returns [||s||_1, ||g||_1, sum_i s2_i, ||g||_2^2].
  With samples g^j (ranks or micro-batches, each a mean over B/R examples), mean_grad the
  mean of the shifted samples g^j - shift, mean_sq the mean of their squares and
  scale = B/(R-1), s2 is the per-coordinate variance of one example's gradient
  (units: gradient^2) and the four entries are the raw l1 / l2 noise and signal sums.
- ``square_pack(grad, out, shift=None) -> out``: x = grad - shift (grad when no shift),
  out[:n] = x, out[n:2n] = x^2 (out float32, contiguous, 2n elements), so one all-reduce
  carries both halves.
- ``accumulate_sq(grad, prev, sq) -> None``: micro-batch step, in place:
  d = grad - prev; sq += d^2; prev = grad.
- ``variance_norms_multi(mean_grads, mean_sqs, scale, shifts=None) -> Tensor[4]``: the sums
  of variance_norms over lists of tensors, in one call.
- ``accumulate_sq_multi(grads, prevs, sqs) -> None``: accumulate_sq over lists, one call.

Inputs are flat-viewed (only numel matters), contiguous, float32 / bfloat16 / float16;
results accumulate in float32 or wider.

Backends (``backend=`` keyword, else env var ``GNS_KERNELS_BACKEND``, else "auto"):
- "auto":   CPU -> "cpp"; CUDA -> the torch op if a CUDA kernel is registered for it
            (C++ CUDA build, or Triton via gns_kernels.triton.register_cuda_kernels),
            else "triton" if triton imports; any other device -> "eager". In an install
            built without the extension (GNS_KERNELS_NO_EXTENSION=1, or no C++ compiler
            found), CPU -> "eager" with a one-time warning.
- "cpp":    the torch ops ``torch.ops.gns_kernels.*`` (C++ kernels in csrc/, extension
            gns_kernels._C). Raises with rebuild instructions if the extension is missing.
- "triton": gns_kernels.triton.fused.* (imported lazily).
- "eager":  composite torch formulas, any device (allocates input-sized temporaries).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence

import torch

Tensor = torch.Tensor

__all__ = [
    "variance_norms",
    "square_pack",
    "accumulate_sq",
    "variance_norms_multi",
    "accumulate_sq_multi",
    "BACKENDS",
    "cpp_available",
]

BACKENDS = ("auto", "cpp", "triton", "eager")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ENV = "GNS_KERNELS_BACKEND"

# --------------------------------------------------------------------------------------
# Loading the C++ extension (schemas live in csrc/ops.cpp, TORCH_LIBRARY(gns_kernels)).
# --------------------------------------------------------------------------------------
# GNS_KERNELS_NO_EXTENSION=1: setup.py builds no extension and this loader skips _C. An
# install without _C (asked for, or built where no C++ compiler was found) runs every op
# through the eager formulas, announced once by a warning at the first CPU op.
_NO_EXT_ENV = "GNS_KERNELS_NO_EXTENSION"
_C_ERROR: Optional[BaseException] = None
_NO_EXTENSION = False  # True: no _C by design (env var, or no compiled _C file installed)
_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get(_NO_EXT_ENV, "0") not in ("", "0"):
    _C = None
    _NO_EXTENSION = True
    _C_ERROR = ImportError(f"skipped: {_NO_EXT_ENV}={os.environ[_NO_EXT_ENV]}")
else:
    try:
        from . import _C  # noqa: F401  (importing registers torch.ops.gns_kernels.*)
    except ImportError as exc:  # the extension is not built (or built for another torch)
        _C = None
        if not any(f.startswith("_C.") and f.endswith((".so", ".pyd")) for f in os.listdir(_here)):
            _NO_EXTENSION = True
            _C_ERROR = ImportError(f"no compiled _C*.so in {_here}")
        else:
            _C_ERROR = exc

_REBUILD_HINT = (
    "the C++ extension gns_kernels._C is not built or does not load ({err}). Rebuild it "
    "from the repository root with `pip install --no-build-isolation -e .` (needs torch "
    "and ninja installed first), or pass backend='eager' / set GNS_KERNELS_BACKEND=eager "
    "to use the slow composite formulas."
)


def cpp_available() -> bool:
    """True when the C++ extension loaded and registered torch.ops.gns_kernels.*."""
    return _C is not None


def _require_cpp() -> None:
    if _C is None:
        raise RuntimeError("gns_kernels.ops: " + _REBUILD_HINT.format(err=_C_ERROR))


_WARNED_NO_EXTENSION = False


def _warn_no_extension() -> None:
    """One warning per process: the ops run the eager formulas because there is no _C."""
    global _WARNED_NO_EXTENSION
    if _WARNED_NO_EXTENSION:
        return
    _WARNED_NO_EXTENSION = True
    warnings.warn(
        f"gns_kernels: no C++ extension ({_C_ERROR}), so the ops use the eager torch formulas "
        "(same results, slower, input-sized temporaries); for the fused kernels reinstall "
        f"gns-kernels where a C++ compiler and ninja are found, without {_NO_EXT_ENV} "
        "(README: Set up)",
        RuntimeWarning,
        stacklevel=4,
    )


# Fake (meta) kernels: output shapes/dtypes for torch.compile, FakeTensor and opcheck.
if _C is not None:

    @torch.library.register_fake("gns_kernels::variance_norms")
    def _variance_norms_fake(mean_grad, mean_sq, scale, shift=None):
        return mean_grad.new_empty(4, dtype=torch.float32)

    @torch.library.register_fake("gns_kernels::variance_norms_multi")
    def _variance_norms_multi_fake(mean_grads, mean_sqs, scale, shifts):
        torch._check(len(mean_grads) > 0, lambda: "mean_grads: expected a non-empty list")
        return mean_grads[0].new_empty(4, dtype=torch.float32)

    @torch.library.register_fake("gns_kernels::square_pack")
    def _square_pack_fake(grad, out, shift=None):
        return None

    @torch.library.register_fake("gns_kernels::accumulate_sq")
    def _accumulate_sq_fake(grad, prev, sq):
        return None

    @torch.library.register_fake("gns_kernels::accumulate_sq_multi")
    def _accumulate_sq_multi_fake(grads, prevs, sqs):
        return None


_TRITON_REGISTERED = False


def _register_triton_cuda() -> None:
    """Let the Triton helper register its kernels as the CUDA impls of the torch ops.

    Called once (lazily): at import when CUDA is available, else at the first CUDA call.
    Only a missing triton (or a gns_kernels.triton without the hook) is tolerated; any
    other error inside gns_kernels.triton surfaces.
    """
    global _TRITON_REGISTERED
    if _TRITON_REGISTERED or _C is None:
        return
    _TRITON_REGISTERED = True
    try:
        from .triton import register_cuda_kernels
    except ImportError as exc:
        name = getattr(exc, "name", None) or ""
        if name in ("triton", "gns_kernels.triton") or name.startswith("triton."):
            return
        raise
    register_cuda_kernels()


def _triton_fused():
    try:
        from .triton import fused
    except ImportError as exc:
        raise RuntimeError(
            f"gns_kernels.ops: backend 'triton' needs triton and gns_kernels.triton.fused ({exc})"
        ) from exc
    return fused


if _C is not None and torch.cuda.is_available():
    _register_triton_cuda()


# --------------------------------------------------------------------------------------
# Backend choice
# --------------------------------------------------------------------------------------
def _env_backend() -> str:
    return os.environ.get(_ENV, "auto") or "auto"


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without importing torch._dynamo (which also
    pulls in triton and FSDP: about 2 s of `import gns_kernels`, bench/RESULTS.md). That
    decorator only sets this attribute, which Dynamo reads when it traces; a test checks
    that both set the same."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _has_cuda_kernel(op_name: str) -> bool:
    """True when a CUDA kernel (C++ build or Triton registration) serves gns_kernels::op_name.

    assume_constant_result: the dispatcher query returns a non-tensor that Dynamo cannot
    trace (a graph break under torch.compile(fullgraph=True) on CUDA tensors); the answer
    does not change once the ops are registered, at import.
    """
    if _C is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"gns_kernels::{op_name}", "CUDA")


def _resolve(backend: Optional[str], device: torch.device, op_name: str) -> str:
    b = backend if backend is not None else _env_backend()
    if b not in BACKENDS:
        src = "backend" if backend is not None else f"environment variable {_ENV}"
        raise ValueError(f"{src}: expected one of {BACKENDS}, got {b!r}")
    if b != "auto":
        if b == "cpp":
            _require_cpp()
        return b
    if device.type == "cpu":
        if _C is None and _NO_EXTENSION:  # installed without _C: eager, announced once
            _warn_no_extension()
            return "eager"
        _require_cpp()  # a _C that fails to load is an error, not a silent fallback
        return "cpp"
    if device.type == "cuda":
        _register_triton_cuda()
        if _has_cuda_kernel(op_name):
            return "cpp"
        try:
            _triton_fused()
        except RuntimeError:
            return "eager"
        return "triton"
    return "eager"


# --------------------------------------------------------------------------------------
# Argument validation (the C++ kernels check again, with the same messages)
# --------------------------------------------------------------------------------------
def _check_tensor(name: str, t, allowed=_FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}; got {str(t.dtype).replace('torch.', '')}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous() first)")


def _check_like(name: str, t: Tensor, ref_name: str, ref: Tensor, numel: Optional[int] = None) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} like {ref_name}, got {t.device}")
    want = ref.numel() if numel is None else numel
    if t.numel() != want:
        raise ValueError(f"{name}: expected {want} elements (like {ref_name}), got {t.numel()}")


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a Python float, got {type(scale).__name__}")
    return float(scale)


def _check_vn(mean_grad, mean_sq, shift, suffix: str = "") -> None:
    """suffix: "" for the single-tensor op, "s[i]" for element i of the _multi lists."""
    ng, nq, ns = (f"mean_grad{suffix}", f"mean_sq{suffix}", f"shift{suffix}")
    _check_tensor(ng, mean_grad)
    _check_tensor(nq, mean_sq)
    if mean_sq.dtype != mean_grad.dtype:
        raise TypeError(f"{nq}: expected dtype {mean_grad.dtype} like {ng}, got {mean_sq.dtype}")
    _check_like(nq, mean_sq, ng, mean_grad)
    if shift is not None:
        _check_tensor(ns, shift)
        _check_like(ns, shift, ng, mean_grad)


def _check_acc(grad, prev, sq, suffix: str = "") -> None:
    ng, npv, nsq = (f"grad{suffix}", f"prev{suffix}", f"sq{suffix}")
    _check_tensor(ng, grad)
    _check_tensor(npv, prev)
    if prev.dtype not in (grad.dtype, torch.float32):
        raise TypeError(f"{npv}: expected dtype {grad.dtype} (like {ng}) or float32, got {prev.dtype}")
    _check_tensor(nsq, sq, allowed=(torch.float32,))
    _check_like(npv, prev, ng, grad)
    _check_like(nsq, sq, ng, grad)


def _check_list(name: str, xs) -> list:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name}: expected a list of tensors, got {type(xs).__name__}")
    return list(xs)


def _common_device(name: str, tensors: list) -> torch.device:
    if not tensors:
        return torch.device("cpu")
    dev = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != dev:
            raise ValueError(f"{name}[{i}]: expected device {dev} like {name}[0], got {t.device}")
    return dev


# --------------------------------------------------------------------------------------
# Eager composite formulas (any device; allocate temporaries)
# --------------------------------------------------------------------------------------
def _eager_vn_terms(mean_grad: Tensor, mean_sq: Tensor, scale: float, shift: Optional[Tensor]) -> Tensor:
    d = mean_grad.reshape(-1).float()
    q = mean_sq.reshape(-1).float()
    g = d if shift is None else d + shift.reshape(-1).float()
    s2 = scale * (q - d * d)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)  # NaN stays NaN
    return torch.stack(
        [
            s2.sqrt().sum(dtype=torch.float64),
            g.abs().sum(dtype=torch.float64),
            s2.sum(dtype=torch.float64),
            (g * g).sum(dtype=torch.float64),
        ]
    )


def _eager_square_pack(grad: Tensor, out: Tensor, shift: Optional[Tensor]) -> Tensor:
    n = grad.numel()
    x = grad.reshape(-1).float()
    if shift is not None:
        x = x - shift.reshape(-1).float()
    out[:n].copy_(x)
    out[n:].copy_(x * x)
    return out


def _eager_accumulate_sq(grad: Tensor, prev: Tensor, sq: Tensor) -> None:
    d = grad.reshape(-1).float() - prev.reshape(-1).float()
    sq.view(-1).add_(d * d)
    prev.copy_(grad)


# --------------------------------------------------------------------------------------
# Public faces
# --------------------------------------------------------------------------------------
def variance_norms(
    mean_grad: Tensor,
    mean_sq: Tensor,
    scale: float,
    shift: Optional[Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """[||s||_1, ||g||_1, sum s2, ||g||_2^2] (float32 Tensor[4]) in one pass.

    mean_grad d, mean_sq q, shift S: same numel, contiguous, float32/bfloat16/float16
    (mean_sq the dtype of mean_grad; shift any of the three). g = d + S (d without shift),
    s2 = max(scale * (q - d^2), 0) with NaN kept, s = sqrt(s2). Shapes: any, flattened.
    """
    _check_vn(mean_grad, mean_sq, shift)
    scale = _check_scale(scale)
    b = _resolve(backend, mean_grad.device, "variance_norms")
    if b == "cpp":
        return torch.ops.gns_kernels.variance_norms(mean_grad, mean_sq, scale, shift)
    if b == "triton":
        return _triton_fused().variance_norms(mean_grad, mean_sq, scale, shift)
    return _eager_vn_terms(mean_grad, mean_sq, scale, shift).float()


def square_pack(
    grad: Tensor, out: Tensor, shift: Optional[Tensor] = None, *, backend: Optional[str] = None
) -> Tensor:
    """Write x = grad - shift (grad without shift) and x^2 into ``out``; return ``out``.

    grad, shift: n elements, contiguous, float32/bfloat16/float16. out: float32, contiguous,
    2n elements: out[:n] = x, out[n:] = x^2 (computed in float32).
    """
    _check_tensor("grad", grad)
    _check_tensor("out", out, allowed=(torch.float32,))
    _check_like("out", out, "grad (2x)", grad, numel=2 * grad.numel())
    if shift is not None:
        _check_tensor("shift", shift)
        _check_like("shift", shift, "grad", grad)
    b = _resolve(backend, grad.device, "square_pack")
    if b == "cpp":
        torch.ops.gns_kernels.square_pack(grad, out, shift)
        return out
    if b == "triton":
        _triton_fused().square_pack(grad, out, shift)
        return out
    return _eager_square_pack(grad, out, shift)


def accumulate_sq(grad: Tensor, prev: Tensor, sq: Tensor, *, backend: Optional[str] = None) -> None:
    """In place: d = grad - prev; sq += d^2; prev = grad (one micro-batch step).

    grad: float32/bfloat16/float16; prev: grad's dtype or float32; sq: float32;
    all contiguous with the same numel; d and d^2 computed in float32.
    """
    _check_acc(grad, prev, sq)
    b = _resolve(backend, grad.device, "accumulate_sq")
    if b == "cpp":
        torch.ops.gns_kernels.accumulate_sq(grad, prev, sq)
    elif b == "triton":
        _triton_fused().accumulate_sq(grad, prev, sq)
    else:
        _eager_accumulate_sq(grad, prev, sq)


def variance_norms_multi(
    mean_grads: Sequence[Tensor],
    mean_sqs: Sequence[Tensor],
    scale: float,
    shifts: Optional[Sequence[Optional[Tensor]]] = None,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """variance_norms summed over lists of tensors (pairs may differ in size and dtype).

    shifts: None, or a list as long as mean_grads (entries may be None: no shift there).
    Returns float32 Tensor[4] (zeros for empty lists), on the tensors' device (CPU if empty).
    """
    mean_grads = _check_list("mean_grads", mean_grads)
    mean_sqs = _check_list("mean_sqs", mean_sqs)
    if len(mean_sqs) != len(mean_grads):
        raise ValueError(f"mean_sqs: expected {len(mean_grads)} tensors like mean_grads, got {len(mean_sqs)}")
    if shifts is not None:
        shifts = _check_list("shifts", shifts)
        if len(shifts) != len(mean_grads):
            raise ValueError(f"shifts: expected {len(mean_grads)} tensors like mean_grads, got {len(shifts)}")
    scale = _check_scale(scale)
    for i, (d, q) in enumerate(zip(mean_grads, mean_sqs)):
        _check_vn(d, q, None if shifts is None else shifts[i], suffix=f"s[{i}]")
    dev = _common_device("mean_grads", mean_grads)
    _common_device("mean_sqs", mean_sqs)
    if shifts is not None:
        _common_device("shifts", [s for s in shifts if s is not None])
    b = _resolve(backend, dev, "variance_norms_multi")
    if not mean_grads:  # nothing to dispatch on: the sums are zero
        return torch.zeros(4, dtype=torch.float32, device=dev)
    if b == "cpp":
        # one entry per tensor (None: no shift), so every registered kernel (C++ CPU/CUDA,
        # Triton via register_cuda_kernels) sees the same list form; the C++ kernels also
        # accept an empty list for "no shift at all"
        return torch.ops.gns_kernels.variance_norms_multi(
            mean_grads, mean_sqs, scale, [None] * len(mean_grads) if shifts is None else shifts
        )
    if b == "triton":
        return _triton_fused().variance_norms_multi(mean_grads, mean_sqs, scale, shifts)
    total = torch.zeros(4, dtype=torch.float64, device=dev)
    for i, (d, q) in enumerate(zip(mean_grads, mean_sqs)):
        total += _eager_vn_terms(d, q, scale, None if shifts is None else shifts[i])
    return total.float()


def accumulate_sq_multi(
    grads: Sequence[Tensor],
    prevs: Sequence[Tensor],
    sqs: Sequence[Tensor],
    *,
    backend: Optional[str] = None,
) -> None:
    """accumulate_sq over lists of tensors in one call (in place on prevs and sqs)."""
    grads = _check_list("grads", grads)
    prevs = _check_list("prevs", prevs)
    sqs = _check_list("sqs", sqs)
    for name, xs in (("prevs", prevs), ("sqs", sqs)):
        if len(xs) != len(grads):
            raise ValueError(f"{name}: expected {len(grads)} tensors like grads, got {len(xs)}")
    for i, (g, p, s) in enumerate(zip(grads, prevs, sqs)):
        _check_acc(g, p, s, suffix=f"s[{i}]")
    dev = _common_device("grads", grads)
    _common_device("prevs", prevs)
    _common_device("sqs", sqs)
    b = _resolve(backend, dev, "accumulate_sq_multi")
    if not grads:
        return
    if b == "cpp":
        torch.ops.gns_kernels.accumulate_sq_multi(grads, prevs, sqs)
    elif b == "triton":
        _triton_fused().accumulate_sq_multi(grads, prevs, sqs)
    else:
        for g, p, s in zip(grads, prevs, sqs):
            _eager_accumulate_sq(g, p, s)
