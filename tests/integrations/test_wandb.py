"""WandbWriter against a real wandb run in offline mode (no network): what run.log gets,
and that the run's file holds the keys."""
from __future__ import annotations

import glob
import math
import time

import pytest
import torch

from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.integrations.wandb import WandbWriter

wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb; in the test extra)")


def _coord_rows(steps=4):
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    coord = AdaptiveBatching(m, opt, micro_batch_size=2, initial_batch_size=4, every=2)
    rows = []
    for k in coord.steps(max_steps=steps):
        for (x,), ctx in coord.micro_batches([(torch.randn(2, 6),)] * 8, m):
            with ctx:
                (m(x).pow(2).mean() / coord.accum_steps).backward()
        opt.step(); opt.zero_grad(); coord.step()
        rows.append(coord.metrics())
    return rows


def test_wandb_writer_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = _coord_rows()
    run = wandb.init(mode="offline", dir=str(tmp_path), project="gns-test")
    logged = []
    real_log = run.log

    def spy(data, *a, **kw):
        logged.append(dict(data))
        return real_log(data, *a, **kw)

    monkeypatch.setattr(run, "log", spy)
    try:
        writer = WandbWriter(run)
        for row in rows:
            assert writer.write(row) == len(logged[-1]) > 0
    finally:
        run.finish()
    assert [d["gns/step"] for d in logged] == [r["step"] for r in rows]
    for d, row in zip(logged, rows):
        assert d["gns/batch_size"] == row["batch_size"] and d["gns/lr_0"] == row["lr_0"]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in d.values())
        # an unmeasured step leaves no point (nan left out), a measured one logs its gns
        assert ("gns/gns" in d) == (row["measured"] and math.isfinite(row["gns"]))
    assert any("gns/gns" in d for d in logged)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    # wandb's service writes the offline file after run.finish() returns (seen: 7 bytes, the
    # header alone, right after finish; the records within a second): poll for it
    deadline = time.monotonic() + 20
    data = open(files[0], "rb").read()
    while b"gns/batch_size" not in data and time.monotonic() < deadline:
        time.sleep(0.2)
        data = open(files[0], "rb").read()
    assert b"gns/gns" in data and b"gns/batch_size" in data


def test_wandb_writer_errors(monkeypatch):
    with pytest.raises(TypeError, match="run"):
        WandbWriter(run=object())
    monkeypatch.setattr(wandb, "run", None)
    with pytest.raises(ValueError, match="wandb.init"):
        WandbWriter().write({"step": 0, "gns": 1.0})
    assert WandbWriter().write({}) == 0
    with pytest.raises(TypeError, match="metrics"):
        WandbWriter().write([1, 2])
