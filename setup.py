"""Build of gns_kernels: the Python package and its C++ (and, where possible, CUDA) kernels.

Builds ``gns_kernels._C`` from ``csrc/*.cpp`` and ``csrc/cpu/*.cpp`` (CPU ops), plus
``csrc/cuda`` where torch is a CUDA build and nvcc is found (``GNS_KERNELS_CUDA=0`` opts
out). Needs torch at build time, so install with ``pip install --no-build-isolation ...``
(or build with ``python -m build --no-isolation``) against the torch already installed.

No extension is built (the ops then run their eager torch formulas, announced by a
warning at first use) when ``GNS_KERNELS_NO_EXTENSION=1`` or when no C++ compiler is
found (``$CXX``, else ``c++``).

Dependencies: a wheel that contains ``_C`` works only with the torch it was compiled
against, so its metadata pins ``torch==<that torch's version>``; the sdist and an install
without the extension ask for ``torch>=2.8``.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_RANGE = "torch>=2.8"


def _no_extension_reason() -> str | None:
    """Why no extension is built (None: build it)."""
    if os.environ.get("GNS_KERNELS_NO_EXTENSION", "0") not in ("", "0"):
        return "GNS_KERNELS_NO_EXTENSION is set"
    cxx = os.environ.get("CXX", "c++").split()[0]
    path = shutil.which(cxx)
    if path is None:
        return f"no C++ compiler found (CXX={cxx!r} is not on PATH)"
    try:
        subprocess.run([path, "--version"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the C++ compiler {path} does not run ({exc})"
    return None


def _building_sdist() -> bool:
    """An sdist ships sources only: no torch is imported and no dependency is pinned."""
    return "sdist" in sys.argv[1:]


def _sources(*patterns: str) -> list[str]:
    out: list[str] = []
    for pattern in patterns:
        out.extend(sorted(glob.glob(os.path.join("csrc", pattern))))
    return out


def _ext_modules():
    from torch.utils.cpp_extension import CppExtension

    cpu_sources = _sources("*.cpp", "cpu/*.cpp")
    if not cpu_sources:
        return []
    # No -std flag: torch.utils.cpp_extension adds the standard its headers need (C++20
    # for torch 2.13); a later -std=c++17 would override it.
    # -fno-math-errno lets sqrtf vectorize (the kernels never rely on errno);
    # -ffp-contract=off keeps every SIMD clone (AVX-512 / AVX2 / baseline, see
    # csrc/cpu/cpu_common.h) bit-identical: no FMA contraction; -fopenmp makes
    # at::parallel_for (ATen's OpenMP backend, inlined from its headers) parallel.
    extra_cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
    cuda_ext = _cuda_extension(cpu_sources, extra_cxx)
    if cuda_ext is not None:
        return [cuda_ext]
    return [
        CppExtension(
            name="gns_kernels._C",
            sources=cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": extra_cxx},
            extra_link_args=["-fopenmp"],
        )
    ]


# ---- CUDA branch (owned by the cuda helper; see docs/cuda.md) ---------------------------
# When torch is a CUDA build and nvcc is found (torch's CUDA_HOME), gns_kernels._C is built
# as a CUDAExtension from the CPU sources plus csrc/cuda (plain CUDA C++ kernels and the
# TORCH_LIBRARY_IMPL(CUDA) binding), else CPU-only as above. GNS_KERNELS_CUDA=0 forces the
# CPU-only build. Without a visible GPU and without TORCH_CUDA_ARCH_LIST, it builds for
# sm_80 and sm_90 (+ PTX for newer GPUs).
def _cuda_extension(cpu_sources, extra_cxx):
    if os.environ.get("GNS_KERNELS_CUDA", "auto") == "0":
        return None
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    if torch.version.cuda is None or CUDA_HOME is None:
        return None
    if not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return None
    cuda_sources = _sources("cuda/*.cu", "cuda/*.cpp")
    if not cuda_sources:
        return None
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    # No -std flag: torch adds the standard its headers need (C++20 from torch 2.14 on).
    # --fmad=false: no FMA contraction, like the CPU build's -ffp-contract=off, so each
    # element's terms round exactly as on the CPU (only the summation order differs).
    cxx = [f for f in extra_cxx if not f.startswith("-std=")]
    extra_nvcc = ["-O3", "--fmad=false"]
    return CUDAExtension(
        name="gns_kernels._C",
        sources=cpu_sources + cuda_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx, "nvcc": extra_nvcc},
        extra_link_args=["-fopenmp"],
    )
# ---- end of the CUDA branch -------------------------------------------------------------


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _configure() -> dict:
    if _building_sdist():
        return {"install_requires": [TORCH_RANGE, "numpy"]}
    reason = _no_extension_reason()
    if reason is not None:
        print(f"gns_kernels setup: building without the C++ extension: {reason}; the ops "
              "will use their eager torch formulas", file=sys.stderr)
        return {"install_requires": [TORCH_RANGE, "numpy"]}
    import torch

    return {
        "ext_modules": _ext_modules(),
        "cmdclass": _cmdclass(),
        "install_requires": [f"torch=={torch.__version__}", "numpy"],
    }


setup(**_configure())
