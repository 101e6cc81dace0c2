"""DDP with ``find_unused_parameters=True`` and gk.ddp_gns_hook on 2 gloo ranks.

The hook's own collective of a measurement (the l1 noise pool's sum, the nuclear share) used
to be issued from a future's callback, on a gloo worker thread, at a time that differed
between the ranks; DDP all-reduces its used-parameter map (find_unused_parameters) right
after the last bucket's hook returns, so the ranks issued the two in different orders: a
gloo size mismatch (SIGABRT), typically on accumulation steps. Here: the hook issues every
all-reduce on the thread running backward; a branch unused on one rank only, in some
micro-batches or all, or on every rank, is measured as gk.estimate measures the gathered
gradients (zero where a rank produced none: what DDP averages); the gradients are plain
DDP's; the coordinator's loop gives the same GNS and weights as without the flag.
"""
from __future__ import annotations

import math

import pytest
import torch

from _harness import run_world, rel as _rel

pytestmark = pytest.mark.distributed

TOL = {"l2": 1e-5, "l1": 1e-5, "nuclear": 1e-3}

SCENARIOS = {
    "l2": dict(geometry="l2"),
    "l1": dict(geometry="l1"),
    "nuclear": dict(geometry="nuclear"),
    "l2_accumulate": dict(geometry="l2", accumulate=3),
    "l1_accumulate": dict(geometry="l1", accumulate=3),
    "nuclear_accumulate": dict(geometry="nuclear", accumulate=2),
    "l2_micro": dict(geometry="l2", accumulate=3, micro=True),
    "l1_micro": dict(geometry="l1", accumulate=3, micro=True),
    "nuclear_micro": dict(geometry="nuclear", accumulate=2, micro=True),
    "l1_accumulate_view": dict(geometry="l1", accumulate=3, as_view=True),
    "l1_micro_view": dict(geometry="l1", accumulate=3, micro=True, as_view=True),
}


@pytest.fixture(scope="module")
def world2():
    return run_world("_unused_workers", "run_many", 2, scenarios=SCENARIOS)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_unused_branch_measured_like_the_gathered_gradients(world2, name):
    cfg = SCENARIOS[name]
    r0, r1 = (r[name]["records"] for r in world2)
    tol = TOL[cfg["geometry"]]
    assert len(r0) == 5
    for k, (a, b) in enumerate(zip(r0, r1)):
        assert a["estimate_step"] == k
        assert a["est"] == b["est"], (k, a["est"], b["est"])  # identical on both ranks
        est, ref = a["est"], a["ref"]
        assert est[3] is True and ref[3] is True, (k, est, ref)
        for what, x, y in zip(("gns", "noise", "signal"), est[:3], ref[:3]):
            assert math.isfinite(x) and _rel(x, y) <= tol, f"step {k} {what}: hook {x} vs gk.estimate {y}"
        if a["ref_pooled"] is not None:
            assert _rel(est[6], a["ref_pooled"]) <= tol, (k, est[6], a["ref_pooled"])
        else:
            assert est[6] is None


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_unused_branch_collectives_and_gradients(world2, name):
    r0, r1 = (r[name]["records"] for r in world2)
    for k, (a, b) in enumerate(zip(r0, r1)):
        # every all-reduce of the hook on the thread running backward, the same sizes on
        # both ranks whichever parameters a rank used
        assert a["threads_ok"] and b["threads_ok"], k
        assert a["payloads"] == b["payloads"], (k, a["payloads"], b["payloads"])
        for rec in (a, b):
            assert rec["none_hooked"] == rec["none_plain"], (k, rec)
            assert rec["grad_vs_plain"] <= 1e-6, (k, rec["grad_vs_plain"])
    # the branch (d.weight, d.bias: the last two parameters) is unused everywhere at step 3
    # (DDP leaves its .grad None), used by some rank at every other step
    assert r0[3]["none_hooked"][-2:] == [True, True]
    assert all(not any(rec["none_hooked"]) for rec in (r0[0], r0[1], r0[2], r0[4]))


def test_adaptive_loop_with_find_unused_parameters():
    """The reported crash: gk.AdaptiveBatching (A >= 2 micro-batches per rank, no_sync) under
    DDP(find_unused_parameters=True), GNSHookState and MicroBatchGNS: it runs, and gives the
    GNS and weights of the same loop without the flag (no parameter is unused here)."""
    res = run_world("_unused_workers", "run_adaptive_both", 2, steps=4)
    for micro in (False, True):
        fu = [r[(micro, True)] for r in res]
        plain = [r[(micro, False)] for r in res]
        rows = fu[0]["rows"]
        assert rows == fu[1]["rows"]
        assert all(r["A"] >= 2 for r in rows) and len(rows) == 4
        assert all(math.isfinite(r["gns"]) for r in rows), rows
        assert rows == plain[0]["rows"], (rows, plain[0]["rows"])
        for p, q in zip(fu[0]["weights"], plain[0]["weights"]):
            assert torch.equal(p, q)
