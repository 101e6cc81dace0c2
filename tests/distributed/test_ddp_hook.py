"""gk.ddp_gns_hook on 1, 2, 3 and 4 gloo ranks (spawned processes; see _harness.py).

Every scenario runs in one process group per world size (a spawn costs seconds); the
rank-side code is in _ddp_scenarios.py, the assertions here. Expected values come from
gk.estimate on the all-gathered local gradients of the same step (float64), plain DDP
(no hook) on the same data, and the process group's collective sequence counter.
"""
from __future__ import annotations

import math

import pytest

from _harness import run_world, rel as _rel

pytestmark = pytest.mark.distributed

TOL = {"l2": 1e-5, "l1": 1e-5, "nuclear": 1e-3}
# the debiased l1 signal sums sqrt(max(g^2 - s2/B, 0)): a coordinate near the clamp turns
# the float32 rounding of the reduced halves into a larger relative error
TOL_DEBIASED = {"l2": 1e-5, "l1": 1e-4, "nuclear": 1e-3}


def _gauss(cfg, world):
    """Whether the hook uses the 'gauss-sums' dof (ranks as samples, >= 3, corrected)."""
    return (cfg["geometry"] == "nuclear" and cfg.get("bias_correction", True) and not cfg.get("micro")
            and world >= 3 and cfg.get("nuclear_dof", "auto") in ("auto", "gauss-sums"))


def _pooled(cfg):
    """Whether the hook state has a noise pool (the default: l1 / nuclear, corrected)."""
    return cfg["geometry"] != "l2" and cfg.get("bias_correction", True)


def _share_rows(cfg, world):
    return 3 + (cfg.get("signal") == "debiased") + 5 * _gauss(cfg, world) + 4 * _pooled(cfg)

SCENARIOS_2 = {
    "l2": dict(geometry="l2"),
    "l1": dict(geometry="l1"),
    "nuclear": dict(geometry="nuclear"),
    "nuclear_raw": dict(geometry="nuclear", bias_correction=False),
    "l1_raw": dict(geometry="l1", bias_correction=False),
    "l1_shift_user_subset": dict(geometry="l1", shift="user", subset=True),
    "l2_shift_last": dict(geometry="l2", shift="last", every=1),
    "nuclear_shift_user": dict(geometry="nuclear", shift="user"),
    "nuclear_shift_last": dict(geometry="nuclear", shift="last", every=1, steps=3),
    "l1_bf16": dict(geometry="l1", dtype="bfloat16"),
    "nuclear_bf16": dict(geometry="nuclear", dtype="bfloat16"),
    "l1_one_bucket": dict(geometry="l1", bucket_cap_mb=25),
    "l1_no_sync_accumulation": dict(geometry="l1", accumulate=3),
    "l1_view_static": dict(geometry="l1", as_view=True, static_graph=True),
    "nuclear_view_static": dict(geometry="nuclear", as_view=True, static_graph=True, shift="user"),
    "l1_nan": dict(geometry="l1", every=1, nan_at=1, steps=3),
    "nuclear_nan": dict(geometry="nuclear", every=1, nan_at=1, steps=3),
    "l1_micro": dict(geometry="l1", accumulate=3, micro=True),
    "nuclear_micro": dict(geometry="nuclear", accumulate=2, micro=True),
    "nuclear_debiased": dict(geometry="nuclear", signal="debiased", shift="user"),
    "l1_debiased": dict(geometry="l1", signal="debiased", shift="user"),
    "l2_debiased": dict(geometry="l2", signal="debiased"),
}

SCENARIOS_4 = {
    "l2": dict(geometry="l2", steps=3),
    "l1_shift_user": dict(geometry="l1", shift="user", steps=3),
    "nuclear": dict(geometry="nuclear", steps=3),
    "l1_bf16_view": dict(geometry="l1", dtype="bfloat16", as_view=True, steps=3),
    "l1_nan": dict(geometry="l1", every=1, nan_at=1, steps=3),
    "l2_micro": dict(geometry="l2", accumulate=2, micro=True, steps=3),
}

