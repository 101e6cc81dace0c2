"""gns_kernels.spectral.precision: explicit per-call matmul precision, and the Gram
precision rule against the end-to-end budget (noise and signal within 1e-3 of float64).

The matmul tests record the precision of every matmul a solve issues while the process
flag says otherwise (set_float32_matmul_precision("medium"): on this CPU oneDNN may then
compute float32 matmuls in bf16). The Gram tests emulate tensor-core Grams exactly:
operands rounded to nearest with a 10-bit (tf32) or 7-bit (bf16) mantissa, products and
sums in float32 (a float32 matmul of the rounded operands).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref
from gns_kernels import spectral as sp
from gns_kernels.spectral import precision as P
from _spectral_data import rand_psd, randn

TOL = 1e-3


@pytest.fixture
def medium_precision():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def test_flag_reading_follows_the_process_setting(medium_precision):
    assert P.fp32_matmul_flag(torch.device("cpu")) == "bf16"
    torch.set_float32_matmul_precision("highest")
    assert P.fp32_matmul_flag(torch.device("cpu")) == "ieee"


def test_flag_reading_cuda_settings_without_a_gpu():
    """The CUDA flag is read from torch.backends.cuda.matmul (no device needed to read it)."""
    m = torch.backends.cuda.matmul
    old = m.fp32_precision
    try:
        m.fp32_precision = "tf32"
        assert P.fp32_matmul_flag(torch.device("cuda")) == "tf32"
        m.fp32_precision = "ieee"
        assert P.fp32_matmul_flag(torch.device("cuda")) == "ieee"
    finally:
        m.fp32_precision = old


def test_check_record_rejects_routes_that_would_be_downgraded():
    R = P.MatmulRecord
    assert not P.check_record(R("ieee", "float32", "bf16", "cpu", (1, 2, 2, 2)))
    assert not P.check_record(R("ieee", "float32", "tf32", "cuda", (1, 2, 2, 2)))
    assert not P.check_record(R("tf32", "rounded+float32", "bf16", "cpu", (1, 2, 2, 2)))
    assert P.check_record(R("ieee", "float32", "ieee", "cuda", (1, 2, 2, 2)))
    assert P.check_record(R("ieee", "float64", "tf32", "cuda", (1, 2, 2, 2)))
    assert P.check_record(R("tf32", "rounded+float32", "tf32", "cuda", (1, 2, 2, 2)))


@pytest.mark.parametrize("flag", ["highest", "medium"])
def test_every_newton_matmul_carries_the_package_precision(gen, flag):
    """Under either process setting, every matmul of a Newton solve (sqrt_trace, and the
    pair sum) is recorded with the precision the package asked for and a route that
    delivers it; under "medium" the float32 requests take the float64 route."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(flag)
    try:
        A = torch.stack([rand_psd(gen, 24, 1e4), rand_psd(gen, 24, 10.0)]).float()
        with sp.record_matmuls() as log:
            t = gk.sqrt_trace(A, "newton")
            tr, pr = sp.sqrt_trace_pair_sum(A, project=False)
            t64 = gk.sqrt_trace(A.double(), "newton", precision="float64")
    finally:
        torch.set_float32_matmul_precision(old)
    it = sp.newton_min_iters() + 3
    # sign step (2 per iteration + 1), coupled iteration (3 per iteration), shift (6)
    assert len(log) >= (2 * sp.sign_iters() + 1) + 3 * it + 6
    assert {r.requested for r in log} == {"ieee", "float64"}
    assert all(P.check_record(r) for r in log), [r for r in log if not P.check_record(r)][:3]
    want_flag = "bf16" if flag == "medium" else "ieee"
    assert {r.flag for r in log} == {want_flag}
    ieee_routes = {r.route for r in log if r.requested == "ieee"}
    assert ieee_routes == ({"float64"} if flag == "medium" else {"float32"})
    want = ref.sqrt_trace(A.double())
    for got in (t, tr, t64):
        assert ((got.double() - want).abs() / want).max() < TOL


