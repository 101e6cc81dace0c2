"""Triton upper-triangle Gram kernel (gns_kernels/triton/gram.py).

Run on CPU tensors through Triton's interpreter (the kernel is a DualKernel: CPU tensors
are interpreted whatever TRITON_INTERPRET was at import, see conftest.py), at small sizes,
against the float64 oracle; and compiled ahead of time for sm_80 / sm_90 in a fresh
process (no GPU needed), with registers and spills read from the cubin / ptxas.
"""
from __future__ import annotations

import pytest
import torch

from gns_kernels import reference as ref

pytest.importorskip("triton")

from gns_kernels.triton.gram import gram_upper  # noqa: E402

pytestmark = pytest.mark.triton


def _check(x, col, G):
    side = "col" if col else "row"
    want = torch.stack([ref.gram(xi, side) for xi in x])  # float64 of the same values
    assert G.dtype == torch.float32 and G.shape == want.shape
    assert torch.equal(G, G.mT)  # mirrored tiles: exactly symmetric
    assert (G.double() - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("col", [False, True])
@pytest.mark.parametrize("K,N", [(1, 5), (16, 16), (33, 20), (70, 45)])
def test_gram_upper_interpreter_sizes(gen, col, K, N):
    L = 2
    shape = (L, N, K) if col else (L, K, N)
    x = torch.randn(*shape, generator=gen)
    _check(x, col, gram_upper(x, col, block=16, block_n=16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_gram_upper_interpreter_dtypes(gen, dtype):
    x = torch.randn(3, 37, 50, generator=gen).to(dtype)
    _check(x, False, gram_upper(x, False, block=16, block_n=16))


def test_gram_upper_noncontiguous_and_default_tiles(gen):
    base = torch.randn(2, 90, 150, generator=gen)
    x = base[:, ::2, 10:140]  # strided rows, offset columns: read through strides
    _check(x, False, gram_upper(x, False))  # default BLOCK 64: T = 1 tile row
    _check(x, True, gram_upper(x, True))  # 130 columns: T = 3, 6 tiles incl. mirrors


def test_gram_upper_every_tile_pair_written(gen):
    # K = 130, block 16: T = 9 tile rows, 45 programs; NaN-filled output would show misses
    x = torch.randn(1, 130, 24, generator=gen)
    G = gram_upper(x, False, block=16, block_n=16)
    assert torch.isfinite(G).all()
    _check(x, False, G)


def test_gram_upper_aot_sm80_sm90():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "gram_aot.py"
    spec = importlib.util.spec_from_file_location("gram_aot", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    res = tool.aot_isolated()
    assert {(r["arch"], r["variant"]) for r in res} == {
        ("sm_80", "fp32"), ("sm_80", "bf16"), ("sm_90", "fp32"), ("sm_90", "bf16")}
    for r in res:
        assert r["cubin_bytes"] > 0 and r["atomics"] == 0
        if "n_regs" in r:  # from the cubin (cuobjdump -res-usage)
            assert r["n_regs"] <= 255 and r["local_bytes"] == 0 and r["stack_bytes"] == 0
        if "spill_store_bytes" in r:  # ptxas -v on the PTX
            assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0
