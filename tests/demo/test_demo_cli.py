"""`gns-kernels demo` in the launching process (nothing spawned): every bad input exits 2
with one line before a rank starts, the run folder is never shared by two runs, help
shows defaults, rank failures are reported by their first cause, a missing matplotlib
is said in one line."""
import json
import os
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from gns_kernels.cli import main
from gns_kernels.demo import launch, rundir
from gns_kernels.demo.checkpoint import rng_state
from gns_kernels.demo.config import DemoConfig, DemoError


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("gns-kernels demo: error:")
    return err[0]


@pytest.fixture
def tiny_corpus(tmp_path):
    """One training file (m0.py) and one validation file (m12.py) of 40 bytes each."""
    root = tmp_path / "corpus"
    root.mkdir()
    for name in ("m0.py", "m12.py"):
        (root / name).write_text("x = 1\n" * 6 + "pass\n" * 0 + "y=2\n")
    return str(root)


@pytest.mark.parametrize("argv,needle", [
    (["--max-batch-size", "60"], "--max-batch-size 60 must be a multiple of --multiple-of 16"),
    (["--adam-lr", "-1"], "--adam-lr must be a finite number > 0, got -1.0"),
    (["--adam-lr", "nan"], "--adam-lr must be a finite number > 0, got nan"),
    (["--adam-lr", "inf"], "--adam-lr must be a finite number > 0, got inf"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0, got -0.1"),
    (["--lr-warmup", "nan"], "--lr-warmup must be in [0, 1), got nan"),
    (["--lr-min", "1.5"], "--lr-min (lr_min_ratio) must be in [0, 1], got 1.5"),
    (["--lr-min", "-0.1"], "--lr-min (lr_min_ratio) must be in [0, 1], got -0.1"),
    (["--lr-min", "nan"], "--lr-min (lr_min_ratio) must be in [0, 1], got nan"),
    (["--theta", "nan"], "--theta must be a finite number > 0, got nan"),
    (["--theta", "inf"], "--theta must be a finite number > 0, got inf"),
    (["--timeout", "0"], "--timeout must be a finite number > 0, got 0.0"),
    (["--timeout", "inf"], "--timeout must be a finite number > 0, got inf"),
    (["--stop-at-step", "0"], "--stop-at-step must be >= 1, got 0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--multiple-of", "0"], "--multiple-of 0 must be a positive multiple of the ranks (2)"),
    (["--max-batch-size", "0"], "--max-batch-size 0 is below --initial-batch-size 16"),
])
def test_bad_numbers_exit_2_one_line(argv, needle, capsys, tmp_path):
    assert main(["demo", *argv, "--out", str(tmp_path / "o")]) == 2
    assert needle in _error_line(capsys)
    assert not os.path.exists(tmp_path / "o" / "config.json")   # nothing was started


def test_context_longer_than_corpus(tiny_corpus, capsys, tmp_path):
    rc = main(["demo", "--corpus", tiny_corpus, "--context", "64", "--out", str(tmp_path / "o")])
    assert rc == 2
    line = _error_line(capsys)
    assert "--context 64 is longer than the corpus's training text (41 bytes" in line
    assert not os.path.exists(tmp_path / "o" / "config.json")


def _resume_folder(tmp_path, config: dict, ck_config: dict | None = None):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    ck = {"model": {}, "rng": [rng_state(), rng_state()], "step": 5,
          "config": config if ck_config is None else ck_config}
    torch.save(ck, str(folder / "checkpoint.pt"))
    (folder / "metrics.csv").write_text("step\n0\n")
    return folder


def test_resume_unknown_key_in_config(capsys, tmp_path):
    cfg = asdict(DemoConfig())
    cfg["learning_rate"] = 0.1
    folder = _resume_folder(tmp_path, cfg)
    assert main(["demo", "--resume", str(folder)]) == 2
    line = _error_line(capsys)
    assert "config.json: unknown key(s) learning_rate" in line


@pytest.mark.parametrize("key,value,needle", [
    ("ranks", "two", "ranks must be int, got 'two'"),
    ("ranks", True, "ranks must be int, got True"),
    ("theta", "0.6", "theta must be float | None, got '0.6'"),
    ("adaptive", 1, "adaptive must be bool, got 1"),
])
def test_resume_value_of_the_wrong_kind(key, value, needle, capsys, tmp_path):
    cfg = asdict(DemoConfig())
    cfg[key] = value
    folder = _resume_folder(tmp_path, cfg)
    assert main(["demo", "--resume", str(folder)]) == 2
    assert needle in _error_line(capsys)


def test_config_json_round_trips():
    from gns_kernels.demo.config import config_from_dict
    cfg = DemoConfig(theta=0.5, lr=1e-3, warmup=4, geometry="l1", steps=9, extra={"a": 1})
    assert config_from_dict(json.loads(json.dumps(asdict(cfg))), "x") == cfg
    assert config_from_dict({"theta": 1}, "x").theta == 1       # an int where a float goes


