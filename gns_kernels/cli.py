"""Command line: ``gns-kernels <command> [options]``.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up (imported lazily so that
``gns-kernels --help`` stays fast).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "estimate": (
        "gns_kernels.demo.estimate",
        "l2/l1/nuclear GNS of a small built-in model from simulated ranks vs the exact values",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gns-kernels", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
