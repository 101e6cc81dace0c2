"""`--compare --preset paper-cpu`: the arithmetic of the Table 2 protocol (steps to reach the
baseline's best validation loss, reduction, median with "not reached", seed spread, B_0
choice), and a one-seed tiny-budget run of the whole protocol whose table is recomputed
here from the runs' metrics.csv files. The effect itself is not tested (docs/demo.md)."""
import csv
import json
import math
import os
import shutil
import sysconfig

import pytest

from gns_kernels.cli import main
from gns_kernels.demo.config import DemoConfig, DemoError
from gns_kernels.demo.presets import (PRESETS, Protocol, add_closeness, apply_preset,
                                      median_with_missing,
                                      paper_table, reduction, run_paper, seed_rows, spread,
                                      steps_to_reach)

nan = float("nan")


def _m(vals, every=1):
    return {"step": [float(i * every) for i in range(len(vals))],
            "samples": [float(8 * (i * every + 1)) for i in range(len(vals))], "val_loss": vals}


def test_steps_to_reach_counts_steps_taken_and_skips_nan():
    m = _m([3.0, nan, 2.5, nan, 2.0, 2.1], every=5)   # logged at steps 0, 10, 20, 25
    assert steps_to_reach(m, 2.5) == 11                 # step index 10 -> 11 steps taken
    assert steps_to_reach(m, 2.0) == 21
    assert steps_to_reach(m, 2.05) == 21
    assert steps_to_reach(m, 1.99) is None
    assert steps_to_reach(m, math.inf) == 1


def test_reduction_percent():
    assert reduction(200, 50) == pytest.approx(75.0)
    assert reduction(200, 300) == pytest.approx(-50.0)
    assert reduction(200, None) is None and reduction(None, 10) is None and reduction(0, 1) is None


@pytest.mark.parametrize("values,expected", [
    ([70.0, 10.0, 40.0], 40.0),
    ([70.0, None, 40.0], 40.0),            # "not reached" ranks lowest: sorted None, 40, 70
    ([None, None, 40.0], None),            # the median is a "not reached"
    ([10.0, 30.0], 20.0),                  # even count: mean of the middle two
    ([None, 30.0], None),                  # middle pair holds a "not reached"
    ([None, 30.0, 50.0, 60.0], 40.0),
    ([], None),
])
def test_median_with_missing(values, expected):
    got = median_with_missing(values)
    assert got == (None if expected is None else pytest.approx(expected))


def test_spread_median_min_max():
    assert spread([1.5, 1.2, 1.4]) == (1.4, 1.2, 1.5)
    med, lo, hi = spread([1.0, 2.0, 4.0, 3.0])
    assert (med, lo, hi) == (2.5, 1.0, 4.0)
    assert all(math.isnan(v) for v in spread([nan]))


def _seed(base, l2, geom):
    row = seed_rows({"baseline": base, "euclidean": l2, "adaptive": geom})
    row["final"] = {"baseline": [v for v in base["val_loss"] if not math.isnan(v)][-1],
                    "euclidean": [v for v in l2["val_loss"] if not math.isnan(v)][-1],
                    "adaptive": [v for v in geom["val_loss"] if not math.isnan(v)][-1]}
    row["steps"] = {"baseline": len(base["step"]), "euclidean": len(l2["step"]),
                    "adaptive": len(geom["step"])}
    return row


