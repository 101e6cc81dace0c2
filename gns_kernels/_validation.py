"""Argument checks shared by the ops faces, their fake kernels, the Triton launchers and the
numeric classes (controller, sampler, optimizers).

Every check raises with a message that starts with the argument's name and says what was
expected: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong value, device,
size or layout. This module imports only torch and the standard library, so any layer of
gns_kernels may use it.
"""
from __future__ import annotations

import math
import sys
import warnings
from numbers import Integral, Real
from typing import Any, Optional, Sequence

import torch

Tensor = torch.Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --------------------------------------------------------------------------------------
# Warnings that point at the user's line
# --------------------------------------------------------------------------------------
# the packages between the user's line and the line that warns: the package itself, torch
# (an optimizer's step hooks, autograd's backward, DDP's comm hooks), the trainer stacks
# whose callbacks call ours (Lightning, transformers, accelerate) and the standard library's
# decorators and context managers
_STACK_PACKAGES = frozenset({"gns_kernels", "torch", "lightning", "pytorch_lightning",
                             "lightning_fabric", "transformers", "accelerate", "contextlib",
                             "functools"})


def warn_user(message: str, category: type = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line: the first frame
    whose module is not the package's, torch's or a trainer stack's (the loop's ``for``,
    ``opt.step()``, ``loss.backward()``, the constructor call, ``trainer.fit(...)``,
    ``trainer.train()``), however deep in the package, torch's hooks or a trainer's
    callbacks the warning is raised."""
    frame = sys._getframe(1)
    level = 2
    while frame is not None and \
            str(frame.f_globals.get("__name__", "")).split(".")[0] in _STACK_PACKAGES:
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


# --------------------------------------------------------------------------------------
# Python numbers
# --------------------------------------------------------------------------------------
def check_int(name: str, value: Any, minimum: Optional[int] = None) -> int:
    """``int(value)`` for an integer (Python or numpy, not bool) >= minimum.

    TypeError for a non-integer (a float such as 8.0 included: counts are never floats),
    ValueError below ``minimum``.
    """
    bound = "" if minimum is None else f" >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name}: expected an int{bound}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int{bound}, got {value}")
    return int(value)


def check_real(
    name: str,
    value: Any,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    *,
    lo_open: bool = False,
    hi_open: bool = True,
) -> float:
    """``float(value)`` for a finite real number (not bool) in the given range.

    Range: lo <= value (lo < value when lo_open) and value < hi (value <= hi when not
    hi_open); None leaves that side open. TypeError for a non-number, ValueError for NaN,
    inf or a value out of range.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}: expected a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    bad = not math.isfinite(v)
    if lo is not None:
        bad = bad or (v <= lo if lo_open else v < lo)
    if hi is not None:
        bad = bad or (v >= hi if hi_open else v > hi)
    if bad:
        if lo is None and hi is None:
            rng = "a finite number"
        elif hi is None:
            rng = f"a finite number {'>' if lo_open else '>='} {lo}"
        elif lo is None:
            rng = f"a finite number {'<' if hi_open else '<='} {hi}"
        else:
            rng = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}: expected {rng}, got {value!r}")
    return v


# --------------------------------------------------------------------------------------
# Tensors of the fused ops
# --------------------------------------------------------------------------------------
def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def check_tensor(name: str, t: Any, allowed: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    """A torch.Tensor of one of the ``allowed`` dtypes, contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}; got {_dtype_name(t.dtype)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous() first)")


def check_like(name: str, t: Tensor, ref_name: str, ref: Tensor, numel: Optional[int] = None) -> None:
    """``t`` on ``ref``'s device with ``numel`` (default: ref.numel()) elements."""
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} like {ref_name}, got {t.device}")
    want = ref.numel() if numel is None else numel
    if t.numel() != want:
        raise ValueError(f"{name}: expected {want} elements (like {ref_name}), got {t.numel()}")


FLOAT32_MAX = 3.4028234663852886e38


