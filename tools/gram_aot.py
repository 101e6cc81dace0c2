"""Ahead-of-time compilation of the Triton Gram kernel (gns_kernels.triton.gram) for sm_80
and sm_90 without a GPU: registers, spills and PTX statistics per (arch, input dtype).

    python tools/gram_aot.py [--json]

Uses the PTX / cubin helpers of tools/fused_aot.py. Compilation needs a process whose
triton was imported without TRITON_INTERPRET=1; from test processes use aot_isolated(),
which runs this file in a fresh interpreter without it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _sibling(name: str):
    """The module tools/<name>.py (tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look the module up while it executes
    spec.loader.exec_module(mod)
    return mod


def compile_aot(archs=(80, 90), dtypes=("fp32", "bf16"), tensor_cores: bool = False) -> list[dict]:
    """triton.compile the Gram kernel for each (arch, dtype); registers/spills/PTX stats."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fused_aot = _sibling("fused_aot")
    _res_usage, _spills, ptx_stats = fused_aot._res_usage, fused_aot._spills, fused_aot.ptx_stats
    from gns_kernels.triton.gram import BLOCK, BLOCK_N, NUM_WARPS, _gram_upper_kernel

    kern = _gram_upper_kernel.jit
    align = [["tt.divisibility", 16]]
    attrs = {(kern.arg_names.index("x_ptr"),): align, (kern.arg_names.index("out_ptr"),): align}
    results = []
    # precision="ieee" (MODE 0) variants; with tensor_cores, also "tf32" on fp32 input
    # (MODE 1, variant "fp32-tf32") and "bf16" on bf16 input (MODE 2, variant "bf16-mma")
    variants = [(dt, 0, dt) for dt in dtypes]
    if tensor_cores:
        variants += [("fp32", 1, "fp32-tf32"), ("bf16", 2, "bf16-mma")]
    for dt, mode, name in variants:
        sig = {"x_ptr": f"*{dt}", "out_ptr": "*fp32", "K": "i32", "N": "i32", "T": "i32",
               "stride_xl": "i32", "stride_xk": "i32", "stride_xn": "i32", "stride_ol": "i32",
               "stride_oi": "i32", "BLOCK": "constexpr", "BLOCK_N": "constexpr", "MODE": "constexpr"}
        consts = {"BLOCK": BLOCK, "BLOCK_N": BLOCK_N, "MODE": mode}
        for cap in archs:
            src = ASTSource(kern, sig, constexprs=consts, attrs=attrs)
            ck = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                                options={"num_warps": NUM_WARPS, "enable_fp_fusion": True})
            ptx = ck.asm["ptx"]
            st = ptx_stats(ptx)
            res = {"kernel": "gram_upper", "variant": name, "arch": f"sm_{cap}",
                   "num_warps": ck.metadata.num_warps, "shared_bytes_meta": ck.metadata.shared,
                   "ptx_bytes": len(ptx), "cubin_bytes": len(ck.asm["cubin"]),
                   "mma": ptx.count("mma.sync") + ptx.count("wgmma"),
                   "fma_f32": ptx.count("fma.rn.f32"), **st}
            res.update(_res_usage(ck.asm["cubin"]))
            res.update(_spills(ptx, st["target"] or f"sm_{cap}"))
            results.append(res)
    return results


def aot_isolated(timeout: float = 600, tensor_cores: bool = False) -> list[dict]:
    """compile_aot() in a fresh interpreter without TRITON_INTERPRET; returns its results."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json"]
                       + (["--tensor-cores"] if tensor_cores else []),
                       capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"gram AOT compilation failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="AOT-compile the Triton Gram kernel for sm_80/sm_90")
    p.add_argument("--json", action="store_true")
    p.add_argument("--tensor-cores", action="store_true", help="also the tf32 and bf16 precision variants")
    a = p.parse_args(argv)
    res = compile_aot(tensor_cores=a.tensor_cores)
    if a.json:
        print(json.dumps(res))
    else:
        for r in res:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