def test_seed_rows_and_table_arithmetic():
    # seed 0: baseline best 1.50 at step index 9 (10 steps); l2 reaches it at 6 steps
    # (40 %), the geometry run at 3 steps (70 %)
    s0 = _seed(_m([3.0, 2.5, 2.2, 2.0, 1.8, 1.7, 1.6, 1.55, 1.52, 1.50]),
               _m([3.0, 2.4, 2.0, 1.8, 1.6, 1.5, 1.49]),
               _m([3.0, 2.0, 1.49, 1.48]))
    assert s0["target"] == 1.50 and s0["base_steps"] == 10
    assert s0["euclidean"] == {"steps": 6, "reduction": pytest.approx(40.0)}
    assert s0["adaptive"] == {"steps": 3, "reduction": pytest.approx(70.0)}
    # seed 1: baseline best 1.60 at index 4 (5 steps) then rises; l2 never; geometry 2 steps
    s1 = _seed(_m([3.0, 2.0, 1.8, 1.7, 1.60, 1.62]),
               _m([3.0, 2.0, 1.7]),
               _m([3.0, 1.6, 1.65]))
    assert s1["target"] == 1.60 and s1["base_steps"] == 5
    assert s1["euclidean"]["steps"] is None and s1["euclidean"]["reduction"] is None
    assert s1["adaptive"]["reduction"] == pytest.approx(60.0)
    # seed 2: l2 reaches at 8 of 8 steps (0 %), geometry at 4 (50 %)
    s2 = _seed(_m([3.0, 2.0, 1.9, 1.8, 1.7, 1.65, 1.62, 1.55]),
               _m([3.0, 2.0, 1.9, 1.8, 1.7, 1.65, 1.62, 1.55]),
               _m([3.0, 2.0, 1.7, 1.55, 1.56]))
    assert s2["adaptive"]["reduction"] == pytest.approx(50.0)
    table = paper_table({"signum": {"B0": 16, "seeds": [s0, s1, s2], "seeds_used": [0, 1, 2],
                                    "geometry": "l1"}})
    row = table.splitlines()[1]
    # finals: baseline 1.50, 1.62, 1.55 -> median 1.55 [1.50, 1.62]; l2 1.49, 1.7, 1.55;
    # geometry 1.48, 1.65, 1.56. Reductions: l2 {40, None, 0} -> median 0.00; geometry
    # {70, 60, 50} -> 60.00
    assert row.split() == ["signum", "16", "1.5500", "[1.5000,", "1.6200]", "1.5500", "[1.4900,",
                           "1.7000]", "1.5600", "[1.4800,", "1.6500]", "0.00", "60.00"]
    detail = [l for l in table.splitlines() if l.startswith("signum") and l.split()[1] == "1"][0]
    assert detail.split()[2:4] == ["1.6000", "5"] and "-/" in detail
    # paired gaps (run final - baseline final): l2 -0.01, +0.08, 0.00 -> mean +0.0233;
    # geometry -0.02, +0.03, +0.01 -> mean +0.0067
    gap = table.splitlines()[-1].split()
    assert gap == ["signum", "+0.0233", "[-0.0100,", "+0.0800]", "+0.0067", "[-0.0200,", "+0.0300]"]


def test_closeness_to_the_seed_spread_and_at_final_loss():
    # baselines end at 1.50 and 1.60: the upper end of the spread is 1.60
    b0 = _m([3.0, 2.0, 1.8, 1.7, 1.6, 1.55, 1.52, 1.50])     # 1.60 first at index 4 -> 5 steps
    b1 = _m([3.0, 2.1, 1.9, 1.75, 1.68, 1.64, 1.61, 1.60])   # 1.60 at index 7 -> 8 steps
    l2_0, g0 = _m([3.0, 1.9, 1.7, 1.65]), _m([3.0, 1.6, 1.58])
    l2_1, g1 = _m([3.0, 1.8, 1.62]), _m([3.0, 1.7, 1.59, 1.55])
    mets = [{"baseline": b0, "euclidean": l2_0, "adaptive": g0},
            {"baseline": b1, "euclidean": l2_1, "adaptive": g1}]
    seeds = [seed_rows(m) for m in mets]
    add_closeness(seeds, mets)
    assert seeds[0]["loose_target"] == 1.60 and seeds[0]["loose_base_steps"] == 5
    assert seeds[1]["loose_base_steps"] == 8
    # seed 0: l2 never <= 1.60; geometry at 2 steps -> (5 - 2) / 5 = 60 %
    assert seeds[0]["euclidean"]["loose_steps"] is None
    assert seeds[0]["adaptive"]["loose_reduction"] == pytest.approx(60.0)
    # seed 1: geometry reaches 1.59 at 3 steps -> (8 - 3) / 8 = 62.5 %
    assert seeds[1]["adaptive"]["loose_reduction"] == pytest.approx(62.5)
    # at the run's final loss: l2 seed 0 ends at 1.65; baseline 0 first <= 1.65 at index 4
    # (5 steps); the run took 4 steps -> 20 %
    assert seeds[0]["euclidean"]["base_steps_to_final"] == 5
    assert seeds[0]["euclidean"]["at_final"] == pytest.approx(20.0)
    # geometry seed 1 ends at 1.55, below baseline 1's best: never reached by the baseline
    assert seeds[1]["adaptive"]["base_steps_to_final"] is None
    assert seeds[1]["adaptive"]["at_final"] is None


