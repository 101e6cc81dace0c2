"""Ahead-of-time compilation of the fused-op Triton kernels for real GPUs, without a GPU.

``triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda",
cap, 32))`` runs Triton's whole CUDA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin via
ptxas) for sm_80 / sm_90 on a machine with no GPU. The signature marks every pointer
16-byte aligned (``tt.divisibility`` 16, what the JIT infers for any tensor from the
caching allocator) and nothing about sizes, so the PTX is what a launch on an arbitrary
size gets. From the PTX we count global loads (128-bit ``ld.global.*.v4`` vs narrower);
from the cubin the registers (``cuobjdump -res-usage``); spill bytes from ``ptxas -v``.

Run as ``python tools/fused_aot.py [--json] [--full]`` in the source tree; it re-executes
itself in a fresh interpreter without TRITON_INTERPRET when triton's standard library was
built for the interpreter in this process (the compiled path cannot be built then).
tools/gram_aot.py uses its PTX / cubin helpers for the Gram kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ARCHS = (80, 90)
_ROOT = Path(__file__).resolve().parent.parent  # the source tree holding gns_kernels/

_ALIGN = [["tt.divisibility", 16]]


@dataclass
class Variant:
    kernel: str  # key of fused.KERNELS
    label: str  # e.g. "bf16+shift"
    signature: dict
    constexprs: dict
    aligned_args: tuple  # names of pointer args hinted 16-byte aligned
    elementwise: bool  # must use 128-bit loads


def _ints(*names):
    return {n: "i32" for n in names}


def variants(full: bool = False) -> list[Variant]:
    """Compilation variants: every kernel; dtypes fp32/bf16 (+fp16 and no-shift when full)."""
    import triton.language as tl

    from gns_kernels.triton import fused

    tl_dt = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
    dts = ("fp32", "bf16", "fp16") if full else ("fp32", "bf16")
    shifts = (True, False) if full else (True,)
    B = fused.BLOCK
    out: list[Variant] = []
    for dt in dts:
        for sh in shifts:
            lab = dt + ("+shift" if sh else "")
            out.append(Variant(
                "variance_norms", lab,
                {"g_ptr": f"*{dt}", "q_ptr": f"*{dt}", "s_ptr": f"*{dt}", "part_ptr": "*fp32",
                 **_ints("part_stride", "n", "num_tiles", "tiles_per_prog"), "scale": "fp32",
                 "HAS_SHIFT": "constexpr", "BLOCK": "constexpr"},
                {"HAS_SHIFT": sh, "BLOCK": B}, ("g_ptr", "q_ptr", "s_ptr", "part_ptr"), True))
            out.append(Variant(
                "variance_norms_multi", lab,
                {"table_ptr": "*i64", "part_ptr": "*fp32",
                 **_ints("part_stride", "n_tensors", "total_tiles", "tiles_per_prog"), "scale": "fp32",
                 "G_DT": "constexpr", "S_DT": "constexpr", "HAS_SHIFT": "constexpr",
                 "ALIGNED": "constexpr", "BLOCK": "constexpr"},
                {"G_DT": tl_dt[dt], "S_DT": tl_dt[dt], "HAS_SHIFT": sh, "ALIGNED": True, "BLOCK": B},
                ("table_ptr", "part_ptr"), True))
            out.append(Variant(
                "square_pack", lab,
                {"g_ptr": f"*{dt}", "s_ptr": f"*{dt}", "out_ptr": "*fp32",
                 **_ints("n", "num_tiles", "tiles_per_prog"),
                 "HAS_SHIFT": "constexpr", "BLOCK": "constexpr"},
                {"HAS_SHIFT": sh, "BLOCK": B}, ("g_ptr", "s_ptr", "out_ptr"), True))
            out.append(Variant(
                "square_pack_multi", lab,
                {"table_ptr": "*i64", **_ints("n_tensors", "total_tiles", "tiles_per_prog"),
                 "G_DT": "constexpr", "S_DT": "constexpr", "HAS_SHIFT": "constexpr",
                 "ALIGNED": "constexpr", "BLOCK": "constexpr"},
                {"G_DT": tl_dt[dt], "S_DT": tl_dt[dt], "HAS_SHIFT": sh, "ALIGNED": True, "BLOCK": B},
                ("table_ptr",), True))
        if dt == "fp32":
            # n % 16 == 0 (the JIT specializes on it): out + n is aligned too, so the x^2 half
            # is stored with 128-bit stores as well.
            out.append(Variant(
                "square_pack", "fp32+shift,n%16=0",
                {"g_ptr": "*fp32", "s_ptr": "*fp32", "out_ptr": "*fp32",
                 **_ints("n", "num_tiles", "tiles_per_prog"),
                 "HAS_SHIFT": "constexpr", "BLOCK": "constexpr"},
                {"HAS_SHIFT": True, "BLOCK": B}, ("g_ptr", "s_ptr", "out_ptr", "n"), True))
        out.append(Variant(
            "accumulate_sq", dt,
            {"g_ptr": f"*{dt}", "p_ptr": f"*{dt}", "sq_ptr": "*fp32",
             **_ints("n", "num_tiles", "tiles_per_prog"), "BLOCK": "constexpr"},
            {"BLOCK": B}, ("g_ptr", "p_ptr", "sq_ptr"), True))
        out.append(Variant(
            "accumulate_sq_multi", dt,
            {"table_ptr": "*i64", **_ints("n_tensors", "total_tiles", "tiles_per_prog"),
             "G_DT": "constexpr", "P_DT": "constexpr", "ALIGNED": "constexpr", "BLOCK": "constexpr"},
            {"G_DT": tl_dt[dt], "P_DT": tl_dt[dt], "ALIGNED": True, "BLOCK": B},
            ("table_ptr",), True))
    out.append(Variant(
        "reduce_partials", "fp32",
        {"part_ptr": "*fp32", "out_ptr": "*fp32", "num_parts": "i32", "RBLOCK": "constexpr"},
        {"RBLOCK": fused.REDUCE_BLOCK}, ("part_ptr", "out_ptr"), False))
    return out


def _nvidia_bin(name: str):
    import triton

    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return p if os.path.exists(p) else shutil.which(name)


def _res_usage(cubin: bytes) -> dict:
    tool = _nvidia_bin("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        txt = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", txt)
    if not m:
        return {}
    return dict(zip(("n_regs", "stack_bytes", "shared_bytes", "local_bytes"), map(int, m.groups())))


def _spills(ptx: str, arch: str) -> dict:
    for name in ("ptxas-blackwell", "ptxas"):
        tool = _nvidia_bin(name)
        if tool is None:
            continue
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([tool, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stdout + r.stderr)
        if r.returncode == 0 and m:
            return {"spill_store_bytes": int(m.group(1)), "spill_load_bytes": int(m.group(2))}
    return {}


def ptx_stats(ptx: str) -> dict:
    """Counts of global memory instructions and instructions that matter for correctness."""
    loads = re.findall(r"\bld\.global[\w.]*", ptx)
    stores = re.findall(r"\bst\.global[\w.]*", ptx)
    return {
        "ld_global_v4": sum(".v4" in x for x in loads),
        "ld_global_v2": sum(".v2" in x for x in loads),
        "ld_global_scalar": sum(".v2" not in x and ".v4" not in x for x in loads),
        "st_global_v4": sum(".v4" in x for x in stores),
        "st_global_other": sum(".v4" not in x for x in stores),
        "atomics": len(re.findall(r"\b(?:atom|red)\.", ptx)),
        "float_max": len(re.findall(r"\bmax(?:\.\w+)*\.f32", ptx)),
        "sqrt_rn": len(re.findall(r"\bsqrt\.rn", ptx)),
        "target": (re.search(r"^\.target\s+(\S+)", ptx, re.M) or [None, None])[1],
    }


def compile_all(full: bool = False, archs=ARCHS) -> list[dict]:
    """Compile every variant for every arch; one result dict per (variant, arch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gns_kernels.triton import fused

    results = []
    for v in variants(full):
        kern = fused.KERNELS[v.kernel].jit
        attrs = {(kern.arg_names.index(a),): _ALIGN for a in v.aligned_args}
        for cap in archs:
            src = ASTSource(kern, v.signature, constexprs=v.constexprs, attrs=attrs)
            ck = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                                options={"num_warps": fused.NUM_WARPS, "enable_fp_fusion": True})
            ptx = ck.asm["ptx"]
            st = ptx_stats(ptx)
            res = {"kernel": v.kernel, "variant": v.label, "arch": f"sm_{cap}",
                   "elementwise": v.elementwise, "num_warps": ck.metadata.num_warps,
                   "ptx_bytes": len(ptx), "cubin_bytes": len(ck.asm["cubin"]), **st}
            res.update(_res_usage(ck.asm["cubin"]))
            res.update(_spills(ptx, st["target"] or f"sm_{cap}"))
            results.append(res)
    return results


