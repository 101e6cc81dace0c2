"""bench/bench_triton_gpu.py runs (CPU interpreter smoke mode).

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


def test_cpu_smoke_run():
    out = _run("--device", "cpu", "--n", "3000", "--no-compile")
    for cand in ("triton.variance_norms", "triton.square_pack (shift)", "triton.accumulate_sq",
                 "triton.variance_norms_multi", "floor: d.sum() + q.sum()", "eager formula"):
        assert f"| {cand} |" in out, out
    assert "| variance_norms / floor |" in out and "| accumulate_sq / copy_ same bytes |" in out