def test_bmm_routes_are_exact_where_claimed(gen, medium_precision):
    a = randn(gen, 3, 17, 29).float()
    b = randn(gen, 3, 29, 11).float()
    # ieee under a bf16 flag: float64 products of the float32 operands, rounded once
    torch.testing.assert_close(P.bmm(a, b, "ieee"), (a.double() @ b.double()).float(), rtol=0, atol=0)
    # tf32 under a bf16 flag: the rounded operands' exact product, rounded once
    ra, rb = P.round_to(a, "tf32"), P.round_to(b, "tf32")
    torch.testing.assert_close(P.bmm(a, b, "tf32"), (ra.double() @ rb.double()).float(), rtol=0, atol=0)
    assert P.bmm(a, b, "float64").dtype == torch.float64
    with pytest.raises(ValueError, match="precision"):
        P.bmm(a, b, "fp8")


def _round_np(x: np.ndarray, bits: int) -> np.ndarray:
    """Round to nearest, ties to even, with ``bits`` explicit mantissa bits (float64 math)."""
    mant, ex = np.frexp(x)  # x = mant 2^ex, 0.5 <= |mant| < 1
    return np.ldexp(np.round(mant * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), ex)


def test_round_mantissa_is_round_to_nearest_even(gen):
    x = torch.cat([randn(gen, 4000).float() * 10.0 ** torch.randint(-30, 30, (4000,), generator=gen),
                   torch.tensor([0.0, -0.0, 1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, math.inf, -math.inf])])
    # bf16: torch's own conversion is round-to-nearest-even
    torch.testing.assert_close(P.round_mantissa(x, 7), x.bfloat16().float(), rtol=0, atol=0)
    got = P.round_mantissa(x, 10).double().numpy()
    want = _round_np(x.double().numpy(), 10)
    fin = np.isfinite(want)
    assert np.array_equal(got[fin], want[fin])
    assert math.isnan(float(P.round_mantissa(torch.tensor([math.nan]), 10)))


def _gram(x: torch.Tensor, precision: str) -> torch.Tensor:
    """float32 Gram x x^T of a (m, n) float32 gradient with ``precision`` operands."""
    return P.bmm(x[None], x.T[None], precision)[0]


def _measurement(gen, m, n, R, noise, shift, precision):
    """(relative noise error, relative signal error, rho) of one emulated measurement:
    per-sample Grams and the mean gradient's Gram with ``precision`` operands, float32
    subtraction, vs the float64 computation of the same float32 gradients."""
    mean = randn(gen, m, n)
    G = [(mean + noise * randn(gen, m, n)).float() for _ in range(R)]
    S = (0.9 * mean).float() if shift else None
    X = [g - S for g in G] if shift else G
    scale = 64.0 / (R - 1)
    mg = torch.stack([_gram(x, precision) for x in X]).mean(0)
    D = torch.stack(X).mean(0)
    Gm = D + S if shift else D
    noise_f = ref.sqrt_trace((scale * (mg - _gram(D, precision))).double())
    signal_f = ref.sqrt_trace(_gram(Gm, precision).double())
    X64 = [x.double() for x in X]
    mg64 = torch.stack([x @ x.T for x in X64]).mean(0)
    D64 = torch.stack(X64).mean(0)
    Gm64 = D64 + S.double() if shift else D64
    noise64 = ref.sqrt_trace(scale * (mg64 - D64 @ D64.T))
    signal64 = ref.sqrt_trace(Gm64 @ Gm64.T)
    rho = float(P.subtraction_condition(mg64, D64 @ D64.T))
    return float(noise_f / noise64 - 1), float(signal_f / signal64 - 1), rho


# (m, n, R, noise std relative to the mean gradient, shift). SMALL_RHO cases keep rho
# below the tf32 limit 2.05 on every seed: max 1.55 / 1.33 / 1.86 / 1.69 over 60-200 seeds
# (33 x 50 at R = 2 reached 2.02 in 60 seeds and 2.0507 once, so it runs at R = 3)
SMALL_RHO = [(33, 50, 3, 5.0, False), (64, 96, 4, 1.0, True), (48, 48, 2, 10.0, False), (40, 70, 4, 2.0, False)]
LARGE_RHO = [(64, 96, 4, 0.01, False), (64, 96, 4, 0.01, True), (33, 128, 2, 0.01, False), (48, 80, 2, 0.01, True)]