def test_apply_preset_and_unknown_name():
    cfg = apply_preset(DemoConfig(), "paper-cpu")
    for k, v in PRESETS["paper-cpu"].items():
        assert getattr(cfg, k) == v
    assert cfg.bias_correction is False       # the paper's raw estimator
    with pytest.raises(DemoError, match="unknown --preset 'nope'"):
        apply_preset(DemoConfig(), "nope")


@pytest.mark.parametrize("flag", [["--max-batch-size", "256"], ["--max-batch-size=256"], ["--max-batch", "256"]])
def test_command_line_options_win_over_the_preset(flag):
    """--preset with an explicit option keeps the option (it was silently replaced by the
    preset's value); the preset's other options apply; --raw-gns maps to bias_correction."""
    from gns_kernels.cli import build_parser, explicit_dests
    from gns_kernels.demo.args import config_from_args, explicit_fields

    argv = ["demo", "--preset", "paper-cpu", "--dim", "48", "--every=7"] + flag
    args = build_parser(argv).parse_args(argv)
    args._explicit = explicit_dests(args._parser, argv)
    cfg = apply_preset(config_from_args(args), "paper-cpu", keep=explicit_fields(args))
    assert (cfg.max_batch_size, cfg.dim, cfg.every) == (256, 48, 7)
    assert (cfg.layers, cfg.samples, cfg.micro_batches) == (1, 200000, 2)  # the preset's
    assert explicit_fields(args) >= {"max_batch_size", "dim", "every"}
    argv = ["demo", "--raw-gns", "--lr-min", "0.1"]
    args = build_parser(argv).parse_args(argv)
    args._explicit = explicit_dests(args._parser, argv)
    assert explicit_fields(args) == {"bias_correction", "lr_min_ratio"}


@pytest.mark.parametrize("extra, want", [([], ("signum", "muon")), (["--optimizer", "signsgd"], ("signsgd",)),
                                         (["--optimizer=muon"], ("muon",))])
def test_optimizer_option_picks_the_protocol_optimizer(monkeypatch, tmp_path, extra, want):
    """--compare --preset with --optimizer runs the protocol for that optimizer alone (it was
    silently ignored: the preset's two optimizers ran)."""
    from gns_kernels.demo import presets

    seen = []
    monkeypatch.setattr(presets, "run_paper", lambda cfg, protocol, top, **kw: seen.append(protocol))
    assert main(["demo", "--compare", "--preset", "paper-cpu", "--out", str(tmp_path / "o")] + extra) == 0
    assert seen[0].optimizers == want
    assert seen[0].seeds == (0, 1, 2) and seen[0].select == "all"


