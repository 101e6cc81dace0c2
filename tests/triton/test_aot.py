"""Ahead-of-time compilation of every fused-op Triton kernel for sm_80 and sm_90 (no GPU).

Compilation runs in a fresh subprocess without TRITON_INTERPRET (see conftest.py), through
tools/fused_aot.py; these tests read its PTX statistics and cubin resource usage.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from gns_kernels.triton import fused  # noqa: E402


def _tool(name: str):
    path = Path(__file__).resolve().parents[2] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look the module up while it executes
    spec.loader.exec_module(mod)
    return mod


_aot = _tool("fused_aot")

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def compiled():
    return _aot.run_isolated(full=False)


def _check(results, expect_variants):
    seen = {(r["kernel"], r["variant"], r["arch"]) for r in results}
    assert seen == {(v.kernel, v.label, f"sm_{a}") for v in expect_variants for a in _aot.ARCHS}
    for r in results:
        where = f"{r['kernel']}[{r['variant']}] {r['arch']}"
        assert r["target"].startswith(r["arch"]), where
        assert r["cubin_bytes"] > 0 and r["ptx_bytes"] > 0, where
        # deterministic reductions: no atomics (float or otherwise) anywhere
        assert r["atomics"] == 0, where
        if r["elementwise"]:
            # the unmasked full-tile loop must use 128-bit loads
            assert r["ld_global_v4"] > 0, where
        if r["kernel"].startswith("variance_norms"):
            # the clamp is a select (keeps NaN), not a NaN-dropping max.f32 (the interpreter,
            # whose maximum is numpy's NaN-propagating one, cannot see this); sqrt rounded
            assert r["float_max"] == 0, where
            assert r["sqrt_rn"] > 0, where
        # registers and spills come from the cubin / ptxas and are recorded in RESULTS.md
        assert 0 < r["n_regs"] <= 255, where
        assert r["local_bytes"] == 0 and r.get("spill_store_bytes", 0) == 0, where


def test_every_kernel_compiles_for_sm80_sm90(compiled):
    _check(compiled, _aot.variants(full=False))
    assert {r["kernel"] for r in compiled} == set(fused.KERNELS)


def test_vector_width_matches_dtype(compiled):
    """fp32: 8 elements/thread = two v4 loads per input; bf16: one v4 load per input."""
    by = {(r["kernel"], r["variant"], r["arch"]): r for r in compiled}
    for arch in ("sm_80", "sm_90"):
        # variance_norms with shift reads 3 inputs
        assert by[("variance_norms", "fp32+shift", arch)]["ld_global_v4"] == 6
        assert by[("variance_norms", "bf16+shift", arch)]["ld_global_v4"] == 3
        assert by[("variance_norms_multi", "fp32+shift", arch)]["ld_global_v4"] == 6
        # square_pack stores x with v4 always; when n % 16 == 0 (the JIT specializes on it)
        # x^2 at out + n too, and even the masked tail vectorizes: no scalar access left
        assert by[("square_pack", "fp32+shift", arch)]["st_global_v4"] == 2
        n16 = by[("square_pack", "fp32+shift,n%16=0", arch)]
        assert n16["st_global_v4"] == 8 and n16["st_global_other"] == 0 and n16["ld_global_scalar"] == 0
        # accumulate_sq: grad, prev, sq loaded; sq and prev stored with v4
        assert by[("accumulate_sq", "fp32", arch)]["st_global_v4"] == 4
        assert by[("accumulate_sq_multi", "fp32", arch)]["st_global_v4"] == 4


def test_integer_specializations_compile():
    """The JIT passes sizes as i64 when >= 2^31 and may specialize a size equal to 1 as a
    constant: both forms must compile for every kernel."""
    res = _aot.run_isolated(int_forms=True)
    assert {(r["kernel"], r["form"]) for r in res} == {(k, f) for k in fused.KERNELS for f in ("i64", "ones")}
    assert all(r["cubin_bytes"] > 0 for r in res)


@pytest.mark.slow
def test_full_matrix_compiles():
    """fp16 and no-shift variants too (about 2x the default compile time)."""
    _check(_aot.run_isolated(full=True), _aot.variants(full=True))
