"""`gns-kernels bench overhead` (gns_kernels.demo.overhead): arguments, table, a tiny real run."""
from __future__ import annotations

import argparse

import pytest

from gns_kernels.demo import overhead


def _args(*argv):
    p = argparse.ArgumentParser()
    overhead.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv,word", [
    (["--ranks", "1"], "--ranks"),
    (["--every", "0"], "--every"),
    (["--rounds", "0"], "--rounds"),
    (["--context", "129"], "--context"),
    (["--local-batch", "0"], "--local-batch"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb"),
    (["--warmup", "-1"], "--warmup"),
    (["--configs", "base,foo"], "--configs"),
    (["--configs", "l1,l1"], "--configs"),
    (["--configs", "cpp,Py"], "--configs"),
])
def test_bad_input_exits_2_with_message(argv, word, capsys):
    assert overhead.run(_args(*argv)) == 2
    err = capsys.readouterr().err
    assert word in err and err.count("\n") == 1


def test_table_means_and_overheads():
    res = {"times": {"base_F1": [1.0, 1.0], "l1_F1": [1.5, 1.5], "s1_F1": [3.0, 3.0],
                     "base_F10": [1.0] * 20, "l1_F10": [1.05] * 20, "s1_F10": [1.2] * 20}}
    text = overhead._fmt_table(res, 10)
    assert "| 1 | 2 | 1.0000 | 1.5000 | +50.0% | 3.0000 | +200.0% |" in text
    assert "| 10 | 20 | 1.0000 | 1.0500 | +5.0% | 1.2000 | +20.0% |" in text
    assert "+0.5000 s" in text and "+2.0000 s" in text
    assert "/ 10 = +0.050000 s/step (+5.00% at F=10, amortized)" in text
    # at F = 5 the one-in-F cost is divided by 5, not by a fixed 100
    res5 = {"times": {"base_F1": [1.0, 1.0], "l1_F1": [1.5, 1.5], "s1_F1": [3.0, 3.0],
                      "base_F5": [1.0] * 10, "l1_F5": [1.1] * 10, "s1_F5": [1.4] * 10}}
    text5 = overhead._fmt_table(res5, 5)
    assert "| 5 | 10 | 1.0000 | 1.1000 | +10.0% | 1.4000 | +40.0% |" in text5
    assert "One l1 measurement step costs +0.5000 s over the F=1 baseline (+50.0%); / 5 = " \
           "+0.100000 s/step (+10.00% at F=5, amortized)." in text5
    assert "One S1 measurement step costs +2.0000 s over the F=1 baseline (+200.0%); / 5 = " \
           "+0.400000 s/step (+40.00% at F=5, amortized)." in text5
    assert "F=100" not in text5 and "/ 100" not in text5


def test_partial_table_with_python_hook_baseline():
    res = {"times": {"base_F1": [1.0], "cpp_F1": [1.2], "py_F1": [1.1], "l1_F1": [1.5],
                     "base_F10": [1.0] * 10, "cpp_F10": [1.01] * 10, "py_F10": [1.02] * 10,
                     "l1_F10": [1.05] * 10}}
    text = overhead._fmt_table(res, 10)
    assert "| DDP + torch's built-in C++ ALLREDUCE hook | 1.2000 | +20.0% | 1.0100 | +1.0% | 1 / 10 |" in text
    assert "| DDP + torch's Python allreduce_hook | 1.1000 | +10.0% | 1.0200 | +2.0% | 1 / 10 |" in text
    assert "| DDP + ddp_gns_hook l1 | 1.5000 | +50.0% | 1.0500 | +5.0% | 1 / 10 |" in text


@pytest.mark.slow
@pytest.mark.distributed
def test_tiny_real_run(capsys):
    rc = overhead.run(_args("--every", "2", "--rounds", "1", "--f1-block", "1", "--f1-rounds", "1",
                            "--warmup", "0", "--context", "16", "--no-breakdown", "--timeout", "300"))
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 1 | 1 |" in out and "| 2 | 2 |" in out and "peak bytes of the hook" in out


def test_quick_sets_a_short_run(monkeypatch, capsys):
    seen = {}

    def fake_launch(rank_main, cfg, world, timeout):
        seen.update(cfg)
        t = {f"{n}_F{f}": [1.0] * (cfg["rounds"] * f if f > 1 else cfg["f1_rounds"] * cfg["f1_block"])
             for n in cfg["configs"] for f in (1, cfg["every"])}
        return {"times": t, "estimates": {}, "params": 10}

    monkeypatch.setattr(overhead, "launch_ranks", fake_launch)
    assert overhead.run(_args("--quick", "--no-memory")) == 0
    assert (seen["every"], seen["rounds"], seen["f1_block"], seen["f1_rounds"], seen["warmup"],
            seen["breakdown"]) == (10, 1, 2, 1, 1, False)
    out = capsys.readouterr().out
    assert "| 10 | 10 |" in out and "at F=10, amortized" in out
