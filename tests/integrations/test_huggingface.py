"""GNSTrainerCallback in a Hugging Face Trainer on a tiny GPT-2 built locally (no hub
download): the GNS of the accumulation micro-batches measured every F steps, logged into
the Trainer's logs and state.log_history, written to a writer; clipping and a single
micro-batch refused."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install transformers accelerate; in the test extra)")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")

from gns_kernels.integrations.huggingface import GNSTrainerCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _hf_workers as W  # noqa: E402  (the tiny local GPT-2 and its data, shared with the AdaptiveTrainer tests)


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


def test_hf_callback_measures_and_logs(tmp_path):
    writer = _Rows()
    cb = GNSTrainerCallback(every=2, writer=writer)
    trainer = transformers.Trainer(model=_model(), args=_args(tmp_path), train_dataset=_DS(),
                                   callbacks=[cb])
    trainer.train()
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
