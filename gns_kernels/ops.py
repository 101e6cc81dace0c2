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
- ``square_pack_multi(grads, outs, shifts=None) -> None``: square_pack over lists, one call
  (the DDP hook packs a whole bucket with it).

Inputs are flat-viewed (only numel matters), contiguous, float32 / bfloat16 / float16;
results accumulate in float32 or wider. No output (out, prev, sq) may share memory with
another argument of the call, across whole lists for the _multi ops (ValueError naming
both, before anything is written); inputs may share memory.

Validation happens once per call: the faces below check the arguments in Python for the
"eager" backend and for CPU tensors; on CUDA (and for backend="triton") they only look at
the first tensor to pick the backend, and the kernel that runs validates (the C++ CUDA
kernels in C++, the Triton launchers in Python, once per list signature), with the same
argument names in the messages. ``variance_norms_multi_unchecked`` (not API) is
variance_norms_multi for a caller that checked its lists once itself
(``_validation.check_vn_lists``, the micro-batch measurement): the same dispatch and
kernels, without the face's or the Triton launcher's checks.

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

import importlib
import os
from typing import Optional, Sequence

import torch

from . import _validation as _v

Tensor = torch.Tensor

__all__ = [  # BACKENDS and cpp_available() are module attributes, not API
    "variance_norms",
    "square_pack",
    "accumulate_sq",
    "variance_norms_multi",
    "accumulate_sq_multi",
    "square_pack_multi",
]

BACKENDS = ("auto", "cpp", "triton", "eager")
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
        # importing the compiled extension registers torch.ops.gns_kernels.*
        _C = importlib.import_module(f"{__package__}._C")
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
    _v.warn_user(
        f"gns_kernels: no C++ extension ({_C_ERROR}), so the ops use the eager torch formulas "
        "(same results, slower, input-sized temporaries); for the fused kernels reinstall "
        f"gns-kernels where a C++ compiler and ninja are found, without {_NO_EXT_ENV} "
        "(README: Set up)")


# Fake (meta) kernels: output shapes/dtypes for torch.compile, FakeTensor and opcheck.
# They validate their arguments like the real kernels: the dispatcher also routes a direct
# call with tensors on two devices (e.g. CPU and meta) here, which must raise, not return
# uninitialised memory or silently do nothing.
def _check_acc_lists(grads, prevs, sqs) -> None:
    """Validate the list arguments of accumulate_sq_multi (sizes, dtypes, one device)."""
    grads = _v.check_list("grads", grads)
    prevs = _v.check_list("prevs", prevs)
    sqs = _v.check_list("sqs", sqs)
    for name, xs in (("prevs", prevs), ("sqs", sqs)):
        if len(xs) != len(grads):
            raise ValueError(f"{name}: expected {len(grads)} tensors like grads, got {len(xs)}")
    for i, (g, p, s) in enumerate(zip(grads, prevs, sqs)):
        _v.check_acc(g, p, s, suffix=f"s[{i}]")
    _v.common_device("grads", grads)


def _check_pack_lists(grads, outs, shifts, *, empty_shifts_ok: bool) -> list:
    """Validate the list arguments of square_pack_multi; returns one shift per tensor."""
    grads, outs, shifts = _v.paired_lists_and_shifts("grads", grads, "outs", outs, shifts, empty_shifts_ok)
    for i, (g, o) in enumerate(zip(grads, outs)):
        _v.check_square_pack(g, o, shifts[i], suffix=f"s[{i}]")
    _v.common_device("grads", grads)
    return shifts


def _pack_overlap(grads: list, outs: list, shifts: list) -> None:
    """No outs[i] shares memory with any other argument of the whole call."""
    _v.check_no_overlap(
        [(f"outs[{i}]", o) for i, o in enumerate(outs)],
        [(f"grads[{i}]", g) for i, g in enumerate(grads)]
        + [(f"shifts[{i}]", s) for i, s in enumerate(shifts) if s is not None],
    )


def _acc_overlap(grads: list, prevs: list, sqs: list) -> None:
    """No prevs[i] / sqs[i] shares memory with any other argument of the whole call."""
    _v.check_no_overlap(
        [(f"prevs[{i}]", p) for i, p in enumerate(prevs)] + [(f"sqs[{i}]", s) for i, s in enumerate(sqs)],
        [(f"grads[{i}]", g) for i, g in enumerate(grads)],
    )


