"""bench/model_gpu.py's arithmetic on tiny hand-computed cases (not its assumptions)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from dataclasses import replace

_PATH = Path(__file__).resolve().parents[1] / "bench" / "model_gpu.py"
_spec = importlib.util.spec_from_file_location("model_gpu", _PATH)
mg = importlib.util.module_from_spec(_spec)
sys.modules["model_gpu"] = mg  # dataclasses look their module up there
_spec.loader.exec_module(mg)

# round numbers: 1 byte/s of copy, 1 FLOP/s of fp32 matmul, 0.5 of fp64, 1000 bytes/s of
# bus, no latency, no launch cost
HW = mg.Hardware(hbm_bw=1.0, hbm_eff=1.0, fp32_flops=1.0, fp32_eff=1.0, fp64_flops=0.5, fp64_eff=1.0,
                 bus_bw=1000.0, coll_latency=0.0, launch_s=0.0)
S = mg.Solver(trace_products=7, pair_products=3, signal_products=5, launches_per_chain=10, pool=False)


def test_gram_and_newton_flops():
    # X (2 x 3): Gram on the smaller side m = 2 over n = 3: 2 * 2^2 * 3
    assert mg.gram_flops(2, 3) == 24 and mg.gram_flops(3, 2) == 24
    # m = 2: 7 products of 2 * 2^3 = 16 FLOPs
    assert mg.newton_flops(2, S) == 7 * 16


def test_solver_defaults_follow_the_package():
    """The products the model counts from the running code equal the schedule written out
    from the package's settings (an independent tally, so a change in either shows)."""
    from gns_kernels import spectral as sp
    from gns_kernels.spectral.nuclear import NOISE_NEWTON
    from gns_kernels.spectral.pairsum import pair_nodes

    it, eps = NOISE_NEWTON
    sign = 2 * sp.sign_iters(eps) + 1  # X X^2 as bmm + baddbmm per step, then H = x X
    coupled = 1 + 3 * (it - 1)  # Z0 = I: one product in the first step
    correction = 1 + 5  # W = e Z^2, Horner to w^6
    s = mg.Solver()
    assert s.trace_products == sign + coupled + correction
    assert s.signal_products == coupled + correction  # float64 signal Grams: no projection
    # qhat (Horner, 6) and S = Y qhat; S^2, F_0's Taylor series (4), K squarings
    assert s.pair_products == 7 + 1 + 4 + pair_nodes(eps)
    t = mg.tf32_solver()
    it32, eps32 = sp.newton.check_newton_args(None, None, "tf32")
    assert t.signal_precision == "tf32"
    assert t.signal_products == 2 * sp.sign_iters(eps32) + 1 + 3 * it32 + 6  # guarded: 3 per step


def test_nuclear_step_one_matrix_one_rank():
    t = mg.nuclear_step([(2, 3)], 1, HW, S)
    # pack: 6 float32 gradients read and written (6 * 8) + the 2x2 Gram copied (4 * 8)
    assert t.bytes["pack"] == 80 and t.seconds["pack"] == pytest.approx(80)
    # Grams: local + mean = 2 * 24 FLOPs; the local Gram written (4 x 4 bytes) and C (4 x 12)
    assert t.flops["grams"] == 48 and t.seconds["grams"] == pytest.approx(48 + 64)
    # no collective on one rank; noise (7 products) and signal (5) of m = 2 at fp64 (0.5/s);
    # bias: 3 fp64 products for the noise matrix; no dof Gram below R = 3
    assert t.seconds["collective"] == 0.0
    assert t.flops["solves"] == 12 * 16 and t.seconds["solves"] == pytest.approx(12 * 16 / 0.5)
    assert t.flops["bias"] == 48 and t.seconds["bias"] == pytest.approx(96)
    assert t.seconds["dof"] == 0.0
    assert t.total_s == pytest.approx(80 + 112 + 384 + 96)
    assert t.host_syncs == 1
    # one chain (noise and signal matrices: one chunk): 10 launches
    assert t.launches == 10
    # launch floor above the GPU time: the excess goes to the solves term
    slow = mg.nuclear_step([(2, 3)], 1, replace(HW, launch_s=100.0), S)
    assert slow.seconds["solves"] + slow.seconds["bias"] + slow.seconds["pool"] == pytest.approx(1000)
    # the matmul floor: every product of the chain, nothing else
    assert mg.matmul_floor_s([(2, 3)], 1, HW, S) == pytest.approx((7 + 3) * 16 / 0.5 + 5 * 16 / 0.5)


def test_allreduce_time():
    assert mg.allreduce_s(1000.0, 1, HW) == 0.0
    assert mg.allreduce_s(1000.0, 2, HW) == pytest.approx(1000 * 2 * 1 / 2 / 1000)
    assert mg.allreduce_s(1000.0, 8, HW) == pytest.approx(1000 * 2 * 7 / 8 / 1000)