SCENARIOS_3 = {  # the ranks share the nuclear solves: an odd rank count
    "nuclear": dict(geometry="nuclear", steps=3),
    "nuclear_raw": dict(geometry="nuclear", bias_correction=False, steps=3),
    "nuclear_shift_user": dict(geometry="nuclear", shift="user", steps=3),
    "nuclear_shift_last_raw": dict(geometry="nuclear", shift="last", every=1, steps=3,
                                   bias_correction=False),
    "nuclear_one_bucket": dict(geometry="nuclear", bucket_cap_mb=25, steps=3),
    "nuclear_nan": dict(geometry="nuclear", every=1, nan_at=1, steps=3),
    "nuclear_micro": dict(geometry="nuclear", accumulate=2, micro=True, steps=3),
    "nuclear_columns": dict(geometry="nuclear", nuclear_dof="columns", steps=3),
    "nuclear_gauss_debiased": dict(geometry="nuclear", nuclear_dof="gauss-sums", signal="debiased",
                                   steps=3),
    "l1_micro_debiased": dict(geometry="l1", accumulate=2, micro=True, signal="debiased", steps=3),
}

SCENARIOS_1 = {  # one rank: the micro-batches are the samples (the hook state is MicroBatchGNS)
    "l1_micro": dict(geometry="l1", accumulate=3, micro=True, steps=3),
    "nuclear_micro": dict(geometry="nuclear", accumulate=2, micro=True, steps=3),
}


@pytest.fixture(scope="module")
def world1():
    return run_world("_ddp_scenarios", "run_many", 1, scenarios=SCENARIOS_1)


@pytest.fixture(scope="module")
def world2():
    return run_world("_ddp_scenarios", "run_many", 2, scenarios=SCENARIOS_2)


@pytest.fixture(scope="module")
def world3():
    return run_world("_ddp_scenarios", "run_many", 3, scenarios=SCENARIOS_3)


@pytest.fixture(scope="module")
def world4():
    return run_world("_ddp_scenarios", "run_many", 4, scenarios=SCENARIOS_4)


def _cases():
    for name in SCENARIOS_1:
        yield pytest.param(1, name, id=f"R1-{name}")
    for name in SCENARIOS_2:
        yield pytest.param(2, name, id=f"R2-{name}")
    for name in SCENARIOS_3:
        yield pytest.param(3, name, id=f"R3-{name}")
    for name in SCENARIOS_4:
        yield pytest.param(4, name, id=f"R4-{name}")


_ALL = {1: SCENARIOS_1, 2: SCENARIOS_2, 3: SCENARIOS_3, 4: SCENARIOS_4}


def _results(request, world):
    return request.getfixturevalue(f"world{world}")


def _same(a, b):
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


@pytest.mark.parametrize("world,name", list(_cases()))
def test_estimate_matches_gathered_gradients(request, world, name):
    cfg = _ALL[world][name]
    res = _results(request, world)
    ranks = [r[name]["records"] for r in res]
    tol = (TOL_DEBIASED if cfg.get("signal") == "debiased" else TOL)[cfg["geometry"]]
    n_measured = 0
    for k, rec in enumerate(ranks[0]):
        assert rec["state_step"] == k + 1, "one step per synchronized backward"
        if not rec["measuring"]:
            assert k % cfg.get("every", 2) != 0
            continue
        n_measured += 1
        assert rec["estimate_step"] == k
        for other in ranks[1:]:  # identical on every rank (nan == nan here)
            assert _same(other[k]["est"], rec["est"]), (k, other[k]["est"], rec["est"])
        est, ref = rec["est"], rec["ref"]
        assert not isinstance(ref, str), ref
        assert est[3] == ref[3], f"step {k}: valid {est[3]} but gk.estimate valid {ref[3]}"
        if cfg.get("nan_at") == k:
            assert est[3] is False and all(math.isnan(v) for v in est[:3])
            continue
        assert est[3] is True
        for what, a, b in zip(("gns", "noise", "signal", "signal_raw"), est[:3] + est[5:6], ref[:3] + ref[5:6]):
            assert _rel(a, b) <= tol, f"step {k} {what}: hook {a} vs gk.estimate {b}"
        # the same dof mode as gk.estimate's (the default: 'gauss-sums' at R >= 3 with ranks
        # as samples, 'columns' otherwise)
        assert est[4] == ref[4], (est[4], ref[4])
        if cfg["geometry"] == "nuclear" and cfg.get("bias_correction", True):
            assert est[4] == ("gauss-sums" if _gauss(cfg, world) else "columns")
    assert n_measured >= 2


