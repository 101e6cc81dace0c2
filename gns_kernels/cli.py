"""Command line: gns-kernels COMMAND [options]; gns-kernels COMMAND --help for each command.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up. Only the module of the command
being run (or asked for --help) is imported, so ``gns-kernels --help`` stays fast and one
command's heavy (or broken) imports never affect another.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ._version import __version__

DESCRIPTION = (
    "Gradient noise scales (l2, l1, nuclear) in the optimizer's geometry: estimates on "
    "built-in models, a training demo that grows the batch by the GNS, and benchmarks.\n"
    "Run 'gns-kernels COMMAND --help' for the options of a command."
)

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
    ("probe",): (
        "gns_kernels.demo.probe",
        "critical batch size from a demo run's checkpoint (short branches at several B) beside its GNS",
    ),
    ("bench", "overhead"): (
        "gns_kernels.benchmarks.overhead",
        "step-time overhead of the l1 and S1 GNS hooks under DDP or FSDP2 (the paper's Table 9)",
    ),
}

# one-line help of each command group (the first word of a two-word path)
GROUPS: dict[str, str] = {
    "bench": "benchmarks: 'gns-kernels bench SUBCOMMAND --help' for each",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions keep their line breaks; each option's help ends with its default.

    The default is not appended where the help text already states it (it mentions
    "default"), nor for options whose default is None or False (flags, optional values).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default is None or action.default is False:
            return help_text
        return super()._get_help_string(action)


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
    parser = argparse.ArgumentParser(prog="gns-kernels", description=DESCRIPTION,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.set_defaults(_parser=parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module, help_text) in COMMANDS.items():
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_text, description=help_text,
                               formatter_class=HelpFormatter)
        else:
            if path[0] not in groups:
                group_help = GROUPS.get(path[0], f"{path[0]} commands")
                g = sub.add_parser(path[0], help=group_help, description=group_help,
                                   formatter_class=HelpFormatter)
                g.set_defaults(_parser=g)
                groups[path[0]] = g.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            p = groups[path[0]].add_parser(path[1], help=help_text, description=help_text,
                                           formatter_class=HelpFormatter)
        p.set_defaults(_module=module, _parser=p)
        if path == selected:
            importlib.import_module(module).add_arguments(p)
            _show_bare_defaults(p)
    return parser


def _show_bare_defaults(parser: argparse.ArgumentParser) -> None:
    """Options added without a help text still show their default in --help."""
    for action in parser._actions:
        default = action.default
        if (action.help is None and action.option_strings and default is not None
                and default is not False and default is not argparse.SUPPRESS):
            action.help = "(default: %(default)s)"


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set:
    """The destinations of the options of ``parser`` that argv names (``--x v``, ``--x=v``
    or an abbreviation argparse accepts): what the user set, as opposed to a default.

    Each token is matched as argparse matches it: an exact option string names that option
    alone (``--lr`` is ``--lr``, not an abbreviation of ``--lr-min`` or ``--lr-warmup``);
    otherwise a ``--`` token names the one long option it abbreviates (argparse has already
    refused an ambiguous one). Tokens after a bare ``--`` are positional."""
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    dests = set()
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        name = token.split("=", 1)[0]
        if name in by_option:
            dests.add(by_option[name])
        elif name.startswith("--"):
            hits = {by_option[o] for o in by_option if o.startswith("--") and o.startswith(name)}
            if len(hits) == 1:
                dests |= hits
        elif name[:2] in by_option:  # a short option with its value attached: -x5
            dests.add(by_option[name[:2]])
    return dests


def main(argv: list[str] | None = None) -> int:
    """Run the command named in argv; no command (or a group without its sub-command)
    prints that level's help and returns 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    args._explicit = explicit_dests(args._parser, argv)
    if getattr(args, "_module", None) is None:
        args._parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
