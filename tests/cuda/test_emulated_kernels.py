"""The CUDA kernels of csrc/cuda, run on the CPU in an emulator, against reference.py.

No GPU here, so the kernel source is compiled for the host instead: every
``kernel<<<grid, threads, smem, stream>>>(args);`` is rewritten into a call of
tests/cuda/emu/gns_emu.h's ``gns_emu::launch``, which runs each block's CUDA threads as
host threads (real barriers for __syncthreads, a real 32-lane exchange for
__shfl_down_sync, one block at a time). The launchers are then called through ctypes
(tests/cuda/emu/emu_api.cpp) on CPU tensors. This executes the real kernel and launcher
code: tensor tables, chunk/tail/vector/scalar paths, misaligned views, dtype groups,
slots and both reduction trees. It cannot check timing, the GPU memory model or register
limits (tests/test_cuda_build.py covers what nvcc can). Built with small launch
parameters (chunks of 2048 elements, 64-thread blocks) so small tensors cross many chunk
boundaries; the GPU build uses 65536 and 256.

Marker nvcc (needs the CUDA toolkit's headers, cuda_bf16.h / cuda_fp16.h, and g++);
fresh random data every run (seed printed; rerun with GNS_TEST_SEED=<seed>).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from gns_kernels import reference as ref

REPO = Path(__file__).resolve().parents[2]
EMU = REPO / "tests" / "cuda" / "emu"
CHUNK, THREADS, CLEANUP = 2048, 64, 64
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPES = list(CODES)
CUDA_ERROR_INVALID_VALUE = 1


def _cuda_include() -> Path | None:
    homes = [os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        probe = subprocess.run([nvcc, "--dryrun", "-c", "x.cu", "-o", os.devnull],
                               capture_output=True, text=True)
        m = re.search(r"^#\$ TOP=(.*)$", probe.stdout + probe.stderr, re.M)
        if m:
            homes.append(m.group(1).strip())
    homes.append("/usr/local/cuda")
    for h in homes:
        if h and (Path(h) / "include" / "cuda_bf16.h").exists():
            return Path(h) / "include"
    return None


CUDA_INCLUDE = _cuda_include()
CXX = shutil.which("g++")

pytestmark = [
    pytest.mark.nvcc,
    # Reason: the kernels include the CUDA toolkit's bf16/fp16 headers; no toolkit, no build.
    pytest.mark.skipif(CUDA_INCLUDE is None, reason="CUDA toolkit headers (cuda_bf16.h) not found"),
    # Reason: the emulation is compiled with the host C++ compiler (C++20 std::barrier).
    pytest.mark.skipif(CXX is None, reason="g++ not found"),
]

_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.S)


def _to_host(src: str) -> tuple[str, int]:
    def rep(m):
        grid, threads = [p.strip() for p in m.group(2).split(",")][:2]
        return (f"::gns_emu::launch(static_cast<int>({grid}), static_cast<int>({threads}), "
                f"[&] {{ {m.group(1)}({m.group(3)}); }});")

    return _LAUNCH.subn(rep, src)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu")
    sources = []
    launches = 0
    for cu in sorted((REPO / "csrc" / "cuda").glob("*.cu")):
        text, n = _to_host(cu.read_text())
        launches += n
        dst = out / f"{cu.stem}.cpp"
        dst.write_text('#include "gns_emu.h"\n' + text)
        sources.append(str(dst))
    assert launches >= 4, "expected kernel launches to rewrite in csrc/cuda/*.cu"
    so = out / "libgns_emu.so"
    cmd = [CXX, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w",
           f"-DGNS_CUDA_CHUNK={CHUNK}", f"-DGNS_CUDA_BLOCK_THREADS={THREADS}",
           f"-DGNS_CUDA_CLEANUP_THREADS={CLEANUP}",
           f"-I{EMU}", f"-I{REPO / 'csrc'}", f"-I{CUDA_INCLUDE}",
           *sources, str(EMU / "emu_api.cpp"), "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(so))



# --------------------------------------------------------------------------------------
# ctypes faces of the launchers (CPU tensors stand in for device memory)
# --------------------------------------------------------------------------------------
P = ctypes.c_void_p


def _arr(ctype, xs):
    return (ctype * max(1, len(xs)))(*xs)


def _ptr(t):
    return None if t is None else t.data_ptr()


def vn_multi(lib, ds, qs, scale, ss=None):
    n = len(ds)
    numels = _arr(ctypes.c_int64, [d.numel() for d in ds])
    nb = lib.emu_num_blocks(n, numels)
    slots = torch.full((4 * nb,), float("nan"), dtype=torch.float64)
    out = torch.full((4,), float("nan"))
    shifts = None if ss is None else _arr(P, [_ptr(s) for s in ss])
    sdt = [0 if ss is None or s is None else CODES[s.dtype] for s in (ss or [None] * n)]
    rc = lib.emu_variance_norms(
        n, numels, _arr(P, [_ptr(d) for d in ds]), _arr(P, [_ptr(q) for q in qs]), shifts,
        _arr(ctypes.c_int, [CODES[d.dtype] for d in ds]), _arr(ctypes.c_int, sdt),
        ctypes.c_float(scale), P(slots.data_ptr() if nb else 0), P(out.data_ptr()))
    assert rc == 0, f"launcher returned CUDA error {rc}"
    return out


def square_pack(lib, grad, out, shift=None):
    return lib.emu_square_pack(
        ctypes.c_int64(grad.numel()), P(grad.data_ptr()), P(_ptr(shift)), CODES[grad.dtype],
        CODES[shift.dtype] if shift is not None else 0, P(out.data_ptr()))


def acc_multi(lib, gs, ps, sqs):
    n = len(gs)
    return lib.emu_accumulate_sq(
        n, _arr(ctypes.c_int64, [g.numel() for g in gs]), _arr(P, [_ptr(g) for g in gs]),
        _arr(P, [_ptr(p) for p in ps]), _arr(P, [_ptr(s) for s in sqs]),
        _arr(ctypes.c_int, [CODES[g.dtype] for g in gs]), _arr(ctypes.c_int, [CODES[p.dtype] for p in ps]))


def _inputs(n, dtype, g, shift_dtype=None, offset=0):
    """d, q = d^2 + u (u in [-0.5, 1.5): some coordinates clamp), optional shift; offset > 0
    makes each a view `offset` elements into its storage (not 16-byte aligned)."""
    d = torch.randn(n + offset, generator=g)
    q = d * d + (torch.rand(n + offset, generator=g) * 2.0 - 0.5)
    s = torch.randn(n + offset, generator=g) if shift_dtype is not None else None
    cut = lambda x, dt: None if x is None else x.to(dt)[offset:]  # noqa: E731
    return cut(d, dtype), cut(q, dtype), cut(s, shift_dtype)


def _close(got, want, rtol, atol=0.0):
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)


# --------------------------------------------------------------------------------------
# variance_norms
# --------------------------------------------------------------------------------------
VN_CASES = [  # n, dtype, shift dtype (None: no shift), offset
    (0, torch.float32, None, 0),
    (1, torch.float32, None, 0),
    (7, torch.bfloat16, torch.float32, 1),
    (CHUNK - 1, torch.float16, None, 0),
    (CHUNK, torch.float32, torch.float16, 0),
    (CHUNK + 1, torch.bfloat16, torch.bfloat16, 0),
    (3 * CHUNK + 5, torch.float32, torch.float32, 1),
    (3 * CHUNK + 5, torch.float16, torch.bfloat16, 0),
    (5 * CHUNK + 8, torch.bfloat16, None, 1),
]


@pytest.mark.parametrize("n,dtype,shift_dtype,offset", VN_CASES)
def test_variance_norms(lib, n, dtype, shift_dtype, offset, gen):
    d, q, s = _inputs(n, dtype, gen, shift_dtype, offset)
    scale = 0.5 + 4.0 * torch.rand((), generator=gen).item()
    got = vn_multi(lib, [d], [q], scale, [s])
    _close(got, ref.variance_norms(d, q, scale, s), rtol=1e-5, atol=1e-6)


def test_variance_norms_multi_mixed_and_deterministic(lib, gen):
    """70 tensors (> 64 per launch), mixed sizes/dtypes/alignment, shifts None for some."""
    ds, qs, ss = [], [], []
    for i in range(70):
        n = int(torch.randint(0, 3 * CHUNK if i % 9 == 0 else 300, (1,), generator=gen))
        d, q, s = _inputs(n, DTYPES[i % 3], gen, None if i % 4 == 0 else DTYPES[(i // 3) % 3], i % 2)
        ds.append(d)
        qs.append(q)
        ss.append(s)
    got = vn_multi(lib, ds, qs, 2.0, ss)
    want = sum(ref.variance_norms(d, q, 2.0, s) for d, q, s in zip(ds, qs, ss))
    _close(got, want, rtol=1e-5)
    assert torch.equal(got, vn_multi(lib, ds, qs, 2.0, ss)), "not bit-identical run to run"
    _close(vn_multi(lib, ds, qs, 2.0, None), sum(ref.variance_norms(d, q, 2.0) for d, q in zip(ds, qs)),
           rtol=1e-5)


@pytest.mark.parametrize("where,bad", [("mean_grad", float("nan")), ("mean_sq", float("nan")),
                                       ("shift", float("inf")), ("mean_grad", float("-inf"))])
def test_variance_norms_non_finite(lib, where, bad, gen):
    d, q, s = _inputs(2 * CHUNK + 3, torch.float32, gen, torch.float32)
    {"mean_grad": d, "mean_sq": q, "shift": s}[where][CHUNK + 1] = bad
    got = vn_multi(lib, [d], [q], 1.5, [s])
    want = ref.variance_norms(d, q, 1.5, s)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    assert not torch.isfinite(got).all()


# --------------------------------------------------------------------------------------
# square_pack
# --------------------------------------------------------------------------------------
SP_CASES = [  # n, dtype, shift dtype, grad/shift offset, out offset
    (0, torch.float32, None, 0, 0),
    (5, torch.float32, None, 0, 0),
    (CHUNK + 4, torch.float32, torch.float32, 0, 0),       # all vector
    (CHUNK + 6, torch.bfloat16, torch.float16, 0, 0),      # upper half out + n misaligned
    (2 * CHUNK + 1, torch.float16, None, 1, 0),            # misaligned input: scalar
    (2 * CHUNK + 3, torch.float32, torch.bfloat16, 0, 1),  # misaligned out: scalar
]


@pytest.mark.parametrize("n,dtype,shift_dtype,offset,out_offset", SP_CASES)
def test_square_pack(lib, n, dtype, shift_dtype, offset, out_offset, gen):
    grad, _, shift = _inputs(n, dtype, gen, shift_dtype, offset)
    out = torch.full((2 * n + out_offset,), float("nan"))[out_offset:]
    assert square_pack(lib, grad, out, shift) == 0
    _close(out, ref.square_pack(grad, shift), rtol=3e-7)


def test_square_pack_multi(lib, gen):
    """One call over a list: every dtype pair (and no shift), odd sizes across chunk
    boundaries, more tensors than one launch's table holds, misaligned views, empty tensors."""
    dts = [torch.float32, torch.bfloat16, torch.float16]
    grads, shifts, outs = [], [], []
    n_tensors = 70  # > kMaxTensorsPerLaunch (64) in one dtype group: two launches
    for i in range(n_tensors):
        n = [0, 1, 7, CHUNK - 1, CHUNK + 5, 2 * CHUNK + 3][i % 6] + (i // 6)
        dt = dts[i % 3] if i < 30 else torch.float32
        sdt = None if i % 4 == 3 or i >= 30 else dts[(i // 3) % 3]
        off = i % 2
        g, _, s = _inputs(n, dt, gen, sdt, off)
        grads.append(g)
        shifts.append(s)
        outs.append(torch.full((2 * n + off,), float("nan"))[off:])
    numels = _arr(ctypes.c_int64, [g.numel() for g in grads])
    rc = lib.emu_square_pack_multi(
        n_tensors, numels, _arr(P, [_ptr(g) for g in grads]), _arr(P, [_ptr(s) for s in shifts]),
        _arr(ctypes.c_int, [CODES[g.dtype] for g in grads]),
        _arr(ctypes.c_int, [0 if s is None else CODES[s.dtype] for s in shifts]),
        _arr(P, [_ptr(o) for o in outs]))
    assert rc == 0
    for i, (g, s, o) in enumerate(zip(grads, shifts, outs)):
        _close(o, ref.square_pack(g, s), rtol=3e-7)
    bad = lib.emu_square_pack_multi(1, numels, _arr(P, [_ptr(grads[1])]), None, _arr(ctypes.c_int, [7]),
                                    None, _arr(P, [_ptr(outs[1])]))
    assert bad == CUDA_ERROR_INVALID_VALUE


# --------------------------------------------------------------------------------------
# accumulate_sq
# --------------------------------------------------------------------------------------
def test_accumulate_sq_multi(lib, gen):
    grads, prevs, sqs, wants = [], [], [], []
    for i in range(20):
        n = int(torch.randint(0, 3 * CHUNK if i % 4 == 0 else 500, (1,), generator=gen))
        dt = DTYPES[i % 3]
        g, p, s = _inputs(n, dt, gen, torch.float32, offset=int(i % 5 == 0))
        p = p.float() if i % 2 else p
        s = s.abs()
        wants.append(ref.accumulate_sq(g, p, s))
        grads.append(g)
        prevs.append(p)
        sqs.append(s)
    assert acc_multi(lib, grads, prevs, sqs) == 0
    for s, p, (ws, wp) in zip(sqs, prevs, wants):
        _close(s, ws, rtol=1e-6, atol=1e-30)
        _close(p, wp.to(p.dtype), rtol=0.0)


def test_accumulate_sq_rejects_prev_dtype(lib):
    g = torch.zeros(10, dtype=torch.float16)
    p = torch.zeros(10, dtype=torch.bfloat16)  # neither grad's dtype nor float32
    s = torch.zeros(10)
    assert acc_multi(lib, [g], [p], [s]) == CUDA_ERROR_INVALID_VALUE
    assert torch.equal(s, torch.zeros(10))
