"""Shared set-up of the Triton tests (marker ``triton``).

TRITON_INTERPRET=1 is set here only on a machine WITHOUT a CUDA device, at import time and
before these tests import triton. triton decides at decoration time whether a ``@triton.jit``
kernel is compiled or interpreted, and builds its standard library (tl.sum, tl.zeros, ...)
the same way when it is first imported; a process that imported triton under the variable
cannot compile kernels, so on a GPU machine the variable stays unset and test_cuda.py (alone
or with the others) runs the kernels compiled. What the variable means for each kind of
test (checked, triton 3.9):

- The fused-op and Gram kernels (gns_kernels.triton.fused, .gram) do not depend on it: they
  are ``DualKernel``s (gns_kernels/triton/_runtime.py) that build both a compiled and an
  interpreted kernel from the same source and choose per launch from the tensors' device,
  and they call only Triton builtins, so they run on CPU tensors whether triton was
  imported with or without the variable (test_fused_interp.py checks the "without" case
  in a fresh process).
- Ahead-of-time compilation cannot run in a process whose triton standard library was
  built for the interpreter (codegen rejects interpreted callees such as tl.sum), so the
  AOT tests compile in a fresh subprocess with the variable removed
  (tools/fused_aot.py's run_isolated); they pass whatever this process did before.
- setdefault keeps an explicit TRITON_INTERPRET from the caller.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