def compile_int_forms(cap: int = 90) -> list[dict]:
    """Compile each kernel (first variant) with the other integer forms the JIT can pass:
    every i32 argument as i64 (values >= 2^31) and as the constant 1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gns_kernels.triton import fused

    results, seen = [], set()
    for v in variants(False):
        if v.kernel in seen:
            continue
        seen.add(v.kernel)
        kern = fused.KERNELS[v.kernel].jit
        ints = [a for a, t in v.signature.items() if t == "i32"]
        forms = {
            "i64": ({a: ("i64" if a in ints else t) for a, t in v.signature.items()}, dict(v.constexprs)),
            "ones": ({a: ("constexpr" if a in ints else t) for a, t in v.signature.items()},
                     {**v.constexprs, **{a: 1 for a in ints}}),
        }
        for form, (sig, cex) in forms.items():
            ck = triton.compile(ASTSource(kern, sig, constexprs=cex), target=GPUTarget("cuda", cap, 32),
                                options={"num_warps": fused.NUM_WARPS, "enable_fp_fusion": True})
            results.append({"kernel": v.kernel, "form": form, "arch": f"sm_{cap}",
                            "cubin_bytes": len(ck.asm["cubin"])})
    return results


def run_isolated(full: bool = False, timeout: float = 600, int_forms: bool = False) -> list[dict]:
    """compile_all in a fresh Python without TRITON_INTERPRET (safe from any test process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--inprocess"]
    if full:
        cmd.append("--full")
    if int_forms:
        cmd.append("--int-forms")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"ahead-of-time compilation failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def format_table(results: list[dict]) -> str:
    cols = ("kernel", "variant", "arch", "n_regs", "spill_store_bytes", "local_bytes",
            "shared_bytes", "ld_global_v4", "ld_global_scalar", "st_global_v4", "atomics")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON list on the last line")
    p.add_argument("--full", action="store_true", help="also fp16 and no-shift variants")
    p.add_argument("--int-forms", action="store_true",
                   help="instead: compile each kernel with i64 sizes and with sizes == 1 (sm_90)")
    p.add_argument("--inprocess", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from gns_kernels.triton._runtime import interpreter_mode_at_import

    if not a.inprocess and interpreter_mode_at_import():
        res = run_isolated(a.full, int_forms=a.int_forms)
    elif a.int_forms:
        res = compile_int_forms()
    else:
        res = compile_all(a.full)
    if a.json:
        print(json.dumps(res))
    elif a.int_forms:
        print("\n".join(f"{r['kernel']} {r['form']} {r['arch']}: ok" for r in res))
    else:
        print(format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
