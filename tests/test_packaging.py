"""Release artifacts built from this checkout: the sdist's file list and metadata, and a
wheel built without the C++ extension. Both build from a copy of the checkout with
setuptools' PEP 517 backend in a subprocess, against the installed torch (as
`python -m build --no-isolation` does)."""
from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import gns_kernels

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _source_copy(tmp: Path) -> Path:
    """The checkout without build outputs, so the build leaves nothing in the repository."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.o", "runs", ".venv*"))
    return src


def _build(kind: str, out: Path, env_extra: dict | None = None) -> Path:
    src = _source_copy(out)
    code = (
        "import sys\n"
        "from setuptools import build_meta\n"
        f"print(build_meta.build_{kind}(sys.argv[1]))\n"
    )
    env = {**os.environ, **(env_extra or {})}
    res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out / res.stdout.strip().splitlines()[-1]


def _package_sources() -> set[str]:
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gns_kernels").rglob("*.py")
             if "__pycache__" not in p.parts}
    return files | {"gns_kernels/py.typed"}


def test_sdist_has_every_source_header_and_license(tmp_path):
    sdist = _build("sdist", tmp_path)
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        rel = {n[len(top) + 1:] for n in names if n.startswith(top + "/")}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    csrc = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert {"csrc/gns_math.h", "csrc/cpu/cpu_common.h"} <= csrc  # the headers the build needs
    assert any(f.startswith("csrc/cuda/") for f in csrc)
    wanted = csrc | _package_sources() | {"LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in"}
    assert not wanted - rel, f"missing from the sdist: {sorted(wanted - rel)}"
    assert not [n for n in rel if n.endswith((".so", ".pyd", ".o", ".pyc"))]
    headers = email.message_from_string(pkg_info)
    assert headers["License-Expression"] == "Apache-2.0"
    assert headers["Version"] == gns_kernels.__version__
    requires = headers.get_all("Requires-Dist")
    assert [r for r in requires if r.startswith("torch") and "extra ==" not in r] == ["torch>=2.8"]  # the sdist pins nothing


def test_wheel_without_extension(tmp_path):
    wheel = _build("wheel", tmp_path, {"GNS_KERNELS_NO_EXTENSION": "1"})
    assert wheel.name.endswith("-py3-none-any.whl")  # pure Python: no compiled file
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    assert _package_sources() <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    requires = email.message_from_string(meta).get_all("Requires-Dist")
    assert [r for r in requires if r.startswith("torch") and "extra ==" not in r] == ["torch>=2.8"]