def check_scale(scale: Any) -> float:
    """The ``scale`` argument of the variance ops (B/(R-1)): a Python int or float (not
    bool; TypeError) that is positive and finite in float32, the kernels' precision
    (ValueError; the C++ and CUDA ops check the same rule, csrc/gns_math.h valid_scale).
    A negative scale would flip every variance's sign and the clamp at 0 would report no
    noise; ``nuclear_stats`` refuses ``scale <= 0`` the same way."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a Python float, got {type(scale).__name__}")
    scale = float(scale)
    if not 0.0 < scale <= FLOAT32_MAX:
        raise ValueError(f"scale: expected a positive finite number (B/(R-1), at most 3.4e38: "
                         f"the kernels compute in float32), got {scale!r}")
    return scale


def check_vn(mean_grad: Any, mean_sq: Any, shift: Any, suffix: str = "") -> None:
    """Arguments of variance_norms; suffix "" for the single op, "s[i]" for list entry i."""
    ng, nq, ns = (f"mean_grad{suffix}", f"mean_sq{suffix}", f"shift{suffix}")
    check_tensor(ng, mean_grad)
    check_tensor(nq, mean_sq)
    if mean_sq.dtype != mean_grad.dtype:
        raise TypeError(f"{nq}: expected dtype {mean_grad.dtype} like {ng}, got {mean_sq.dtype}")
    check_like(nq, mean_sq, ng, mean_grad)
    if shift is not None:
        check_tensor(ns, shift)
        check_like(ns, shift, ng, mean_grad)


def check_square_pack(grad: Any, out: Any, shift: Any, suffix: str = "") -> None:
    """Arguments of square_pack (out: float32 with 2 * grad.numel() elements); suffix as in
    check_vn."""
    ng, no, ns = (f"grad{suffix}", f"out{suffix}", f"shift{suffix}")
    check_tensor(ng, grad)
    check_tensor(no, out, allowed=(torch.float32,))
    check_like(no, out, f"{ng} (2x)", grad, numel=2 * grad.numel())
    if shift is not None:
        check_tensor(ns, shift)
        check_like(ns, shift, ng, grad)


def check_acc(grad: Any, prev: Any, sq: Any, suffix: str = "") -> None:
    """Arguments of accumulate_sq; suffix as in check_vn."""
    ng, npv, nsq = (f"grad{suffix}", f"prev{suffix}", f"sq{suffix}")
    check_tensor(ng, grad)
    check_tensor(npv, prev)
    if prev.dtype not in (grad.dtype, torch.float32):
        raise TypeError(f"{npv}: expected dtype {grad.dtype} (like {ng}) or float32, got {prev.dtype}")
    check_tensor(nsq, sq, allowed=(torch.float32,))
    check_like(npv, prev, ng, grad)
    check_like(nsq, sq, ng, grad)


def check_list(name: str, xs: Any) -> list:
    """A list or tuple (of tensors, checked later); returned as a list."""
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name}: expected a list of tensors, got {type(xs).__name__}")
    return list(xs)


def paired_lists_and_shifts(name_a: str, a: Any, name_b: str, b: Any, shifts: Any,
                            empty_shifts_ok: bool) -> tuple[list, list, list]:
    """(a, b, shifts) as lists of equal length, shifts one entry (tensor or None) per tensor
    of a. empty_shifts_ok: the op's schema form, where an empty list means "no shift"."""
    a = check_list(name_a, a)
    b = check_list(name_b, b)
    if len(b) != len(a):
        raise ValueError(f"{name_b}: expected {len(a)} tensors like {name_a}, got {len(b)}")
    if shifts is None or (empty_shifts_ok and len(shifts) == 0):
        return a, b, [None] * len(a)
    shifts = check_list("shifts", shifts)
    if len(shifts) != len(a):
        raise ValueError(f"shifts: expected {len(a)} tensors like {name_a}, got {len(shifts)}")
    return a, b, shifts


