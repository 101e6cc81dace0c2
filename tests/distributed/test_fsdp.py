"""gk.attach_fsdp_gns on FSDP2 models, 2 and 4 gloo ranks (spawned; see _harness.py).

All scenarios of one world size run in one process group (a spawn costs seconds); the
rank-side code is in _fsdp_workers.py, the assertions here. Expected values come from
gk.estimate on the all-gathered local gradients of the same step (float64), the DDP hook
(gk.ddp_gns_hook) on the same model, data and seed, plain FSDP2 (no hook) on the same
data, the process group's collective sequence counter and the wrapped dist calls.
"""
from __future__ import annotations

import math

import pytest
import torch

from _harness import GATHERED_TOL, run_world, rel as _rel

pytestmark = pytest.mark.distributed

TOL = GATHERED_TOL
TOL_DEBIASED = {"l2": 1e-5, "l1": 1e-4, "nuclear": 1e-3}  # see test_ddp_hook.TOL_DEBIASED

SCENARIOS_2 = {
    "l2": dict(geometry="l2", steps=3, every=2),
    "l1": dict(geometry="l1", steps=3, every=2, after_remove=True),
    "nuclear": dict(geometry="nuclear", steps=3, every=2),
    "nuclear_raw_shard1_no_reshard": dict(geometry="nuclear", bias_correction=False, placement="gns",
                                          reshard=False, steps=1),
    "l1_subset_shard1_no_reshard": dict(geometry="l1", subset=True, placement="gns", reshard=False, steps=1),
    "l1_mp_bf16": dict(geometry="l1", mp="bf16", ddp=False, steps=1),
    "nuclear_mp_bf16": dict(geometry="nuclear", mp="bf16", ddp=False, steps=1),
    "l2_mp_bf16_reduce_bf16": dict(geometry="l2", mp="bf16_reduce_bf16", ddp=False, steps=1),
    "l1_mp_fp16_reduce_fp16": dict(geometry="l1", mp="fp16", ddp=False, steps=1),
    "l1_accumulate": dict(geometry="l1", accumulate=3, steps=2),
    "nuclear_accumulate": dict(geometry="nuclear", accumulate=2, steps=1),
    # SUM op; and the packing into a separate buffer (reuse_input=False)
    "l1_sum_op_copy_pack": dict(geometry="l1", force_sum=True, reuse_input=False, steps=1, ddp=False),
    # a parameter without gradient: FSDP2 leaves it out of the reduce-scatter input
    "nuclear_unused_param": dict(geometry="nuclear", unused=True, steps=1, ddp=False),
    "l1_nan": dict(geometry="l1", nan_at=0, steps=2, ddp=False),
    "nuclear_nan": dict(geometry="nuclear", nan_at=0, steps=2, ddp=False),
}

SCENARIOS_4 = {
    "l1": dict(geometry="l1", steps=2, every=2),
    "l2_mp_bf16": dict(geometry="l2", mp="bf16", ddp=False, steps=1),
    "nuclear": dict(geometry="nuclear", steps=1),
    "l1_nan": dict(geometry="l1", nan_at=0, steps=2, ddp=False),
    "l2_unused_param": dict(geometry="l2", unused=True, steps=1, ddp=False),
    "nuclear_debiased": dict(geometry="nuclear", signal="debiased", steps=1),
    "l1_debiased_mp_fp16": dict(geometry="l1", signal="debiased", mp="fp16", ddp=False, steps=1),
}

GROUPS = 3  # fully_shard on model.a, model.b and the root (model.c)


@pytest.fixture(scope="module")
def world2():
    return run_world("_fsdp_workers", "run_many", 2, timeout=240, scenarios=SCENARIOS_2)


@pytest.fixture(scope="module")
def world4():
    return run_world("_fsdp_workers", "run_many", 4, timeout=240, scenarios=SCENARIOS_4)


def _cases(filter_=lambda name, kw: True):
    for name, kw in SCENARIOS_2.items():
        if filter_(name, kw):
            yield pytest.param(2, name, id=f"R2-{name}")
    for name, kw in SCENARIOS_4.items():
        if filter_(name, kw):
            yield pytest.param(4, name, id=f"R4-{name}")


def _scenario(world, name):
    return (SCENARIOS_2 if world == 2 else SCENARIOS_4)[name]


def _results(request, world, name):
    return [r[name] for r in request.getfixturevalue(f"world{world}")]


def _same(a, b):
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def _finite_steps(kw):
    nan_at = kw.get("nan_at")
    return [k for k in range(kw.get("steps", 3)) if nan_at is None or k != nan_at]