@pytest.mark.parametrize("world,name", list(_cases()))
def test_noise_pooled_matches_the_float64_pool(request, world, name):
    """noise_pooled after every measurement equals gns_kernels.reference.pooled_noise on the
    gathered gradients of all measurements so far (the EMA of the variances / covariances,
    corrected for the pool's dof); nan at an invalid measurement, which the pool skips; the
    first nuclear measurement is the measurement's own corrected noise. None without a
    pool (l2, the raw estimator)."""
    cfg = _ALL[world][name]
    ranks = [r[name]["records"] for r in _results(request, world)]
    tol = {"l1": 1e-5, "nuclear": 1e-3}.get(cfg["geometry"])
    seen = 0
    for k, rec in enumerate(ranks[0]):
        if not rec["measuring"]:
            continue
        pooled = rec["est"][6]
        if not _pooled(cfg):
            assert pooled is None and rec["ref_pooled"] is None
            continue
        for other in ranks[1:]:
            assert _same([other[k]["est"][6]], [pooled])
        if cfg.get("nan_at") == k:
            assert math.isnan(pooled) and math.isnan(rec["ref_pooled"])
            continue
        seen += 1
        assert _rel(pooled, rec["ref_pooled"]) <= tol, (k, pooled, rec["ref_pooled"])
    assert not _pooled(cfg) or seen >= 2


@pytest.mark.parametrize("world,name", list(_cases()))
def test_gradients_equal_plain_ddp(request, world, name):
    cfg = _ALL[world][name]
    res = _results(request, world)
    bf16 = cfg.get("dtype") == "bfloat16"
    for rank_records in (r[name]["records"] for r in res):
        for rec in rank_records:
            if cfg.get("nan_at") == rec["step"]:
                assert math.isnan(rec["grad_vs_mean"])
                continue
            scale = rec["grad_scale"]
            # bf16: plain DDP sums bf16 values, the hook rounds a float32 mean once
            tol = scale * (2.0 ** -7 if bf16 else 1e-6)
            assert rec["grad_vs_plain"] <= tol, (rec["step"], rec["grad_vs_plain"], scale)
            assert rec["grad_vs_mean"] <= scale * (2.0 ** -7 if bf16 else 1e-6)


def _expected_payload(cfg, bucket):
    """Expected all-reduce size of a measurement step's bucket (from its parameter shapes)."""
    shapes = bucket["shapes"]
    numel = bucket["numel"]
    sizes = [math.prod(s) for s in shapes]
    if cfg["geometry"] == "nuclear":
        grams = [min(s) ** 2 for s in shapes if len(s) == 2]
        if not grams:
            return numel, bucket["dtype"]
        return numel + sum(grams), "torch.float32"
    measured = [not cfg.get("subset") or len(s) == 2 for s in shapes]
    if not any(measured):
        return numel, bucket["dtype"]
    return sum(2 * n if m else n for n, m in zip(sizes, measured)), "torch.float32"


def _shares_solves(cfg, world, rec):
    """A nuclear measurement on several ranks adds the one share all-reduce; an l1 one with
    a noise pool the all-reduce of its pooled sum (one float64)."""
    return (cfg["geometry"] == "nuclear" or _pooled(cfg)) and world > 1 and rec["measuring"]


def _n_matrices(rec):
    return sum(len(s) == 2 for b in rec["buckets"] for s in b["shapes"])


@pytest.mark.parametrize("world,name", list(_cases()))
def test_collectives_one_allreduce_per_bucket(request, world, name):
    cfg = _ALL[world][name]
    res = _results(request, world)
    several = False
    for rank_records in (r[name]["records"] for r in res):
        for rec in rank_records:
            buckets, payloads = rec["buckets"], rec["payloads"]
            several |= len(buckets) > 1
            # nothing else: every collective of the step (DDP's own included) is counted;
            # a nuclear measurement on R > 1 ranks adds exactly one all-reduce of rows x L
            # float64 (noise, signal, solver report per matrix; + debiased signal; + pair
            # sum, tr C, ||C||_F^2, Q, A with the 'gauss-sums' dof), after the buckets'
            extra = 1 if _shares_solves(cfg, world, rec) else 0
            assert rec["hooked_seq"] == rec["plain_seq"] + extra, rec
            assert len(payloads) == len(buckets) + extra, (payloads, buckets)
            if extra:
                want = (_share_rows(cfg, world) * _n_matrices(rec) if cfg["geometry"] == "nuclear"
                        else 1)
                assert payloads[-1] == (want, "torch.float64"), payloads
                payloads = payloads[:-1]
            for b, (numel, dtype) in zip(buckets, payloads):
                if rec["measuring"]:
                    assert (numel, dtype) == _expected_payload(cfg, b), (b, numel, dtype)
                else:
                    assert (numel, dtype) == (b["numel"], b["dtype"])
    if cfg.get("bucket_cap_mb", 0.001) < 1:
        assert several, "small bucket_cap_mb should give several buckets"


