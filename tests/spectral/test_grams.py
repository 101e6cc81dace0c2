"""gns_kernels.spectral.grams (gram, gram_list, gram_batched) vs the float64 oracle."""
from __future__ import annotations

import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref
from gns_kernels import spectral as sp
from _spectral_data import (METHODS, SHAPES, TOL, grad_with_spectrum, rand_psd, randn,  # noqa: F401
                            rank_deficient, rel_err, samples, sparse_row_covariance, stats_inputs,
                            with_eigenvalues)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gram_matches_reference_all_sides_and_groups(gen, dtype):
    shapes = [(7, 13), (13, 7), (7, 13), (9, 9), (300, 257), (7, 13), (1, 5), (5, 1)]
    xs = [randn(gen, *s, dtype=dtype) for s in shapes]
    for side in ("auto", "row", "col"):
        out = gk.gram(xs, side=side)
        assert len(out) == len(xs)
        for x, G in zip(xs, out):
            want = ref.gram(x, side)  # float64 Gram of the same (rounded) values
            assert G.dtype == torch.float32
            assert G.shape == want.shape
            # float32 accumulation: relative to the Gram's scale
            assert (G.double() - want).abs().max() <= 2e-6 * want.abs().max() + 1e-30, (side, x.shape)


def test_gram_auto_takes_smaller_side_and_blocks_are_symmetric(gen):
    x = randn(gen, 3, 600, 513, dtype=torch.float32)  # > one CPU strip (64 rows): blocked path
    out = torch.ops.gns_kernels.gram_batched(x, True)
    assert out.shape == (3, 513, 513)
    assert torch.equal(out, out.mT)  # mirrored blocks: exactly symmetric
    want = x.double().mT @ x.double()
    assert (out.double() - want).abs().max() <= 2e-6 * want.abs().max()
    shapes = [g.shape for g in gk.gram([x[0], x[0].T])]
    assert shapes == [(513, 513), (513, 513)]


@pytest.mark.parametrize("threads", [1, 2])
def test_gram_list_strided_inputs_several_blocks(gen, threads):
    # transposed and sliced views, k = 301: several CPU strips (64 rows), worker threads or not
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = randn(gen, 5, 420, 301, dtype=torch.float32)
        xs = [base[i, :, :] for i in range(3)] + [base[3].T.T, base[4][:, :]]
        for col in (False, True):
            out = torch.ops.gns_kernels.gram_list(xs, col)
            assert len(out) == 5
            for x, G in zip(xs, out):
                assert G.shape == ((301, 301) if col else (420, 420))
                assert torch.equal(G, G.T)  # mirrored blocks: exactly symmetric
                want = ref.gram(x, "col" if col else "row")
                assert (G.double() - want).abs().max() <= 2e-6 * want.abs().max()
        xt = [x.T for x in xs]  # non-contiguous (n, m) views, rows strided
        out = torch.ops.gns_kernels.gram_list(xt, False)
        for x, G in zip(xt, out):
            want = ref.gram(x, "row")
            assert (G.double() - want).abs().max() <= 2e-6 * want.abs().max()
    finally:
        torch.set_num_threads(old)


def test_gram_bf16_accumulates_in_float32(gen):
    # 4096 bf16 products: a bf16 accumulator would be off by ~1e-2 relative
    x = randn(gen, 6, 4096, dtype=torch.bfloat16)
    (G,) = gk.gram([x])
    want = x.double() @ x.double().T
    assert G.dtype == torch.float32
    assert (G.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_gram_rejects_bad_input():
    with pytest.raises(ValueError, match=r"tensors\[1\].*2-D"):
        gk.gram([torch.ones(2, 2), torch.ones(3)])
    with pytest.raises(ValueError, match=r"tensors\[0\].*floating"):
        gk.gram([torch.ones(2, 2, dtype=torch.int64)])
    with pytest.raises(ValueError, match="side"):
        gk.gram([torch.ones(2, 2)], side="left")



def test_smaller_side_matches_the_oracle_side():
    for shape in [(1, 1), (3, 7), (7, 3), (5, 5), (0, 4), (4, 0), (2, 9, 4)]:
        assert sp.smaller_side(shape) == ref.gram_side(shape, "auto"), shape
    assert sp.smaller_side((768, 2048)) == "row" and sp.smaller_side((2048, 768)) == "col"


def test_gram_empty_sides(gen):
    # a zero-size side gives a 0 x 0 Gram; an empty reduction dimension a zero Gram
    for shape, side, want in [((0, 5), "row", (0, 0)), ((5, 0), "col", (0, 0)),
                              ((4, 0), "row", (4, 4)), ((0, 3), "col", (3, 3))]:
        (G,) = gk.gram([torch.ones(shape)], side=side)
        assert G.shape == want and G.dtype == torch.float32, (shape, side)
        assert torch.equal(G, torch.zeros(want))
    assert torch.ops.gns_kernels.gram_batched(torch.ones(0, 3, 5), False).shape == (0, 3, 3)


def test_cpu_gram_ignores_a_lowered_float32_matmul_flag(gen):
    """Under set_float32_matmul_precision("medium") (oneDNN may then multiply float32 in
    bf16) the Gram is computed in float64 and rounded once: exactly the float64 Gram's
    float32 rounding. Under "highest" it is the float32 GEMM (not bitwise that), so the
    check can fail if the flag reached the Gram."""
    x = torch.randn(37, 211, generator=gen) + 3.0
    want = (x.double() @ x.double().T).float()
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        (got,) = gk.gram([x])
    finally:
        torch.set_float32_matmul_precision(old)
    assert torch.equal(got, want)
    (plain,) = gk.gram([x])
    assert not torch.equal(plain, want)  # the float32 route rounds differently


@pytest.mark.parametrize("shape", [(10, 64), (64, 10), (16, 12), (33, 70)])
def test_cpu_gram_does_not_depend_on_the_address_or_strides(gen, shape):
    """A DDP bucket holds each gradient at an offset that its bucket layout sets, and DDP
    changes the layout after the first iteration (a resumed run's first step uses another
    one): the CPU Gram of a view must not depend on where it sits. The CPU GEMM's bits do
    (a 10 x 64 Gram from a view 4 bytes off an aligned address differed in 65 of 100
    entries before the aligned copy); a transposed copy of the values must not matter
    either."""
    x = randn(gen, *shape, dtype=torch.float32)
    want = gk.gram([x])
    n = x.numel()
    for off in range(17):
        buf = torch.zeros(off + n + 3)
        v = buf[off:off + n].view(shape)
        v.copy_(x)
        for side in ("auto", "row", "col"):
            assert torch.equal(gk.gram([v], side=side)[0], gk.gram([x], side=side)[0]), (off, side)
        row = torch.ops.gns_kernels.gram_list([v, x], False)
        assert torch.equal(row[0], row[1]), off
    t = x.T.contiguous().T  # the same values, column-major
    assert not t.is_contiguous()
    assert torch.equal(gk.gram([t])[0], want[0])
