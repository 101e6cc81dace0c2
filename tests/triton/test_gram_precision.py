"""The Triton Gram kernel's explicit precision argument (interpreter, CPU): "tf32" multiplies
operands rounded to nearest with a 10-bit mantissa (the emulation the error model of
gns_kernels.spectral.precision is tested with), "bf16" bfloat16 operands (exact products)."""
from __future__ import annotations

import pytest
import torch

from gns_kernels.spectral.precision import round_mantissa

pytest.importorskip("triton")

from gns_kernels.triton.gram import gram_upper  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("col", [False, True])
def test_gram_tf32_is_the_gram_of_tf32_rounded_operands(gen, col):
    x = torch.randn(2, 33, 45, generator=gen) * 3.0
    got = gram_upper(x, col, block=16, block_n=16, precision="tf32")
    r = round_mantissa(x, 10).double()
    want = r.mT @ r if col else r @ r.mT
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= 2e-6 * scale  # float32 accumulation only
    ieee = gram_upper(x, col, block=16, block_n=16)
    exact = x.double().mT @ x.double() if col else x.double() @ x.double().mT
    assert (ieee.double() - exact).abs().max() <= 2e-6 * scale
    assert (got.double() - exact).abs().max() > 1e-5 * scale  # the rounding is really applied
    assert torch.equal(got, got.mT)


def test_gram_bf16_inputs_exact_and_rejects_float32(gen):
    x = torch.randn(2, 20, 37, generator=gen).bfloat16()
    got = gram_upper(x, block=16, block_n=16, precision="bf16")
    torch.testing.assert_close(got, gram_upper(x, block=16, block_n=16), rtol=0, atol=0)
    with pytest.raises(ValueError, match="precision"):
        gram_upper(x.float(), precision="bf16")
    with pytest.raises(ValueError, match="precision"):
        gram_upper(x.float(), precision="tf32x3")


@pytest.mark.slow
def test_gram_tensor_core_variants_compile_for_sm80_sm90():
    """precision="tf32" / "bf16" compile ahead of time (no GPU needed) to tensor-core
    instructions (mma / wgmma), no spills, no atomics."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "gram_aot.py"
    spec = importlib.util.spec_from_file_location("gram_aot", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    res = {(r["arch"], r["variant"]): r for r in tool.aot_isolated(tensor_cores=True)}
    for arch in ("sm_80", "sm_90"):
        assert res[(arch, "fp32")]["mma"] == 0  # ieee: FFMA only
        for v in ("fp32-tf32", "bf16-mma"):
            r = res[(arch, v)]
            assert r["mma"] > 0 and r["atomics"] == 0, (arch, v, r)
            if "spill_store_bytes" in r:
                assert r["spill_store_bytes"] == 0