@pytest.mark.parametrize("case", SMALL_RHO)
def test_tf32_grams_within_budget_where_the_rule_allows(gen, case):
    m, n, R, noise, shift = case
    en, es, rho = _measurement(gen, m, n, R, noise, shift, "tf32")
    assert P.gram_precision_rule(rho) == "tf32", rho
    assert abs(en) < TOL and abs(es) < TOL, (en, es, rho)
    # the error model with the measured constant: |err| <= GRAM_KAPPA u rho
    assert abs(en) <= P.GRAM_KAPPA * P.UNIT_ROUNDOFF["tf32"] * rho


@pytest.mark.parametrize("case", LARGE_RHO)
def test_noise_to_signal_1e4_needs_ieee(gen, case):
    """noise/signal = 1e-4 (per-entry variance of the noise vs the mean gradient), with and
    without a shift: the rule says ieee, ieee Grams stay within the budget, and tf32 Grams
    (what the rule forbids) leave it."""
    m, n, R, noise, shift = case
    en, es, rho = _measurement(gen, m, n, R, noise, shift, "ieee")
    assert P.gram_precision_rule(rho) == "ieee", rho
    # float32 Grams: the noise error is float32 accumulation amplified by rho, up to
    # 0.95 u rho over 300 seeds (33 x 128 at R = 2, rho up to 2.2e4: 4 of 300 seeds above
    # 1e-3, so "within the budget" holds only below rho ~ 1e4); the signal is not amplified
    assert abs(en) <= 1.5 * P.UNIT_ROUNDOFF["ieee"] * rho, (en, rho)
    assert abs(es) < TOL, (es, rho)
    # tf32 on 5 fresh draws: rho ~ 1e4 without a shift puts it far outside the budget
    # (median |error| 0.066 over 150 seeds, min 0.013), but a rare draw falls inside (one
    # seed in a CI run: 9.93e-4), so the median of the 5 is tested
    draws = [_measurement(gen, m, n, R, noise, shift, "tf32") for _ in range(5)]
    if not shift:
        en32 = sorted(abs(d[0]) for d in draws)
        assert en32[2] > TOL, (en32, rho)
    for _, es32, _ in draws:
        assert abs(es32) < TOL  # the signal alone would be fine: the subtraction is the problem


def test_bf16_rounding_leaves_the_budget_but_bf16_inputs_are_exact(gen):
    en, _, rho = _measurement(gen, 64, 96, 4, 0.01, False, "bf16")  # rho ~ 1e4: errors ~1 (>= 1.2 in 40 seeds)
    assert P.gram_precision_rule(rho) == "ieee" and abs(en) > TOL
    assert P.gram_precision_rule(rho, torch.bfloat16) == "bf16"
    x = randn(gen, 33, 70).bfloat16().float()  # bf16 values: rounding them changes nothing
    torch.testing.assert_close(_gram(x, "bf16"), _gram(x, "ieee"), rtol=0, atol=0)


def test_rule_thresholds_and_inputs():
    assert P.gram_precision_rule(None) == "ieee"
    assert P.gram_precision_rule(math.inf) == "ieee"
    assert P.gram_precision_rule(1.0) == "tf32"
    assert P.gram_precision_rule(P.max_subtraction_condition("tf32") * 1.01) == "ieee"
    assert P.max_subtraction_condition("bf16") < 1.0  # never for rounded operands
    with pytest.raises(ValueError, match="precision"):
        P.max_subtraction_condition("fp8")
    A = torch.eye(3)
    assert math.isinf(float(P.subtraction_condition(A, A)))
    assert float(P.subtraction_condition(2 * A, A)) == pytest.approx(2.0)