@pytest.mark.parametrize("opt", ["sgd", "msgd"])
def test_protocol_refuses_an_l2_optimizer(capsys, tmp_path, opt):
    out = tmp_path / "o"
    assert main(["demo", "--compare", "--preset", "paper-cpu", "--optimizer", opt, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--optimizer {opt}: its GNS geometry is l2" in err
    assert not out.exists()


def test_cli_rejects_unknown_preset(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["demo", "--compare", "--preset", "nope", "--out", str(tmp_path / "o")])
    assert "--preset" in capsys.readouterr().err


@pytest.mark.parametrize("theta", ["0", "-1", "nan", "inf"])
def test_bad_theta_same_message_for_one_run_and_the_protocol(capsys, tmp_path, theta):
    """--theta has one check (config.check_theta): a single run and --compare --preset
    refuse the same values with the same line, nan and inf included, before writing."""
    lines = []
    for extra in ([], ["--compare", "--preset", "paper-cpu"]):
        out = tmp_path / ("o" + str(len(lines)))
        assert main(["demo", *extra, f"--theta={theta}", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        lines.append(err[0])
        assert not out.exists()
    assert lines[0] == lines[1] == f"gns-kernels demo: error: --theta must be a finite number > 0, got {float(theta)}"


@pytest.mark.parametrize("jobs", [0, -1, 1.5])
def test_run_paper_rejects_bad_jobs(tmp_path, jobs):
    with pytest.raises(DemoError, match="--jobs must be an integer >= 1"):
        run_paper(DemoConfig(), Protocol(), str(tmp_path / "p"), log=lambda m: None, jobs=jobs)
    assert not os.path.exists(tmp_path / "p")   # refused before anything is written


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    std = sysconfig.get_paths()["stdlib"]
    for n in ["argparse.py", "csv.py", "textwrap.py", "string.py", "fractions.py", "heapq.py",
              "random.py", "shutil.py", "dataclasses.py", "enum.py", "functools.py"]:
        shutil.copy(os.path.join(std, n), root / n)
    return str(root)


def _read(path):
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return ([int(r["step"]) for r in rows],
            [float(r["val_loss"]) if r["val_loss"] else None for r in rows])


@pytest.mark.slow
@pytest.mark.distributed
def test_tiny_protocol_table_matches_metrics(small_corpus, tmp_path):
    # one optimizer, one seed, a 2-batch x 2-LR grid, the adaptive LR search over the same 2
    # LRs and 160 sequences: 8 launches
    cfg = apply_preset(DemoConfig(), "paper-cpu")
    cfg = DemoConfig(**{**cfg.__dict__, "dim": 16, "layers": 1, "heads": 2, "mlp": 32,
                        "context": 16, "samples": 160, "val_windows": 8, "eval_every": 2,
                        "every": 2, "warmup": 2, "corpus": small_corpus, "quiet": True})
    proto = Protocol(optimizers=("signum",), seeds=(3,), grid=(8, 16),
                     lrs=(("signum", (1e-3, 4e-3)),))
    # two runs at a time (the final table's set-up); the arithmetic below does not depend on it
    res = run_paper(cfg, proto, str(tmp_path / "p"), log=lambda m: None, jobs=2)
    d = res["per_optimizer"]["signum"]
    top = tmp_path / "p" / "signum"
    finals = {}
    for B in (8, 16):
        for lr in ("0.001", "0.004"):
            steps, vals = _read(top / f"grid_B{B}_lr{lr}" / "metrics.csv")
            finals[(B, lr)] = [v for v in vals if v is not None][-1]
    best = min(finals, key=lambda k: (finals[k], k[0], float(k[1])))
    assert (d["B0"], d["lr"]["baseline"]) == (best[0], float(best[1]))
    steps, vals = _read(top / f"grid_B{best[0]}_lr{best[1]}" / "metrics.csv")
    logged = [(s, v) for s, v in zip(steps, vals) if v is not None]
    target = min(v for _, v in logged)
    base = next(s for s, v in logged if v <= target) + 1
    s = d["seeds"][0]
    assert s["target"] == pytest.approx(target) and s["base_steps"] == base
    for kind, geom in (("euclidean", "l2"), ("adaptive", "l1")):
        tuned = {}
        for lr in ("0.001", "0.004"):   # the LR search: the lower final loss wins
            _, vals = _read(top / f"{geom}_lr{lr}_seed3" / "metrics.csv")
            tuned[lr] = [v for v in vals if v is not None][-1]
        lr = min(tuned, key=lambda k: (tuned[k], float(k)))
        assert d["lr"][kind] == float(lr)
        with open(top / f"{geom}_lr{lr}_seed3" / "config.json") as fh:   # the LR was applied
            assert json.load(fh)["lr"] == float(lr)
        steps, vals = _read(top / f"{geom}_lr{lr}_seed3" / "metrics.csv")
        reach = next((st + 1 for st, v in zip(steps, vals) if v is not None and v <= target), None)
        assert s[kind]["steps"] == reach
        want = None if reach is None else 100.0 * (base - reach) / base
        assert s[kind]["reduction"] == (None if want is None else pytest.approx(want))
    with open(tmp_path / "p" / "paper.txt") as fh:
        text = fh.read()
    assert "adaptive runs' LR search" in text and "peak LR, signum" in text
    with open(tmp_path / "p" / "paper_signum.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    # a second call reuses every finished run (same table, no new launch)
    again = run_paper(cfg, proto, str(tmp_path / "p"), log=lambda m: None)
    assert again["table"] == res["table"]


def test_protocol_lrs_for():
    p = Protocol(lrs=(("signum", (1e-3, 2e-3)), ("muon", ())))
    assert p.lrs_for("signum") == (1e-3, 2e-3)
    assert p.lrs_for("muon") == (None,) and p.lrs_for("adamw") == (None,)


def test_plot_paper_writes_a_png_with_four_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from gns_kernels.demo.presets import plot_paper

    def run(scale):
        steps = [0.0, 1.0, 2.0, 3.0]
        return {"step": steps, "samples": [8.0 * s for s in steps], "batch_size": [8.0, 8.0, 16.0, 16.0],
                "val_loss": [2.0 * scale, 1.8 * scale, float("nan"), 1.5 * scale]}

    curves = {0: {"constant": run(1.0), "adaptive": run(1.1)}, 1: {"constant": run(1.02)}}
    out = plot_paper(curves, str(tmp_path / "p.png"), title="t")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_run_paper_picks_b0_and_lrs_and_uses_them_on_every_seed(monkeypatch, tmp_path):
    """The protocol's selection on synthetic final losses (no training): an interior (B, lr)
    optimum with an exact tie at a larger B (the smaller B wins), each adaptive kind's LR
    with a tie (the smaller LR wins), and every later seed run at the chosen values."""
    import gns_kernels.demo.plots as plots
    import gns_kernels.demo.presets as presets

    const = {(8, 1e-3): 1.30, (8, 2e-3): 1.20, (8, 4e-3): 1.25,
             (16, 1e-3): 1.10, (16, 2e-3): 1.00, (16, 4e-3): 1.05,
             (32, 1e-3): 1.15, (32, 2e-3): 1.00, (32, 4e-3): 1.40}
    adaptive = {("l2", 1e-3): 1.50, ("l2", 2e-3): 1.45, ("l2", 4e-3): 1.20,
                ("l1", 1e-3): 1.35, ("l1", 2e-3): 1.10, ("l1", 4e-3): 1.10}
    launched = []

    def fake_run(rc, log):
        launched.append(rc)
        if not rc.adaptive:
            final = const[(rc.initial_batch_size, rc.lr)] + 0.01 * rc.seed
        else:
            final = adaptive[(rc.resolved_geometry(), rc.lr)] + 0.01 * rc.seed
        summary = {"final_val_loss": final, "best_val_loss": final, "steps": 3,
                   "elapsed_s": 1.0, "final_batch_size": rc.initial_batch_size}
        metrics = {"step": [0.0, 1.0, 2.0], "samples": [8.0, 16.0, 24.0],
                   "val_loss": [2.0, 1.5, final], "batch_size": [8.0, 8.0, 8.0]}
        return summary, metrics

    monkeypatch.setattr(presets, "_run", fake_run)
    monkeypatch.setattr(plots, "plots_available", lambda: False)
    proto = Protocol(optimizers=("signum",), seeds=(0, 1), grid=(8, 16, 32),
                     lrs=(("signum", (1e-3, 2e-3, 4e-3)),), select="first")
    res = run_paper(DemoConfig(), proto, str(tmp_path / "p"), log=lambda m: None)
    d = res["per_optimizer"]["signum"]
    assert d["B0"] == 16
    assert d["lr"] == {"baseline": 2e-3, "euclidean": 4e-3, "adaptive": 2e-3}
    # 9 grid runs + 6 LR-search runs + both seeds' three runs: seed 0's are the grid's and
    # the search's folders (a real _run reuses them), so 18 distinct run folders
    assert len(launched) == 21
    assert len({rc.out for rc in launched}) == 18
    seed1 = {(rc.adaptive, rc.resolved_geometry()): rc for rc in launched if rc.seed == 1}
    assert seed1[(False, "l1")].lr == 2e-3 and seed1[(False, "l1")].initial_batch_size == 16
    assert seed1[(True, "l2")].lr == 4e-3 and seed1[(True, "l1")].lr == 2e-3
    assert all(rc.initial_batch_size == 16 for rc in seed1.values())
    # the seed rows use those runs' losses
    assert [s["final"]["baseline"] for s in d["seeds"]] == [1.00, 1.01]
    assert [s["final"]["euclidean"] for s in d["seeds"]] == [1.20, 1.21]
    assert "peak LR, signum: constant 0.002, l2 0.004, l1 0.002" in res["table"]


def test_protocol_lrs_are_checked():
    with pytest.raises(DemoError, match="share a folder"):
        Protocol(lrs=(("signum", (1e-3, 1e-3)),)).lrs_for("signum")
    with pytest.raises(DemoError, match="finite and > 0"):
        Protocol(lrs=(("signum", (1e-3, 0.0)),)).lrs_for("signum")


def test_no_lr_line_without_a_search():
    row = {"final": {"baseline": 1.0, "euclidean": 1.1, "adaptive": 1.05}, "steps":
           {"baseline": 10, "euclidean": 4, "adaptive": 5}, "target": 1.0, "base_steps": 10,
           "euclidean": {"steps": None, "reduction": None},
           "adaptive": {"steps": None, "reduction": None}}
    d = {"B0": 16, "seeds": [row], "seeds_used": [0], "geometry": "l1",
         "lr": {"baseline": None, "euclidean": None, "adaptive": None}}
    assert "peak LR" not in paper_table({"signum": d})


def _fake_protocol_run(finals, launched):
    """A stand-in for presets._run: final loss finals(rc), no training."""
    def fake_run(rc, log):
        launched.append(rc)
        final = finals(rc)
        summary = {"final_val_loss": final, "best_val_loss": final, "steps": 3,
                   "elapsed_s": 1.0, "final_batch_size": rc.initial_batch_size}
        metrics = {"step": [0.0, 1.0, 2.0], "samples": [8.0, 16.0, 24.0],
                   "val_loss": [2.0, 1.5, final], "batch_size": [8.0, 8.0, 8.0]}
        return summary, metrics
    return fake_run


def test_run_paper_chooses_on_the_mean_over_seeds(monkeypatch, tmp_path):
    """select='all': the grid and the LR search run on every seed and the choice is the
    lowest MEAN final loss. Seed 0 alone favours (B 32, 4e-3) and l1 at 4e-3 (a lucky draw);
    the means favour (16, 2e-3) and l1 at 2e-3. Every seed's table runs are the grid's and
    the search's own (no extra launch)."""
    import gns_kernels.demo.plots as plots
    import gns_kernels.demo.presets as presets

    const = {(16, 2e-3): (1.10, 1.10, 1.10), (16, 4e-3): (1.12, 1.12, 1.13),
             (32, 2e-3): (1.15, 1.14, 1.15), (32, 4e-3): (1.05, 1.20, 1.21)}
    adaptive = {("l2", 2e-3): (1.30, 1.31, 1.29), ("l2", 4e-3): (1.35, 1.36, 1.34),
                ("l1", 2e-3): (1.22, 1.20, 1.21), ("l1", 4e-3): (1.18, 1.27, 1.26)}
    seeds = (5, 6, 7)

    def finals(rc):
        i = seeds.index(rc.seed)
        if not rc.adaptive:
            return const[(rc.initial_batch_size, rc.lr)][i]
        assert rc.initial_batch_size == 16   # the adaptive runs start from the chosen B_0
        return adaptive[(rc.resolved_geometry(), rc.lr)][i]

    launched = []
    monkeypatch.setattr(presets, "_run", _fake_protocol_run(finals, launched))
    monkeypatch.setattr(plots, "plots_available", lambda: False)
    proto = Protocol(optimizers=("signum",), seeds=seeds, grid=(16, 32),
                     lrs=(("signum", (2e-3, 4e-3)),))
    res = run_paper(DemoConfig(), proto, str(tmp_path / "p"), log=lambda m: None)
    d = res["per_optimizer"]["signum"]
    assert (d["B0"], d["lr"]) == (16, {"baseline": 2e-3, "euclidean": 2e-3, "adaptive": 2e-3})
    # grid 4 x 3 seeds, search 2 LRs x 2 kinds x 3 seeds, then the 9 table runs, all reused
    assert len(launched) == 12 + 12 + 9
    assert len({rc.out for rc in launched}) == 24
    assert [s["final"]["baseline"] for s in d["seeds"]] == [1.10, 1.10, 1.10]
    assert [s["final"]["adaptive"] for s in d["seeds"]] == [1.22, 1.20, 1.21]
    # the grid table reports every seed and the mean
    row = next(l for l in res["grid_table"].splitlines() if l.split()[1:3] == ["32", "0.004"])
    assert "1.0500/1.2000/1.2100" in row and f"{(1.05 + 1.20 + 1.21) / 3:.4f}" in row
    with open(tmp_path / "p" / "paper.json") as fh:
        saved = json.load(fh)
    assert saved["selection_seeds"] == [5, 6, 7]
    assert [r["final_val_loss"] for r in saved["grid"]["signum"][3]["runs"]] == [1.05, 1.20, 1.21]


def test_per_optimizer_grids_and_selection_seeds_are_checked():
    p = Protocol(grid=(16, 32), grids=(("muon", (8, 16)),))
    assert p.grid_for("signum") == (16, 32) and p.grid_for("muon") == (8, 16)
    assert Protocol().grid_for("muon")[0] == 8 and Protocol().select_seeds() == (0, 1, 2)
    assert Protocol(seeds=(4, 2), select="first").select_seeds() == (4,)
    for bad in ((), (16, 16), (0, 16), (16.0,), (True,)):
        with pytest.raises(DemoError, match=r"Protocol.grids\['muon'\]: expected distinct integer"):
            Protocol(grids=(("muon", bad),)).grid_for("muon")
    with pytest.raises(DemoError, match="Protocol.grid: expected distinct integer"):
        Protocol(grid=(8, 8)).grid_for("signum")
    with pytest.raises(DemoError, match="Protocol.select: expected 'all' or 'first', got 'best'"):
        Protocol(select="best").select_seeds()
    with pytest.raises(DemoError, match="Protocol.seeds: expected at least one seed"):
        Protocol(seeds=()).select_seeds()


def test_paper_cpu_20_is_twenty_bytes_per_parameter():
    """The issue-34 regime: 84,720 parameters (counted here on the model) and 26475
    sequences of 64 bytes, 20.0 bytes per parameter; everything else as paper-cpu."""
    from gns_kernels.demo.model import ByteTransformer

    p, base = PRESETS["paper-cpu-20"], PRESETS["paper-cpu"]
    model = ByteTransformer(vocab=256, dim=p["dim"], n_layers=p["layers"], n_heads=p["heads"],
                            mlp_hidden=p["mlp"], context=p["context"])
    n = sum(t.numel() for t in model.parameters())
    assert n == 84720
    assert p["samples"] * p["context"] / n == pytest.approx(20.0, abs=1e-3)
    assert p["eval_every"] == 50
    assert {k: v for k, v in p.items() if k not in ("dim", "layers", "heads", "mlp", "samples", "eval_every")} == \
        {k: v for k, v in base.items() if k not in ("dim", "layers", "heads", "mlp", "samples", "eval_every")}


def test_every_preset_is_a_command_line_choice():
    from gns_kernels.cli import build_parser
    from gns_kernels.demo.presets import PROTOCOLS

    parser = build_parser(["demo"]).parse_args(["demo"])._parser
    choices = next(a.choices for a in parser._actions if "--preset" in a.option_strings)
    assert sorted(choices) == sorted(PRESETS) == sorted(PROTOCOLS)


def test_theta_applies_to_the_geometry_matched_runs(monkeypatch, tmp_path):
    """--theta with --compare --preset: the geometry-matched runs (search and table) run at
    it in folders named by it, so runs at another theta are never reused or overwritten;
    the l2 runs and the baselines are the same runs as without --theta."""
    import dataclasses

    import gns_kernels.demo.plots as plots
    import gns_kernels.demo.presets as presets

    launched = []
    monkeypatch.setattr(presets, "_run", _fake_protocol_run(lambda rc: 1.0 + 0.01 * rc.seed, launched))
    monkeypatch.setattr(plots, "plots_available", lambda: False)
    proto = Protocol(optimizers=("signum",), seeds=(0, 1), grid=(16,), lrs=(("signum", (4e-3,)),))
    run_paper(dataclasses.replace(DemoConfig(), theta=1.5), proto, str(tmp_path / "a"), log=lambda m: None)
    with_theta = list(launched)
    launched.clear()
    run_paper(DemoConfig(), proto, str(tmp_path / "a"), log=lambda m: None)
    geo = [rc for rc in with_theta if rc.adaptive and rc.resolved_geometry() == "l1"]
    assert geo and all(rc.theta == 1.5 and rc.resolved_theta() == 1.5 for rc in geo)
    assert all(os.path.basename(rc.out).startswith("l1_lr0.004_th1.5_seed") for rc in geo)
    l2 = [rc for rc in with_theta if rc.adaptive and rc.resolved_geometry() == "l2"]
    assert l2 and all(rc.resolved_theta() == 0.3 for rc in l2)
    others = sorted(rc.out for rc in with_theta if rc not in geo)
    assert others == sorted(rc.out for rc in launched
                            if not (rc.adaptive and rc.resolved_geometry() == "l1"))
    assert not any("_th" in os.path.basename(rc.out) for rc in launched)
    with pytest.raises(DemoError, match="--theta"):
        run_paper(dataclasses.replace(DemoConfig(), theta=-1.0), proto, str(tmp_path / "b"),
                  log=lambda m: None)
