"""`gns-kernels probe RUN_DIR`: the plumbing on a tiny one-rank demo run stopped with
--stop-at-step (branches restored from its checkpoint, the run's LR rule and validation
windows, the report), and bad input. The criterion's arithmetic: tests/test_probe.py."""
import json
import math
import os
import shutil
import sysconfig

import pytest
import torch

from gns_kernels.cli import main
from gns_kernels.demo.probe import DemoRun, load_run

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--mlp", "64", "--context", "32",
        "--val-windows", "16", "--quiet"]
RUN = ["--ranks", "1", "--optimizer", "signum", "--lr", "4e-3", "--samples", "640",
       "--initial-batch-size", "8", "--every", "2", "--eval-every", "5", "--raw-gns",
       "--max-local-batch", "4", "--seed", "3", "--stop-at-step", "6", *TINY]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    std = sysconfig.get_paths()["stdlib"]
    for n in ["argparse.py", "csv.py", "textwrap.py", "string.py", "fractions.py", "heapq.py",
              "bisect.py", "random.py", "shutil.py", "dataclasses.py", "enum.py", "functools.py"]:
        shutil.copy(os.path.join(std, n), root / n)
    out = str(tmp_path_factory.mktemp("run") / "r")
    assert main(["demo", *RUN, "--corpus", str(root), "--out", out]) == 0
    return out


@pytest.mark.distributed
def test_branch_restores_the_checkpoint_and_the_runs_lr_rule(stopped):
    cfg, ck = load_run(stopped)
    run = DemoRun(cfg, ck)
    assert run.step == 6 and run.samples_seen == 48 and run.batch_size == 8 and run.micro_batch == 4
    model, opts = run.start()
    for k, v in ck["model"].items():
        torch.testing.assert_close(model.state_dict()[k], v)
    # the momentum buffers came back
    assert any("momentum_buffer" in st for st in opts[0].state.values())
    # the LR rule: base lr x warmup_cosine(samples) x sqrt(B / B_0), by hand
    import gns_kernels as gk
    warm = cfg.lr_warmup * cfg.samples
    for n, B in ((0, 8), (16, 32)):
        f = gk.warmup_cosine(48 + n, cfg.samples, warm, cfg.lr_min_ratio) * math.sqrt(B / 8)
        assert run.lr_rule(n, B) == pytest.approx(f)
    # the run's own lr at the checkpoint is base x schedule(samples seen) x omega (B = B_0)
    assert opts[0].param_groups[0]["lr"] == pytest.approx(
        opts[0].param_groups[0]["base_lr"] * run.lr_rule(0, 8), rel=1e-6)
    assert 0 < run.evaluate(model) < math.log(256) + 1


