"""The C++ CUDA kernels (csrc/cuda) on a GPU against the float64 oracle gns_kernels.reference.

Marker ``cuda``: skipped where no CUDA device is present, or where gns_kernels._C was built
without csrc/cuda (CPU torch, no nvcc), checked from the dispatcher: the CUDA kernel of
each op must be the one registered by csrc/cuda/binding.cpp (not the Triton fallback).
Fresh random data every run (seed printed; rerun with GNS_TEST_SEED=<seed>).
"""
from __future__ import annotations

import os

import pytest
import torch

from gns_kernels import ops
from gns_kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 7, 4096, 65536, 65537, (1 << 20) + 3]
OPS = ["variance_norms", "variance_norms_multi", "square_pack", "accumulate_sq", "accumulate_sq_multi"]


def _cpp_cuda_built() -> bool:
    if not ops.cpp_available():
        return False
    return all(
        "cuda/binding.cpp" in torch._C._dispatch_dump(f"gns_kernels::{op}") for op in OPS
    )


pytestmark = [
    pytest.mark.cuda,
    # Reason: these run the kernels; without a GPU only the nvcc build checks apply.
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # Reason: a CPU-only build (CPU torch or no nvcc) has no C++ CUDA kernels to test.
    pytest.mark.skipif(
        torch.cuda.is_available() and not _cpp_cuda_built(),
        reason="gns_kernels._C built without csrc/cuda (needs a CUDA torch and nvcc)",
    ),
]

vn = torch.ops.gns_kernels.variance_norms if ops.cpp_available() else None



def _vn_inputs(n, dtype, g, with_shift, shift_dtype=None, offset=0):
    """On the GPU: d, q = d^2 + u (u in [-0.5, 1.5): some coordinates clamp), shift.

    offset > 0 makes every tensor a view starting `offset` elements into its storage, so
    its data pointer is not 16-byte aligned (the kernels' scalar path)."""
    d = torch.randn(n + offset, generator=g)
    q = d * d + (torch.rand(n + offset, generator=g) * 2.0 - 0.5)
    s = torch.randn(n + offset, generator=g) if with_shift else None

    def cu(x, dt):
        return None if x is None else x.to(dt).cuda()[offset:]

    return cu(d, dtype), cu(q, dtype), cu(s, shift_dtype or dtype)


def _close(got, want, rtol, atol=0.0):
    torch.testing.assert_close(
        got.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol, equal_nan=True
    )


# Float32 per-element arithmetic on exactly representable inputs, float64 partial sums.
VN_RTOL = 1e-5


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_shift", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_variance_norms(n, dtype, with_shift, offset, gen):
    d, q, s = _vn_inputs(n, dtype, gen, with_shift, offset=offset)
    scale = 0.5 + 4.0 * torch.rand((), generator=gen).item()
    got = vn(d, q, scale, s)
    assert got.dtype == torch.float32 and got.shape == (4,) and got.is_cuda
    _close(got, ref.variance_norms(d, q, scale, s), rtol=VN_RTOL, atol=1e-6)
    assert torch.equal(got, vn(d, q, scale, s)), "not bit-identical run to run"
    # The public face picks the same kernel for CUDA tensors.
    assert torch.equal(got, ops.variance_norms(d, q, scale, s, backend="cpp"))


@pytest.mark.parametrize("shift_dtype", DTYPES)
def test_variance_norms_mixed_shift_dtype(shift_dtype, gen):
    d, q, s = _vn_inputs(10_001, torch.float32, gen, True, shift_dtype=shift_dtype)
    _close(vn(d, q, 3.0, s), ref.variance_norms(d, q, 3.0, s), rtol=VN_RTOL)


