"""Attack suite, command line: options combined with --preset and --resume, bad values of
the bench's options. Checked at the parser / configuration level (no training run).

Reproductions of issue 28: `--lr` with `--preset` counted as `--lr-min` and `--lr-warmup`
(the preset's lr_min_ratio 0.0 became 0.1); `--resume DIR --samples 640` ran on the saved
budget without a word; `bench overhead --timeout 0` ended in a traceback.
"""
from __future__ import annotations

import pytest

from gns_kernels.cli import build_parser, explicit_dests, main
from gns_kernels.demo.args import config_from_args, explicit_fields
from gns_kernels.demo.config import DemoConfig
from gns_kernels.demo.presets import PRESETS, apply_preset


def _parse(argv):
    args = build_parser(argv).parse_args(argv)
    args._explicit = explicit_dests(args._parser, argv)
    return args


def _preset_config(extra):
    args = _parse(["demo", "--preset", "paper-cpu"] + extra)
    return apply_preset(config_from_args(args), "paper-cpu", keep=explicit_fields(args)), args


@pytest.mark.parametrize("flag", [["--lr", "0.01"], ["--lr=0.01"]])
def test_lr_with_preset_sets_lr_alone(flag):
    cfg, args = _preset_config(flag)
    assert explicit_fields(args) == {"preset", "lr"}
    assert cfg.lr == 0.01
    for key in ("lr_min_ratio", "lr_warmup"):  # the preset's, not the command line's default
        assert getattr(cfg, key) == PRESETS["paper-cpu"].get(key, getattr(DemoConfig(), key))
    assert cfg.lr_min_ratio == PRESETS["paper-cpu"]["lr_min_ratio"]


@pytest.mark.parametrize("flag, field", [
    (["--lr-m", "0.25"], "lr_min_ratio"),          # a real abbreviation of --lr-min
    (["--lr-min=0.25"], "lr_min_ratio"),
    (["--lr-w", "0.25"], "lr_warmup"),
    (["--max-b", "256"], "max_batch_size"),
    (["--raw-gns"], "bias_correction"),
])
def test_abbreviations_name_one_option(flag, field):
    cfg, args = _preset_config(flag)
    assert explicit_fields(args) == {"preset", field}


def test_explicit_dests_matches_argparse_on_every_option():
    """Every option string of the demo, given exactly, names its own destination alone,
    and a prefix names an option only where argparse itself accepts it."""
    parser = _parse(["demo"])._parser
    for action in parser._actions:
        for opt in action.option_strings:
            if opt in ("-h", "--help"):
                continue
            assert explicit_dests(parser, [opt]) == {action.dest}, opt
    # tokens after a bare "--" and values are not options
    assert explicit_dests(parser, ["--seed", "3", "--", "--lr"]) == {"seed"}
    # an ambiguous prefix names nothing (argparse refuses it before this is asked)
    assert explicit_dests(parser, ["--lr-"]) == set()
    with pytest.raises(SystemExit):
        build_parser(["demo", "--lr-", "1"]).parse_args(["demo", "--lr-", "1"])


@pytest.mark.parametrize("extra, named", [
    (["--samples", "640"], "--samples"),
    (["--samples=640"], "--samples"),
    (["--sam", "640"], "--samples"),
    (["--lr", "0.1", "--seed", "3"], "--lr, --seed"),
    (["--preset", "paper-cpu"], "--preset"),
    (["--compare"], "--compare"),
    (["--out", "elsewhere"], "--out"),
])
def test_resume_refuses_options_it_would_ignore(extra, named, tmp_path, capsys):
    """`--resume DIR --samples 640` exited 0 and ended inside the saved budget. Every option
    that a resumed run takes from its config.json is refused with exit 2 naming it, before
    the folder is read."""
    assert main(["demo", "--resume", str(tmp_path / "run")] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gns-kernels demo: error:"), err
    assert named in err[0] and "cannot be changed on resume" in err[0]


@pytest.mark.parametrize("extra", [[], ["--quiet"], ["--stop-at-step", "3"], ["--timeout", "60"]])
def test_resume_accepts_the_options_that_apply(extra, tmp_path, capsys):
    """The options a resumed run honours pass the check (the run then stops at the missing
    checkpoint, which names the folder)."""
    assert main(["demo", "--resume", str(tmp_path / "run")] + extra) == 2
    err = capsys.readouterr().err
    assert "cannot be changed on resume" not in err and "checkpoint.pt" in err


def test_resume_without_recorded_argv_compares_with_defaults(tmp_path):
    """A namespace built in code (no argv recorded) is checked against the defaults."""
    from gns_kernels.demo.train import given_options

    args = build_parser(["demo"]).parse_args(["demo", "--resume", "x", "--samples", "7"])
    assert not hasattr(args, "_explicit")
    assert given_options(args) == {"resume", "samples"}


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf"])
def test_bench_overhead_bad_timeout_exits_2_with_one_line(value, capsys):
    assert main(["bench", "overhead", f"--timeout={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gns-kernels bench overhead: --timeout:"), err


@pytest.mark.parametrize("exc", [TimeoutError("bench overhead: ranks did not finish in 1 s"),
                                 RuntimeError("not caught")])
def test_bench_overhead_rank_timeout_is_one_line(monkeypatch, capsys, exc):
    """A run that does not finish in --timeout ends with exit 1 and one line (it was a
    traceback); other errors are not hidden."""
    from gns_kernels.benchmarks import overhead

    def launch(*a, **k):
        raise exc
    monkeypatch.setattr(overhead, "launch_ranks", launch)
    if isinstance(exc, TimeoutError):
        assert main(["bench", "overhead", "--timeout", "1"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["gns-kernels bench overhead: error: bench overhead: ranks did not finish in 1 s"]
    else:
        with pytest.raises(RuntimeError, match="not caught"):
            main(["bench", "overhead", "--timeout", "1"])