def test_nuclear_step_ranks_share_the_solves():
    # a matrix's two solves stay on one rank: with an m = 4 and an m = 2 matrix on 2 ranks
    # the busiest rank holds the m = 4 one (both solves), never half of each
    per = lambda m: (7 + 5) * 2 * m ** 3  # noqa: E731  noise and signal products of one matrix
    assert mg.nuclear_step([(4, 4), (2, 2)], 2, HW, S).flops["solves"] == per(4)
    assert mg.nuclear_step([(4, 4), (2, 2)], 8, HW, S).flops["solves"] == per(4)
    # 84 equal matrices on 8 ranks: the busiest rank gets ceil(84 / 8) = 11 of them
    t = mg.nuclear_step([(8, 8)] * 84, 8, HW, S)
    assert t.flops["solves"] == 11 * per(8)
    assert len(mg.busiest_rank_matrices([8] * 84, 8)) == 11
    t = mg.nuclear_step([(4, 4), (2, 2)], 2, HW, S)
    assert t.bytes["collective"] == 80
    # Grams: every local one (128 + 16 FLOPs), the mean-gradient Grams of the busiest
    # rank's matrices (the m = 4 one: 128)
    assert t.flops["grams"] == 144 + 128
    assert mg.nuclear_step([(4, 4)] * 4, 2, HW, S).flops["grams"] == 4 * 128 + 2 * 128
    assert t.seconds["collective"] == pytest.approx(80 * 1 / 1000)


def test_nuclear_step_dof_gram_from_three_ranks():
    # the deviation Gram (2 m^2 n) and one read of it, only at R >= 3
    assert mg.nuclear_step([(2, 3)], 2, HW, S).flops["dof"] == 0
    t = mg.nuclear_step([(2, 3)], 3, HW, S)
    assert t.flops["dof"] == 24 and t.seconds["dof"] == pytest.approx(24 + 4 * 4)


def test_l_step_bytes():
    t = mg.l_step([(2, 3)], 2, HW, grad_itemsize=2)
    assert t.bytes["pack"] == 6 * (2 + 8)  # read bf16, write [x, x^2] float32
    assert t.bytes["collective"] == 6 * 8 - 6 * 2  # float32 pack instead of the bf16 bucket
    half = mg.l_step([(2, 3)], 2, HW, grad_itemsize=2, bf16_grad_half=True)
    assert half.bytes["collective"] == 6 * 4  # only the float32 squares are extra


def test_nuclear_step_pool_term():
    """The noise pool: per owned matrix one more sqrt-trace and pair sum (the noise
    matrix's products again, float64) plus ~6 m^2 float32 reads/writes of the pool update."""
    t = mg.nuclear_step([(2, 3)], 1, HW, replace(S, pool=True))
    off = mg.nuclear_step([(2, 3)], 1, HW, S)
    assert off.seconds["pool"] == 0.0 and off.flops["pool"] == 0
    assert t.flops["pool"] == 112 + 48 and t.bytes["pool"] == 4 * 24
    assert t.seconds["pool"] == pytest.approx((112 + 48) / 0.5 + 96)
    assert t.total_s == pytest.approx(off.total_s + t.seconds["pool"])
    # the pool is on by default, as the package's (GNSHookState(pool_beta=0.9))
    assert mg.Solver().pool is True


def test_l_step_pool_term():
    t = mg.l_step([(4, 4)], 2, HW, pool=True)
    assert t.bytes["pool"] == 8 * 32 and t.seconds["pool"] == pytest.approx(8 * 32)
    assert mg.l_step([(4, 4)], 2, HW).seconds["pool"] == 0.0


def test_host_step_one_matrix_one_rank():
    """The host route: no solve on the GPU; float64 D D^T (fp64 rate 0.5) and C formed on
    the device, the staged matrices' bytes to the host; host core-seconds from host_s."""
    t = mg.host_step([(2, 3)], 1, HW, S)
    assert t.bytes["pack"] == 80 and t.seconds["pack"] == pytest.approx(80)
    # Grams: local 24 FLOPs at fp32 (1/s) + D D^T 24 at fp64 (0.5/s); bytes: the local Gram
    # (4 x 4) + per owned element 20 (read the float32 mean Gram and the float64 D D^T, write C)
    assert t.flops["grams"] == 48 and t.seconds["grams"] == pytest.approx(24 + 48 + 16 + 80)
    assert t.seconds["solves"] == t.seconds["bias"] == 0.0 and t.seconds["collective"] == 0.0
    assert t.bytes["copy"] == 4 * 8 * 2  # C and the signal Gram, float64 (no pool)
    a, b = mg.staging_counts(False)
    assert t.launches == a + b and a >= 0 and b > 0
    pooled = mg.host_step([(2, 3)], 1, HW, replace(S, pool=True))
    assert pooled.bytes["copy"] == 4 * (8 * 2 + 4) and pooled.bytes["pool"] == 4 * 24
    assert mg.staging_launches(True, 11, 1) == mg.staging_counts(True)[0] + 11 * mg.staging_counts(True)[1]
    calls = []

    def fake(m, pair):
        calls.append((m, pair))
        return 10.0 if pair else 1.0

    assert mg.host_core_s([(2, 3), (4, 4)], 1, S, fake) == pytest.approx(2 * (10 + 1))
    assert mg.host_core_s([(2, 3), (4, 4)], 1, replace(S, pool=True), fake) == pytest.approx(2 * (20 + 1))
    assert sorted(set(calls)) == [(2, False), (2, True), (4, False), (4, True)]