@pytest.mark.parametrize("world,name", list(_cases()))
def test_estimate_matches_gathered_gradients_and_ddp(request, world, name):
    """FSDP2 estimate == gk.estimate on the gathered local gradients == DDP hook estimate."""
    kw = _scenario(world, name)
    geometry = kw["geometry"]
    tol = (TOL_DEBIASED if kw.get("signal") == "debiased" else TOL)[geometry]
    res = _results(request, world, name)
    checked = 0
    for rank_res in res:
        for rec in rank_res["records"]:
            if not rec["measuring"] or rec["step"] not in _finite_steps(kw):
                continue
            est, ref = rec["est"], rec["ref"]
            assert est is not None and ref is not None
            assert est[3] is True and ref[3] is True, (rec["step"], est, ref)
            for i, field in enumerate(("gns", "noise", "signal")):
                assert _rel(est[i], ref[i]) <= tol, (rec["step"], field, est, ref)
                if rec["ddp"] is not None:
                    assert _rel(est[i], rec["ddp"][i]) <= tol, (rec["step"], field, est, rec["ddp"])
            checked += 1
    assert checked >= world  # at least one measured step per rank


@pytest.mark.parametrize("world,name", list(_cases()))
def test_identical_on_every_rank_and_schedule(request, world, name):
    kw = _scenario(world, name)
    every = kw.get("every", 1)
    res = _results(request, world, name)
    for rank_res in res:
        assert rank_res["groups"] == GROUPS
        assert rank_res["unused_grad_is_none"]
        for rec in rank_res["records"]:
            k = rec["step"]
            assert rec["measuring"] == (k % every == 0)
            assert rec["state_step"] == k + 1  # one optimizer step per synchronized backward
            if rec["measuring"]:
                assert rec["estimate_step"] == k
    for k in range(len(res[0]["records"])):
        ests = [r["records"][k]["est"] for r in res]
        if ests[0] is not None:
            assert all(_same(e, ests[0]) for e in ests[1:]), ests


@pytest.mark.parametrize("world,name", list(_cases()))
def test_sharded_gradients_are_plain_fsdp2s(request, world, name):
    """The hook leaves the sharded gradients plain FSDP2 produces: bitwise at 2 ranks and
    on steps without a measurement. At 4 ranks gloo's reduce-scatter (an all-reduce
    whose segmentation depends on the buffer length) may add the R terms of an element
    in another order for the longer packed buffer: then they agree to the reassociation
    bound 2 (R-1) u sum_j |g^j| (u = 2^-24). bf16 / fp16 reduce dtype: the hook reduces in
    float32 and rounds once, so within bf16 rounding."""
    kw = _scenario(world, name)
    finite = _finite_steps(kw)
    for rank_res in _results(request, world, name):
        for rec in rank_res["records"]:
            if rec["step"] not in finite:
                continue
            if kw.get("mp") in ("bf16_reduce_bf16", "fp16") and rec["measuring"]:
                assert rec["grad_vs_plain"] <= 2 * 2.0**-8 * rec["grad_scale"], rec["grad_vs_plain"]
            elif world == 2 or not rec["measuring"]:
                assert rec["grad_equal_plain"], (rec["step"], rec["grad_vs_plain"])
            else:
                bound = 2 * (world - 1) * 2.0**-24 * world * rec["abs_scale"]
                assert rec["grad_vs_plain"] <= bound, (rec["step"], rec["grad_vs_plain"], bound)
            bound = (1e-6 if kw.get("mp", "none") == "none" else 2.0**-7) * rec["grad_scale"]
            assert rec["grad_vs_mean"] <= bound, (rec["step"], rec["grad_vs_mean"], rec["grad_scale"])


