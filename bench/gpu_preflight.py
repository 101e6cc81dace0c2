"""The GPU window's preflight (seconds): the build's tools, the torch version, and whether
every torch API the package names exists in the torch that runs it.

    python bench/gpu_preflight.py            # prints a report; exit 0
    python bench/gpu_preflight.py --build-env # also prints `KEY=VALUE` lines for the shell

Build tools (what `python setup.py build_ext --inplace` of the CUDA extension needs):
setuptools >= 77 (pyproject.toml's SPDX `license`; `--no-build-isolation` does not check
it), ninja (without it the sources compile one after another), nvcc under torch's
CUDA_HOME (without it setup.py quietly builds a CPU-only extension), the C++ compiler
(``$CXX``, else /usr/bin/g++ where it exists: the GPU image's `c++` wrapper links
libstdc++ statically and C++ errors then crash), the job count (``nproc --all``, which
OMP_NUM_THREADS does not lower) and the device's compute capability (TORCH_CUDA_ARCH_LIST:
the build targets this GPU alone).

torch APIs: every module of gns_kernels is parsed (not imported) and each name it takes
from torch is resolved in the running torch: ``from torch.x import y``, ``import torch.x``
and attribute chains on a name bound to a torch module (``dist.reduce_scatter_single``,
``torch.distributed.fsdp.FSDPModule``). A name that does not resolve is listed with its
file and line, and whether the use sits under a ``hasattr`` / ``getattr`` / ``try`` guard
(a guarded one has a fallback by construction; an unguarded one fails where it runs).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "gns_kernels"
SETUPTOOLS_MIN = (77,)


def row(what: str, value: str, target: str = "") -> None:
    print(f"@@ | preflight | {what} | {value} | {target} |", flush=True)


# ----------------------------------------------------------------------------- tools
def _version_tuple(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _run(cmd: list) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"error: {exc}"
    return (p.stdout or p.stderr).strip()


def build_env() -> tuple[dict, list]:
    """({KEY: VALUE} for the build, [why the CUDA build is skipped]) of this machine."""
    env, missing = {}, []
    try:
        import setuptools

        sv = setuptools.__version__
        env["SETUPTOOLS"] = sv
        if _version_tuple(sv) < SETUPTOOLS_MIN:
            missing.append(f"setuptools {sv} < 77 (pyproject.toml's SPDX license)")
    except ImportError:
        missing.append("setuptools not importable")
    ninja = shutil.which("ninja")
    if ninja is None:
        try:
            import ninja as _ninja  # the PyPI package carries the binary

            ninja = os.path.join(_ninja.BIN_DIR, "ninja")
            env["NINJA_DIR"] = _ninja.BIN_DIR
        except (ImportError, AttributeError):
            ninja = None
    env["NINJA"] = _run([ninja, "--version"]) if ninja else "absent"
    if ninja is None:
        missing.append("ninja not found (the sources would compile one at a time)")
    # GPU_WINDOW_CXX, else /usr/bin/g++, else $CXX: the GPU image sets CXX=/opt/gcc/bin/g++,
    # a wrapper that links libstdc++ statically, and the extension built with it crashed
    # (SIGSEGV) at the first C++ exception (an H200 run, 2026-11-28: a bad argument test)
    env["CXX"] = (os.environ.get("GPU_WINDOW_CXX")
                  or ("/usr/bin/g++" if os.path.exists("/usr/bin/g++") else os.environ.get("CXX") or "c++"))
    if os.environ.get("CXX") and os.environ["CXX"] != env["CXX"]:
        print(f"note: CXX={os.environ['CXX']} in the environment is not used (GPU_WINDOW_CXX overrides)")
    env["CXX_VERSION"] = (_run([env["CXX"], "--version"]).splitlines() or ["?"])[0]
    env["JOBS"] = _run(["nproc", "--all"]) if shutil.which("nproc") else str(os.cpu_count() or 1)
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME

        env["TORCH"] = torch.__version__
        env["TORCH_CUDA"] = str(torch.version.cuda)
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
        if nvcc and os.path.exists(nvcc):
            env["NVCC"] = (_run([nvcc, "--version"]).splitlines() or ["?"])[-1]
        else:
            env["NVCC"] = "absent"
            missing.append(f"no nvcc under torch's CUDA_HOME ({CUDA_HOME})")
        if torch.version.cuda is None:
            missing.append("torch is a CPU build")
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            env["ARCH"] = f"{major}.{minor}"
        else:
            env["ARCH"] = "none"
            missing.append("no CUDA device visible")
    except ImportError as exc:
        missing.append(f"torch not importable ({exc})")
    return env, missing


# ----------------------------------------------------------------------------- torch APIs
class _Uses(ast.NodeVisitor):
    """The torch names one module takes: (dotted name, line, guarded)."""

    def __init__(self):
        self.aliases: dict[str, str] = {}  # local name -> the torch module path it is bound to
        self.uses: list[tuple[str, int, bool]] = []
        self._guard = 0

    # a use under try/except, or inside hasattr(...)/getattr(..., default), has a fallback
    def visit_Try(self, node):
        self._guard += 1
        for n in node.body:
            self.visit(n)
        self._guard -= 1
        for n in node.handlers + node.orelse + node.finalbody:
            self.visit(n)

    def visit_Call(self, node):
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in ("hasattr", "getattr") and len(node.args) >= 2:
            base = self._dotted(node.args[0])
            attr = node.args[1]
            if base and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                self.uses.append((f"{base}.{attr.value}", node.lineno, True))
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for a in node.names:
            if a.name == "torch" or a.name.startswith("torch."):
                self.uses.append((a.name, node.lineno, self._guard > 0))
                if a.asname:
                    self.aliases[a.asname] = a.name
                else:
                    self.aliases["torch"] = "torch"

    def visit_ImportFrom(self, node):
        mod = node.module or ""
        if node.level == 0 and (mod == "torch" or mod.startswith("torch.")):
            for a in node.names:
                full = f"{mod}.{a.name}"
                self.uses.append((full, node.lineno, self._guard > 0))
                self.aliases[a.asname or a.name] = full

    def _dotted(self, node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id]] + parts[::-1])
        return None

    def visit_Attribute(self, node):
        d = self._dotted(node)
        if d is not None:
            self.uses.append((d, node.lineno, self._guard > 0))
            return  # the longest chain only
        self.generic_visit(node)


def _resolve(name: str):
    """(ok, how far it resolved) of a dotted torch name: modules are imported, then
    attributes taken; past a non-module object the remaining parts are taken too (a
    class's attribute), but a value that is not a module or class ends the check."""
    parts = name.split(".")
    obj, i = None, 0
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except Exception:  # noqa: BLE001  (not a module: try the parent)
            continue
    if obj is None:
        return False, ""
    done = ".".join(parts[:i])
    for p in parts[i:]:
        if not (isinstance(obj, type) or type(obj).__name__ == "module"):
            return True, done  # an instance or function: its attributes are not API names
        if not hasattr(obj, p):
            try:  # a submodule not yet imported
                obj = importlib.import_module(f"{done}.{p}")
            except Exception:  # noqa: BLE001
                return False, done
        else:
            obj = getattr(obj, p)
        done = f"{done}.{p}"
    return True, done


def torch_api_uses(pkg: Path = PKG) -> dict[str, list[tuple[str, int, bool]]]:
    """{dotted torch name: [(file, line, guarded)]} over every module of the package."""
    out: dict[str, list] = {}
    for f in sorted(pkg.rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        v = _Uses()
        v.visit(tree)
        for name, line, guarded in v.uses:
            where = f.relative_to(REPO) if f.is_relative_to(REPO) else f
            out.setdefault(name, []).append((str(where), line, guarded))
    return out


def missing_torch_apis(pkg: Path = PKG) -> list[tuple[str, list]]:
    """[(name, its uses)] of the names the running torch lacks."""
    bad = []
    for name, uses in sorted(torch_api_uses(pkg).items()):
        ok, _ = _resolve(name)
        if not ok:
            bad.append((name, uses))
    return bad


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-env", action="store_true",
                   help="also print KEY=VALUE lines (prefixed 'env ') for the shell script")
    a = p.parse_args(argv)
    env, missing = build_env()
    print(f"python {platform.python_version()} at {sys.executable}")
    for k, v in env.items():
        print(f"{k}: {v}")
    row("build tools", f"setuptools {env.get('SETUPTOOLS', '?')}, ninja {env.get('NINJA')}, "
        f"nvcc {env.get('NVCC', '?')}, CXX {env.get('CXX')}, {env.get('JOBS')} jobs, "
        f"sm {env.get('ARCH', '?')}", "setuptools >= 77, ninja, nvcc")
    if missing:
        print("CUDA build: SKIP: " + "; ".join(missing))
    else:
        print("CUDA build: all pieces present")
    uses = torch_api_uses()
    bad = missing_torch_apis()
    unguarded = [(n, u) for n, u in bad if not all(g for _, _, g in u)]
    for name, where in bad:
        guard = "guarded" if all(g for _, _, g in where) else "UNGUARDED"
        print(f"missing in torch {env.get('TORCH', '?')}: {name} ({guard}; "
              + ", ".join(f"{f}:{ln}" for f, ln, _ in where[:4]) + ")")
    row(f"torch APIs the package names ({len(uses)})",
        f"{len(uses) - len(bad)} resolve in torch {env.get('TORCH', '?')}; missing: "
        + (", ".join(f"{n}{'' if all(g for _, _, g in u) else ' (UNGUARDED)'}" for n, u in bad) or "none"),
        "none missing unguarded")
    if a.build_env:
        for k, v in env.items():
            print(f"env {k}={v}")
        print("env BUILD_SKIP=" + ("; ".join(missing) if missing else ""))
    return 1 if unguarded else 0


if __name__ == "__main__":
    raise SystemExit(main())