@pytest.mark.parametrize("world,name", [c for c in _cases() if _ALL[c.values[0]][c.values[1]]["geometry"] == "nuclear"])
def test_ranks_share_the_solves(request, world, name):
    """Each of the 2L sqrt-traces is solved on exactly one rank (R > 1), balanced by cost;
    one rank solves all of them (R = 1)."""
    res = _results(request, world)
    per_rank = [r[name]["records"] for r in res]
    for k, rec in enumerate(per_rank[0]):
        if not rec["measuring"]:
            assert all(not other[k]["solved"] for other in per_rank)
            continue
        L = _n_matrices(rec)
        counts = [sum(n + s for n, s, _ in other[k]["solved"]) for other in per_rank]
        solves = (3 if _ALL[world][name].get("signal") == "debiased" else 2) * L
        assert sum(counts) == solves, counts
        if world > 1:  # 3 matrices (Gram sides 13, 17, 5): no rank solves all of them
            assert max(counts) < solves, counts
        # the eigensolver hints (checkpointed) stay identical on every rank, and every
        # measured shape has a report (each rank records the shared report of all matrices)
        hints = [other[k]["hints"] for other in per_rank]
        assert all(h == hints[0] for h in hints), hints
        shapes = {"x".join(map(str, s)) for b in rec["buckets"] for s in b["shapes"] if len(s) == 2}
        assert set(hints[0]) == shapes, (hints[0], shapes)


def test_one_rank_one_sample_skips_or_raises():
    (res,) = run_world("_ddp_scenarios", "run_one_rank_edges", 1)
    # MicroBatchGNS, 1 rank x 1 micro-batch: not measured, a warning, training goes on
    assert res["warned"] and res["estimate"] is None and res["step"] == 1
    # a GNSHookState on one rank can never measure: a clear error
    assert res["error"] is not None and "at least 2 samples" in res["error"]
    # the hook drives the state through its public methods, in the documented order
    # (every=2, 3 steps of A=2 micro-batches on one rank: S = 2 at steps 0 and 2), and
    # asks it for the measurement's plan once per measurement, not once per parameter
    assert [tuple(c) for c in res["protocol"]] == [
        ("micro_batches_for_sync", 0), ("accepts_samples", 0, 2), ("plan", 0), ("end_sync", 0),
        ("record", 0, 2),
        ("micro_batches_for_sync", 1), ("end_sync", 1),
        ("micro_batches_for_sync", 2), ("accepts_samples", 2, 2), ("plan", 2), ("end_sync", 2),
        ("record", 2, 2)]


def test_micro_step_failure_on_one_rank_is_invalid_everywhere_then_recovers():
    res = run_world("_ddp_scenarios", "run_micro_failure", 2)
    assert [r["raised"] for r in res] == [0, 1]  # raised once, on the failing rank only
    for r in res:
        recs = r["records"]
        assert [rec["step"] for rec in recs] == [1, 2, 3]
        assert [rec["estimate_step"] for rec in recs] == [0, 1, 2]
        for rec in recs:  # the gradients are those of the failure-free run
            assert rec["grad_diff"] == 0.0
        gns, noise, signal, valid = recs[0]["est"][:4]
        assert valid is False and math.isnan(gns)  # step 0: invalid on every rank
        assert recs[0]["clean_est"][3] is True
        for rec in recs[1:]:  # later steps: as if nothing had failed
            assert rec["est"][3] is True and rec["est"][:6] == rec["clean_est"][:6]
        # ... except the noise pool, which skipped the invalid measurement: after it the pool
        # holds one measurement, whose pooled l1 noise is that measurement's own (c4) noise
        first = recs[1]["est"]
        assert abs(first[6] - first[1]) <= 1e-6 * first[1]
        assert abs(recs[1]["clean_est"][6] - first[1]) > 1e-3 * first[1]
    assert _same(res[0]["records"][0]["est"], res[1]["records"][0]["est"])
