"""gns_kernels.spectral.eigh: float32 eigvalsh with an error bound and a float64 fallback."""
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


def test_plain_float32_eigvalsh_fails_rank_deficient_bound(gen):
    """Why eigh needs its fallback: plain float32 eigvalsh misses the bound of the test above
    on a rank-deficient 768 x 768 matrix (3e-3 relative error was seen)."""
    A = rank_deficient(gen, 768, 10)
    plain = torch.linalg.eigvalsh(A.float()).clamp_min(0).sqrt().sum()
    assert rel_err(plain, ref.sqrt_trace(A)) > TOL
    lam = sp.psd_eigvalsh(A)
    assert lam.dtype == torch.float64
    assert rel_err(lam.clamp_min(0).sqrt().sum(), ref.sqrt_trace(A)) < 1e-6


@pytest.mark.parametrize("threads", [1, 2])
def test_psd_eigvalsh_list_matches_float64(gen, threads):
    # eigenvalues of scales[l] * (A[l] - B[l]) vs float64 eigvalsh of the same values,
    # m = 300 (one matrix per worker), a rank-deficient difference (float64 fallback), a
    # float64 input, B = None, a zero matrix and a non-finite one (NaN row, others intact)
    m = 300
    X = randn(gen, m, 2 * m, dtype=torch.float32)
    Y = randn(gen, m, 7, dtype=torch.float32)
    A0 = gk.gram([X])[0]
    B0 = (A0.double() - (Y.double() @ Y.double().T)).float()  # A0 - B0: rank 7 + rounding
    A1 = rand_psd(gen, m, 1e4, torch.float64)
    nan = A0.clone()
    nan[3, 5] = math.nan
    As = [A0, A0, A1, torch.zeros(m, m), nan]
    Bs = [None, B0, None, None, None]
    scales = [1e-20, 7.5, 3.0, 2.0, 1.0]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lam, used64 = torch.ops.gns_kernels.psd_eigvalsh_list(As, Bs, scales, sp.EIGH_TOL, [False] * 5)
        lam_w, used64_w = torch.ops.gns_kernels.psd_eigvalsh_list(As, Bs, scales, sp.EIGH_TOL, [True] * 5)
    finally:
        torch.set_num_threads(old)
    assert lam.shape == (5, m) and lam.dtype == torch.float64
    # the rank-7 difference falls back to float64; the well-conditioned Gram does not; the
    # hint solves every finite nonzero matrix in float64 directly, with the fallback's result
    assert used64.tolist() == [False, True, False, False, False]
    assert used64_w.tolist() == [True, True, True, False, False]
    assert torch.equal(lam_w[1], lam[1])
    assert torch.equal(lam_w[3], lam[3])
    for i in range(4):
        S = As[i].double() if Bs[i] is None else As[i].double() - Bs[i].double()
        S = scales[i] * S
        want = torch.linalg.eigvalsh(S)
        got_tr = lam[i].clamp_min(0).sqrt().sum()
        want_tr = want.clamp_min(0).sqrt().sum()
        if i == 3:
            assert torch.equal(lam[i], torch.zeros(m, dtype=torch.float64))
            continue
        assert abs(got_tr - want_tr) <= TOL * want_tr, i
        assert (lam[i] - want).abs().max() <= 1e-4 * want.abs().max(), i
    assert torch.isnan(lam[4]).all()


def test_eigh_survives_float32_convergence_failure():
    """float32 LAPACK eigvalsh fails to converge on such matrices (seen in the DDP hook on an
    embedding gradient); sqrt_trace('eigh') and nuclear_stats must fall back to float64."""
    failed = 0
    for seed in range(6):
        A, D, C = sparse_row_covariance(seed)
        try:
            torch.linalg.eigvalsh(C)
        except torch.linalg.LinAlgError:
            failed += 1
        want = float(ref.sqrt_trace(C))
        assert float(sp.sqrt_trace(C, method="eigh")) == pytest.approx(want, rel=1e-3)
        noise, signal = sp.nuclear_stats([A], [D], scale=8.0)
        assert float(noise[0]) == pytest.approx(want, rel=1e-3)
        assert float(signal[0]) == pytest.approx(float(ref.nuclear_norm(D)), rel=1e-3)
    assert failed > 0, "the float32 failure this test guards against no longer occurs here"


def test_eigh_float32_nan_output_takes_the_float64_path(gen, monkeypatch):
    # float32 LAPACK can return NaN eigenvalues for a finite matrix without raising (seen on
    # the sparse-row covariances above): the NaN error bound must trigger the fallback,
    # never become the result
    real = torch.linalg.eigvalsh

    def nan_in_float32(x, *a, **k):
        lam = real(x, *a, **k)
        return torch.full_like(lam, math.nan) if x.dtype == torch.float32 else lam

    A = torch.stack([rand_psd(gen, m, 1e3, torch.float32) for m in (300,) * 2])
    B = torch.stack([rand_psd(gen, 40, 1e3, torch.float32) for _ in range(3)])
    want_A, want_B = ref.sqrt_trace(A.double()), ref.sqrt_trace(B.double())
    monkeypatch.setattr(torch.linalg, "eigvalsh", nan_in_float32)
    for X, want in ((A, want_A), (B, want_B)):  # per-matrix path (m >= 256) and chunks
        assert rel_err(sp.sqrt_trace(X, "eigh"), want) < TOL
    lam, used64 = torch.ops.gns_kernels.psd_eigvalsh_list(list(A), [None, None], [1.0, 1.0], sp.EIGH_TOL,
                                                          [False, False])
    assert used64.tolist() == [True, True]
    assert rel_err(lam.clamp_min(0).sqrt().sum(-1), want_A) < TOL


def test_psd_eigvalsh_list_empty_matrices():
    lam, used64 = torch.ops.gns_kernels.psd_eigvalsh_list([torch.zeros(0, 0)] * 2, [None, torch.zeros(0, 0)],
                                                          [1.0, 2.0], sp.EIGH_TOL, [False, True])
    assert lam.shape == (2, 0) and lam.dtype == torch.float64
    assert used64.tolist() == [False, False]
    assert sp.psd_eigvalsh(torch.zeros(4, 0, 0)).shape == (4, 0)
