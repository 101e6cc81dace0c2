"""`gns-kernels demo`: bad input, a short 2-rank run (CSV, batch growth per Algorithm 1,
plot.png), resume continuing the same trajectory, the --compare table."""
import csv
import json
import math
import os
import shutil
import sysconfig

import pytest

from gns_kernels.cli import main
from gns_kernels.demo import train
from gns_kernels.demo.loop import build_optimizers
from gns_kernels.demo.train import METRIC_COLUMNS, compare_table

REQUIRED = ["step", "samples", "lr", "batch_size", "gns_raw", "gns_ema", "train_loss", "val_loss"]

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--mlp", "64", "--context", "32",
        "--val-windows", "16", "--quiet"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A copy of a few stdlib modules (the real corpus, just smaller, so the test is quick)."""
    root = tmp_path_factory.mktemp("corpus")
    std = sysconfig.get_paths()["stdlib"]
    names = ["argparse.py", "csv.py", "json/__init__.py", "json/decoder.py", "json/encoder.py",
             "textwrap.py", "string.py", "fractions.py", "heapq.py", "bisect.py", "random.py",
             "shutil.py", "dataclasses.py", "enum.py", "functools.py", "pathlib.py"]
    for n in names:
        os.makedirs(os.path.dirname(root / n), exist_ok=True)
        shutil.copy(os.path.join(std, n), root / n)
    return str(root)


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("gns-kernels demo: error:")
    return err[0]


@pytest.mark.parametrize("argv,needle", [
    (["--optimizer", "lamb"], "unknown --optimizer 'lamb'"),
    (["--geometry", "l3"], "unknown --geometry 'l3'"),
    (["--ranks", "0"], "--ranks must be >= 1"),
    (["--ranks", "-2"], "--ranks must be >= 1"),
    (["--ranks", "2", "--initial-batch-size", "7"], "does not split across 2 ranks"),
    (["--ranks", "2", "--initial-batch-size", "8", "--max-local-batch", "2",
      "--micro-batches", "5"], "does not split across 2 ranks"),
    (["--theta", "0"], "--theta must be a finite number > 0, got 0.0"),
    (["--theta", "-0.5"], "--theta must be a finite number > 0, got -0.5"),
    (["--every", "0"], "--every must be >= 1"),
])
def test_bad_input_one_line_nonzero(argv, needle, capsys, tmp_path):
    rc = main(["demo", *argv, "--out", str(tmp_path / "o")])
    assert rc != 0
    assert needle in _error_line(capsys)


def test_bad_out_and_corpus(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["demo", "--out", str(blocker / "sub")])       # a file where a folder must go
    assert rc != 0
    line = _error_line(capsys)
    assert "--out" in line and "not a writable folder" in line
    rc = main(["demo", "--corpus", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert rc != 0
    assert "corpus folder not found" in _error_line(capsys)
    rc = main(["demo", "--resume", str(tmp_path / "nothing")])
    assert rc != 0
    assert "--resume" in _error_line(capsys)


def test_built_optimizers_are_the_configured_classes():
    """The geometry comes from gk.geometry_for(optimizer_classes(name)); the run must build
    exactly those classes (in that order), and measure the composites on the hidden 2-D
    weights only."""
    from gns_kernels.demo.config import optimizer_classes
    from gns_kernels.demo.model import ByteTransformer
    m = ByteTransformer(dim=16, n_layers=1, n_heads=2, mlp_hidden=16, context=8)
    expected = {"muon": "nuclear", "specsgd": "nuclear", "signum": "l1", "signsgd": "l1",
                "adamw": "l1", "sgd": "l2", "msgd": "l2"}
    assert set(expected) == set(train.OPTIMIZERS)
    for name in train.OPTIMIZERS:
        cfg = train.DemoConfig(optimizer=name)
        opts, measured = build_optimizers(cfg, m)
        assert [type(o) for o in opts] == optimizer_classes(name)
        assert cfg.resolved_geometry() == expected[name]
        assert cfg.resolved_theta() == (0.3 if expected[name] == "l2" else 0.6)
        if name in ("muon", "specsgd"):
            assert {id(p) for p in measured} == {id(p) for p in m.hidden_matrices()}
        else:
            assert measured is None
    assert train.DemoConfig(optimizer="muon", geometry="l1").resolved_geometry() == "l1"


def _rows(folder):
    with open(os.path.join(folder, "metrics.csv"), newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


RUN = ["--ranks", "2", "--samples", "480", "--initial-batch-size", "8", "--every", "2",
       "--warmup", "3", "--theta", "0.15", "--max-batch-size", "64", "--eval-every", "3",
       "--max-local-batch", "8", "--checkpoint-every", "100", "--seed", "3", *TINY]


@pytest.fixture(scope="module")
def full_run(small_corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "full")
    rc = main(["demo", *RUN, "--corpus", small_corpus, "--out", out])
    assert rc == 0
    return out


@pytest.mark.distributed
def test_short_two_rank_run(full_run):
    fields, rows = _rows(full_run)
    assert fields[:len(REQUIRED)] == REQUIRED and fields == METRIC_COLUMNS
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(len(rows))) and len(rows) >= 6
    B = [int(r["batch_size"]) for r in rows]
    samples = [int(r["samples"]) for r in rows]
    assert samples == [sum(B[:i + 1]) for i in range(len(B))] and samples[-1] <= 480
    theta, F, warm, mult, cap = 0.15, 2, 3, 8, 64        # multiple_of = 2 ranks x 4 (B_0 = 8)
    grew = False
    for k in range(len(rows) - 1):
        r = rows[k]
        measured = k % F == 0 and r["gns_raw"] != ""
        if measured:
            assert r["gns_ema"] != ""
        if measured and k >= warm:
            target = float(r["gns_ema"]) / theta ** 2     # N / (theta^2 M)
            if abs(target - round(target)) < 1e-4 * target:
                continue                                   # ceil at a CSV-rounding boundary
            want = max(B[k], int(math.ceil(math.ceil(target) / mult) * mult))
            want = min(want, cap) if want > B[k] else B[k]
            assert B[k + 1] == want, (k, target, B[k], B[k + 1])
            grew |= B[k + 1] > B[k]
        else:
            assert B[k + 1] == B[k], k                     # no measurement or warm-up: frozen
    assert grew and B[-1] > B[0]
    # the controller's inputs are logged: its EMA of the signal (beta 0.9, started at the
    # first valid measurement) and the hook's pooled noise (the noise EMA, formed on the
    # covariances) recomputed from them give the logged gns_ema
    N = M = None
    for r in rows:
        if r["noise"] != "":
            assert r["gns_raw"] != ""
            assert float(r["gns_raw"]) == pytest.approx(float(r["noise"]) / float(r["signal"]),
                                                        rel=1e-6)
            n, m = float(r["noise_pooled"]), float(r["signal"])
            N, M = (n, m) if N is None else (n, 0.9 * M + 0.1 * m)
        else:
            assert r["gns_raw"] == ""
        if N is not None:
            assert float(r["gns_ema"]) == pytest.approx(N / M, rel=1e-6)
    assert N is not None
    for k in range(warm + 1):
        assert B[k] == 8
    # LR multiplier sqrt(B/B0) recorded after each step
    assert float(rows[-1]["lr_multiplier"]) == pytest.approx(math.sqrt(B[-1] / 8), rel=1e-5)
    # the micro-batch split obeys the cap: 2 ranks x A x b == B, b <= 8; accumulation used
    for r in rows:
        assert 2 * int(r["accum_steps"]) * int(r["micro_batch"]) == int(r["batch_size"])
        assert int(r["micro_batch"]) <= 8
    assert any(int(r["accum_steps"]) > 1 and r["gns_raw"] != "" for r in rows)
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"] != ""]
    assert len(vals) >= 3 and all(math.isfinite(v) for v in vals)


@pytest.mark.distributed
def test_plot_is_a_png(full_run):
    path = os.path.join(full_run, "plot.png")
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 200 and img.shape[1] >= 600
    assert img[..., :3].std() > 0.01                      # not a blank canvas


@pytest.fixture(scope="module")
def stopped_run(small_corpus, tmp_path_factory):
    """RUN interrupted after 5 steps (--stop-at-step); tests copy it before resuming."""
    out = str(tmp_path_factory.mktemp("run") / "stopped")
    assert main(["demo", *RUN, "--corpus", small_corpus, "--out", out, "--stop-at-step", "5"]) == 0
    return out


@pytest.mark.distributed
def test_resume_continues_same_trajectory(full_run, stopped_run, tmp_path):
    out = str(tmp_path / "interrupted")
    shutil.copytree(stopped_run, out)
    _, part = _rows(out)
    assert len(part) == 5 and os.path.exists(os.path.join(out, "checkpoint.pt"))
    assert not os.path.exists(os.path.join(out, "summary.json"))
    assert main(["demo", "--resume", out]) == 0
    _, resumed = _rows(out)
    _, full = _rows(full_run)
    assert len(resumed) == len(full)
    for a, b in zip(resumed, full):
        # noise_pooled: every rank's share of the noise pool is in the checkpoint
        for key in ("step", "samples", "batch_size", "lr", "gns_raw", "gns_ema", "train_loss", "val_loss",
                    "noise_pooled"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


@pytest.mark.distributed
def test_resume_does_not_mix_two_runs(full_run, small_corpus, tmp_path, capsys):
    """Run A finished in DIR; run B (other --samples) in the same DIR is refused; had B
    written its config.json beside A's checkpoint before dying, --resume refuses the pair."""
    folder = str(tmp_path / "dir")
    shutil.copytree(full_run, folder)
    before = open(os.path.join(folder, "metrics.csv")).read()
    assert main(["demo", *RUN, "--samples", "960", "--corpus", small_corpus, "--out", folder]) == 2
    assert "is not empty" in _error_line(capsys)
    conf = os.path.join(folder, "config.json")
    with open(conf) as fh:
        b = json.load(fh)
    b["samples"] = 960
    with open(conf, "w") as fh:
        json.dump(b, fh)
    assert main(["demo", "--resume", folder]) == 2
    line = _error_line(capsys)
    assert "checkpoint.pt and config.json belong to different runs" in line
    assert "samples: checkpoint 480 vs config.json 960" in line
    assert open(os.path.join(folder, "metrics.csv")).read() == before


