"""Command line: ``gns-kernels <command> [options]``.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up. Only the module of the command
being run is imported, so one command's heavy (or broken) imports never affect another.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command path -> (module, one-line help). A path of two words is a sub-command
# ("bench overhead").
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("estimate",): (
        "gns_kernels.demo.estimate",
        "l2/l1/nuclear GNS of a small built-in model from simulated ranks vs the exact values",
    ),
    ("demo",): (
        "gns_kernels.demo.train",
        "train a byte-level transformer with DDP, growing the batch by the GNS (Algorithm 1)",
    ),
    ("bench", "overhead"): (
        "gns_kernels.demo.overhead",
        "step-time overhead of the l1 and S1 GNS hooks under DDP (the paper's Table 9)",
    ),
}


def _selected(argv: list[str]) -> tuple[str, ...] | None:
    words = [a for a in argv if not a.startswith("-")]
    for path in COMMANDS:
        if tuple(words[: len(path)]) == path:
            return path
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Parser with every command listed; only the selected command's module is imported."""
    argv = sys.argv[1:] if argv is None else argv
    selected = _selected(argv)
    parser = argparse.ArgumentParser(prog="gns-kernels", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module, help_text) in COMMANDS.items():
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = g.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            p = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if path == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
