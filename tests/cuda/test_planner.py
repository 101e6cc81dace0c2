"""Host-side check of the CUDA multi-tensor launch planner (marker nvcc, no GPU needed).

Compiles tests/cuda/planner_check.cu with nvcc (warnings as errors) and runs it: the
planner of csrc/cuda/multi_tensor.cuh is driven on 600 random tensor lists (empty tensors,
chunk-boundary sizes, >64 tensors so several launches, dtype-group subsets, absent
operands) and every block of every launch is walked through `locate`, the function the
kernels call on the device, to check exact coverage of every element and one distinct
reduction slot per block. Skipped, with the reason, where nvcc is absent.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.nvcc,
    # Reason: compiling the .cu check needs the CUDA compiler.
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found on PATH"),
]

REPO = Path(__file__).resolve().parents[2]


def test_planner_covers_every_element_once(tmp_path):
    exe = tmp_path / "planner_check"
    build = subprocess.run(
        [
            "nvcc", "-std=c++17", "-O1", f"-I{REPO / 'csrc'}",
            "-Xcompiler", "-Wall,-Wextra,-Werror", "-Werror", "all-warnings",
            "-arch=sm_80", str(REPO / "tests" / "cuda" / "planner_check.cu"), "-o", str(exe),
        ],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "planner_check: OK" in run.stdout
