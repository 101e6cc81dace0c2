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


@pytest.mark.skipif(not ops.cpp_available(), reason="the torch ops need the C++ extension gns_kernels._C")
def test_registered_impls_match_the_schemas(gen):
    """The functions register_cuda_kernels installs, called by the dispatcher exactly as it
    would call them for CUDA tensors: here registered for CPU under copies of the real
    schemas in a scratch namespace, so they run through Triton's interpreter."""
    pytest.importorskip("triton")
    from gns_kernels.triton import OPS, _impl, fused

    lib = torch.library.Library("gns_kernels_triton_schema_check", "DEF")
    for name in OPS:
        schema = str(getattr(torch.ops.gns_kernels, name).default._schema)
        lib.define(schema.split("::", 1)[1])
        lib.impl(name, _impl(name), "CPU")
    scratch = torch.ops.gns_kernels_triton_schema_check
    n = 1500
    d = torch.randn(n, generator=gen)
    q = d * d + torch.rand(n, generator=gen)
    s = torch.randn(n, generator=gen)
    assert torch.equal(scratch.variance_norms(d, q, 2.0, s), fused.variance_norms(d, q, 2.0, s))
    assert torch.equal(scratch.variance_norms(d, q, 2.0), fused.variance_norms(d, q, 2.0))
    assert torch.equal(scratch.variance_norms_multi([d, q], [q, q], 2.0, [s, None]),
                       fused.variance_norms_multi([d, q], [q, q], 2.0, [s, None]))
    out1, out2 = torch.empty(2 * n), torch.empty(2 * n)
    assert scratch.square_pack(d, out1, s) is None
    fused.square_pack(d, out2, s)
    assert torch.equal(out1, out2)
    p1, sq1, p2, sq2 = s.clone(), q.clone(), s.clone(), q.clone()
    scratch.accumulate_sq(d, p1, sq1)
    fused.accumulate_sq(d, p2, sq2)
    assert torch.equal(p1, p2) and torch.equal(sq1, sq2)
    scratch.accumulate_sq_multi([d], [p1], [sq1])
    fused.accumulate_sq_multi([d], [p2], [sq2])
    assert torch.equal(p1, p2) and torch.equal(sq1, sq2)
    m1 = [torch.full((2 * n,), float("nan")), torch.full((14,), float("nan"))]
    m2 = [torch.full((2 * n,), float("nan")), torch.full((14,), float("nan"))]
    assert scratch.square_pack_multi([d, q[:7]], m1, [s, None]) is None
    fused.square_pack_multi([d, q[:7]], m2, [s, None])
    assert torch.equal(m1[0], m2[0]) and torch.equal(m1[1], m2[1])
    assert scratch.square_pack_multi([d], m1[:1], []) is None  # [] = no shift at all
    fused.square_pack_multi([d], m2[:1])
    assert torch.equal(m1[0], m2[0])