def check_vn_lists(mean_grads: Any, mean_sqs: Any, shifts: Any, *, empty_shifts_ok: bool = False) -> list:
    """The list arguments of variance_norms_multi (each list, each entry as check_vn, one
    device); returns one shift (tensor or None) per tensor. The one check of these lists
    on every path: ops.variance_norms_multi's face, its fake kernel, and the micro-batch
    measurement, which then calls ops.variance_norms_multi_unchecked.

    empty_shifts_ok: the op's schema form, where an empty list means "no shift at all".
    """
    mean_grads, mean_sqs, shifts = paired_lists_and_shifts(
        "mean_grads", mean_grads, "mean_sqs", mean_sqs, shifts, empty_shifts_ok)
    for i, (d, q) in enumerate(zip(mean_grads, mean_sqs)):
        check_vn(d, q, shifts[i], suffix=f"s[{i}]")
    common_device("mean_grads", mean_grads)
    return shifts


def common_device(name: str, tensors: list) -> torch.device:
    """The device of every tensor of the list (CPU for an empty list)."""
    if not tensors:
        return torch.device("cpu")
    dev = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != dev:
            raise ValueError(f"{name}[{i}]: expected device {dev} like {name}[0], got {t.device}")
    return dev


def check_same_device(named: Sequence[tuple[str, Optional[Tensor]]]) -> None:
    """Every tensor of (name, tensor) pairs on the first one's device (None entries skipped)."""
    ref_name, ref = None, None
    for name, t in named:
        if t is None:
            continue
        if ref is None:
            ref_name, ref = name, t
        elif t.device != ref.device:
            raise ValueError(f"{name}: expected device {ref.device} like {ref_name}, got {t.device}")


def _has_storage(t: Tensor) -> bool:
    """True for a tensor whose memory addresses mean something (not meta, not fake)."""
    if t.device.type == "meta" or t.numel() == 0:
        return False
    if isinstance(t, torch._subclasses.FakeTensor):
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def check_no_overlap(outputs: Sequence[tuple[str, Tensor]], inputs: Sequence[tuple[str, Tensor]]) -> None:
    """No output shares memory with another output or with any input (inputs may share).

    The kernels write outputs while other threads (or GPU blocks) read the inputs and the
    other outputs, so any overlap is a data race. Tensors are contiguous here, so each one
    is the byte range [data_ptr, data_ptr + numel * element_size). One sort and a sweep:
    O(k log k) for k tensors. Raises ValueError naming both arguments. Tensors without
    real storage (meta, fake, empty) are skipped, and so is the whole check while
    torch.compile traces (addresses exist only at run time; the compiled graph calls the
    torch ops, whose kernels check again).
    """
    if torch.compiler.is_compiling():
        return
    spans = []
    for is_out, named in ((True, outputs), (False, inputs)):
        for name, t in named:
            if t is None or not _has_storage(t):
                continue
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), len(spans), is_out, name))
    if len(spans) < 2:
        return
    spans.sort(key=lambda s: (s[0], s[1]))
    far_any = far_out = None  # the span reaching furthest so far (any / outputs only)
    for span in spans:
        start, end, _, is_out, _ = span
        other = far_any if is_out else far_out
        if other is not None and other[1] > start:
            # name the output first; of two outputs, the one listed later
            span_first = is_out and (not other[3] or span[2] > other[2])
            first, second = (span, other) if span_first else (other, span)
            raise ValueError(f"{first[4]}: must not share memory with {second[4]}")
        if far_any is None or end > far_any[1]:
            far_any = span
        if is_out and (far_out is None or end > far_out[1]):
            far_out = span


SIGNALS = ("raw", "debiased")  # signal= of gk.estimate, the hook states and the controller


def check_signal(signal, allow_none: bool = False):
    """signal=: 'raw' (the paper's signal) or 'debiased' (or None where ``allow_none``:
    "take it from elsewhere"); ValueError naming the argument otherwise."""
    if allow_none and signal is None:
        return None
    if not isinstance(signal, str) or signal not in SIGNALS:
        allowed = "None, 'raw' or 'debiased'" if allow_none else "'raw' (the paper's signal) or 'debiased'"
        raise ValueError(f"signal: expected {allowed}, got {signal!r}")
    return signal