if _C is not None:

    @torch.library.register_fake("gns_kernels::variance_norms")
    def _variance_norms_fake(mean_grad, mean_sq, scale, shift=None):
        _v.check_vn(mean_grad, mean_sq, shift)
        return mean_grad.new_empty(4, dtype=torch.float32)

    @torch.library.register_fake("gns_kernels::variance_norms_multi")
    def _variance_norms_multi_fake(mean_grads, mean_sqs, scale, shifts):
        torch._check(len(mean_grads) > 0, lambda: "mean_grads: expected a non-empty list")
        _v.check_vn_lists(mean_grads, mean_sqs, shifts, empty_shifts_ok=True)
        return mean_grads[0].new_empty(4, dtype=torch.float32)

    @torch.library.register_fake("gns_kernels::square_pack")
    def _square_pack_fake(grad, out, shift=None):
        _v.check_square_pack(grad, out, shift)
        return None

    @torch.library.register_fake("gns_kernels::square_pack_multi")
    def _square_pack_multi_fake(grads, outs, shifts):
        _check_pack_lists(grads, outs, shifts, empty_shifts_ok=True)
        return None

    @torch.library.register_fake("gns_kernels::accumulate_sq")
    def _accumulate_sq_fake(grad, prev, sq):
        _v.check_acc(grad, prev, sq)
        return None

    @torch.library.register_fake("gns_kernels::accumulate_sq_multi")
    def _accumulate_sq_multi_fake(grads, prevs, sqs):
        _check_acc_lists(grads, prevs, sqs)
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


def _triton_registered(op_name: str) -> bool:
    """True when gns_kernels.triton registered its launcher as the op's CUDA kernel."""
    if not _TRITON_REGISTERED:
        return False
    from .triton import registered

    return registered(op_name)


def _device_of(t) -> Optional[torch.device]:
    """t.device for a tensor, else None (the full checks then name the argument)."""
    return t.device if isinstance(t, torch.Tensor) else None


def _kernel_validates(b: str, device: Optional[torch.device]) -> bool:
    """True when the kernel backend ``b`` runs on ``device`` validates its arguments itself
    (Triton launchers; C++ CUDA kernels), so the face does not check them a second time."""
    return device is not None and (b == "triton" or (b == "cpp" and device.type == "cuda"))


def _plain(t) -> bool:
    """A plain tensor with real storage (not a subclass such as FakeTensor, not wrapped by a
    functorch transform): the dispatcher has nothing to add for it."""
    return type(t) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(t)


def _resolve(backend: Optional[str], device: torch.device, op_name: str, probe=None) -> str:
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
            # the CUDA kernel is our Triton launcher: call it directly (same function, no
            # dispatcher) for plain tensors, except while torch.compile traces, which must
            # see the torch op (probe: the call's first tensor)
            if (probe is not None and not torch.compiler.is_compiling() and _plain(probe)
                    and _triton_registered(op_name)):
                return "triton"
            return "cpp"
        try:
            _triton_fused()
        except RuntimeError:
            return "eager"
        return "triton"
    return "eager"


# --------------------------------------------------------------------------------------
# Eager composite formulas (any device; allocate temporaries)
# --------------------------------------------------------------------------------------
_SUM_CHUNK = 4096


