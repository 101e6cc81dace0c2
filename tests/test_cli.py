"""gns_kernels.cli: help of every command level, --version, exit codes, lazy imports."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import gns_kernels
from gns_kernels import cli


def _run(args: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(args)
    except SystemExit as exc:  # argparse exits for --help, --version and usage errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_version_is_the_package_version(capsys):
    rc, out = _run(["--version"], capsys)
    assert rc == 0
    assert out.strip() == f"gns-kernels {gns_kernels.__version__}"


def test_version_source_is_the_one_pyproject_reads():
    """pyproject.toml takes the distribution's version from gns_kernels._version."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" in meta["project"]["dynamic"] and "version" not in meta["project"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gns_kernels._version.__version__"}
    from gns_kernels._version import __version__

    assert gns_kernels.__version__ == __version__


def test_no_command_prints_top_level_help(capsys):
    rc, out = _run([], capsys)
    assert rc == 2
    assert out.startswith("usage: gns-kernels [-h] [--version] COMMAND")
    for command in ("estimate", "demo", "bench"):
        assert f"    {command}  " in out


def test_group_without_subcommand_prints_its_own_help(capsys):
    rc, out = _run(["bench"], capsys)
    assert rc == 2
    assert out.startswith("usage: gns-kernels bench [-h] SUBCOMMAND")
    assert "overhead" in out and "estimate" not in out


@pytest.mark.parametrize("path", [[], ["bench"], *[list(p) for p in cli.COMMANDS]])
def test_every_command_answers_help(path, capsys):
    rc, out = _run([*path, "--help"], capsys)
    assert rc == 0
    assert out.startswith("usage: " + " ".join(["gns-kernels", *path]))
    assert "``" not in out  # plain text, no reStructuredText markup


def test_help_shows_defaults():
    """Every option with a default shows it in --help: appended by the formatter, or already
    stated in the option's own help text (flags, whose default is False, excepted)."""
    for path in cli.COMMANDS:
        sub = cli.build_parser(list(path)).parse_args(list(path))._parser
        formatter = sub._get_formatter()
        for action in sub._actions:
            default = action.default
            if not action.option_strings or any(default is x for x in (None, False, argparse.SUPPRESS)):
                continue
            expanded = formatter._expand_help(action)
            assert "default" in expanded.lower(), (path, action.option_strings, expanded)


def test_help_formatter_adds_default_once():
    p = argparse.ArgumentParser(formatter_class=cli.HelpFormatter)
    p.add_argument("--a", type=int, default=7, help="an option")
    p.add_argument("--b", type=int, default=3, help="stated already (default 3)")
    p.add_argument("--c", action="store_true", help="a flag")
    p.add_argument("--d", type=int, default=None, help="optional")
    text = " ".join(p.format_help().split())
    assert "an option (default: 7)" in text
    assert "stated already (default 3)" in text and "(default 3) (default" not in text
    assert "a flag (default" not in text and "optional (default" not in text


def test_help_imports_no_command_module():
    """gns-kernels --help lists the commands without importing their modules (or torch's
    heavy parts): only the package itself is imported."""
    code = (
        "import sys\n"
        "from gns_kernels import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "bad = [m for m in ('gns_kernels.demo', 'gns_kernels.distributed', 'torch._dynamo', 'triton')"
        " if m in sys.modules]\n"
        "print('LOADED', bad)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "LOADED []"
