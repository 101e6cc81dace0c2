"""AdaptiveBatching under real DDP and FSDP2 on 2 gloo ranks: a torch.compile'd model gives the
eager run's batches, estimates and weights; MicroBatchGNS as the DDP hook state (ranks x
micro-batches) follows the coordinator's accumulation count on every rank."""
from __future__ import annotations

import math

import pytest
import torch

from _harness import run_world

pytestmark = pytest.mark.distributed


def _close(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-9)


def test_compiled_ddp_model_matches_eager():
    eager = run_world("_adaptive_workers", "run", 2, compiled=False)
    comp = run_world("_adaptive_workers", "run", 2, compiled=True, timeout=400)
    for e, c in zip(eager, comp):
        assert [r["batch_size"] for r in c["rows"]] == [r["batch_size"] for r in e["rows"]]
        assert [r["measured"] for r in c["rows"]] == [r["measured"] for r in e["rows"]]
        assert all(_close(rc["gns"], re["gns"]) for rc, re in zip(c["rows"], e["rows"]))
        for p, q in zip(c["weights"], e["weights"]):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    rows = eager[0]["rows"]
    assert sum(r["measured"] for r in rows) == 4 and rows[-1]["next_batch_size"] > 16


def test_microbatchgns_as_ddp_hook_state_ranks_times_micro_batches():
    out = run_world("_adaptive_workers", "run", 2, micro=True, steps=8)
    r0, r1 = out
    assert r0["rows"] == r1["rows"] or all(
        all(_close(a[k], b[k]) if isinstance(a[k], float) else a[k] == b[k] for k in a)
        for a, b in zip(r0["rows"], r1["rows"]))
    rows = r0["rows"]
    assert all(r["batch_size"] == 2 * r["accum_steps"] * 4 for r in rows)
    assert sum(r["accum_steps"] for r in rows) == len(r0["micro_sizes"])  # A micro-batches per step
    assert set(r0["micro_sizes"]) == {4}
    assert r0["position"] == rows[-1]["samples_seen"] == sum(r["batch_size"] for r in rows)
    assert all(r["valid"] for r in rows if r["measured"]) and sum(r["measured"] for r in rows) == 4
    assert rows[-1]["next_batch_size"] > 16


@pytest.mark.slow
def test_fsdp2_eager_and_compiled_match_ddp():
    """FSDP2 (ranks as samples) through the coordinator: the same batches and GNS as DDP on
    the same model, data and seed, eager and torch.compile'd."""
    ddp = run_world("_adaptive_workers", "run", 2, steps=6)[0]["rows"]
    for compiled in (False, True):
        out = run_world("_adaptive_workers", "run_fsdp", 2, compiled=compiled, timeout=400)
        rows = out[0]["rows"]
        assert out[1]["rows"] == rows or all(
            _close(a["gns"], b["gns"]) for a, b in zip(rows, out[1]["rows"]))
        assert [r["batch_size"] for r in rows] == [r["batch_size"] for r in ddp]
        assert all(_close(a["gns"], b["gns"]) for a, b in zip(rows, ddp))
    assert rows[-1]["next_batch_size"] > 16


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_readme_loop_on_the_model_matches_the_explicit_loop(fsdp):
    """AdaptiveBatching(ddp_or_fsdp_model, opt, geometry=...) + coord.batches(...) (the
    README loop: no hook state, no no_sync, no coord.step()) gives the explicit loop's
    batches, GNS and weights."""
    explicit = run_world("_adaptive_workers", "run_fsdp" if fsdp else "run", 2, steps=6)
    readme = run_world("_adaptive_workers", "run_model_form", 2, fsdp=fsdp, steps=6)
    for e, r in zip(explicit, readme):
        assert [x["batch_size"] for x in r["rows"]] == [x["batch_size"] for x in e["rows"]]
        assert [x["measured"] for x in r["rows"]] == [x["measured"] for x in e["rows"]]
        assert all(_close(a["gns"], b["gns"]) for a, b in zip(r["rows"], e["rows"]))
        for p, q in zip(r["weights"], e["weights"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert explicit[0]["rows"][-1]["next_batch_size"] > 16


def test_fsdp2_params_collected_before_fully_shard_are_refused():
    out = run_world("_adaptive_workers", "run_fsdp_params_before_shard", 2)
    for r in out:
        assert r["error"] and "AFTER fully_shard" in r["error"] and "fsdp_gns_shard_placement" in r["error"]