@pytest.mark.distributed
def test_probe_command_writes_its_report(stopped, tmp_path, capsys):
    out = str(tmp_path / "p")
    rc = main(["probe", stopped, "--batch-sizes", "8,16,32", "--samples", "48", "--seeds", "0,1",
               "--repeats", "2", "--evals", "4", "--out", out, "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "B_crit: median" in text and "theta for B_crit" in text
    r = json.load(open(os.path.join(out, "probe.json")))
    assert set(r["per_seed"]) == {"0", "1"}
    assert set(r["gns"]["fresh"]) == {"l1", "nuclear", "l2"}
    for seed, v in r["per_seed"].items():
        curves = v["curves"]
        assert curves["8"][0][-1] == 48                   # the smallest B ran --samples
        assert curves["8"][1][-1] == pytest.approx(v["target"])
        assert all(c[0][-1] <= 96 for c in curves.values())   # cap 2 x 48
        assert v["ratios"]["8"] == pytest.approx(1.0)
    # the two seeds start from the same point and read different data
    assert r["per_seed"]["0"]["curves"]["8"][1][0] == r["per_seed"]["1"]["curves"]["8"][1][0]
    assert r["per_seed"]["0"]["target"] != r["per_seed"]["1"]["target"]
    for g, v in r["gns"]["fresh"].items():
        if v["theta_for_b_crit"] is not None:
            assert v["theta_for_b_crit"] == pytest.approx(math.sqrt(v["gns"] / r["summary"]["b_crit_median"]))
            lo, hi = v["theta_range"]
            assert lo == pytest.approx(math.sqrt(v["gns"] / r["summary"]["b_crit_max"]))
            assert hi == pytest.approx(math.sqrt(v["gns"] / r["summary"]["b_crit_min"]))
    assert os.path.exists(os.path.join(out, "probe.txt"))
    assert set(r["gns"]["at_batch"]) == {"8", "16", "32"}
    # the fixed-point theta: GNS interpolated at B_crit (log-log), by hand
    bc = r["summary"]["b_crit_median"]
    pts = {int(B): d["l1"] for B, d in r["gns"]["at_batch"].items()}
    a = max(B for B in pts if B <= bc)
    b = min([B for B in pts if B >= bc] or [a])
    g = pts[a] if a == b else math.exp(math.log(pts[a]) + (math.log(bc) - math.log(a)) /
                                       (math.log(b) - math.log(a)) * (math.log(pts[b]) - math.log(pts[a])))
    assert r["gns"]["fixed_point_theta"]["l1"] == pytest.approx(math.sqrt(g / bc))


@pytest.mark.distributed
def test_gns_only(stopped, tmp_path, capsys):
    out = str(tmp_path / "g")
    assert main(["probe", stopped, "--gns-only", "--batch-sizes", "8,16", "--repeats", "2",
                 "--b-crit", "12", "--out", out]) == 0
    g = json.load(open(os.path.join(out, "gns.json")))
    assert set(g["at_batch"]) == {"8", "16"} and g["b_crit"] == 12
    pts = {int(B): d["l1"]["gns"] for B, d in g["at_batch"].items()}
    at = math.exp(0.5 * (math.log(pts[8]) + math.log(pts[16])) + (math.log(12) - 0.5 * math.log(128))
                  / math.log(2) * (math.log(pts[16]) - math.log(pts[8])))
    assert g["fixed_point_theta"]["l1"] == pytest.approx(math.sqrt(at / 12))
    assert "fixed point" in capsys.readouterr().out


def test_probe_branches_use_the_loops_model_and_lr_schedule(monkeypatch):
    """The probe's branches build the model and the LR schedule with the demo loop's own
    functions (one definition of each): whatever loop.build_model / loop.lr_schedule give
    is what DemoRun uses."""
    import types

    import gns_kernels as gk
    from gns_kernels.demo import loop
    from gns_kernels.demo.config import DemoConfig

    cfg = DemoConfig(ranks=1, optimizer="signum", samples=640, initial_batch_size=8, lr_warmup=0.1,
                     lr_min_ratio=0.2, lr_scale=2.0, dim=32, layers=1, heads=2, mlp=64, context=16,
                     val_windows=4)
    # the loop's schedule: lr_scale x warmup_cosine over samples seen
    sched = loop.lr_schedule(cfg)
    for n in (0, 30, 64, 300, 640):
        assert sched(n) == pytest.approx(2.0 * gk.warmup_cosine(n, 640, 64, 0.2))
    model = loop.build_model(cfg)
    opts, _ = loop.build_optimizers(cfg, model)
    ck = {"model": model.state_dict(), "optimizers": [o.state_dict() for o in opts],
          "coord": [dict(step=3, samples_seen=24, batch_size=8, micro_batch_size=4, world_size=1,
                         controller=dict(noise_ema=None, signal_ema=None))]}
    corpus = types.SimpleNamespace(train=torch.randint(0, 256, (400,), dtype=torch.uint8),
                                   val=torch.randint(0, 256, (200,), dtype=torch.uint8))
    built, real_build = [], loop.build_model

    def spy_model(c):
        built.append(c)
        return real_build(c)
    monkeypatch.setattr(loop, "build_model", spy_model)
    monkeypatch.setattr(loop, "lr_schedule", lambda c: (lambda n: 0.5 + n / 1000))
    run = DemoRun(cfg, ck, corpus)
    assert run.lr_rule(0, 8) == pytest.approx(0.5 + 24 / 1000)
    assert run.lr_rule(16, 32) == pytest.approx((0.5 + 40 / 1000) * 2.0)
    m, _ = run.start()
    assert built == [cfg]
    for k, v in ck["model"].items():
        torch.testing.assert_close(m.state_dict()[k], v)


def test_interp_loglog():
    from gns_kernels.demo.probe import interp_loglog
    assert interp_loglog({16: 4.0, 64: 16.0}, 32) == pytest.approx(8.0)
    assert interp_loglog({16: 4.0, 64: 16.0}, 64) == pytest.approx(16.0)
    assert interp_loglog({16: 4.0, 64: 16.0}, 8) is None
    assert interp_loglog({16: 4.0, 64: math.nan}, 32) is None


@pytest.mark.parametrize("argv, needle", [
    (["--batch-sizes", "16"], "--batch-sizes"),
    (["--batch-sizes", "16,x"], "--batch-sizes"),
    (["--samples", "4"], "--samples"),
    (["--tolerance", "0.5"], "--tolerance"),
    (["--cap", "1.1", "--tolerance", "1.25"], "--cap"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_input_one_line(argv, needle, tmp_path, capsys):
    assert main(["probe", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gns-kernels probe: error:") and needle in err[0]


def test_missing_checkpoint_named(tmp_path, capsys):
    assert main(["probe", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.pt" in err


def test_gns_by_batch_keys_the_batch_measured(monkeypatch):
    """A grid batch below 2 b or not a multiple of b is measured at b x max(2, B // b):
    the result is keyed by that batch (one entry per measured batch), not by the grid's."""
    import gns_kernels.probe as probe
    from gns_kernels.demo.probe import gns_by_batch

    calls = []

    def fake_measure(model, measured, draw, loss_fn, b, micro, **kw):
        calls.append((b, micro, kw["seed"]))
        return {"l1": {"gns": float(b * micro)}}

    class Run:
        micro_batch, measured, draw, loss_fn = 32, [], None, None

        def start(self):
            return torch.nn.Linear(2, 2), []

    monkeypatch.setattr(probe, "measure_gns", fake_measure)
    out = gns_by_batch(Run(), [16, 32, 64, 100, 128], repeats=1, bias_correction=False)
    assert sorted(out) == [64, 96, 128]
    assert all(out[M]["l1"]["gns"] == M for M in out)
    assert calls == [(32, 2, 20_064), (32, 3, 20_096), (32, 4, 20_128)]