def test_resume_config_not_json(capsys, tmp_path):
    folder = _resume_folder(tmp_path, asdict(DemoConfig()))
    (folder / "config.json").write_text("{not json")
    assert main(["demo", "--resume", str(folder)]) == 2
    assert "config.json is not readable JSON" in _error_line(capsys)


def test_resume_refuses_a_checkpoint_of_another_run(capsys, tmp_path):
    a = DemoConfig(samples=480, out=str(tmp_path / "run"))
    b = DemoConfig(samples=960, out=str(tmp_path / "run"))
    folder = _resume_folder(tmp_path, asdict(b), ck_config=asdict(a))
    assert main(["demo", "--resume", str(folder)]) == 2
    line = _error_line(capsys)
    assert "belong to different runs (samples: checkpoint 480 vs config.json 960)" in line


def test_resume_without_metrics(capsys, tmp_path):
    folder = _resume_folder(tmp_path, asdict(DemoConfig()))
    os.remove(folder / "metrics.csv")
    assert main(["demo", "--resume", str(folder)]) == 2
    assert "no metrics.csv there" in _error_line(capsys)


def test_resume_and_overwrite_exclude_each_other(capsys, tmp_path):
    folder = _resume_folder(tmp_path, asdict(DemoConfig()))
    assert main(["demo", "--resume", str(folder), "--overwrite"]) == 2
    assert "--overwrite" in _error_line(capsys)


