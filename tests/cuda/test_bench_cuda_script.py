"""bench/bench_cuda_gpu.py --paper (no GPU): bytes per parameter, 3 TB/s times and grids."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_cuda_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_cuda_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paper_tables(capsys):
    mod = _load()
    assert mod.main(["--paper"]) == 0
    text = capsys.readouterr().out
    # variance_norms float32: 8 B/param -> 160e6 * 8 / 3e12 s = 0.4267 ms; 1e9 -> 2.667 ms.
    assert "| variance_norms | float32 | 8 | 0.427 ms | 2.667 ms |" in text
    # accumulate_sq bf16: grad 2 + prev 2 read + 2 written + sq 4 read + 4 written = 14 B.
    assert "| accumulate_sq | bfloat16 | 14 | 0.747 ms | 4.667 ms |" in text
    # 1e9 / 65536 -> 15259 blocks; the Llama list (84 tensors) needs 2 table launches.
    assert "| 1B flat tensor | 15259 | 1 |" in text
    assert "| 160M Llama list (84 tensors, 84.9M) | 1296 | 2 |" in text


def test_occupancy_arithmetic():
    mod = _load()
    # 32 regs x 256 threads: 8 blocks = 2048 threads; 48 regs: 1536 regs/warp -> 42 warps -> 5.
    assert mod.occupancy(32) == 8
    assert mod.occupancy(48) == 5
    assert mod.occupancy(26, threads=512, smem=1024) == 4
    assert mod.op_bytes("square_pack", 10, 2, shift=True) == 10 * 2 * 2 + 80
