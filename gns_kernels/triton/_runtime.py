"""One Triton kernel source, two runtimes: compiled (CUDA) or interpreted (CPU tensors).

``triton.jit`` decides at decoration time, from TRITON_INTERPRET, whether a kernel is
compiled or interpreted, so a process that imported the kernels before setting the
variable (or that needs both, e.g. interpreter tests and ahead-of-time compilation in one
pytest run) cannot switch. ``DualKernel`` builds both objects from the raw Python function
(``triton.runtime.jit.JITFunction`` and ``triton.runtime.interpreter.InterpretedFunction``)
and picks one at each launch from the device of the tensors: CPU tensors run in Triton's
interpreter (numpy, for tests), CUDA tensors run the compiled kernel.

Restriction this imposes on kernel code (checked by the interpreter tests): call only
Triton *builtins* (tl.load, tl.store, tl.where, tl.full, tl.minimum, tl.sqrt_rn, ...) and
``tl.reduce(x, 0, SUM_COMBINE)`` with ``SUM_COMBINE`` below, never the @jit functions of
Triton's standard library (tl.sum, tl.zeros, tl.cdiv): those are JITFunctions when triton
was imported without TRITON_INTERPRET=1 and cannot be called by the interpreter. The
interpreter recognises ``SUM_COMBINE`` by identity and reduces with numpy.

If triton itself was imported with TRITON_INTERPRET=1, its standard library is interpreted
and the compiled variant cannot be built in that process (codegen refuses interpreted
callees): ahead-of-time compilation then has to run in a fresh process
(gns_kernels.triton._aot does so; see tests/triton/test_aot.py).
"""
from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# The standard library's sum combine function (a JITFunction, or an InterpretedFunction
# when triton was imported under TRITON_INTERPRET=1); identity matters, see above.
SUM_COMBINE = tl.standard._sum_combine


def interpreter_mode_at_import() -> bool:
    """True when triton's standard library was built for the interpreter (env var set early)."""
    return not isinstance(SUM_COMBINE, JITFunction)


class DualKernel:
    """A Triton kernel launchable on CUDA tensors (compiled) and CPU tensors (interpreted).

    ``jit`` is the JITFunction (also what triton.compile(ASTSource(jit, ...)) takes for
    ahead-of-time compilation); ``interp`` the InterpretedFunction.
    """

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.jit = JITFunction(fn)
        self._interp = None

    @property
    def interp(self) -> InterpretedFunction:
        if self._interp is None:
            self._interp = InterpretedFunction(self.fn)
        return self._interp

    def launch(self, device: torch.device, grid: tuple, *args, num_warps: int = 4, **constexprs):
        """Run on ``grid`` programs; CPU -> interpreter, CUDA -> compiled (``num_warps`` warps)."""
        if device.type == "cpu":
            self.interp[grid](*args, **constexprs)
        elif device.type == "cuda":
            self.jit[grid](*args, num_warps=num_warps, **constexprs)
        else:
            raise ValueError(f"tensors: expected device cpu (interpreter) or cuda, got {device}")


def dual_kernel(fn) -> DualKernel:
    """Decorator form of DualKernel (use instead of @triton.jit)."""
    return DualKernel(fn)