def test_non_empty_out_is_refused(capsys, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"run A")
    assert main(["demo", "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert "is not empty (checkpoint.pt)" in line and "--overwrite" in line and "--resume" in line
    assert (out / "checkpoint.pt").read_bytes() == b"run A"
    assert main(["demo", "--compare", "--out", str(out)]) == 2
    assert "is not empty" in _error_line(capsys)


def test_overwrite_deletes_only_the_demo_files(tmp_path):
    out = tmp_path / "o"
    (out / "small").mkdir(parents=True)
    for name in ("checkpoint.pt", "checkpoint.pt.tmp", "metrics.csv", "config.json", "summary.json",
                 "notes.txt", "small/metrics.csv", "small/mine.txt"):
        (out / name).write_text("x")
    rundir.prepare_out_dir(str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["notes.txt", "small"]
    assert os.listdir(out / "small") == ["mine.txt"]
    # an empty or new folder is fine without --overwrite
    assert rundir.prepare_out_dir(str(tmp_path / "new")) == str(tmp_path / "new")
    assert rundir.prepare_out_dir(str(tmp_path / "new")) == str(tmp_path / "new")


def test_overwrite_then_failure_leaves_nothing_to_resume(capsys, tmp_path):
    """Run A's checkpoint is gone as soon as run B takes the folder with --overwrite, so a
    run B that dies before its first checkpoint cannot be resumed with A's weights."""
    out = tmp_path / "o"
    folder = _resume_folder(tmp_path, asdict(DemoConfig(out=str(out))))
    os.rename(folder, out)
    rc = main(["demo", "--overwrite", "--samples", "960", "--corpus", str(tmp_path / "missing"),
               "--out", str(out)])
    assert rc == 2 and "corpus folder not found" in _error_line(capsys)
    assert main(["demo", "--resume", str(out)]) == 2
    assert "no checkpoint.pt and no config.json there" in _error_line(capsys)


def test_help_shows_defaults_and_stop_at_step(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--stop-at-step" in text and "--overwrite" in text and "--timeout" in text
    assert "B_0, global sequences per step (default: 16)" in text
    assert "(default: 300.0)" not in text and "None: 300" in text
    assert "`" not in text


# -- failure reports ----------------------------------------------------------------------
def _report(folder, rank, t, exc):
    launch._write_failure(str(folder), rank, exc)
    path = folder / f"rank{rank}.json"
    data = json.loads(path.read_text())
    data["time"] = t
    path.write_text(json.dumps(data))


def test_the_earliest_failure_is_reported(tmp_path, capsys):
    _report(tmp_path, 0, 200.0, RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1"))
    _report(tmp_path, 1, 100.0, ValueError("the real cause\nspans two lines"))
    first = launch.first_failure(str(tmp_path))
    assert first["rank"] == 1 and first["type"] == "ValueError"
    launch._report_failure(RuntimeError("process 0 terminated"), str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("gns-kernels demo: error: rank 1 failed first: ValueError: the real cause "
                       "spans two lines")
    assert any("Traceback" in ln or "ValueError" in ln for ln in err[:-1])


def test_a_demo_error_in_a_rank_is_exit_2(tmp_path):
    _report(tmp_path, 0, 100.0, DemoError("disk full while writing /x/checkpoint.pt"))
    with pytest.raises(DemoError, match="^disk full while writing /x/checkpoint.pt$"):
        launch._report_failure(RuntimeError("process 0 terminated"), str(tmp_path))


def test_no_report_falls_back_to_the_exception(tmp_path, capsys):
    launch._report_failure(RuntimeError("process 1 terminated with signal SIGKILL"), str(tmp_path))
    assert capsys.readouterr().err.strip() == (
        "gns-kernels demo: error: a training process failed: process 1 terminated with signal SIGKILL")


def test_a_killed_rank_is_named_before_the_consequences(tmp_path, capsys):
    from torch.multiprocessing.spawn import ProcessExitedException
    _report(tmp_path, 0, 100.0, RuntimeError("[gloo] Connection closed by peer"))
    exc = ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1,
                                 error_pid=4242, exit_code=-9, signal_name="SIGKILL")
    launch._report_failure(exc, str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "gns-kernels demo: error: rank 1 was killed by signal SIGKILL"
    assert err[0] == "(then rank 0: RuntimeError: [gloo] Connection closed by peer)"


@pytest.mark.distributed
def test_the_store_holds_its_port(tmp_path):
    """The launcher's store binds port 0 and keeps the port: nothing else can take it
    before the ranks connect (the race of picking a free port, closing it, handing it on)."""
    import socket
    import torch.distributed as dist
    from datetime import timedelta
    store = launch.open_store(5.0)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(OSError):
            s.bind((launch.HOST, store.port))
    client = dist.TCPStore(launch.HOST, store.port, None, False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.distributed
def test_process_group_timeout_applies(tmp_path):
    """Rank 0 alone: joining the group fails after --timeout seconds (not torch's 30
    minutes) and the failure report says so."""
    import torch.distributed as dist

    threads = torch.get_num_threads()
    store = launch.open_store(2.0)
    cfg = DemoConfig(timeout=2.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(Exception):
            launch._spawn_worker(0, 2, store.port, cfg, None, None, str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert time.monotonic() - t0 < 120          # i.e. the 2 s timeout, not the 30 min default
    report = launch.first_failure(str(tmp_path))
    assert report["rank"] == 0 and "timeout" in report["message"].lower()
    assert not dist.is_initialized()


def test_missing_matplotlib_is_said_in_one_line(monkeypatch, tmp_path, capsys):
    from gns_kernels.demo import plots, summary
    monkeypatch.setattr(plots, "plots_available", lambda: False)
    cfg = DemoConfig(out=str(tmp_path), quiet=True)
    ctrl = SimpleNamespace(batch_size=16, gns_ema=None, lr_multiplier=1.0, num_measurements=0,
                           num_skipped=0)
    corpus = SimpleNamespace(root="/c", train=torch.zeros(10), val=torch.zeros(5))
    res = summary.finish(cfg, 3, 48, 2.0, 2.0, ctrl, 16, "nuclear", 0.6, 1.0, corpus)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["plot.png skipped: matplotlib is not installed (pip install matplotlib, or "
                   "the package's 'demo' extra)"]
    assert res["plot"] is None and not os.path.exists(tmp_path / "plot.png")
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


def test_disk_full_in_a_rank_exits_2_with_one_line(tiny_corpus, monkeypatch, capsys, tmp_path):
    """One rank run in this process (spawning replaced by a direct call): the checkpoint
    writer hits ENOSPC; the command prints one line and exits 2, no .tmp is left."""
    import errno
    import torch.multiprocessing as mp
    from gns_kernels.demo import checkpoint

    def full(path, data):
        with open(path, "wb") as fh:
            fh.write(bytes(data)[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def spawn_here(fn, args=(), nprocs=1, join=True, **kwargs):
        assert nprocs == 1
        try:
            fn(0, *args)
        except Exception as exc:
            raise RuntimeError("process 0 terminated with exit code 1") from exc

    monkeypatch.setattr(checkpoint, "_write_bytes", full)
    monkeypatch.setattr(mp, "spawn", spawn_here)
    out = tmp_path / "o"
    threads = torch.get_num_threads()
    try:
        rc = main(["demo", "--ranks", "1", "--micro-batches", "2", "--initial-batch-size", "2",
                   "--samples", "8", "--context", "8", "--dim", "8", "--layers", "1", "--heads", "2",
                   "--mlp", "8", "--val-windows", "2", "--checkpoint-every", "1", "--quiet",
                   "--corpus", tiny_corpus, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 2
    assert _error_line(capsys) == (f"gns-kernels demo: error: disk full while writing {out}/"
                                   "checkpoint.pt (the previous checkpoint, if any, is kept; free "
                                   "space and --resume)")
    assert not os.path.exists(out / "checkpoint.pt.tmp") and not os.path.exists(out / "checkpoint.pt")


def test_lr_min_reaches_the_config():
    import argparse

    from gns_kernels.demo.args import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args([])).lr_min_ratio == DemoConfig.lr_min_ratio == 0.1
    assert config_from_args(p.parse_args(["--lr-min", "0"])).lr_min_ratio == 0.0