@pytest.mark.parametrize("world,name", list(_cases()))
def test_collectives_counted(request, world, name):
    """Measurement steps: one reduce-scatter per param group (l1/l2: twice plain's payload,
    float32; nuclear: plain's payload plus the other-dimension blocks of non-natural
    matrices) and l1/l2: ONE all-reduce of 4 numbers per step, after all of them;
    nuclear: one all-reduce of the group's Grams right after each group's reduce-scatter
    (each group here has one weight matrix), then ONE all-reduce of 3L float64 after all of
    them (the ranks' shares of the sqrt-traces). Other steps: exactly plain FSDP2's calls."""
    kw = _scenario(world, name)
    geometry = kw["geometry"]
    for rank_res in _results(request, world, name):
        for rec in rank_res["records"]:
            plain, hooked = rec["plain_calls"], rec["hooked_calls"]
            assert [c[0] for c in plain] == ["reduce_scatter"] * GROUPS  # only the synchronized micro-step
            if not rec["measuring"]:
                assert hooked == plain
                assert rec["hooked_seq"] == rec["plain_seq"]
                continue
            rs = [c for c in hooked if c[0] == "reduce_scatter"]
            ar = [c for c in hooked if c[0] == "all_reduce"]
            assert len(rs) == GROUPS
            if geometry == "nuclear":
                assert rec["hooked_seq"] == rec["plain_seq"] + GROUPS + 1
                assert [c[0] for c in hooked] == ["reduce_scatter", "all_reduce"] * GROUPS + ["all_reduce"]
                # L matrices = the groups' Gram all-reduces (one weight matrix per group)
                rows = 4 if kw.get("signal") == "debiased" else 3  # + the debiased signal
                rows += 4 * _pooled(kw)  # + the pooled sqrt-trace, pair sum, dof and first flag
                assert hooked[-1] == ("all_reduce", rows * (len(ar) - 1), "torch.float64")
                ar = ar[:-1]
            else:
                assert rec["hooked_seq"] == rec["plain_seq"] + 1
                assert len(ar) == 1 and hooked[-1][0] == "all_reduce"  # after every reduce-scatter
            for h, p in zip(rs, plain):
                assert h[2] == "torch.float32"
                if geometry == "nuclear":
                    assert p[1] <= h[1] <= 2 * p[1]
                else:
                    assert h[1] == 2 * p[1]
            if geometry == "nuclear":
                assert all(c[2] == "torch.float32" for c in ar)
                # two k x k Grams per weight matrix, k = min(m, n): 24x13, 17x24, 5x17
                assert sorted(c[1] for c in ar) == sorted(2 * k * k for k in (13, 17, 5))
            else:
                width = 5 if kw.get("signal") == "debiased" and geometry == "l1" else 4
                width += _pooled(kw)  # the l1 noise pool's sum rides in the same all-reduce
                assert ar[0] == ("all_reduce", width, "torch.float64")


def _pooled(kw):
    return kw["geometry"] != "l2" and kw.get("bias_correction", True)


@pytest.mark.parametrize("world,name", list(_cases()))
def test_noise_pooled_matches_the_float64_pool(request, world, name):
    """FSDP2: noise_pooled equals gns_kernels.reference.pooled_noise on the gathered
    gradients (each rank pools its shard, l1; the solving rank each matrix, nuclear); nan
    at an invalid measurement; None without a pool."""
    kw = _scenario(world, name)
    geometry = kw["geometry"]
    tol = TOL[geometry]
    for rank_res in _results(request, world, name):
        for rec in rank_res["records"]:
            if not rec["measuring"]:
                continue
            pooled, want = rec["est"][4], rec["ref_pooled"]
            if not _pooled(kw):
                assert pooled is None
                continue
            if kw.get("nan_at") == rec["step"]:
                assert math.isnan(pooled) and math.isnan(want)
                continue
            assert abs(pooled - want) <= tol * abs(want), (rec["step"], pooled, want)


@pytest.mark.parametrize("world,name", list(_cases()))
def test_in_place_packing_used(request, world, name):
    """l1/l2 with a float32 reduce dtype pack in FSDP's enlarged input buffer (reuse_input);
    bf16 reduce dtype, nuclear and reuse_input=False use a separate pack."""
    kw = _scenario(world, name)
    measured = sum(rec["measuring"] for rec in _results(request, world, name)[0]["records"])
    expect_in_place = (kw["geometry"] != "nuclear" and kw.get("reuse_input", True)
                       and kw.get("mp", "none") in ("none", "bf16"))
    for rank_res in _results(request, world, name):
        assert rank_res["packed_in_place"] == (GROUPS * measured if expect_in_place else 0)


