"""GNSTrainerCallback in a Hugging Face Trainer on a tiny GPT-2 built locally (no hub
download): the GNS of the accumulation micro-batches measured every F steps, logged into
the Trainer's logs and state.log_history, written to a writer; clipping and a single
micro-batch refused. Steps shorter than planned (an epoch's last step with fewer
micro-batches, an epoch's partial last micro-batch) keep the measurement on the Trainer's
steps: measured from their own micro-batches (compared with a float64 computation from
the micro-batch gradients) or skipped with one warning."""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install transformers accelerate; in the test extra)")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")

from gns_kernels.integrations.huggingface import GNSTrainerCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _hf_workers as W  # noqa: E402  (the tiny local GPT-2 and its data, shared with the AdaptiveTrainer tests)
from _oracle import l1_gns  # noqa: E402


def _DS():
    return W.DS(n=64)


def _model():
    return W.model()


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=4,
                max_steps=6, learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0.0,
                logging_steps=100, report_to="none", use_cpu=True, save_strategy="no",
                dataloader_num_workers=0, seed=0, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


class _Rows:
    def __init__(self):
        self.rows = []

    def write(self, row):
        self.rows.append(dict(row))


def _ours(caught):
    return [w for w in caught if "GNSTrainerCallback" in str(w.message) or "MicroBatchGNS" in str(w.message)]


def test_hf_callback_measures_and_logs(tmp_path):
    writer = _Rows()
    cb = GNSTrainerCallback(every=2, writer=writer)
    trainer = transformers.Trainer(model=_model(), args=_args(tmp_path), train_dataset=_DS(),
                                   callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not _ours(caught), [str(w.message) for w in _ours(caught)]   # the documented use: no warning
    assert [r["step"] for r in cb.history] == [0, 2, 4]
    assert cb.history == writer.rows
    for r in cb.history:
        assert r["valid"] and math.isfinite(r["gns"]) and r["gns"] > 0
        assert r["batch_size"] == 16 and r["accum_steps"] == 4
    logged = [h for h in trainer.state.log_history if "gns/gns" in h]
    assert [h["gns/gns"] for h in logged] == [r["gns"] for r in cb.history]
    assert cb.gns.geometry == "l1"   # AdamW


def test_hf_callback_refuses_clipping_and_one_micro_batch(tmp_path):
    for kw, match in (({"max_grad_norm": 1.0}, "max_grad_norm"),
                      ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps")):
        trainer = transformers.Trainer(model=_model(), args=_args(tmp_path, **kw), train_dataset=_DS(),
                                       callbacks=[GNSTrainerCallback(every=2)])
        with pytest.raises(ValueError, match=match):
            trainer.train()


class _MicroGrads(transformers.TrainerCallback):
    """Each optimizer step's micro-batch gradients (float64 differences of .grad after each
    micro-batch's backward), read beside the callback under test."""

    def __init__(self):
        self.steps, self._cur, self._prev = [], [], None

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.params = [p for p in model.parameters() if p.requires_grad]

    def _take(self):
        g = [torch.zeros(p.shape, dtype=torch.float64) if p.grad is None else p.grad.double()
             for p in self.params]
        self._cur.append(g if self._prev is None else [a - b for a, b in zip(g, self._prev)])
        self._prev = [t.clone() for t in g]

    def on_substep_end(self, *a, **kw):
        self._take()

    def on_pre_optimizer_step(self, *a, **kw):
        self._take()
        self.steps.append(self._cur)
        self._cur, self._prev = [], None


def _short_run(tmp_path, n, accum, epochs):
    spy, cb = _MicroGrads(), GNSTrainerCallback(every=1)
    args = _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=accum,
                 max_steps=-1, num_train_epochs=epochs)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=W.DS(n=n),
                                   callbacks=[spy, cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    for r in cb.history:    # every measured step from its own micro-batches
        micro = spy.steps[r["step"]]
        assert r["accum_steps"] == len(micro) and r["batch_size"] == 2 * len(micro)
        assert r["gns"] == pytest.approx(l1_gns(micro, 2), rel=1e-5), r["step"]
    return cb, spy, trainer, _ours(caught)


def test_hf_callback_epoch_end_one_micro_batch(tmp_path):
    """Issue 39 item 2: 14 examples, b = 2, A = 2, 4 epochs, every=1: each epoch ends with a
    one-micro-batch step (16 steps). Before, the callback fell a step behind at the first
    and measured only steps 0-2, silently; now every step of two micro-batches is measured
    and the four single ones are skipped with one warning that points at train()."""
    cb, spy, trainer, ours = _short_run(tmp_path, n=14, accum=2, epochs=4)
    assert [len(m) for m in spy.steps] == [2, 2, 2, 1] * 4
    assert [r["step"] for r in cb.history] == [k for k in range(16) if k % 4 != 3]
    assert len(ours) == 1 and "step 3 is not measured" in str(ours[0].message)
    assert "1 micro-batch" in str(ours[0].message)
    assert ours[0].filename == __file__       # the user's trainer.train() line
    assert cb.gns.step == 16


def test_hf_callback_short_and_partial_steps(tmp_path):
    """The class of item 2: a step with fewer (full) micro-batches than planned is measured
    from them (A = 3, 10 examples: steps of 3, 2, 3, 2 micro-batches, no warning); a step
    holding the epoch's partial micro-batch (11 examples of b = 2: its last has 1) is not
    an equal-sample measurement and is skipped with a warning naming it."""
    cb, spy, _, ours = _short_run(tmp_path / "short", n=10, accum=3, epochs=2)
    assert [len(m) for m in spy.steps] == [3, 2, 3, 2]
    assert [r["accum_steps"] for r in cb.history] == [3, 2, 3, 2] and not ours
    cb, spy, _, ours = _short_run(tmp_path / "partial", n=11, accum=2, epochs=2)
    assert [r["step"] for r in cb.history] == [0, 1, 3, 4]
    assert len(ours) == 1 and "partial batch (1 of 2 examples)" in str(ours[0].message)
    assert ours[0].filename == __file__
