"""gk.attach_fsdp_gns on FSDP2 x tensor parallelism: 4 gloo ranks, a 2 x 2 (dp, tp) mesh (and
HSDP x TP on 8 ranks, 2 x 2 x 2),
parallelize_module (colwise / rowwise) then fully_shard over the dp mesh, as torchtitan
builds it. The expected value is the 1-D FSDP2 run on the 2 data-parallel ranks with the
same weights and data (R = 2: the tp ranks of a data-parallel rank are one sample), and
gk.estimate on the gathered local gradients; the gradients are plain FSDP2 x TP's.
Rank-side code and the net (every way a weight meets tp): _tp_workers.py.
"""
from __future__ import annotations

import pytest

from _harness import GATHERED_TOL, check_estimates_agree, run_world, scenario_records

pytestmark = pytest.mark.distributed

WORLD = 4
SCENARIOS = {
    "l1": dict(geometry="l1", steps=2, every=2),
    "l1_no_pool": dict(geometry="l1", pool=False, steps=1),
    "l1_debiased": dict(geometry="l1", signal="debiased", steps=1),
    "l2": dict(geometry="l2", steps=1),
    "nuclear": dict(geometry="nuclear", steps=2),
    "nuclear_no_pool": dict(geometry="nuclear", pool=False, steps=1),
    "nuclear_newton": dict(geometry="nuclear", method="newton", steps=1),
    "nuclear_host": dict(geometry="nuclear", method="host", steps=3),
    # accumulation over 2 micro-steps; bf16 parameters with a float32 reduce; a frozen weight
    "l1_accumulate": dict(geometry="l1", accumulate=2, steps=1),
    "nuclear_accumulate": dict(geometry="nuclear", accumulate=2, steps=1),
    "nuclear_mp_bf16": dict(geometry="nuclear", mp=True, steps=1),
    "l1_mp_bf16": dict(geometry="l1", mp=True, steps=1),
    "nuclear_frozen": dict(geometry="nuclear", frozen=True, steps=1),
}
TOL = 1e-4  # the bound vs the 1-D run (measured: <= 6e-5 nuclear, eigh tolerances; ~1e-7 l1/l2)
TOL_BF16 = 1e-2
REF_TOL = GATHERED_TOL  # vs gk.estimate


@pytest.fixture(scope="module")
def world4():
    return run_world("_tp_workers", "run_many", WORLD, timeout=300, scenarios=SCENARIOS)


_records = scenario_records


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_estimate_equals_the_1d_run_on_the_data_parallel_ranks(world4, name):
    res = _records(world4, name)
    kw = SCENARIOS[name]
    # (not for the lagged host route, nor in bf16: the gathered copy computes in float32)
    ref_tol = None if kw.get("method") == "host" or kw.get("mp") else REF_TOL[kw["geometry"]]
    # bf16: the tp model computes in other bf16 roundings than the 1-D one (its matmuls are
    # split), so their gradients differ at bf16 precision (measured 6e-4 on the gns); 1e-2
    # still catches a wrong sample count (R = 4 for 2 triples the variance scale B / (R - 1))
    tol = TOL_BF16 if kw.get("mp") else TOL
    assert check_estimates_agree(res[0]["records"], "tp", "flat", tol, ref_tol) >= 1
    for r in res[1:]:  # identical on every rank, tp ranks included
        assert [x["est"] for x in r["records"]] == [x["est"] for x in res[0]["records"]]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gradients_are_plain_fsdp2_x_tps(world4, name):
    for rank, r in enumerate(_records(world4, name)):
        assert all(x["grad_equal_plain"] for x in r["records"]), rank


def test_samples_are_the_data_parallel_ranks(world4):
    for rank, r in enumerate(_records(world4, "l1")):
        assert r["dp"] == (2, rank // 2) and r["tp"] == (2, rank % 2)


def test_l_collectives(world4):
    """l1 on a measurement step: plain FSDP2 x TP's reduce-scatters with twice the payload,
    then ONE all-reduce of 5 float64 (over dp x tp); other steps: plain's calls."""
    for rec in _records(world4, "l1")[0]["records"]:
        plain, hooked = rec["calls"]["plain"], rec["calls"]["tp"]
        if not rec["measuring"]:
            assert hooked == plain
            continue
        assert [c[1] for c in hooked[:-1]] == [2 * c[1] for c in plain]
        assert hooked[-1][:2] == ("all_reduce", 5) and hooked[-1][2] == "torch.float64"


# ---- HSDP x TP: 8 ranks, (replicate 2, shard 2, tp 2) against the 1-D run on the 4
# data-parallel ranks of each tp column
SCENARIOS_8 = {
    "l1": dict(geometry="l1", steps=1),
    "l2_no_pool": dict(geometry="l2", steps=1),
    "nuclear": dict(geometry="nuclear", steps=1),
    "nuclear_no_pool": dict(geometry="nuclear", pool=False, steps=1),
}


@pytest.fixture(scope="module")
def world8():
    return run_world("_tp_workers", "run_many", 8, timeout=400, scenarios=SCENARIOS_8, hsdp=True)


@pytest.mark.parametrize("name", list(SCENARIOS_8))
def test_hsdp_x_tp_equals_the_1d_run_on_the_data_parallel_ranks(world8, name):
    """HSDP x TP (measured: ~1e-7 l1, 4e-6 nuclear): within 1e-4 of the 1-D run on the 4
    data-parallel ranks and of gk.estimate; identical on all 8 ranks; gradients plain
    HSDP x TP's; R = 4 (replicate x shard), the tp pairs one sample each."""
    res = _records(world8, name)
    ref_tol = REF_TOL[SCENARIOS_8[name]["geometry"]]
    assert check_estimates_agree(res[0]["records"], "tp", "flat", TOL, ref_tol) >= 1
    for rank, r in enumerate(res):
        assert r["hsdp"] and r["dp"] == (4, rank // 2) and r["tp"] == (2, rank % 2)
        assert [x["est"] for x in r["records"]] == [x["est"] for x in res[0]["records"]]
        assert all(x["grad_equal_plain"] for x in r["records"]), rank
