"""The TF32 Newton opt-in (issue 30 item 5), in emulation: every product's operands rounded
to nearest with a 10-bit mantissa (spectral.precision.round_mantissa), float32 sums.

The trace must stay within newton.TF32_TRACE_BUDGET of float64 eigvalsh on a fixed-seed
family (sample covariances at odd sides, R = 2-8, and i^-p spectra, p <= 1); operands TRUNCATED to
10 bits (what tensor cores do to float32 inputs not rounded first) must leave that bound
on the same family, so the test can fail. Off by default."""
from __future__ import annotations

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref
from gns_kernels.spectral import newton as N
from gns_kernels.spectral import precision as P

from _spectral_data import rand_orthogonal, randn

BUDGET = N.TF32_TRACE_BUDGET


def _family(seed: int, m: int) -> torch.Tensor:
    """(7, m, m) float64: sample covariances of R = 2, 4, 8 Gaussian samples with n = m/2
    to 4m columns, and Q diag(i^-p) Q^T for p = 0.5, 1; every matrix scaled to ||.||_F = 1
    (the trace is relative anyway). Steeper spectra are out of the budget (i^-2: 1.2e-3 at
    m = 33, docs/spectral.md): one reason the opt-in stays off by default."""
    gen = torch.Generator().manual_seed(seed)
    mats = []
    for R, n in ((2, 4 * m), (4, 2 * m), (8, m), (8, 4 * m), (4, m // 2 + 1)):
        X = randn(gen, R, m, n)
        D = X.mean(0)
        mats.append(sum((x - D) @ (x - D).T for x in X) / (R - 1))
    for p in (0.5, 1.0):
        Q = rand_orthogonal(gen, m)
        lam = torch.arange(1, m + 1, dtype=torch.float64) ** -p
        mats.append((Q * lam) @ Q.T)
    A = torch.stack([0.5 * (M + M.T) for M in mats])
    return A / torch.linalg.matrix_norm(A, keepdim=True)


def _truncate(x: torch.Tensor, bits: int) -> torch.Tensor:
    x = x.float().contiguous()
    out = (x.view(torch.int32) & ~((1 << (23 - bits)) - 1)).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


def _worst(A: torch.Tensor, dtype) -> float:
    want = ref.sqrt_trace(A)
    got = gk.sqrt_trace(A.to(dtype), "newton", precision="tf32").double()
    assert torch.isfinite(got).all()
    return ((got - want).abs() / want).max().item()


@pytest.mark.parametrize("m", [33, 97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tf32_rounded_within_budget_and_truncated_not(m, dtype, monkeypatch):
    A = _family(7 + m, m)
    rounded = _worst(A, dtype)
    assert rounded <= BUDGET, rounded
    monkeypatch.setattr(P, "round_mantissa", _truncate)
    truncated = _worst(A, dtype)
    assert truncated > BUDGET, truncated  # the bound tells rounding from truncation


def test_tf32_every_product_is_tf32_and_off_by_default():
    A = _family(3, 24)[:3].float()
    with P.record_matmuls() as log:
        gk.sqrt_trace(A, "newton", precision="tf32")
    assert log and all(r.requested == "tf32" and P.check_record(r) for r in log)
    with P.record_matmuls() as log:
        gk.sqrt_trace(A, "newton-tf32")
    assert log and all(r.requested == "tf32" for r in log)
    with P.record_matmuls() as log:  # the default: no TF32 product
        gk.sqrt_trace(A, "newton")
    assert log and all(r.requested != "tf32" for r in log)
    assert gk.GNSHookState("nuclear", every=1, batch_size=8).method == "auto"
    with pytest.raises(ValueError, match="method: 'newton-tf32'"):  # an experiment of sqrt_trace only
        gk.GNSHookState("nuclear", every=1, batch_size=8, method="newton-tf32")


def test_nuclear_stats_newton_tf32_against_eigh():
    """nuclear_stats with method='newton-tf32' (the experiment the hook states refuse): noise and signal of sample layers within
    the budget of the float64 eigenvalue path on the same (float32) inputs."""
    gen = torch.Generator().manual_seed(11)
    R, shapes = 4, [(23, 57), (40, 31)]
    grams, grads = [], []
    for m, n in shapes:
        X = randn(gen, R, m, n, dtype=torch.float32)
        D = X.mean(0)
        side_row = m <= n
        G = sum((x @ x.T) if side_row else (x.T @ x) for x in X) / R
        grams.append(G)
        grads.append(D)
    n_tf, s_tf = gk.nuclear_stats(grams, grads, scale=8.0, method="newton-tf32")
    n_e, s_e = gk.nuclear_stats(grams, grads, scale=8.0, method="eigh")
    for a, b in ((n_tf, n_e), (s_tf, s_e)):
        assert ((a.double() - b.double()).abs() / b.double()).max() <= 2 * BUDGET, (a, b)
    with pytest.raises(ValueError, match="method"):
        gk.nuclear_stats(grams, grads, method="tf32")