def test_nuclear_payload_natural_vs_extra(request):
    """Default Shard(0): the wide 17x24 and 5x17 weights (row Gram) carry their column
    blocks in the reduce-scatter; with fsdp_gns_shard_placement the 17x24 one is Shard(1)
    (natural: no extra payload); the tall 24x13 one is natural either way."""
    R = 2
    default = _results(request, 2, "nuclear")[0]
    shard1 = _results(request, 2, "nuclear_raw_shard1_no_reshard")[0]
    plain = {c[1] for c in default["records"][0]["plain_calls"]}
    sizes = sorted(c[1] for c in default["records"][0]["hooked_calls"] if c[0] == "reduce_scatter")
    pad = lambda m: -(-m // R) * R  # noqa: E731
    a = pad(24) * 13 + pad(24)  # tall: natural
    b = pad(17) * 24 + pad(17) + 17 * pad(24)  # + column blocks of the 17x24 weight
    c = pad(5) * 17 + 5 * pad(17)  # + column blocks of the 5x17 weight
    assert sizes == sorted([a, b, c])
    assert a in plain
    assert shard1["placements"][shard1["names"].index("b.weight")] == "S(1)"
    s1 = sorted(c_[1] for c_ in shard1["records"][0]["hooked_calls"] if c_[0] == "reduce_scatter")
    assert s1 == sorted([a, 17 * 24 + pad(17), c])


def test_remove_restores_plain_fsdp2(request):
    for rank_res in _results(request, 2, "l1"):
        after = rank_res["after_remove"]
        assert after["step_unchanged"]
        assert after["calls"] == rank_res["records"][1]["plain_calls"]  # same shapes, no extras
        assert after["comms"] and "GNSReduceScatter" not in after["comms"]
        assert after["twice"] is not None and "already attached" in after["twice"]
        assert after["wrapped_after_remove"] == []  # FSDP2's own post_backward again


@pytest.mark.parametrize("world,name", [(2, "l1_nan"), (2, "nuclear_nan"), (4, "l1_nan")])
def test_nan_on_one_rank_invalid_everywhere_then_recovers(request, world, name):
    kw = _scenario(world, name)
    res = _results(request, world, name)
    for rank_res in res:
        for rec in rank_res["records"]:
            est = rec["est"]
            assert est is not None
            if rec["step"] == kw["nan_at"]:
                assert est[3] is False and all(math.isnan(v) for v in est[:3]), est
            else:
                assert est[3] is True and math.isfinite(est[0]), est


def test_bad_input():
    from gns_kernels.distributed import GNSHookState, MicroBatchGNS
    from gns_kernels.distributed.fsdp import attach_fsdp_gns

    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match="state"):
        attach_fsdp_gns(model, object())
    with pytest.raises(ValueError, match="shift"):
        attach_fsdp_gns(model, GNSHookState("l1", batch_size=8, shift="last"))
    with pytest.raises(TypeError, match="MicroBatchGNS"):
        attach_fsdp_gns(model, MicroBatchGNS(list(model.parameters()), geometry="l1", batch_size=8,
                                             micro_batches=2))
    with pytest.raises(ValueError, match="no FSDP2 module"):
        attach_fsdp_gns(model, GNSHookState("l1", batch_size=8))
    with pytest.raises(TypeError, match="model"):
        attach_fsdp_gns("not a model", GNSHookState("l1", batch_size=8))
    # the 'gauss-sums' dof needs each rank's deviation from the whole mean gradient
    with pytest.raises(ValueError, match="nuclear_dof: 'gauss-sums' is not available under FSDP2"):
        attach_fsdp_gns(model, GNSHookState("nuclear", batch_size=8, nuclear_dof="gauss-sums"))


def test_shard_placement():
    from torch.distributed.tensor import Shard

    from gns_kernels.distributed.fsdp import fsdp_gns_shard_placement

    p = lambda *s: torch.nn.Parameter(torch.zeros(*s))  # noqa: E731
    assert fsdp_gns_shard_placement(p(17, 24), 4) == Shard(1)  # wide, 24 % 4 == 0
    assert fsdp_gns_shard_placement(p(16, 16), 4) == Shard(1)  # square: row Gram
    assert fsdp_gns_shard_placement(p(5, 17), 4) == Shard(0)  # uneven: FSDP2 needs even Shard(1)
    assert fsdp_gns_shard_placement(p(24, 13), 4) == Shard(0)  # tall: column Gram natural
    assert fsdp_gns_shard_placement(p(24), 4) == Shard(0)

    class TPSlice:  # a tensor-parallel DTensor's shape and local slice, as FSDP2 sees them
        def __init__(self, shape, local):
            self.shape, self._local = torch.Size(shape), torch.zeros(local)

        def dim(self):
            return len(self.shape)

        def to_local(self):
            return self._local

    # wide 4096 x 11008 sliced by tp 8 on dim 1: the local width 1376 decides (1376 % 64 != 0;
    # the global 11008 % 64 == 0 would choose Shard(1) and FSDP2 would refuse the uneven split)
    assert fsdp_gns_shard_placement(TPSlice((4096, 11008), (4096, 1376)), 64) == Shard(0)
    assert fsdp_gns_shard_placement(TPSlice((4096, 11008), (4096, 1376)), 16) == Shard(1)
    # the side is the whole matrix's: a wide weight whose local slice is tall stays row-Gram
    assert fsdp_gns_shard_placement(TPSlice((512, 2048), (512, 256)), 4) == Shard(1)
