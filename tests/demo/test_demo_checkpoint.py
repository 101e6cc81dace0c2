"""demo/checkpoint.py: RNG states that load under weights_only=True, a crafted pickle is
refused without running, a full disk is reported and leaves no .tmp, a checkpoint is
matched against its config.json."""
import errno
import json
import os
import random
from dataclasses import asdict

import numpy as np
import pytest
import torch

from gns_kernels.demo import checkpoint as ckpt
from gns_kernels.demo.config import DemoConfig, DemoError


class _Payload:
    """Unpickling this would create `marker` (it must never happen)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_rng_state_round_trip_under_weights_only(tmp_path):
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    np.random.standard_normal()           # leaves a cached Gaussian in numpy's state
    state = ckpt.rng_state()
    path = str(tmp_path / "rng.pt")
    torch.save({"rng": [state]}, path)
    want = (torch.rand(5), np.random.standard_normal(7), np.random.randint(0, 1 << 30, 3),
            [random.random() for _ in range(3)])
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    loaded = torch.load(path, weights_only=True)["rng"][0]
    ckpt.set_rng_state(loaded)
    got = (torch.rand(5), np.random.standard_normal(7), np.random.randint(0, 1 << 30, 3),
           [random.random() for _ in range(3)])
    assert torch.equal(want[0], got[0])
    assert np.array_equal(want[1], got[1]) and np.array_equal(want[2], got[2])
    assert want[3] == got[3]


def _demo_checkpoint(cfg: DemoConfig, ranks: int = 2) -> dict:
    return {"model": {"w": torch.zeros(2)}, "rng": [ckpt.rng_state()] * ranks, "step": 3,
            "coord": [{"step": 3}] * ranks, "config": asdict(cfg)}


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    path = str(tmp_path / "checkpoint.pt")
    ck = _demo_checkpoint(DemoConfig())
    ck["extra"] = _Payload(str(marker))
    torch.save(ck, path)
    with pytest.raises(DemoError) as info:
        ckpt.load_checkpoint(path)
    msg = str(info.value)
    assert path in msg and "not loaded" in msg and "open" in msg   # names the refused global
    assert not marker.exists()


def _resume_error(tmp_path, capsys, change) -> str:
    """The one error line of --resume on a run folder whose checkpoint `change(ck)` edits."""
    from gns_kernels.cli import main
    folder = tmp_path / "run"
    folder.mkdir()
    cfg = DemoConfig(out=str(folder))
    (folder / "config.json").write_text(json.dumps(asdict(cfg)))
    (folder / "metrics.csv").write_text("step\n0\n")
    ck = _demo_checkpoint(cfg)
    change(ck)
    torch.save(ck, str(folder / "checkpoint.pt"))
    assert main(["demo", "--resume", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_resume_of_a_crafted_checkpoint_exits_2_without_running_it(tmp_path, capsys):
    marker = tmp_path / "payload_ran"
    line = _resume_error(tmp_path, capsys, lambda ck: ck.update(model=_Payload(str(marker))))
    assert "not loaded" in line and "checkpoint.pt" in line
    assert not marker.exists()


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"not a zip file")
    with pytest.raises(DemoError, match="not a readable checkpoint"):
        ckpt.load_checkpoint(str(path))
    torch.save({"model": {}}, str(path))
    with pytest.raises(DemoError, match="not a demo checkpoint"):
        ckpt.load_checkpoint(str(path))


def test_disk_full_is_named_and_leaves_no_tmp(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    ckpt.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)       # the previous one

    def full(p, data):
        with open(p, "wb") as fh:                  # a partial file, as a real full disk leaves
            fh.write(bytes(data)[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "_write_bytes", full)
    with pytest.raises(DemoError) as info:
        ckpt.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert str(info.value).startswith(f"disk full while writing {path}")
    assert not os.path.exists(path + ".tmp")
    assert torch.load(path, weights_only=True)["step"] == 1            # previous one kept


def test_other_write_errors_propagate_and_leave_no_tmp(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")

    def denied(p, data):
        open(p, "wb").close()
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ckpt, "_write_bytes", denied)
    with pytest.raises(PermissionError):
        ckpt.save_checkpoint({"step": 2}, path)
    assert not os.path.exists(path + ".tmp") and not os.path.exists(path)


def test_check_belongs_names_the_differing_keys():
    a = DemoConfig(samples=480, seed=3, out="/x", quiet=True)
    ck = _demo_checkpoint(a)
    same_run = DemoConfig(samples=480, seed=3, out="/elsewhere", quiet=False, stop_at_step=9,
                          timeout=5.0)
    ckpt.check_belongs(ck, asdict(same_run), "/x", 2)       # watch-only keys may differ
    with pytest.raises(DemoError) as info:
        ckpt.check_belongs(ck, asdict(DemoConfig(samples=960, seed=3, lr=0.1)), "/x", 2)
    msg = str(info.value)
    assert "belong to different runs" in msg
    assert "samples: checkpoint 480 vs config.json 960" in msg and "lr: checkpoint None" in msg
    assert "seed" not in msg
    with pytest.raises(DemoError, match="RNG states of 2 ranks, the run has 3"):
        ckpt.check_belongs(ck, asdict(a), "/x", 3)


def test_check_belongs_refuses_a_checkpoint_of_the_old_loop():
    """A checkpoint from before the demo ran on AdaptiveBatching (controller, sampler, hook
    ... and no coord) is refused with one line, not a KeyError in a rank."""
    cfg = DemoConfig(samples=480)
    ck = _demo_checkpoint(cfg)
    del ck["coord"]
    ck.update(controller={}, sampler={}, hook=[{}, {}], lr_multiplier={"multiplier": 1.0},
              schedulers=[], optimizers=[])
    with pytest.raises(DemoError, match="earlier version of the demo .* start a new run"):
        ckpt.check_belongs(ck, asdict(cfg), "/x", 2)
    ck = _demo_checkpoint(cfg)
    ck["coord"] = [{}]
    with pytest.raises(DemoError, match="no coordinator state .* 2 ranks"):
        ckpt.check_belongs(ck, asdict(cfg), "/x", 2)


def test_resume_of_an_old_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    def old_layout(ck):
        del ck["coord"]
        ck.update(controller={"batch_size": 16}, sampler={"position": 0}, hook=[{}, {}])
    assert "earlier version of the demo" in _resume_error(tmp_path, capsys, old_layout)
