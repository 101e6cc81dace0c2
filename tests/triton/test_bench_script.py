"""bench/bench_triton_gpu.py runs (CPU interpreter smoke mode, and the on-paper table).

No timing is asserted: only that the script works and prints its table, so that a user
with a GPU gets a working benchmark.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "bench_triton_gpu.py")


def _run(*args):
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_paper_table():
    out = _run("--paper")
    # 8 bytes per parameter (two float32 reads) -> 1e9 * 8 / 3e12 s = 2.667 ms
    assert "| variance_norms | float32 | 8 | 0.427 ms | 2.667 ms |" in out
    assert "| accumulate_sq | bfloat16 | 14 | 0.747 ms | 4.667 ms |" in out


def test_cpu_smoke_run():
    out = _run("--device", "cpu", "--n", "3000", "--no-compile")
    for cand in ("triton.variance_norms", "triton.square_pack (shift)", "triton.accumulate_sq",
                 "triton.variance_norms_multi", "floor: d.sum() + q.sum()", "eager formula"):
        assert f"| {cand} |" in out, out
    assert "| variance_norms / floor |" in out and "| accumulate_sq / copy_ same bytes |" in out