def fixed_order_sum(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """sum(x) in ``dtype`` (0-d tensor), added in an order independent of the thread count.

    torch's full reduction splits its work by the number of threads, so its last bits
    change with torch.set_num_threads. Here rows of _SUM_CHUNK elements are summed with one
    row per output (each output is reduced by one thread, in a fixed order), repeatedly,
    until at most _SUM_CHUNK partials are left, which one thread sums.
    """
    x = x.reshape(-1).to(dtype)
    while x.numel() > _SUM_CHUNK:
        k = x.numel() // _SUM_CHUNK
        head = x[: k * _SUM_CHUNK].view(k, _SUM_CHUNK).sum(dim=1)
        tail = x[k * _SUM_CHUNK:]
        x = torch.cat([head, tail.sum().reshape(1)]) if tail.numel() else head
    return x.sum()


def eager_variance_sums(s2: Tensor, g: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """[sum sqrt(s2), sum |g|, sum s2, sum g^2] as a Tensor[4] of ``dtype``.

    The l1 / l2 sums of the variance ops. s2: per-coordinate variance of one example's
    gradient (any shape; negative entries, from rounding, count as 0; NaN stays NaN);
    g: the mean gradient (same numel). This is the one eager form of these sums, shared by
    the ops' "eager" backend and gk.estimate (the fused kernels compute the same sums in one
    pass; gns_kernels.reference is the independent float64 oracle). Summed in ``dtype``
    with fixed_order_sum (the same bits for any number of CPU threads).
    """
    s2 = s2.reshape(-1)
    g = g.reshape(-1)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)  # NaN stays NaN
    return torch.stack(
        [fixed_order_sum(s2.sqrt(), dtype), fixed_order_sum(g.abs(), dtype),
         fixed_order_sum(s2, dtype), fixed_order_sum(g * g, dtype)]
    )


def _eager_vn_terms(mean_grad: Tensor, mean_sq: Tensor, scale: float, shift: Optional[Tensor]) -> Tensor:
    d = mean_grad.reshape(-1).float()
    q = mean_sq.reshape(-1).float()
    g = d if shift is None else d + shift.reshape(-1).float()
    return eager_variance_sums(scale * (q - d * d), g)


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
    scale = _v.check_scale(scale)
    dev = _device_of(mean_grad)
    b = None if dev is None else _resolve(backend, dev, "variance_norms", mean_grad)
    if not _kernel_validates(b, dev):
        _v.check_vn(mean_grad, mean_sq, shift)
        b = b or _resolve(backend, mean_grad.device, "variance_norms")
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
    dev = _device_of(grad)
    b = None if dev is None else _resolve(backend, dev, "square_pack", grad)
    if not _kernel_validates(b, dev):
        _v.check_square_pack(grad, out, shift)
        b = b or _resolve(backend, grad.device, "square_pack")
    # memory overlap: the C++ kernels and the Triton launchers check it themselves
    if b == "cpp":
        torch.ops.gns_kernels.square_pack(grad, out, shift)
        return out
    if b == "triton":
        _triton_fused().square_pack(grad, out, shift)
        return out
    _v.check_no_overlap([("out", out)], [("grad", grad), ("shift", shift)])
    return _eager_square_pack(grad, out, shift)


def accumulate_sq(grad: Tensor, prev: Tensor, sq: Tensor, *, backend: Optional[str] = None) -> None:
    """In place: d = grad - prev; sq += d^2; prev = grad (one micro-batch step).

    grad: float32/bfloat16/float16; prev: grad's dtype or float32; sq: float32;
    all contiguous with the same numel; d and d^2 computed in float32.
    """
    dev = _device_of(grad)
    b = None if dev is None else _resolve(backend, dev, "accumulate_sq", grad)
    if not _kernel_validates(b, dev):
        _v.check_acc(grad, prev, sq)
        b = b or _resolve(backend, grad.device, "accumulate_sq")
    # memory overlap: the C++ kernels and the Triton launchers check it themselves
    if b == "cpp":
        torch.ops.gns_kernels.accumulate_sq(grad, prev, sq)
    elif b == "triton":
        _triton_fused().accumulate_sq(grad, prev, sq)
    else:
        _v.check_no_overlap([("prev", prev), ("sq", sq)], [("grad", grad)])
        _eager_accumulate_sq(grad, prev, sq)


def _list_device(name: str, xs) -> Optional[torch.device]:
    """Device of the first tensor of a non-empty list argument (None: let the checks speak)."""
    xs = _v.check_list(name, xs)
    return _device_of(xs[0]) if xs else None


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
    scale = _v.check_scale(scale)
    dev = _list_device("mean_grads", mean_grads)
    b = None if dev is None else _resolve(backend, dev, "variance_norms_multi", mean_grads[0])
    if b == "triton":  # the launcher validates (once per list signature)
        return _triton_fused().variance_norms_multi(mean_grads, mean_sqs, scale, shifts)
    if not _kernel_validates(b, dev):
        shifts_list = _v.check_vn_lists(mean_grads, mean_sqs, shifts)
        shifts = None if shifts is None else shifts_list
        dev = _v.common_device("mean_grads", list(mean_grads))
        b = b or _resolve(backend, dev, "variance_norms_multi")
    mean_grads, mean_sqs = list(mean_grads), list(mean_sqs)
    if not mean_grads:  # nothing to dispatch on: the sums are zero
        return torch.zeros(4, dtype=torch.float32, device=dev)
    return _vn_multi_kernel(b, dev, mean_grads, mean_sqs, scale, shifts, _triton_fused().variance_norms_multi
                            if b == "triton" else None)


def variance_norms_multi_unchecked(
    mean_grads: list,
    mean_sqs: list,
    scale: float,
    shifts: Optional[list] = None,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """``variance_norms_multi`` without the argument checks, for a caller that checked the
    lists and the scale once itself (``gns_kernels._validation.check_vn_lists`` and
    ``check_scale``): the micro-batch measurement (gns_kernels.distributed._micro_measure),
    whose path validates its tensor lists once. Not part of the API (not in ``__all__``):
    arguments reach the Triton launcher (its device-type check aside) and the eager
    formulas unchecked; the C++ kernels check in C++ whoever calls them. Same backends,
    dispatch and results as ``variance_norms_multi``.
    """
    if not mean_grads:  # nothing to dispatch on: the sums are zero
        return torch.zeros(4, dtype=torch.float32)
    dev = mean_grads[0].device
    b = _resolve(backend, dev, "variance_norms_multi", mean_grads[0])
    return _vn_multi_kernel(b, dev, mean_grads, mean_sqs, scale, shifts,
                            _triton_fused().variance_norms_multi_unchecked if b == "triton" else None)


def _vn_multi_kernel(b: str, dev: torch.device, mean_grads: list, mean_sqs: list, scale: float,
                     shifts: Optional[list], triton_launcher) -> Tensor:
    """The kernel of backend ``b`` on non-empty lists whose checks are done (or left to
    the kernel); triton_launcher: the Triton entry (checking or not) when b is "triton"."""
    if b == "cpp":
        # one entry per tensor (None: no shift), so every registered kernel (C++ CPU/CUDA,
        # Triton via register_cuda_kernels) sees the same list form; the C++ kernels also
        # accept an empty list for "no shift at all"
        return torch.ops.gns_kernels.variance_norms_multi(
            mean_grads, mean_sqs, scale, [None] * len(mean_grads) if shifts is None else list(shifts)
        )
    if b == "triton":
        return triton_launcher(mean_grads, mean_sqs, scale, shifts)
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
    dev = _list_device("grads", grads)
    b = None if dev is None else _resolve(backend, dev, "accumulate_sq_multi", grads[0])
    if b == "triton":  # the launcher validates (once per list signature)
        return _triton_fused().accumulate_sq_multi(grads, prevs, sqs)
    if not _kernel_validates(b, dev):
        _check_acc_lists(grads, prevs, sqs)
        dev = _v.common_device("grads", list(grads))
        b = b or _resolve(backend, dev, "accumulate_sq_multi")
    grads, prevs, sqs = list(grads), list(prevs), list(sqs)
    if not grads:
        return
    # memory overlap across the lists: the C++ kernels and the Triton launchers check it
    if b == "cpp":
        torch.ops.gns_kernels.accumulate_sq_multi(grads, prevs, sqs)
    else:
        _acc_overlap(grads, prevs, sqs)
        for g, p, s in zip(grads, prevs, sqs):
            _eager_accumulate_sq(g, p, s)


def square_pack_multi(
    grads: Sequence[Tensor],
    outs: Sequence[Tensor],
    shifts: Optional[Sequence[Optional[Tensor]]] = None,
    *,
    backend: Optional[str] = None,
) -> None:
    """square_pack over lists in one call: outs[i][:n_i] = x_i, outs[i][n_i:] = x_i^2.

    grads[i], shifts[i]: n_i elements, contiguous, float32/bfloat16/float16 (any mix);
    outs[i]: float32, contiguous, 2 n_i elements; x_i = grads[i] - shifts[i] computed in
    float32 (grads[i] when shifts is None or shifts[i] is None). No output may share memory
    with any other argument of the call (ValueError naming both, before anything is written).
    """
    dev = _list_device("grads", grads)
    b = None if dev is None else _resolve(backend, dev, "square_pack_multi", grads[0])
    if b == "triton":  # the launcher validates (once per list signature)
        return _triton_fused().square_pack_multi(grads, outs, shifts)
    if not _kernel_validates(b, dev):
        shifts_list = _check_pack_lists(grads, outs, shifts, empty_shifts_ok=False)
        shifts = None if shifts is None else shifts_list
        dev = _v.common_device("grads", list(grads))
        b = b or _resolve(backend, dev, "square_pack_multi")
    grads, outs = list(grads), list(outs)
    if not grads:
        return
    sh = [None] * len(grads) if shifts is None else list(shifts)
    if b == "cpp":
        torch.ops.gns_kernels.square_pack_multi(grads, outs, sh)
    else:
        _pack_overlap(grads, outs, sh)
        for g, o, s in zip(grads, outs, sh):
            _eager_square_pack(g, o, s)
