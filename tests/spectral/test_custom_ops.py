"""The spectral torch.library ops: opcheck and torch.compile(fullgraph=True)."""
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


def test_opcheck(gen):
    from torch.library import opcheck

    x = randn(gen, 3, 9, 14, dtype=torch.float32)
    opcheck(torch.ops.gns_kernels.gram_batched, (x, False))
    opcheck(torch.ops.gns_kernels.gram_batched, (x.bfloat16(), True))
    opcheck(torch.ops.gns_kernels.gram_list, (list(x.unbind(0)), False))
    opcheck(torch.ops.gns_kernels.gram_list, ([x[0].bfloat16(), x[1].bfloat16()], True))
    A = torch.stack([rand_psd(gen, 9, 1e3, torch.float32) for _ in range(2)])
    opcheck(torch.ops.gns_kernels.psd_eigvalsh, (A, 2e-4))
    opcheck(torch.ops.gns_kernels.psd_eigvalsh_list, ([A[0], A[1]], [None, 0.5 * A[0]], [2.0, 0.25], 2e-4,
                                                      [False, True]))
    opcheck(torch.ops.gns_kernels.newton_sqrt_trace, (A, 25, 1e-6, None, True))
    opcheck(torch.ops.gns_kernels.newton_sqrt_trace, (A.double(), 22, 1e-4, A.new_ones(2), False))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_opcheck_cuda(gen):
    """The ops on CUDA tensors (the Triton Gram, the stacked Newton path). On an H100
    (2026-11-25) gram_list returned views of one stacked result there, which a custom op
    may not (outputs aliasing each other): gk.gram and the hooks' Grams failed on CUDA."""
    from torch.library import opcheck

    x = randn(gen, 3, 37, 70, dtype=torch.float32).cuda()
    opcheck(torch.ops.gns_kernels.gram_batched, (x, False))
    opcheck(torch.ops.gns_kernels.gram_list, (list(x.unbind(0)), False))
    opcheck(torch.ops.gns_kernels.gram_list, ([x[0].bfloat16(), x[1].bfloat16()], True))
    got = torch.ops.gns_kernels.gram_list(list(x.unbind(0)), True)
    for xi, G in zip(x.unbind(0), got):
        want = xi.double().T @ xi.double()
        assert float((G.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    A = torch.stack([rand_psd(gen, 9, 1e3, torch.float32) for _ in range(2)]).cuda()
    opcheck(torch.ops.gns_kernels.newton_sqrt_trace, (A, 25, 1e-6, None, True))


def test_torch_compile_fullgraph(gen):
    R, B = 2, 16
    layers = samples(gen, R, SHAPES[:3])

    def measure(xs0, xs1):
        g0, g1 = gk.gram(xs0), gk.gram(xs1)
        mean_grams = [(a + b) / 2 for a, b in zip(g0, g1)]
        mean_grads = [(a + b) / 2 for a, b in zip(xs0, xs1)]
        return gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1))

    xs0 = [s[0] for s in layers]
    xs1 = [s[1] for s in layers]
    compiled = torch.compile(measure, fullgraph=True, backend="aot_eager")
    n, s = compiled(xs0, xs1)
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(n, rn) < TOL and rel_err(s, rs) < TOL