def test_variance_norms_multi_mixed_list(gen):
    """Mixed sizes, dtypes, alignments and per-tensor shifts (None for some), 150 tensors:
    more than one launch (64 tensors per launch) and several kernel instantiations."""
    ds, qs, ss = [], [], []
    for i in range(150):
        n = int(torch.randint(0, 70_000 if i % 10 == 0 else 3000, (1,), generator=gen))
        dt = DTYPES[i % 3]
        d, q, s = _vn_inputs(n, dt, gen, i % 4 != 0, shift_dtype=DTYPES[(i // 3) % 3], offset=i % 2)
        ds.append(d)
        qs.append(q)
        ss.append(s)
    got = torch.ops.gns_kernels.variance_norms_multi(ds, qs, 2.0, ss)
    want = sum(ref.variance_norms(d, q, 2.0, s) for d, q, s in zip(ds, qs, ss))
    _close(got, want, rtol=VN_RTOL)
    assert torch.equal(got, torch.ops.gns_kernels.variance_norms_multi(ds, qs, 2.0, ss))
    no_shift = torch.ops.gns_kernels.variance_norms_multi(ds, qs, 2.0, [])
    _close(no_shift, sum(ref.variance_norms(d, q, 2.0) for d, q in zip(ds, qs)), rtol=VN_RTOL)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["mean_grad", "mean_sq", "shift"])
def test_variance_norms_non_finite_propagates(bad, where, gen):
    d, q, s = _vn_inputs(100_003, torch.float32, gen, True)
    {"mean_grad": d, "mean_sq": q, "shift": s}[where][77_777] = bad
    got = vn(d, q, 1.5, s).cpu()
    want = ref.variance_norms(d, q, 1.5, s).cpu()
    # Non-finite exactly where the oracle is (mean_sq = -inf clamps to 0 in both).
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (got, want)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)


def test_variance_norms_nan_not_clamped_to_zero():
    # scale * (q - d^2) = NaN must stay NaN through the clamp (fmaxf(NaN, 0) would give 0).
    d = torch.zeros(5, device="cuda")
    q = torch.tensor([1.0, float("nan"), 1.0, 1.0, 1.0], device="cuda")
    got = vn(d, q, 1.0).cpu()
    assert torch.isnan(got[0]) and torch.isnan(got[2])
    assert got[1] == 0 and got[3] == 0


def test_variance_norms_accuracy_2_26(gen):
    n = 1 << 26
    d, q, s = _vn_inputs(n, torch.float32, gen, False)
    _close(vn(d, q, 1.0), ref.variance_norms(d, q, 1.0), rtol=1e-6)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_shift", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_square_pack(n, dtype, with_shift, offset, gen):
    grad, _, shift = _vn_inputs(n, dtype, gen, with_shift, offset=offset)
    out = torch.full((2 * n + offset,), float("nan"), device="cuda")[offset:]
    torch.ops.gns_kernels.square_pack(grad, out, shift)
    _close(out, ref.square_pack(grad, shift), rtol=3e-7)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prev_f32", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_accumulate_sq(n, dtype, prev_f32, offset, gen):
    grad, prev, sq = _vn_inputs(n, dtype, gen, True, offset=offset)
    prev = prev.float() if prev_f32 else prev
    sq = sq.float().abs()
    want_sq, want_prev = ref.accumulate_sq(grad, prev, sq)
    torch.ops.gns_kernels.accumulate_sq(grad, prev, sq)
    _close(sq, want_sq, rtol=1e-6, atol=1e-30)
    _close(prev, want_prev.to(prev.dtype), rtol=0.0)


def test_accumulate_sq_multi(gen):
    grads, prevs, sqs, wants = [], [], [], []
    for i in range(100):
        n = int(torch.randint(0, 80_000 if i % 7 == 0 else 2000, (1,), generator=gen))
        dt = DTYPES[i % 3]
        g, p, s = _vn_inputs(n, dt, gen, True, offset=int(i % 3 == 0))
        p = p.float() if i % 2 else p
        s = s.float().abs()
        wants.append(ref.accumulate_sq(g, p, s))
        grads.append(g)
        prevs.append(p)
        sqs.append(s)
    torch.ops.gns_kernels.accumulate_sq_multi(grads, prevs, sqs)
    for s, p, (ws, wp) in zip(sqs, prevs, wants):
        _close(s, ws, rtol=1e-6, atol=1e-30)
        _close(p, wp.to(p.dtype), rtol=0.0)


def test_bad_arguments_name_the_argument():
    d = torch.randn(10, device="cuda")
    with pytest.raises(ValueError, match="mean_sq"):
        vn(d, torch.randn(11, device="cuda"), 1.0)
    with pytest.raises(ValueError, match="mean_sq"):
        vn(d, torch.randn(10), 1.0)  # CPU tensor with a CUDA one
    with pytest.raises(TypeError, match="mean_sq"):
        vn(d, torch.randn(10, device="cuda", dtype=torch.float16), 1.0)
    with pytest.raises(ValueError, match="shift"):
        vn(d, d, 1.0, torch.randn(20, device="cuda")[::2])
    with pytest.raises(TypeError, match="out"):
        torch.ops.gns_kernels.square_pack(d, torch.empty(20, device="cuda", dtype=torch.float16))
    with pytest.raises(TypeError, match="prev"):
        torch.ops.gns_kernels.accumulate_sq(
            d.half(), torch.zeros(10, device="cuda", dtype=torch.bfloat16), torch.zeros(10, device="cuda")
        )
    with pytest.raises(ValueError, match=r"sqs\[1\]"):
        torch.ops.gns_kernels.accumulate_sq_multi([d, d], [d.clone(), d.clone()], [d.clone(), d[:5].clone()])


def test_outputs_must_not_overlap_across_lists():
    n = 1 << 18
    g1, g2, p0, p1, s = (torch.randn(n, device="cuda") for _ in range(5))
    acc = torch.ops.gns_kernels.accumulate_sq_multi
    with pytest.raises(ValueError, match=r"^sqs\[1\]: must not share memory with sqs\[0\]"):
        acc([g1, g2], [p0, p1], [s, s])
    with pytest.raises(ValueError, match=r"^prevs\[1\]: must not share memory with grads\[0\]"):
        acc([g1, g2], [p0, g1], [s, torch.zeros_like(s)])
    buf = torch.zeros(4 * n, device="cuda")
    with pytest.raises(ValueError, match="^out: must not share memory with grad"):
        torch.ops.gns_kernels.square_pack(buf[:n], buf[: 2 * n])
    with pytest.raises(ValueError, match="^sq: must not share memory with prev"):
        torch.ops.gns_kernels.accumulate_sq(g1, buf[:n], buf[n - 1 : 2 * n - 1])


def test_no_input_sized_temporaries(gen):
    n = 1 << 24
    d, q, s = _vn_inputs(n, torch.float32, gen, True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    vn(d, q, 1.0, s)
    torch.cuda.synchronize()
    # Only the float64 slots (4 per 65536 elements) and the 4-float result.
    assert torch.cuda.max_memory_allocated() - base < n // 64


def test_opcheck_cuda(gen):
    """Schema, fake kernels and mutation annotations agree with the CUDA kernels."""
    d, q, s = _vn_inputs(5000, torch.float32, gen, True)
    torch.library.opcheck(torch.ops.gns_kernels.variance_norms, (d, q, 2.0, s))
    torch.library.opcheck(torch.ops.gns_kernels.variance_norms_multi, ([d, d[:7]], [q, q[:7]], 2.0, [s, None]))
    torch.library.opcheck(torch.ops.gns_kernels.square_pack, (d, torch.empty(2 * d.numel(), device="cuda"), s))
    torch.library.opcheck(torch.ops.gns_kernels.accumulate_sq, (d, q.clone(), s.abs()))
    torch.library.opcheck(
        torch.ops.gns_kernels.accumulate_sq_multi, ([d, d[:9]], [q.clone(), q[:9].clone()], [s.abs(), s[:9].abs()])
    )
