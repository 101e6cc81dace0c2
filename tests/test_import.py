"""`import gns_kernels`: what it loads, the public names, and the install without _C."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gns_kernels as gk
from gns_kernels import ops, reference

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("triton", "torch._dynamo", "torch.distributed.fsdp")


def _python(code: str, env_extra: dict | None = None, pythonpath: str | None = None, cwd=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env, cwd=cwd)
    assert res.returncode == 0, res.stderr
    return res


def test_import_loads_no_dynamo_triton_or_fsdp():
    """Compared with a bare `import torch` in the same fresh process: the package adds none
    of torch._dynamo, torch.distributed.fsdp, triton (on a machine with CUDA the Triton
    kernels are registered at import, so triton is not checked there)."""
    code = (
        "import sys, torch\n"
        "base = set(sys.modules)\n"
        "import gns_kernels\n"
        f"heavy = {HEAVY!r}\n"
        "print('TORCH', sorted(m for m in heavy if m in base))\n"
        "print('ADDED', sorted(m for m in heavy if m in sys.modules and m not in base))\n"
        "print('CUDA', torch.cuda.is_available())\n"
    )
    lines = dict(line.split(" ", 1) for line in _python(code).stdout.strip().splitlines())
    assert lines["TORCH"] == "[]", f"import torch alone already loads {lines['TORCH']}"
    added = ast.literal_eval(lines["ADDED"])
    if lines["CUDA"] == "True":
        added = [m for m in added if m != "triton"]
    assert added == []


def test_lazy_names_load_on_first_access():
    code = (
        "import sys, gns_kernels as gk\n"
        "lazy = ('gns_kernels.distributed', 'gns_kernels.adaptive', 'gns_kernels.coordinator', "
        "'gns_kernels.lr', 'gns_kernels.demo')\n"
        "print(sorted(m for m in lazy if m in sys.modules))\n"
        "print(gk.warmup_cosine.__module__, gk.AdaptiveBatching.__module__, gk.GNSHookState.__module__,"
        " gk.attach_fsdp_gns.__module__)\n"
    )
    out = _python(code).stdout.strip().splitlines()
    assert out[0] == "[]"
    assert out[1].split() == ["gns_kernels.lr", "gns_kernels.coordinator.core",
                              "gns_kernels.distributed.state", "gns_kernels.distributed.fsdp"]


def test_public_names():
    for name in gk.__all__:
        assert getattr(gk, name) is not None, name
    assert set(gk.__all__) <= set(dir(gk))
    from gns_kernels.distributed.fsdp import attach_fsdp_gns
    from gns_kernels.lr import warmup_cosine

    assert gk.attach_fsdp_gns is attach_fsdp_gns and gk.warmup_cosine is warmup_cosine
    from gns_kernels.adaptive import AdaptiveBatching

    assert gk.AdaptiveBatching is AdaptiveBatching
    assert len(gk.__all__) == 27
    # names that moved: an AttributeError naming the replacement
    for moved, hint in (("LRMultiplier", "gns_kernels.lr.LRMultiplier"),
                        ("MicroBatchSampler", "coord.batch_sampler"),
                        ("AdaptiveBatchSampler", "AdaptiveBatching"),
                        ("to_tensorboard", "coord.to_tensorboard"),
                        ("tensorboard_writer", "SummaryWriter")):
        assert moved not in gk.__all__
        with pytest.raises(AttributeError, match=f"gns_kernels.{moved} is no longer.*{hint}"):
            getattr(gk, moved)
    # internal builders stay in their modules
    for internal in ("estimate_from_stats", "FSDPGNSHandle"):
        assert internal not in gk.__all__
        assert not hasattr(gk, internal), internal
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        gk.not_a_name  # noqa: B018


def test_constant_marker_matches_torch_compiler():
    """ops marks _has_cuda_kernel constant for torch.compile without importing torch._dynamo;
    the mark must be exactly what torch.compiler.assume_constant_result sets."""

    def f():
        return True

    def g():
        return True

    marked = torch.compiler.assume_constant_result(f)
    assert marked is f
    ops._assume_constant_result(g)
    assert f.__dict__ == g.__dict__ and f.__dict__
    assert ops._has_cuda_kernel.__dict__ == f.__dict__


_OPS_CODE = """
import sys, warnings, torch
warnings.simplefilter("always")
import gns_kernels as gk, gns_kernels.ops as o
g = torch.Generator().manual_seed(5)
d = torch.randn(1001, generator=g)
q = d * d + torch.rand(1001, generator=g)
sh = torch.randn(1001, generator=g)
out = torch.empty(2002)
print("CPP", o.cpp_available())
print("VN", gk.variance_norms(d, q, 3.0, sh).double().tolist())
print("VNM", gk.variance_norms_multi([d, d[:7]], [q, q[:7]], 3.0).double().tolist())
gk.square_pack(d, out, sh)
print("SP", (out.double().sum().item(), out.double().square().sum().item()))
prev, sq = sh.clone(), torch.zeros(1001)
gk.accumulate_sq(d, prev, sq)
print("ACC", (sq.double().sum().item(), torch.equal(prev, d)))
"""


def _parse_ops(stdout: str) -> dict:
    out = {}
    for line in stdout.strip().splitlines():
        key, value = line.split(" ", 1)
        out[key] = ast.literal_eval(value)
    return out


def _expected():
    g = torch.Generator().manual_seed(5)
    d = torch.randn(1001, generator=g)
    q = d * d + torch.rand(1001, generator=g)
    sh = torch.randn(1001, generator=g)
    vn = reference.variance_norms(d, q, 3.0, sh)
    vnm = [a + b for a, b in zip(reference.variance_norms(d, q, 3.0), reference.variance_norms(d[:7], q[:7], 3.0))]
    x = d.double() - sh.double()
    return {"VN": [float(v) for v in vn], "VNM": [float(v) for v in vnm],
            "SP": (float(x.sum() + (x * x).sum()), float((x * x).square().sum() + (x * x).sum())),
            "ACC": (float((x * x).sum()), True)}


def _check_eager_run(res):
    got = _parse_ops(res.stdout)
    want = _expected()
    assert got["CPP"] is False
    assert got["VN"] == pytest.approx(want["VN"], rel=1e-5)
    assert got["VNM"] == pytest.approx(want["VNM"], rel=1e-5)
    assert got["SP"] == pytest.approx(want["SP"], rel=1e-5)
    assert got["ACC"][0] == pytest.approx(want["ACC"][0], rel=1e-5) and got["ACC"][1] is True
    # one warning for the whole process (five ops ran), naming the cause and the remedy
    warns = [line for line in res.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warns) == 1, res.stderr
    assert "eager torch formulas" in warns[0] and "C++ compiler" in warns[0]
    return warns[0]


def test_no_extension_env_runs_eager_with_one_warning(tmp_path):
    res = _python(_OPS_CODE, env_extra={"GNS_KERNELS_NO_EXTENSION": "1"}, cwd=tmp_path)
    assert "GNS_KERNELS_NO_EXTENSION=1" in _check_eager_run(res)


def test_install_without_compiled_extension_runs_eager(tmp_path):
    """A copy of the package with no _C*.so (what an install without a compiler holds)."""
    shutil.copytree(ROOT / "gns_kernels", tmp_path / "gns_kernels",
                    ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "GNS_KERNELS_NO_EXTENSION"}
    # an editable install of the package elsewhere (a development checkout) would serve the
    # missing gns_kernels._C through its import finder: leave such finders out
    prelude = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not (f if isinstance(f, type) else type(f)).__module__.startswith('__editable__')]\n"
        "import gns_kernels; print(gns_kernels.__file__)\n"
    )
    res = subprocess.run([sys.executable, "-c", prelude + _OPS_CODE],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    first, rest = res.stdout.split("\n", 1)
    assert first == str(tmp_path / "gns_kernels" / "__init__.py")
    res.stdout = rest
    assert "no compiled _C" in _check_eager_run(res)
