"""register_cuda_kernels and the package without triton (subprocesses keep this process clean)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gns_kernels import ops
from gns_kernels.triton import register_cuda_kernels

pytestmark = pytest.mark.triton


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=dict(os.environ), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA no-op; a CUDA device is present")
def test_noop_without_cuda():
    assert register_cuda_kernels() == []


@pytest.mark.skipif(not ops.cpp_available(), reason="the torch ops need the C++ extension gns_kernels._C")
def test_registers_cuda_impls_where_none_exist():
    """force=True registers on a CPU-only torch too (the dispatcher accepts CUDA kernels);
    an op that already has a CUDA kernel (the C++ CUDA build) keeps it."""
    pytest.importorskip("triton")
    out = _run(
        """
        import torch
        import gns_kernels.ops  # loads gns_kernels._C (the schemas)
        from gns_kernels.triton import register_cuda_kernels, OPS
        has = lambda n: torch._C._dispatch_has_kernel_for_dispatch_key(f"gns_kernels::{n}", "CUDA")
        pre = [n for n in OPS if has(n)]            # C++ CUDA kernels, if this build has them
        lib = None
        if "square_pack" not in pre:                 # simulate a C++ CUDA kernel for one op
            lib = torch.library.Library("gns_kernels", "IMPL")
            lib.impl("square_pack", lambda g, o, s=None: None, "CUDA")
            pre.append("square_pack")
        got = register_cuda_kernels(force=True)
        assert register_cuda_kernels(force=True) == got   # idempotent
        assert sorted(got) == sorted(n for n in OPS if n not in pre), (got, pre)
        assert all(has(n) for n in OPS)
        print("OK", len(got))
        """
    )
    assert out.startswith("OK")


def test_package_without_triton():
    """With triton unimportable: gns_kernels imports, CPU ops work, registration is a
    no-op, and asking for the Triton backend gives a clear error."""
    out = _run(
        """
        import sys
        sys.modules["triton"] = None   # makes `import triton` raise ImportError
        import torch, gns_kernels as gk
        from gns_kernels.triton import available, register_cuda_kernels
        assert not available()
        assert register_cuda_kernels() == [] and register_cuda_kernels(force=True) == []
        d = torch.randn(100); q = d * d + 1
        r = gk.variance_norms(d, q, 2.0)
        assert r.shape == (4,) and torch.isfinite(r).all()
        try:
            gk.variance_norms(d, q, 2.0, backend="triton")
        except RuntimeError as e:
            assert "triton" in str(e)
        else:
            raise AssertionError("backend='triton' without triton did not raise")
        print("OK")
        """
    )
    assert out == "OK"
