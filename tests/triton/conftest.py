"""Shared set-up of the Triton tests (marker ``triton``).

TRITON_INTERPRET=1 is set here, at import time and before triton is imported by these
tests, for kernels written with ``@triton.jit``: triton decides at decoration time whether
a kernel is compiled or interpreted, and its standard library (tl.sum, tl.zeros, ...) is
built the same way when triton is first imported. Setting it here is therefore only
effective when nothing in this pytest process imported triton earlier. What that means
for each kind of test (checked, triton 3.9):

- The fused-op kernels (gns_kernels.triton.fused) do not depend on the variable at all:
  they are ``DualKernel``s (gns_kernels/triton/_runtime.py) that build both a compiled and
  an interpreted kernel from the same source and choose per launch from the tensors'
  device, and they call only Triton builtins, so they run on CPU tensors whether triton
  was imported with or without the variable (test_fused_interp.py checks the "without"
  case in a fresh process).
- Ahead-of-time compilation cannot run in a process whose triton standard library was
  built for the interpreter (codegen rejects interpreted callees such as tl.sum), so the
  AOT tests compile in a fresh subprocess with the variable removed
  (gns_kernels.triton._aot.run_isolated); they pass whatever this process did before.
- setdefault keeps an explicit TRITON_INTERPRET=0 from the caller.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def gen(request):
    """A torch.Generator with a fresh seed every run (printed in the test's report on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    return g
