"""Triton kernels of gns_kernels (the GPU path of the fused ops; optional dependency).

- ``gns_kernels.triton.fused``: variance_norms, square_pack, accumulate_sq,
  variance_norms_multi, accumulate_sq_multi, square_pack_multi with the signatures of gns_kernels.ops, for
  CUDA tensors (compiled) and CPU tensors (Triton's interpreter). Importing it needs triton.
- ``register_cuda_kernels()``: make those kernels the CUDA implementations of the torch
  ops ``torch.ops.gns_kernels.*`` (defined in C++, csrc/ops.cpp) when no CUDA kernel is
  registered for them yet (i.e. the CUDA C++ kernels are not built).
- ``available()``: whether triton imports.

This package imports without triton: only ``fused`` (and the spectral helper's ``gram``)
need it, and ``register_cuda_kernels`` is then a no-op. See docs/triton.md.

Why ``torch.library.register_kernel(op, "cuda", fn)`` and not ``torch.library.triton_op``:
the ops are defined once, in C++ (one schema file; the CPU and CUDA C++ kernels register
against it), while ``triton_op`` would define the op itself from Python. A Python CUDA
kernel registered on the existing op keeps torch.compile working: the op has a fake kernel
(gns_kernels.ops), so compiled graphs keep it as one opaque node and call our launcher at
run time (no graph break; Inductor just does not look inside the Triton kernels, which are
single-pass bandwidth-bound kernels with nothing to fuse into).
"""
from __future__ import annotations

import torch

__all__ = ["available", "register_cuda_kernels", "registered", "OPS"]

# torch op name -> name of the launcher in gns_kernels.triton.fused (same signature).
OPS = ("variance_norms", "variance_norms_multi", "square_pack", "accumulate_sq", "accumulate_sq_multi",
       "square_pack_multi")

_LIB = None  # torch.library.Library holding our registrations (kept alive here)
_REGISTERED: list[str] = []


def registered(op_name: str) -> bool:
    """Whether this package registered its Triton launcher as the CUDA kernel of op
    ``op_name`` (``register_cuda_kernels``)."""
    return op_name in _REGISTERED


def available() -> bool:
    """True when the triton package imports (and has the runtime pieces fused.py uses)."""
    try:
        import triton  # noqa: F401
        from triton.runtime.interpreter import InterpretedFunction  # noqa: F401
    except ImportError:
        return False
    return True


def _op_defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"gns_kernels::{name}", "")
    except RuntimeError:
        return False
    return True


def _impl(name: str):
    """The CUDA implementation of op ``name``: the Triton launcher with the op's calling form."""

    def impl(*args, **kwargs):
        from . import fused

        fn = getattr(fused, name)
        if name == "square_pack":  # schema returns (): the op mutates out
            fn(*args, **kwargs)
            return None
        return fn(*args, **kwargs)

    impl.__name__ = f"gns_kernels_triton_{name}"
    return impl


def register_cuda_kernels(force: bool = False) -> list[str]:
    """Register the Triton launchers as CUDA kernels of torch.ops.gns_kernels.* ops.

    Only ops that exist (gns_kernels._C loaded) and have no CUDA kernel yet (the CUDA C++
    build is preferred) are registered. A no-op returning [] when triton is missing or
    when torch has no usable CUDA device (``force=True`` skips the device check, for tests
    on CPU-only machines: the dispatcher accepts CUDA kernels without a GPU). Idempotent.
    Returns the names of the ops registered by this package (this call or earlier ones).
    """
    global _LIB
    if not available():
        return []
    if not force and not torch.cuda.is_available():
        return []
    for name in OPS:
        if name in _REGISTERED or not _op_defined(name):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"gns_kernels::{name}", "CUDA"):
            continue  # the CUDA C++ kernels are built and registered: they win
        if _LIB is None:
            _LIB = torch.library.Library("gns_kernels", "IMPL")
        torch.library.register_kernel(f"gns_kernels::{name}", "cuda", _impl(name), lib=_LIB)
        _REGISTERED.append(name)
    return list(_REGISTERED)
