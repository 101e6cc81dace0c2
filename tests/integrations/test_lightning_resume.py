"""GNSCallback's resume on one device, in this process (no process group): a checkpoint
written during fit (ModelCheckpoint, mid-epoch) continues the uninterrupted run exactly
when the loader's order depends on the epoch alone (a DistributedSampler); where Lightning
makes that impossible the resume warns, at the user's fit() line, naming why: a
RandomSampler (its order comes from the global RNG, which Lightning does not restore) and
a checkpoint written after fit() stopped mid-epoch (Lightning resumes it at the next
epoch's start). The 2-process DDP and FSDP2 resumes are in test_lightning.py."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning; in the test extra)")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lightning_workers as W  # noqa: E402
from _oracle import l1_gns  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

STOP, STEPS = 3, 5


def _callback():
    from gns_kernels.integrations.lightning import GNSCallback

    return GNSCallback(micro_batch_size=4, initial_batch_size=8, max_batch_size=32, every=1,
                       geometry="l1", theta=0.3)


def _loader(kind):
    ds = W._data(256)
    if kind == "distributed":   # the order depends on the seed and the epoch alone
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0,
                                                                       shuffle=True, seed=0))
    return DataLoader(ds, batch_size=4, shuffle=True)


def _fit(folder, callbacks, steps, kind, ckpt_path=None, checkpointing=False):
    model = W._module()
    trainer = W._trainer("auto", callbacks, str(folder), steps, 1, checkpointing=checkpointing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(kind), ckpt_path=ckpt_path)   # the user's line warnings point at
    ours = [w for w in caught if any(k in str(w.message) for k in W._PACKAGE)]
    return model, trainer, ours


def _spy(gns):
    """Beside the callback: each step's micro-batch gradients (differences of .grad after
    each backward, float64) and the coordinator's metrics after each step."""
    import lightning as L

    class Spy(L.Callback):
        def __init__(self):
            self.micro, self.rows, self._prev = {}, [], None

        def on_after_backward(self, trainer, pl_module):
            g = [p.grad.double().clone() for p in pl_module.parameters()]
            k = trainer.global_step                  # the step in progress
            first = k not in self.micro
            self.micro.setdefault(k, []).append(g if first else [a - b for a, b in zip(g, self._prev)])
            self._prev = g

        def on_train_batch_end(self, trainer, *a):
            m = gns.coord.metrics()
            if m and (not self.rows or self.rows[-1]["step"] != m["step"]):
                self.rows.append(m)

    return Spy()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """5 steps with a ModelCheckpoint at step 3, and a checkpoint written after fit()
    stopped (mid-epoch: 256 examples are 64 micro-batches, the run uses fewer)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = tmp_path_factory.mktemp("pl_resume")
    gns = _callback()
    spy = _spy(gns)
    mc = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=STOP, save_top_k=-1, filename="gns-{step}")
    model, trainer, ours = _fit(folder, [gns, spy, mc], STEPS, "distributed", checkpointing=True)
    assert not ours, [str(w.message) for w in ours]       # the documented use: no warning
    trainer.save_checkpoint(str(folder / "after_fit.ckpt"))
    return {"folder": folder, "model": model, "state": gns.coord.state_dict(), "spy": spy,
            "total": trainer.num_training_batches}


def test_lightning_one_device_measures(uninterrupted):
    """One device, the micro-batches as the samples: every step (every=1) is measured from
    its own micro-batches (it raised at step 0 before: no micro_step() was called), against
    a float64 computation from the gradients, and the batch grows."""
    spy = uninterrupted["spy"]
    assert [r["step"] for r in spy.rows] == list(range(STEPS))
    for r in spy.rows:
        micro = spy.micro[r["step"]]
        assert r["measured"] and r["accum_steps"] == len(micro) >= 2
        assert r["gns"] == pytest.approx(l1_gns(micro, 4), rel=1e-5), r["step"]
    assert spy.rows[-1]["batch_size"] > spy.rows[0]["batch_size"]


def test_lightning_resume_one_device_exact(uninterrupted):
    """Issue 39 item 12 on one device: resumed from the step-3 checkpoint, the micro-batches
    from the first on, the coordinator state and the weights are the uninterrupted run's."""
    u = uninterrupted
    gns = _callback()
    model, _, ours = _fit(u["folder"], [gns], STEPS, "distributed",
                          ckpt_path=str(u["folder"] / f"gns-step={STOP}.ckpt"))
    assert not ours, [str(w.message) for w in ours]
    full = u["model"].seen
    assert 0 < len(model.seen) < len(full) and model.seen == full[len(full) - len(model.seen):]
    assert gns.coord.state_dict()["samples_seen"] == u["state"]["samples_seen"]
    assert gns.coord.state_dict()["controller"] == u["state"]["controller"]
    for k, v in u["model"].state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_lightning_resume_warns_where_not_exact(uninterrupted):
    """A RandomSampler (DataLoader(shuffle=True) on one device) and a checkpoint written
    after fit() stopped mid-epoch cannot be resumed exactly: one warning each, naming the
    cause and attributed to the fit() call."""
    u = uninterrupted
    _, _, ours = _fit(u["folder"], [_callback()], STOP + 1, "random",
                      ckpt_path=str(u["folder"] / f"gns-step={STOP}.ckpt"))
    assert len(ours) == 1 and "RandomSampler" in str(ours[0].message), [str(w.message) for w in ours]
    assert ours[0].filename == __file__
    _, _, ours = _fit(u["folder"], [_callback()], STEPS + 1, "distributed",
                      ckpt_path=str(u["folder"] / "after_fit.ckpt"))
    assert len(ours) == 1, [str(w.message) for w in ours]
    msg = str(ours[0].message)
    assert "after fit() had stopped" in msg and f"of {u['total']} of epoch 0" in msg, msg
    assert ours[0].filename == __file__
