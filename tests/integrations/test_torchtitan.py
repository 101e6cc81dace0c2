"""torchtitan: GNSTrainer on 2 gloo ranks, and on 4 as HSDP (FSDP2 through torchtitan's own parallelize_fn,
optimizer, LR schedulers, checkpointer, MetricsProcessor; CPU patches listed in
_torchtitan_workers.py): the batch grows mid-run, the metrics reach the MetricsProcessor,
a resume from torchtitan's DCP checkpoint continues bit-exactly; ChunkedLossWrapper is
refused. And, without torchtitan, what its loss normalization does to the GNS when ranks
hold unequal numbers of valid tokens.

torchtitan is not in the test extra (it upgrades setuptools / huggingface-hub); CI (.ci/run)
runs this file in a venv of its own that sees the main environment:
    python -m venv --system-site-packages tt && tt/bin/pip install "torch==2.13.0" torchtitan==0.3.0
    GNS_REQUIRE_TORCHTITAN=1 tt/bin/python -m pytest -q tests/integrations/test_torchtitan.py
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import gns_kernels as gk

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "distributed"))

if os.environ.get("GNS_REQUIRE_TORCHTITAN") == "1" and importlib.util.find_spec("torchtitan") is None:
    raise RuntimeError("GNS_REQUIRE_TORCHTITAN=1 but torchtitan is not importable (.ci/run installs it "
                       "in its own venv)")

_NO_TT = ("torchtitan is not installed: it is left out of the test extra (it upgrades "
          "setuptools / huggingface-hub in the shared environment); .ci/run runs these tests "
          "in a venv of its own (pip install torchtitan==0.3.0 there)")


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason=_NO_TT)
def test_torchtitan_gns_trainer_refuses_cuda_graphs():
    """A step's number of micro-batches changes: GNSTrainer refuses captured CUDA graphs."""
    from _harness import run_world

    with tempfile.TemporaryDirectory(prefix="gns_tt_") as folder:
        res = run_world("_torchtitan_workers", "refused", 2, folder=folder, what="cudagraphs", timeout=400)
    assert all(r is not None and "training.disable_cuda_graphs" in r for r in res), res


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason=_NO_TT)
def test_torchtitan_gns_trainer_two_gloo_ranks():
    from _harness import run_world

    with tempfile.TemporaryDirectory(prefix="gns_tt_") as folder:
        res = run_world("_torchtitan_workers", "fit", 2, folder=folder, timeout=400)
    for rank, r in enumerate(res):
        a, b = r["first"], r["second"]
        assert "ChunkedLossWrapper" in a["refusal"]
        assert a["model"].startswith("FSDP") and a["step"] == 4 and b["step"] == 4
        hist = a["history"]
        assert [h["step"] for h in hist] == [0, 1, 2, 3]
        sizes = [h["batch_size"] for h in hist]
        assert sizes[0] == 8 and sizes[-1] == 16, sizes          # B_0 = global_batch_size, grew
        assert [h["accum_steps"] for h in hist] == [s // (2 * 2) for s in sizes]
        assert all(h["measured"] and h["valid"] and h["gns"] > 0 for h in hist)   # every=1
        # the data loader served exactly the micro-batches the steps took
        assert a["data_n"] == sum(h["accum_steps"] for h in hist)
        # MetricsProcessor.log got the coordinator's row of each step (torchtitan counts from 1)
        assert [s for s, _ in a["logged"]] == [1, 2, 3, 4]
        for (s, extra), h in zip(a["logged"], hist):
            assert extra["gns/step"] == h["step"] == s - 1
            assert extra["gns/batch_size"] == h["batch_size"] and extra["gns/gns"] == h["gns"]
        # resumed from torchtitan's step-2 checkpoint (DCPState(coord) among its states)
        assert len(b["history"]) == 2
        for x, y in zip(b["history"], hist[2:]):
            assert x.keys() == y.keys()
            for k in x:
                assert x[k] == y[k] or (isinstance(x[k], float) and math.isnan(x[k]) and math.isnan(y[k])), (rank, k)
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), (rank, k)
    assert res[0]["first"]["history"] == res[1]["first"]["history"]


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason=_NO_TT)
def test_torchtitan_gns_trainer_hsdp_four_gloo_ranks():
    """HSDP (data_parallel_replicate_degree 2 x data_parallel_shard_degree 2): the GNS
    samples are all 4 data-parallel ranks, B a multiple of 4 x local_batch_size, and the
    batch grows."""
    from _harness import run_world

    with tempfile.TemporaryDirectory(prefix="gns_tt_") as folder:
        res = run_world("_torchtitan_workers", "fit_hsdp", 4, folder=folder, timeout=500)
    for rank, r in enumerate(res):
        assert r["hsdp"] and r["replicate"] == 2 and r["dp"] == (4, rank)
        hist = r["history"]
        sizes = [h["batch_size"] for h in hist]
        assert sizes[0] == 8 and sizes[-1] == 16, sizes
        assert [h["accum_steps"] for h in hist] == [s // (4 * 2) for s in sizes]
        assert all(h["measured"] and h["valid"] and h["gns"] > 0 for h in hist)
        assert r["data_n"] == sum(h["accum_steps"] for h in hist)
    assert all(r["history"] == res[0]["history"] for r in res[1:])


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason=_NO_TT)
def test_torchtitan_gns_trainer_fsdp_x_tp_four_gloo_ranks():
    """FSDP2 x tensor parallelism (data_parallel_shard_degree 2 x tensor_parallel_degree
    2, torchtitan's llama3 TP plan: colwise / rowwise projections, sequence-parallel norms):
    R = the 2 data-parallel ranks, B a multiple of 2 x local_batch_size, the batch grows,
    the first measurement equals, within 1e-4, the same run on 2 ranks without tp, and a
    resume from torchtitan's checkpoint continues bit for bit."""
    from _harness import rel, run_world, same_state

    with tempfile.TemporaryDirectory(prefix="gns_tt_") as folder:
        res = run_world("_torchtitan_workers", "fit_tp", 4, folder=folder, resume=True, timeout=500)
    with tempfile.TemporaryDirectory(prefix="gns_tt_") as folder:
        flat = run_world("_torchtitan_workers", "fit_tp", 2, folder=folder, tp=1, timeout=500)
    # resumed from torchtitan's step-2 checkpoint, every process its own coordinator share
    # (the tp ranks of a data-parallel rank hold different pool parts): step 3 and the final
    # state as the uninterrupted run's, bit for bit
    for rank, r in enumerate(res):
        assert len(r["resumed_history"]) == 1
        x, y = r["resumed_history"][0], r["history"][2]
        assert x.keys() == y.keys()
        assert all(x[k] == y[k] or (isinstance(x[k], float) and math.isnan(x[k]) and math.isnan(y[k]))
                   for k in x), rank
        same_state(r["resumed_state"], r["state"], f"rank {rank}")
    with pytest.raises(AssertionError):  # the premise: the tp ranks' shares differ (pool parts)
        same_state(res[0]["state"], res[1]["state"])
    for rank, r in enumerate(res):
        assert r["tp_mesh"] and r["tp"] == (2, rank % 2) and r["dp"] == (2, rank // 2)
        hist = r["history"]
        sizes = [h["batch_size"] for h in hist]
        assert sizes[0] == 4 and sizes[-1] == 8, sizes
        assert [h["accum_steps"] for h in hist] == [s // (2 * 2) for s in sizes]
        assert all(h["measured"] and h["valid"] and h["gns"] > 0 for h in hist)
        assert r["data_n"] == sum(h["accum_steps"] for h in hist)
    assert all(r["history"] == res[0]["history"] for r in res[1:])
    a, b = res[0]["history"][0], flat[0]["history"][0]
    assert not flat[0]["tp_mesh"] and flat[0]["dp"] == (2, 0)
    for key in ("gns", "noise", "signal"):
        assert rel(a[key], b[key]) < 1e-4, (key, a[key], b[key])


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason=_NO_TT)
def test_torchtitan_gns_trainer_hsdp_x_tp_eight_gloo_ranks():
    """HSDP x TP (data_parallel_replicate_degree 2 x data_parallel_shard_degree 2 x
    tensor_parallel_degree 2): R = 4, the batch grows 8 -> 16, and every measurement equals,
    within 1e-4, the same run on 4 FSDP2 ranks without tp (measured: 2e-8 on the first)."""
    from _harness import rel, run_world

    with tempfile.TemporaryDirectory(prefix="gns_tt_") as folder:
        res = run_world("_torchtitan_workers", "fit_tp", 8, folder=folder, replicate=2, timeout=600)
    with tempfile.TemporaryDirectory(prefix="gns_tt_") as folder:
        flat = run_world("_torchtitan_workers", "fit_tp", 4, folder=folder, tp=1, timeout=600)
    for rank, r in enumerate(res):
        assert r["hsdp"] and r["tp"] == (2, rank % 2) and r["dp"] == (4, rank // 2)
        assert [h["batch_size"] for h in r["history"]] == [h["batch_size"] for h in flat[0]["history"]]
        assert r["history"][0]["batch_size"] == 8 and r["history"][-1]["batch_size"] == 16
        assert r["history"] == res[0]["history"]
    for a, b in zip(res[0]["history"], flat[0]["history"]):
        for key in ("gns", "noise", "signal"):
            assert rel(a[key], b[key]) < 1e-4, (key, a[key], b[key])


def test_torchtitan_token_normalization_weights_ranks():
    """torchtitan divides each rank's token-summed loss by the global number of valid
    tokens N and FSDP2 sums, so rank j's gradient is (n_j / N) x its per-token mean m_j.
    The GNS treats the R rank gradients as equal-weight samples: with equal n_j it is the
    GNS of the per-rank means (a common factor cancels in noise / signal); with unequal
    n_j the samples are weighted and the estimate is another one (here far larger)."""
    g = torch.Generator().manual_seed(7)
    d, R = 96, 4
    signal = torch.randn(d, generator=g, dtype=torch.float64)

    def rank_means(counts):
        return [signal + torch.randn(n, d, generator=g, dtype=torch.float64).mean(0) * 0.5
                for n in counts]

    for counts, same in (([32, 32, 32, 32], True), ([56, 40, 24, 8], False)):
        means = rank_means(counts)
        N = sum(counts)
        titan = [[(n / N) * m] for n, m in zip(counts, means)]     # torchtitan's rank gradients
        plain = [[m] for m in means]                                 # per-rank mean gradients
        for geometry in ("l2", "l1"):
            a = gk.estimate(titan, batch_size=N, geometry=geometry)
            b = gk.estimate(plain, batch_size=N, geometry=geometry)
            assert a.valid and b.valid
            if same:
                assert a.gns == pytest.approx(b.gns, rel=1e-9)
                # noise and signal themselves are 1/R^2 of the per-rank-mean convention
                assert a.noise == pytest.approx(b.noise / R**2, rel=1e-9)
            else:
                assert a.gns > 3 * b.gns, (geometry, a.gns, b.gns)
