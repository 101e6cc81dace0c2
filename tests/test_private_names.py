"""No private names cross the package's modules; tests and bench use public names or the
internal ones docs/internals.md lists (issue 42).

A private name: one that starts with '_' (not a dunder). A private module: one with a path
segment after ``gns_kernels`` that starts with '_' (``gns_kernels.distributed._share``);
its names are the package's own business, so the package's modules may import them.
Read from the source with ``ast`` (imports and ``module._name`` attribute reads of an
imported module), not by importing anything.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = "gns_kernels"


def _modules() -> dict:
    out = {}
    for f in (ROOT / PKG).rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_module(mod: str) -> bool:
    return any(_private(seg) for seg in mod.split(".")[1:])


def _absolute(me: str, is_init: bool, level: int, module) -> str:
    if not level:
        return module or ""
    parts = me.split(".")
    if not is_init:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def private_uses(path: pathlib.Path, me: str = "") -> list:
    """(line, 'module.name') for every private name of a package module that the file at
    path imports or reads as an attribute of an imported module, and for every name it
    imports from a private module ('module.name' with the module's own path)."""
    tree = ast.parse(path.read_text())
    is_init = path.name == "__init__.py"
    bound, uses = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(me, is_init, node.level, node.module)
            if base != PKG and not base.startswith(PKG + "."):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    bound[alias.asname or alias.name] = full
                    if _private_module(full):
                        uses.append((node.lineno, full))
                elif _private(alias.name) or _private_module(base):
                    uses.append((node.lineno, full))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PKG):
                    bound[alias.asname or PKG] = alias.name if alias.asname else PKG
                    if _private_module(alias.name):
                        uses.append((node.lineno, alias.name))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _private(node.attr)):
            uses.append((node.lineno, f"{bound[node.value.id]}.{node.attr}"))
    return uses


def test_no_private_name_crosses_the_package_modules():
    crossing = []
    for me, path in sorted(MODULES.items()):
        for line, full in private_uses(path, me):
            mod, _, name = full.rpartition(".")
            if full in MODULES:  # a module imported by name
                mod, name = full, ""
            if mod == me or _private_module(mod) or (name and not _private(name)):
                continue
            crossing.append(f"{path.relative_to(ROOT)}:{line} {full}")
    assert crossing == []


def _listed() -> set:
    text = (ROOT / "docs" / "internals.md").read_text()
    return set(re.findall(r"`(gns_kernels(?:\.\w+)+)`", text))


def test_tests_and_bench_use_listed_internal_names():
    listed = _listed()
    unlisted = []
    for where in ("tests", "bench"):
        for path in sorted((ROOT / where).rglob("*.py")):
            for line, full in private_uses(path):
                # a name of a private module is covered by the module's entry
                mod = full if full in MODULES else full.rpartition(".")[0]
                if full not in listed and not (_private_module(mod) and mod in listed):
                    unlisted.append(f"{path.relative_to(ROOT)}:{line} {full}")
    assert unlisted == [], "add these to docs/internals.md or use a public name"


def test_the_listed_internal_names_exist():
    missing = []
    for full in _listed():
        if full in MODULES:
            continue
        mod, _, name = full.rpartition(".")
        if mod not in MODULES or not re.search(rf"^\s*(def |class )?{re.escape(name)}\b", MODULES[mod].read_text(),
                                                re.M):
            missing.append(full)
    assert missing == []
