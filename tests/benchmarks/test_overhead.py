"""`gns-kernels bench overhead` (gns_kernels.benchmarks.overhead): arguments, tables, the
command line path, tiny real runs under DDP and FSDP2."""
from __future__ import annotations

import argparse

import pytest

from gns_kernels import cli
from gns_kernels.benchmarks import overhead


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
    (["--configs", "base_p"], "--configs"),  # an FSDP2 configuration under DDP
    (["--parallel", "fsdp2", "--configs", "base,py"], "--configs"),
])
def test_bad_input_exits_2_with_message(argv, word, capsys):
    assert overhead.run(_args(*argv)) == 2
    err = capsys.readouterr().err
    assert word in err and err.count("\n") == 1


def test_table_means_and_overheads():
    res = {"times": {"base_F1": [1.0, 1.0], "l1_F1": [1.5, 1.5], "s1_F1": [3.0, 3.0],
                     "base_F10": [1.0] * 20, "l1_F10": [1.05] * 20, "s1_F10": [1.2] * 20}}
    text = overhead.format_results(res, 10)
    assert "| 1 | 2 | 1.0000 | 1.5000 | +50.0% | 3.0000 | +200.0% |" in text
    assert "| 10 | 20 | 1.0000 | 1.0500 | +5.0% | 1.2000 | +20.0% |" in text
    assert "+0.5000 s" in text and "+2.0000 s" in text
    assert "/ 10 = +0.050000 s/step (+5.00% at F=10, amortized)" in text
    # at F = 5 the one-in-F cost is divided by 5, not by a fixed 100
    res5 = {"times": {"base_F1": [1.0, 1.0], "l1_F1": [1.5, 1.5], "s1_F1": [3.0, 3.0],
                      "base_F5": [1.0] * 10, "l1_F5": [1.1] * 10, "s1_F5": [1.4] * 10}}
    text5 = overhead.format_results(res5, 5)
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
    text = overhead.format_results(res, 10)
    assert "| DDP + torch's built-in C++ ALLREDUCE hook | 1.2000 | +20.0% | 1.0100 | +1.0% | 1 / 10 |" in text
    assert "| DDP + torch's Python allreduce_hook | 1.1000 | +10.0% | 1.0200 | +2.0% | 1 / 10 |" in text
    assert "| DDP + ddp_gns_hook l1 | 1.5000 | +50.0% | 1.0500 | +5.0% | 1 / 10 |" in text


def test_fsdp2_tables_placement_rows_relative_to_their_own_baseline():
    res = {"times": {"base_F1": [1.0], "l1_F1": [1.5], "s1_F1": [3.0], "base_p_F1": [2.0], "s1_p_F1": [2.5],
                     "base_F5": [1.0] * 5, "l1_F5": [1.1] * 5, "s1_F5": [1.4] * 5,
                     "base_p_F5": [], "s1_p_F5": []},
           "memory": {"base": 1000, "l1": 1500, "s1": 1000, "base_p": 900, "s1_p": 1200}, "params": 10}
    text = overhead.format_results(res, 5, "fsdp2")
    assert "One S1 (Shard(1) placement) measurement step costs +0.5000 s over the F=1 baseline " \
           "(+25.0%); / 5 = +0.100000 s/step (+5.00% at F=5, amortized)." in text
    assert "| FSDP2 (fsdp_gns_shard_placement) + attach_fsdp_gns S1 | 2.5000 | +25.0% | - |  | 1 / 0 |" in text
    lines = text.splitlines()
    l1 = next(x for x in lines if x.strip().startswith("FSDP2 + attach_fsdp_gns l1 "))
    s1p = next(x for x in lines if "+ attach_fsdp_gns S1" in x and "placement" in x and "extra" in x)
    assert l1.split()[-1] == "+500" and s1p.split()[-1] == "+300"


def test_command_line_path(capsys):
    """`gns-kernels bench overhead` reaches this command."""
    assert cli.main(["bench", "overhead", "--ranks", "1"]) == 2
    assert "--ranks: expected >= 2" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_tiny_real_run(parallel, capsys):
    configs = "base,l1" if parallel == "ddp" else "base,l1,base_p,s1_p"
    rc = overhead.run(_args("--parallel", parallel, "--configs", configs, "--every", "2", "--rounds", "1",
                            "--f1-block", "1", "--f1-rounds", "1", "--warmup", "0", "--context", "16",
                            "--no-breakdown", "--timeout", "300", "--json", "/dev/null"))
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 1 / 2 |" in out and "peak bytes allocated during the backward" in out
    # the l1 measurement step allocates its [x, x^2] pack on top of the plain step's memory
    extra = next(x for x in out.splitlines() if "attach_fsdp_gns l1" in x or "ddp_gns_hook l1" in x
                 if "extra" in x)
    assert int(extra.split()[-1].replace(",", "")) > 0


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
