"""Build of the C++ (and, where possible, CUDA) kernels of gns_kernels.

Always builds ``gns_kernels._C`` from ``csrc/*.cpp`` and ``csrc/cpu/*.cpp`` (CPU ops).
Needs torch at build time, so install with ``pip install --no-build-isolation ...``
against the torch that is already installed (see README).
"""
from __future__ import annotations

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


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
    # -fno-math-errno lets sqrtf vectorize (the kernels never rely on errno);
    # -ffp-contract=off keeps every SIMD clone (AVX-512 / AVX2 / baseline, see
    # csrc/cpu/cpu_common.h) bit-identical: no FMA contraction; -fopenmp makes
    # at::parallel_for (ATen's OpenMP backend, inlined from its headers) parallel.
    extra_cxx = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
    return [
        CppExtension(
            name="gns_kernels._C",
            sources=cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": extra_cxx},
            extra_link_args=["-fopenmp"],
        )
    ]


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(ext_modules=_ext_modules(), cmdclass=_cmdclass())
