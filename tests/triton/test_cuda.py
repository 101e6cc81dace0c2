"""The Triton kernels compiled and run on a CUDA device (skipped where none is present).

Same checks as the interpreter tests, plus: the torch ops path after
register_cuda_kernels (when the C++ CUDA kernels are not built), torch.compile without
graph breaks, bit-identical reruns, and the 2^26-element accuracy case.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gns_kernels import ops, reference as ref  # noqa: E402
from gns_kernels.triton import fused, register_cuda_kernels  # noqa: E402

pytestmark = [
    pytest.mark.triton,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(n, dtype, shift, gen):
    d = torch.randn(n, generator=gen, dtype=torch.float64)
    q = d * d + torch.rand(n, generator=gen, dtype=torch.float64) - 0.1
    s = torch.randn(n, generator=gen, dtype=torch.float64) if shift else None
    cu = lambda x: None if x is None else x.to(dtype).cuda()  # noqa: E731
    return cu(d), cu(q), cu(s)


def _close(got, want, rtol=1e-5):
    want = want.double().cpu()
    atol = 1e-6 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double().cpu(), want, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("n", [1, 7, 4096, 65537, 2**20 + 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [False, True])
def test_ops_on_gpu(n, dtype, shift, gen):
    d, q, s = _inputs(n, dtype, shift, gen)
    got = fused.variance_norms(d, q, 2.5, s)
    _close(got, ref.variance_norms(d, q, 2.5, s))
    assert torch.equal(got, fused.variance_norms(d, q, 2.5, s))
    out = torch.empty(2 * n, device="cuda")
    fused.square_pack(d, out, s)
    torch.testing.assert_close(out.double().cpu(), ref.square_pack(d, s).cpu(), rtol=1e-6, atol=1e-30)
    prev = q.clone()
    sq = torch.rand(n, generator=gen).cuda()
    want_sq, _ = ref.accumulate_sq(d, prev, sq)
    fused.accumulate_sq(d, prev, sq)
    torch.testing.assert_close(sq.double().cpu(), want_sq.cpu(), rtol=1e-6, atol=1e-30)
    assert torch.equal(prev, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_square_pack_multi_on_gpu(dtype, gen):
    sizes = (1, 7, 4096, 65537, 1031)
    grads = [torch.randn(n, generator=gen).to(dtype).cuda() for n in sizes]
    shifts = [None if i % 2 else torch.randn(n, generator=gen).cuda() for i, n in enumerate(sizes)]
    pack = torch.full((2 * sum(sizes) + 1,), float("nan"), device="cuda")
    outs, off = [], 1  # an odd offset: the outs are not 16-byte aligned
    for n in sizes:
        outs.append(pack[off:off + 2 * n])
        off += 2 * n
    fused.square_pack_multi(grads, outs, shifts)
    for g, s, o in zip(grads, shifts, outs):
        torch.testing.assert_close(o.double().cpu(), ref.square_pack(g, s).cpu(), rtol=1e-6, atol=1e-30)


def test_nan_propagates_on_gpu():
    d = torch.zeros(4096 + 7, device="cuda")
    q = torch.full_like(d, -1.0)
    q[5] = float("nan")
    got = fused.variance_norms(d, q, 1.0)
    assert torch.isnan(got[0]) and torch.isnan(got[2]) and got[1] == 0 and got[3] == 0


def test_multi_on_gpu(gen):
    sizes = [0, 1, 7, 1024, 1025, 2**20 + 3, 0, 3000]
    ds, qs, ss = [], [], []
    for i, n in enumerate(sizes):
        d, q, s = _inputs(n, DTYPES[i % 3], i % 2 == 0, gen)
        ds.append(d)
        qs.append(q)
        ss.append(s)
    want = sum(ref.variance_norms(d, q, 1.5, s).cpu() for d, q, s in zip(ds, qs, ss))
    got = fused.variance_norms_multi(ds, qs, 1.5, ss)
    _close(got, want)
    assert torch.equal(got, fused.variance_norms_multi(ds, qs, 1.5, ss))
    prevs = [torch.randn(d.numel(), generator=gen).cuda() for d in ds]
    sqs = [torch.rand(d.numel(), generator=gen).cuda() for d in ds]
    want_sq = [ref.accumulate_sq(g, p, s)[0].cpu() for g, p, s in zip(ds, prevs, sqs)]
    fused.accumulate_sq_multi(ds, prevs, sqs)
    for g, p, s, w in zip(ds, prevs, sqs, want_sq):
        torch.testing.assert_close(s.double().cpu(), w, rtol=1e-6, atol=1e-30)
        assert torch.equal(p, g.float())


def test_accuracy_2_pow_26(gen):
    n = 2**26
    d = torch.randn(n, generator=gen).cuda()
    q = d * d + torch.rand(n, generator=gen).cuda()
    _close(fused.variance_norms(d, q, 1.0), ref.variance_norms(d, q, 1.0), rtol=1e-6)


@pytest.mark.skipif(not ops.cpp_available(), reason="the torch ops need the C++ extension gns_kernels._C")
def test_torch_ops_and_compile(gen):
    register_cuda_kernels()
    d, q, s = _inputs(5000, torch.float32, True, gen)
    want = fused.variance_norms(d, q, 2.0, s)
    # the Triton kernel, or the C++ CUDA kernel where that build is present
    _close(torch.ops.gns_kernels.variance_norms(d, q, 2.0, s), want.double())

    def via_torch_ops(d, q, s):
        return torch.ops.gns_kernels.variance_norms(d, q, 2.0, s) * 1.0

    def via_gk(d, q, s):  # the user path: gns_kernels.ops dispatch, then the torch op
        return ops.variance_norms(d, q, 2.0, s) * 1.0

    for f in (via_torch_ops, via_gk):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True)  # fullgraph: a graph break raises
        _close(compiled(d, q, s), want.double())


@pytest.mark.skipif(not ops.cpp_available(), reason="the torch ops need the C++ extension gns_kernels._C")
def test_opcheck_cuda(gen):
    """torch.library.opcheck (schema, fake kernel, autograd registration) on CUDA tensors."""
    register_cuda_kernels()
    d, q, s = _inputs(3000, torch.float32, True, gen)
    out = torch.empty(6000, device="cuda")
    prev, sq = q.clone(), torch.zeros(3000, device="cuda")
    for op, args in [
        (torch.ops.gns_kernels.variance_norms.default, (d, q, 2.0, s)),
        (torch.ops.gns_kernels.variance_norms_multi.default, ([d, q], [q, d], 2.0, [s, None])),
        (torch.ops.gns_kernels.square_pack.default, (d, out, s)),
        (torch.ops.gns_kernels.accumulate_sq.default, (d, prev, sq)),
        (torch.ops.gns_kernels.accumulate_sq_multi.default, ([d], [prev], [sq])),
    ]:
        torch.library.opcheck(op, args)
