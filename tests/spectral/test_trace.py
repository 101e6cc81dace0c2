"""gns_kernels.spectral.sqrt_trace vs float64 eigvalsh of the same input (gns_kernels.reference).

Accuracy bound: every sqrt-trace method within 1e-3 relative of float64 eigvalsh of the
same input on random PSD matrices (sizes 1..768, condition up to 1e6), exactly
rank-deficient ones, any scale (1e-30..1e30), Grams of gradients whose singular values
span six decades; finite on every finite PSD input."""
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


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m", [1, 2, 7, 33, 130, 300])
@pytest.mark.parametrize("cond", [1.0, 1e3, 1e6])
def test_sqrt_trace_random_psd(gen, method, m, cond):
    for dtype in (torch.float64, torch.float32):
        A = rand_psd(gen, m, cond, dtype)
        got = gk.sqrt_trace(A, method)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert rel_err(got, ref.sqrt_trace(A)) < TOL, (method, m, cond, dtype)


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_size_768(gen, method):
    A = rand_psd(gen, 768, 1e6, torch.float32)
    assert rel_err(gk.sqrt_trace(A, method), ref.sqrt_trace(A)) < TOL


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m,r", [(300, 10), (64, 1), (64, 3), (768, 10)])
def test_sqrt_trace_exactly_rank_deficient(gen, method, m, r):
    A = rank_deficient(gen, m, r)  # float64, exact zeros up to float64 rounding
    want = ref.sqrt_trace(A)
    assert rel_err(gk.sqrt_trace(A, method), want) < TOL
    # the float32 input (rounding noise on the zero eigenvalues): eigh and host agree with
    # float64 eigvalsh of the rounded input; newton suppresses the noise, so compare it with
    # the exact value (what the rounded input approximates)
    A32 = A.float()
    target = ref.sqrt_trace(A32) if method in ("eigh", "host") else want
    assert rel_err(gk.sqrt_trace(A32, method), target) < TOL


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1e12, 1e30])
def test_sqrt_trace_any_scale(gen, method, scale):
    for dtype in (torch.float32, torch.float64):
        A = (rand_psd(gen, 40, 1e6) * scale).to(dtype)
        got = gk.sqrt_trace(A, method)
        assert torch.isfinite(got).all()
        assert rel_err(got, ref.sqrt_trace(A)) < TOL, (method, scale, dtype)
        Z = (rank_deficient(gen, 40, 3) * scale).to(dtype)
        assert rel_err(gk.sqrt_trace(Z, method), ref.sqrt_trace(Z.double() if method == "newton" else Z)) < TOL


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m,n", [(64, 160), (300, 200)])
def test_sqrt_trace_grams_of_gradients_six_decades(gen, method, m, n):
    G = grad_with_spectrum(gen, m, n, decades=6)
    (A,) = gk.gram([G])  # float32 Gram on the smaller side
    assert rel_err(gk.sqrt_trace(A, method), ref.sqrt_trace(A)) < TOL
    exact = ref.nuclear_norm(G)  # and the signal it stands for, ||G||_S1
    assert rel_err(gk.sqrt_trace(A, method), exact) < TOL


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_batched_and_nonfinite_isolated(gen, method):
    A = torch.stack([rand_psd(gen, 20, c) for c in (1.0, 1e2, 1e4, 1e6, 1e3, 10.0)]).reshape(2, 3, 20, 20)
    bad = A.clone()
    bad[1, 2, 3, 4] = float("nan")
    bad[0, 1, 0, 0] = float("inf")
    got = gk.sqrt_trace(bad, method)
    assert got.shape == (2, 3)
    assert torch.isnan(got[1, 2]) and not torch.isfinite(got[0, 1])
    ok = torch.ones(2, 3, dtype=torch.bool)
    ok[1, 2] = ok[0, 1] = False
    want = ref.sqrt_trace(A)
    assert rel_err(got[ok], want[ok]) < TOL


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_slightly_indefinite_and_zero(gen, method):
    # C = A - B with B = A up to rounding in most directions (a subtraction's result)
    X = randn(gen, 50, 80, dtype=torch.float32)
    A = X @ X.T
    D = X[:, :75]
    C = A - D @ D.T  # PSD rank 5 in exact arithmetic; float32 rounding makes it indefinite
    got = gk.sqrt_trace(C, method)
    assert torch.isfinite(got)
    exact = ref.sqrt_trace(X[:, 75:].double() @ X[:, 75:].double().T)
    assert rel_err(got, exact) < 0.05  # rounding of A and D D^T dominates; finite and close
    assert gk.sqrt_trace(torch.zeros(5, 5), method).item() == 0.0
    assert gk.sqrt_trace(torch.zeros(0, 4, 4), method).shape == (0,)

def test_sqrt_trace_auto_cpu_is_eigh_and_deterministic(gen):
    A = torch.stack([rand_psd(gen, 60, 1e4, torch.float32) for _ in range(5)])
    nt = torch.get_num_threads()
    a = gk.sqrt_trace(A)
    assert torch.get_num_threads() == nt  # the worker-thread section restores it
    assert torch.equal(a, gk.sqrt_trace(A, "eigh"))
    assert torch.equal(a, gk.sqrt_trace(A))


def test_sqrt_trace_rejects_bad_input():
    with pytest.raises(ValueError, match="A: expected square"):
        gk.sqrt_trace(torch.ones(3, 4))
    with pytest.raises(ValueError, match="method"):
        gk.sqrt_trace(torch.eye(3), "svd")
    with pytest.raises(ValueError, match="A: expected a floating"):
        gk.sqrt_trace(torch.eye(3, dtype=torch.int32))


def test_sqrt_trace_validate_flag_and_env(monkeypatch):
    A = torch.eye(4)
    A[0, 1] = 1.0  # not symmetric
    assert torch.isfinite(gk.sqrt_trace(A))  # hot path: no check (symmetrized)
    with pytest.raises(ValueError, match="symmetric"):
        gk.sqrt_trace(A, validate=True)
    monkeypatch.setenv("GNS_KERNELS_VALIDATE", "1")
    with pytest.raises(ValueError, match="symmetric"):
        gk.sqrt_trace(A)
    B = torch.eye(4)
    B[2, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        gk.sqrt_trace(B)


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_float64_far_below_float32_range(gen, method):
    # float64 input at 1e-300 (and 1e+300): float32 cannot hold it; the result must not be 0
    for scale in (1e-300, 1e-200, 1e200, 1e300):
        A = rand_psd(gen, 9, 1e3) * scale
        got = gk.sqrt_trace(A, method)
        assert got.dtype == torch.float64 and got.item() != 0.0
        assert rel_err(got, ref.sqrt_trace(A)) < TOL, (method, scale)


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_empty_matrices(method):
    assert torch.equal(gk.sqrt_trace(torch.zeros(0, 0), method), torch.zeros(()))
    assert gk.sqrt_trace(torch.zeros(3, 0, 0, dtype=torch.float64), method).shape == (3,)