@pytest.mark.distributed
def test_a_failing_rank_is_reported_by_its_own_error(stopped_run, tmp_path, capsys):
    """Rank 1 alone fails (its RNG state in the checkpoint is corrupt); rank 0 then loses
    its peer. The last line names rank 1's error, not rank 0's lost connection."""
    import torch
    folder = str(tmp_path / "bad")
    shutil.copytree(stopped_run, folder)
    path = os.path.join(folder, "checkpoint.pt")
    ck = torch.load(path, weights_only=True)
    ck["rng"][1]["torch"] = torch.zeros(3, dtype=torch.uint8)
    torch.save(ck, path)
    assert main(["demo", "--resume", folder, "--timeout", "60"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gns-kernels demo: error: rank 1 failed first: RuntimeError: ")
    assert "RNG state size to be 3" in err[-1]
    assert "set_rng_state" in "\n".join(err[:-1])           # rank 1's traceback precedes it


def _metrics(vals, step_every=1):
    return {"step": [float(i * step_every) for i in range(len(vals))], "val_loss": vals}


def test_compare_table_layout():
    results = {
        "small": dict(label="B=8", final_val_loss=2.0, best_val_loss=1.9, steps=10, samples=80, final_batch_size=8),
        "large": dict(label="B=32", final_val_loss=2.4, best_val_loss=2.3, steps=3, samples=96, final_batch_size=32),
        "euclidean": dict(label="Euclidean GNS (l2)", final_val_loss=1.95, best_val_loss=1.95, steps=6,
                          samples=80, final_batch_size=16),
        "adaptive": dict(label="Non-Euclidean GNS (nuclear)", final_val_loss=1.85, best_val_loss=1.85,
                         steps=5, samples=80, final_batch_size=24),
    }
    nan = float("nan")
    metrics = {
        "small": _metrics([3.0, nan, 2.5, nan, 2.2, 2.0, nan, 1.9, nan, 2.0]),   # best 1.9 at step 7
        "large": _metrics([3.0, 2.5, 2.3]),                                       # never <= 1.9
        "euclidean": _metrics([3.0, 2.4, 2.0, 1.96, 1.95, 1.95]),                 # never
        "adaptive": _metrics([3.0, 2.5, 2.0, 1.88, 1.85]),                        # step 3 -> 4 steps
    }
    table = compare_table(results, metrics, "muon")
    lines = table.splitlines()
    assert lines[0].split()[0] == "Optimizer" and "Steps reduction(%)" in lines[0]
    # reduction vs the baseline's 8 steps (index 7 -> 8 steps taken): (8 - 4) / 8 = 50%
    assert lines[1].split() == ["muon", "2.0000", "2.4000", "1.9500", "1.8500", "50.00"]
    body = {l.split("  ")[0].strip(): l for l in lines[4:]}
    assert "not reached" in body["B=32"] and "not reached" in body["Euclidean GNS (l2)"]
    assert body["B=8"].split()[-3:] == ["8", "0.00", "6"]          # its final 2.0 first at step 5
    assert body["Non-Euclidean GNS (nuclear)"].split()[-4:] == ["4", "50.00", "not", "reached"]
    assert body["B=32"].split()[-1] == "5"                          # 2.4 -> the 2.2 at step 4
    assert body["Euclidean GNS (l2)"].split()[-1] == "8"
    # the summary's full-precision loss may differ from the CSV's rounded one: the table
    # reads the logged values, so the baseline still reaches its own final loss
    results["small"]["final_val_loss"] = 2.0 + 1e-7
    again = {l.split("  ")[0].strip(): l for l in compare_table(results, metrics, "muon").splitlines()[4:]}
    assert again["B=8"].split()[-1] == "6"
    metrics["adaptive"] = _metrics([3.0, 2.5, 2.0])
    assert compare_table(results, metrics, "muon").splitlines()[1].split()[-1] == "-"


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_end_to_end(small_corpus, tmp_path, capsys):
    # four launches (about 1-2 minutes here): slow; the table layout itself is tested above
    out = tmp_path / "cmp"
    argv = ["demo", "--compare", "--ranks", "2", "--samples", "320", "--initial-batch-size", "8",
            "--every", "2", "--warmup", "3", "--eval-every", "2", "--corpus", small_corpus,
            "--out", str(out), *TINY]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Optimizer" in printed and "Steps reduction(%)" in printed
    for sub in ("small", "large", "euclidean", "adaptive"):
        assert os.path.exists(out / sub / "metrics.csv")
    with open(out / "compare.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    import json
    res = json.loads((out / "compare.json").read_text())
    assert {r["samples"] for r in res.values()} <= set(range(289, 321))  # same budget
    assert res["large"]["final_batch_size"] == 32 and res["small"]["final_batch_size"] == 8
    assert res["euclidean"]["geometry"] == "l2" and res["adaptive"]["geometry"] == "nuclear"


@pytest.mark.parametrize("ranks,b0,micro,max_local,b", [
    (2, 16, 1, 32, 8), (2, 8, 1, 32, 4), (1, 8, 2, 32, 4), (3, 12, 1, 32, 4), (2, 6, 1, 32, 3),
    (4, 64, 2, 32, 8), (2, 64, 1, 8, 8), (2, 24, 1, 5, 4), (1, 18, 2, 32, 9)])
def test_default_micro_batch_and_multiple_of(ranks, b0, micro, max_local, b):
    """b is fixed for the run (AdaptiveBatching): the largest micro-batch <= --max-local-batch
    that splits B_0 into at least --micro-batches per rank; every B is a multiple of R x b."""
    cfg = train.DemoConfig(ranks=ranks, initial_batch_size=b0, micro_batches=micro,
                           max_local_batch=max_local)
    m = cfg.resolved_multiple_of()
    assert cfg.micro_batch_size() == b and m == ranks * b
    assert b0 % m == 0 and b0 // m >= micro and b <= max_local
    assert train.DemoConfig(ranks=2, initial_batch_size=16, multiple_of=8).micro_batch_size() == 4


@pytest.mark.parametrize("argv,needle", [
    (["--multiple-of", "3"], "--multiple-of 3 must be a positive multiple of the ranks (2)"),
    (["--multiple-of", "32"], "--initial-batch-size 16 must be a multiple of --multiple-of 32"),
    (["--ranks", "1", "--multiple-of", "16"], "is 1 micro-batches per rank, fewer than --micro-batches 2"),
    (["--initial-batch-size", "128", "--multiple-of", "128"], "above --max-local-batch 32"),
])
def test_bad_multiple_of_one_line(argv, needle, capsys, tmp_path):
    assert main(["demo", *argv, "--out", str(tmp_path / "o")]) == 2
    assert needle in _error_line(capsys)


def _children(pid):
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                kids += [int(k) for k in fh.read().split()]
        except OSError:
            pass
    return kids


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_a_killed_rank_ends_the_run_with_its_name(small_corpus, tmp_path):
    """SIGKILL one rank mid-run: the command ends (not after the timeout's minutes), names
    the killed rank on its last line, and the last checkpoint still loads."""
    import signal
    import subprocess
    import sys
    import time
    from gns_kernels.demo.checkpoint import load_checkpoint

    out = str(tmp_path / "killed")
    argv = [sys.executable, "-m", "gns_kernels.cli", "demo", *RUN, "--samples", "200000",
            "--max-batch-size", "8", "--checkpoint-every", "2", "--corpus", small_corpus,
            "--out", out, "--timeout", "600"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(out, "checkpoint.pt")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint in 240 s"
            time.sleep(0.5)
        ranks = []
        for pid in _children(proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                ranks.append(pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=240)     # far less than --timeout 600
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last in ("gns-kernels demo: error: rank 0 was killed by signal SIGKILL",
                    "gns-kernels demo: error: rank 1 was killed by signal SIGKILL"), err[-2000:]
    ck = load_checkpoint(os.path.join(out, "checkpoint.pt"))
    assert ck["step"] >= 2 and len(ck["rng"]) == 2
