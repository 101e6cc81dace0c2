"""GNSCallback in a Lightning Trainer on 2 gloo processes: under DDP and under
ModelParallelStrategy (FSDP2, fully_shard in configure_model; and FSDP2 x tensor
parallelism on 4 processes) it measures, logs, grows the accumulation mid-epoch and
checkpoints every rank's state (resumed through ckpt_path); LR schedulers, FSDP1
(FSDPStrategy) and a LightningModule that is not the FSDP2 root are refused."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning; in the test extra)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _harness import run_world, same_state as _same  # noqa: E402

pytestmark = pytest.mark.distributed
W = "_lightning_workers"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_lightning_callback_adapts_and_logs(strategy):
    """tp: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2) on 4
    processes (colwise / rowwise, then fully_shard over the dp mesh): R = 2, the tp ranks of
    a data-parallel rank see the same micro-batches."""
    world = 4 if strategy == "tp" else 2
    with tempfile.TemporaryDirectory(prefix="gns_pl_") as folder:
        res = run_world(W, "fit", world, folder=folder, strategy=strategy, steps=8, stop=5,
                        resume=True, timeout=300)
    for rank, r in enumerate(res):
        assert r["global_step"] == 8 and r["coord_step"] == 8
        assert all(s == 4 for s in r["sizes"])
        # the micro-batches the module saw: sum of A_k over the 8 steps
        steps_logged = [int(d["gns/step"]) for d in r["logged"]]
        assert steps_logged == list(range(8))
        accum = [int(d["gns/accum_steps"]) for d in r["logged"]]
        assert len(r["sizes"]) == sum(accum)
        assert accum[-1] > accum[0], f"rank {rank}: the batch never grew ({accum})"
        assert any("gns/gns" in d for d in r["logged"])
        assert [d["gns/batch_size"] for d in r["logged"]] == [2 * 4 * a for a in accum]  # R = 2
    assert all(r["logged"] == res[0]["logged"] for r in res[1:])
    if strategy == "tp":  # the tp pairs (0, 1) and (2, 3) read the same data, the pairs not
        assert res[0]["seen"] == res[1]["seen"] and res[2]["seen"] == res[3]["seen"]
        assert res[0]["seen"] != res[2]["seen"]
    for rank, r in enumerate(res):
        # loggers' step (_batches_that_stepped) counts optimizer steps (it stayed 0)
        assert r["batches_that_stepped"] == 8
        # issue 39 item 12: resumed from the step-5 checkpoint (ModelCheckpoint, mid-epoch)
        # through ckpt_path, the run continues the uninterrupted one exactly: the same
        # micro-batches from the first on (Lightning restarted the epoch's plain
        # DataLoader at its first batch), the same coordinator state (batch, EMAs,
        # sampler position, pool) and bit-identical weights (they differed by 0.02)
        n = r["before"]
        assert 0 < n < len(r["seen"])
        assert r["resumed_seen"] == r["seen"][n:], f"rank {rank}"
        _same(r["resumed_state"], r["state"], f"rank {rank}")
        for k, v in r["params"].items():
            assert torch.equal(v, r["resumed_params"][k]), (rank, k)
        assert not r["warnings"] and not r["resumed_warnings"], (r["warnings"], r["resumed_warnings"])
        assert r["resumed_pool_keys"]


def test_lightning_callback_refuses_a_scheduler():
    with tempfile.TemporaryDirectory(prefix="gns_pl_") as folder:
        res = run_world(W, "refused", 2, folder=folder, what="sched", timeout=150)
    for msg in res:
        assert msg is not None and "lr_schedule" in msg, msg


@pytest.mark.parametrize("cls,match", [("FSDPStrategy", "FSDP1"),
                                       ("ModelParallelStrategy", "fully_shard"),
                                       ("unsharded", "fully_shard")])
def test_lightning_callback_refuses_fsdp_strategies(cls, match):
    """Lightning's FSDPStrategy needs a GPU to reach on_train_start, so the refusals are
    checked on the strategy object itself: FSDP1, and a LightningModule that is not the
    FSDP2 root (with tensor_parallel_size 1 or 2: tensor parallelism is measured, test above)."""
    from types import SimpleNamespace

    import lightning.pytorch.strategies as S
    import torch

    from gns_kernels.integrations.lightning import GNSCallback

    if cls == "FSDPStrategy":
        strategy = S.FSDPStrategy()
    else:
        strategy = S.ModelParallelStrategy(1, 2 if cls == "ModelParallelStrategy" else 1)
    cb = GNSCallback(micro_batch_size=4, initial_batch_size=8)
    with pytest.raises(RuntimeError, match=match):
        cb._measured_model(SimpleNamespace(strategy=strategy, world_size=2), torch.nn.Linear(2, 2))
