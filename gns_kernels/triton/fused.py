"""Triton kernels of the fused l1/l2 ops (GPU path of gns_kernels.ops; same signatures).

Semantics (float32 arithmetic whatever the input dtype; oracle gns_kernels.reference):

- ``variance_norms(mean_grad, mean_sq, scale, shift=None) -> Tensor[4]`` float32:
  d = mean_grad, q = mean_sq, g = d + shift (d without shift),
  s2 = max(scale * (q - d^2), 0) with NaN kept (``tl.where(s2 < 0, 0, s2)``: NaN < 0 is
  false, whereas tl.maximum would drop the NaN), s = sqrt(s2) (correctly rounded),
  returns [||s||_1, ||g||_1, sum s2, ||g||_2^2] (units: gradient, gradient, gradient^2,
  gradient^2; shapes: any, flattened).
- ``square_pack(grad, out, shift=None) -> out``: x = grad - shift; out[:n] = x,
  out[n:2n] = x^2 (out float32, 2n elements).
- ``accumulate_sq(grad, prev, sq) -> None``: d = grad - prev; sq += d^2; prev = grad.
- ``variance_norms_multi`` / ``accumulate_sq_multi``: the same over lists of tensors.

Inputs: contiguous float32 / bfloat16 / float16 tensors on a CUDA device (compiled
kernels) or on the CPU (Triton's interpreter, for tests). Validation is shared with
gns_kernels.ops (same error messages).

Work split (no float atomics anywhere; results bit-identical run to run on one device):
- Elements are cut in tiles of BLOCK = 1024 (4 warps x 32 lanes x 8 elements: two 128-bit
  loads per float32 input, one per bf16/fp16 input); program p handles the contiguous
  tiles [p*T, (p+1)*T) with T = clamp(ceil(tiles / 4096), 1, 256). So a launch has
  min(tiles, 4096) programs up to 2^30 elements (above 4M elements that is more than
  four waves of resident blocks on A100/H100, so the partial last wave costs little) and
  each float32 lane sums at most T <= 256 values sequentially before the tree reduction
  (T = 16 at 2^26 elements). The partition depends only on the sizes, not on the GPU.
  Full tiles are loaded without masks (128-bit vector loads when the pointer is 16-byte
  aligned); only the one partial tile at the end of a tensor is masked.
- Reductions: each program writes its 4 partial sums to its own slot of a [4, programs]
  float32 buffer; a second kernel (4 programs, one per statistic) sums the slots in a
  fixed order, 4096 slots per step (one step up to 2^30 elements per dtype group). The
  only temporaries are O(programs): 64 KB of partial slots per launch up to 2^30
  elements, 16 bytes per 2^18 elements beyond.
- Lists (_multi): ONE launch per distinct dtype combination (usually one) over a
  device-side int64 table, one row per non-empty tensor:
  [ptr_a, ptr_b, ptr_c, numel, first_tile]; the global tile sequence of all tensors is
  split among programs as above, each program finds its first tensor by binary search
  over first_tile and walks on. Tables are built on the host (one small host-to-device
  copy) and cached by (pointers, sizes), so repeated calls on the same buffers, as in
  training, reuse them. Pointers are hinted 16-byte aligned (tl.multiple_of) only when
  every tensor of the launch is, so misaligned views still run (with scalar loads).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch
import triton.language as tl

from .. import _validation as _v
from ._runtime import SUM_COMBINE, dual_kernel

Tensor = torch.Tensor

__all__ = [  # the ops; the tiling constants and plan() are internals
    "variance_norms",
    "square_pack",
    "accumulate_sq",
    "variance_norms_multi",
    "accumulate_sq_multi",
    "square_pack_multi",
]

BLOCK = 1024  # elements per tile (4 warps x 32 lanes x 8 elements)
NUM_WARPS = 4
REDUCE_BLOCK = 4096  # partial slots summed per step by the final reduction
MAX_PROGRAMS = 4096  # programs per launch up to MAX_PROGRAMS * MAX_TILES_PER_PROGRAM tiles
MAX_TILES_PER_PROGRAM = 256  # bounds the sequential float32 sum per lane

_sum_combine = SUM_COMBINE  # global name the kernels reference


# --------------------------------------------------------------------------------------
# Kernels (raw functions wrapped by dual_kernel: builtins only, see _runtime.py)
# --------------------------------------------------------------------------------------
@dual_kernel
def _variance_norms_kernel(g_ptr, q_ptr, s_ptr, part_ptr, part_stride, n, num_tiles,
                           tiles_per_prog, scale,
                           HAS_SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Partial sums [sqrt(s2), |g|, s2, g^2] of program p's tiles -> part[k*stride + p]."""
    pid = tl.program_id(0)
    t0 = pid.to(tl.int64) * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, num_tiles)
    n_full = n // BLOCK
    full_end = tl.minimum(t1, n_full)
    lane = tl.arange(0, BLOCK)
    acc_s = tl.full([BLOCK], 0.0, tl.float32)
    acc_a = tl.full([BLOCK], 0.0, tl.float32)
    acc_v = tl.full([BLOCK], 0.0, tl.float32)
    acc_g = tl.full([BLOCK], 0.0, tl.float32)
    for t in range(t0, full_end):
        offs = t * BLOCK + lane
        d = tl.load(g_ptr + offs).to(tl.float32)
        q = tl.load(q_ptr + offs).to(tl.float32)
        s2 = scale * (q - d * d)
        s2 = tl.where(s2 < 0.0, 0.0, s2)  # keeps NaN
        if HAS_SHIFT:
            g = d + tl.load(s_ptr + offs).to(tl.float32)
        else:
            g = d
        acc_s += tl.sqrt_rn(s2)
        acc_a += tl.abs(g)
        acc_v += s2
        acc_g += g * g
    if full_end < t1:  # the masked tail tile (index n_full) is this program's
        offs = n_full * BLOCK + lane
        m = offs < n
        d = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + offs, mask=m, other=0.0).to(tl.float32)
        s2 = scale * (q - d * d)
        s2 = tl.where(s2 < 0.0, 0.0, s2)
        s2 = tl.where(m, s2, 0.0)  # scale * 0 is NaN for scale = inf
        if HAS_SHIFT:
            g = d + tl.load(s_ptr + offs, mask=m, other=0.0).to(tl.float32)
        else:
            g = d
        acc_s += tl.sqrt_rn(s2)
        acc_a += tl.abs(g)
        acc_v += s2
        acc_g += g * g
    tl.store(part_ptr + pid, tl.reduce(acc_s, 0, _sum_combine))
    tl.store(part_ptr + part_stride + pid, tl.reduce(acc_a, 0, _sum_combine))
    tl.store(part_ptr + 2 * part_stride + pid, tl.reduce(acc_v, 0, _sum_combine))
    tl.store(part_ptr + 3 * part_stride + pid, tl.reduce(acc_g, 0, _sum_combine))


@dual_kernel
def _variance_norms_multi_kernel(table_ptr, part_ptr, part_stride, n_tensors, total_tiles,
                                 tiles_per_prog, scale,
                                 G_DT: tl.constexpr, S_DT: tl.constexpr,
                                 HAS_SHIFT: tl.constexpr, ALIGNED: tl.constexpr,
                                 BLOCK: tl.constexpr):
    """variance_norms partials over a table of tensors; row = [d, q, shift, numel, tile0]."""
    pid = tl.program_id(0)
    t0 = pid.to(tl.int64) * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, total_tiles)
    # Binary search: the last table row whose first tile is <= t0.
    lo = pid.to(tl.int64) * 0  # int64 whatever integer width the sizes were given in
    hi = lo + (n_tensors - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(table_ptr + mid * 5 + 4) <= t0
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    lane = tl.arange(0, BLOCK)
    acc_s = tl.full([BLOCK], 0.0, tl.float32)
    acc_a = tl.full([BLOCK], 0.0, tl.float32)
    acc_v = tl.full([BLOCK], 0.0, tl.float32)
    acc_g = tl.full([BLOCK], 0.0, tl.float32)
    t = t0
    k = lo
    while t < t1:
        row = table_ptr + k * 5
        dp = tl.load(row).to(tl.pointer_type(G_DT), bitcast=True)
        qp = tl.load(row + 1).to(tl.pointer_type(G_DT), bitcast=True)
        sp = tl.load(row + 2).to(tl.pointer_type(S_DT), bitcast=True)
        if ALIGNED:
            dp = tl.multiple_of(dp, 16)
            qp = tl.multiple_of(qp, 16)
            sp = tl.multiple_of(sp, 16)
        numel = tl.load(row + 3)
        first = tl.load(row + 4)
        n_full = numel // BLOCK
        end_k = tl.minimum(first + (numel + (BLOCK - 1)) // BLOCK, t1)
        full_end = tl.minimum(first + n_full, end_k)
        for tt in range(t, full_end):
            offs = (tt - first) * BLOCK + lane
            d = tl.load(dp + offs).to(tl.float32)
            q = tl.load(qp + offs).to(tl.float32)
            s2 = scale * (q - d * d)
            s2 = tl.where(s2 < 0.0, 0.0, s2)
            if HAS_SHIFT:
                g = d + tl.load(sp + offs).to(tl.float32)
            else:
                g = d
            acc_s += tl.sqrt_rn(s2)
            acc_a += tl.abs(g)
            acc_v += s2
            acc_g += g * g
        if full_end < end_k:
            offs = n_full * BLOCK + lane
            m = offs < numel
            d = tl.load(dp + offs, mask=m, other=0.0).to(tl.float32)
            q = tl.load(qp + offs, mask=m, other=0.0).to(tl.float32)
            s2 = scale * (q - d * d)
            s2 = tl.where(s2 < 0.0, 0.0, s2)
            s2 = tl.where(m, s2, 0.0)
            if HAS_SHIFT:
                g = d + tl.load(sp + offs, mask=m, other=0.0).to(tl.float32)
            else:
                g = d
            acc_s += tl.sqrt_rn(s2)
            acc_a += tl.abs(g)
            acc_v += s2
            acc_g += g * g
        t = end_k
        k += 1
    tl.store(part_ptr + pid, tl.reduce(acc_s, 0, _sum_combine))
    tl.store(part_ptr + part_stride + pid, tl.reduce(acc_a, 0, _sum_combine))
    tl.store(part_ptr + 2 * part_stride + pid, tl.reduce(acc_v, 0, _sum_combine))
    tl.store(part_ptr + 3 * part_stride + pid, tl.reduce(acc_g, 0, _sum_combine))


@dual_kernel
def _reduce_partials_kernel(part_ptr, out_ptr, num_parts, RBLOCK: tl.constexpr):
    """out[k] = sum_p part[k, p] in a fixed order (program k; deterministic)."""
    k = tl.program_id(0)
    row = part_ptr + k.to(tl.int64) * num_parts
    lane = tl.arange(0, RBLOCK)
    acc = tl.full([RBLOCK], 0.0, tl.float32)
    for start in range(0, num_parts, RBLOCK):
        offs = start + lane
        acc += tl.load(row + offs, mask=offs < num_parts, other=0.0)
    tl.store(out_ptr + k, tl.reduce(acc, 0, _sum_combine))


@dual_kernel
def _square_pack_kernel(g_ptr, s_ptr, out_ptr, n, num_tiles, tiles_per_prog,
                        HAS_SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """x = grad - shift; out[i] = x, out[n + i] = x^2 (float32)."""
    pid = tl.program_id(0)
    t0 = pid.to(tl.int64) * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, num_tiles)
    n_full = n // BLOCK
    full_end = tl.minimum(t1, n_full)
    lane = tl.arange(0, BLOCK)
    for t in range(t0, full_end):
        offs = t * BLOCK + lane
        x = tl.load(g_ptr + offs).to(tl.float32)
        if HAS_SHIFT:
            x = x - tl.load(s_ptr + offs).to(tl.float32)
        tl.store(out_ptr + offs, x)
        tl.store(out_ptr + n + offs, x * x)
    if full_end < t1:
        offs = n_full * BLOCK + lane
        m = offs < n
        x = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_SHIFT:
            x = x - tl.load(s_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, x, mask=m)
        tl.store(out_ptr + n + offs, x * x, mask=m)


@dual_kernel
def _accumulate_sq_kernel(g_ptr, p_ptr, sq_ptr, n, num_tiles, tiles_per_prog,
                          BLOCK: tl.constexpr):
    """d = grad - prev; sq += d^2; prev = grad (in place)."""
    pid = tl.program_id(0)
    t0 = pid.to(tl.int64) * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, num_tiles)
    n_full = n // BLOCK
    full_end = tl.minimum(t1, n_full)
    lane = tl.arange(0, BLOCK)
    for t in range(t0, full_end):
        offs = t * BLOCK + lane
        graw = tl.load(g_ptr + offs)
        d = graw.to(tl.float32) - tl.load(p_ptr + offs).to(tl.float32)
        tl.store(sq_ptr + offs, tl.load(sq_ptr + offs) + d * d)
        tl.store(p_ptr + offs, graw.to(p_ptr.dtype.element_ty))
    if full_end < t1:
        offs = n_full * BLOCK + lane
        m = offs < n
        graw = tl.load(g_ptr + offs, mask=m, other=0.0)
        d = graw.to(tl.float32) - tl.load(p_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(sq_ptr + offs, tl.load(sq_ptr + offs, mask=m, other=0.0) + d * d, mask=m)
        tl.store(p_ptr + offs, graw.to(p_ptr.dtype.element_ty), mask=m)


@dual_kernel
def _accumulate_sq_multi_kernel(table_ptr, n_tensors, total_tiles, tiles_per_prog,
                                G_DT: tl.constexpr, P_DT: tl.constexpr,
                                ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """accumulate_sq over a table of tensors; row = [grad, prev, sq, numel, tile0]."""
    pid = tl.program_id(0)
    t0 = pid.to(tl.int64) * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, total_tiles)
    lo = pid.to(tl.int64) * 0  # int64 whatever integer width the sizes were given in
    hi = lo + (n_tensors - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(table_ptr + mid * 5 + 4) <= t0
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    lane = tl.arange(0, BLOCK)
    t = t0
    k = lo
    while t < t1:
        row = table_ptr + k * 5
        gp = tl.load(row).to(tl.pointer_type(G_DT), bitcast=True)
        pp = tl.load(row + 1).to(tl.pointer_type(P_DT), bitcast=True)
        qp = tl.load(row + 2).to(tl.pointer_type(tl.float32), bitcast=True)
        if ALIGNED:
            gp = tl.multiple_of(gp, 16)
            pp = tl.multiple_of(pp, 16)
            qp = tl.multiple_of(qp, 16)
        numel = tl.load(row + 3)
        first = tl.load(row + 4)
        n_full = numel // BLOCK
        end_k = tl.minimum(first + (numel + (BLOCK - 1)) // BLOCK, t1)
        full_end = tl.minimum(first + n_full, end_k)
        for tt in range(t, full_end):
            offs = (tt - first) * BLOCK + lane
            graw = tl.load(gp + offs)
            d = graw.to(tl.float32) - tl.load(pp + offs).to(tl.float32)
            tl.store(qp + offs, tl.load(qp + offs) + d * d)
            tl.store(pp + offs, graw.to(P_DT))
        if full_end < end_k:
            offs = n_full * BLOCK + lane
            m = offs < numel
            graw = tl.load(gp + offs, mask=m, other=0.0)
            d = graw.to(tl.float32) - tl.load(pp + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(qp + offs, tl.load(qp + offs, mask=m, other=0.0) + d * d, mask=m)
            tl.store(pp + offs, graw.to(P_DT), mask=m)
        t = end_k
        k += 1


@dual_kernel
def _square_pack_multi_kernel(table_ptr, n_tensors, total_tiles, tiles_per_prog,
                              G_DT: tl.constexpr, S_DT: tl.constexpr,
                              HAS_SHIFT: tl.constexpr, ALIGNED: tl.constexpr,
                              BLOCK: tl.constexpr):
    """square_pack over a table of tensors; row = [grad, out, shift, numel, tile0]."""
    pid = tl.program_id(0)
    t0 = pid.to(tl.int64) * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, total_tiles)
    lo = pid.to(tl.int64) * 0  # int64 whatever integer width the sizes were given in
    hi = lo + (n_tensors - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(table_ptr + mid * 5 + 4) <= t0
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    lane = tl.arange(0, BLOCK)
    t = t0
    k = lo
    while t < t1:
        row = table_ptr + k * 5
        gp = tl.load(row).to(tl.pointer_type(G_DT), bitcast=True)
        op = tl.load(row + 1).to(tl.pointer_type(tl.float32), bitcast=True)
        sp = tl.load(row + 2).to(tl.pointer_type(S_DT), bitcast=True)
        if ALIGNED:
            gp = tl.multiple_of(gp, 16)
            op = tl.multiple_of(op, 16)
            sp = tl.multiple_of(sp, 16)
        numel = tl.load(row + 3)
        first = tl.load(row + 4)
        n_full = numel // BLOCK
        end_k = tl.minimum(first + (numel + (BLOCK - 1)) // BLOCK, t1)
        full_end = tl.minimum(first + n_full, end_k)
        for tt in range(t, full_end):
            offs = (tt - first) * BLOCK + lane
            x = tl.load(gp + offs).to(tl.float32)
            if HAS_SHIFT:
                x = x - tl.load(sp + offs).to(tl.float32)
            tl.store(op + offs, x)
            tl.store(op + numel + offs, x * x)
        if full_end < end_k:
            offs = n_full * BLOCK + lane
            m = offs < numel
            x = tl.load(gp + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_SHIFT:
                x = x - tl.load(sp + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(op + offs, x, mask=m)
            tl.store(op + numel + offs, x * x, mask=m)
        t = end_k
        k += 1


KERNELS = {
    "variance_norms": _variance_norms_kernel,
    "variance_norms_multi": _variance_norms_multi_kernel,
    "reduce_partials": _reduce_partials_kernel,
    "square_pack": _square_pack_kernel,
    "accumulate_sq": _accumulate_sq_kernel,
    "accumulate_sq_multi": _accumulate_sq_multi_kernel,
    "square_pack_multi": _square_pack_multi_kernel,
}


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(num_tiles: int) -> tuple[int, int]:
    """(tiles_per_program, programs) for ``num_tiles`` tiles of BLOCK elements."""
    tpp = min(MAX_TILES_PER_PROGRAM, max(1, _cdiv(num_tiles, MAX_PROGRAMS)))
    return tpp, _cdiv(num_tiles, tpp)


def _check_device(name: str, t: Tensor) -> torch.device:
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CUDA tensor (or CPU under Triton's interpreter), got {t.device}")
    return t.device


def _reduce(part: Tensor, device: torch.device) -> Tensor:
    out = torch.empty(4, dtype=torch.float32, device=device)
    _reduce_partials_kernel.launch(device, (4,), part, out, part.shape[1], RBLOCK=REDUCE_BLOCK)
    return out


def variance_norms(mean_grad: Tensor, mean_sq: Tensor, scale: float, shift: Optional[Tensor] = None) -> Tensor:
    """[||s||_1, ||g||_1, sum s2, ||g||_2^2] as float32 Tensor[4] (see module docstring).

    mean_grad, mean_sq (same dtype), shift (any of float32/bf16/fp16): same numel,
    contiguous, one device. Two launches: partial sums, then the fixed-order reduction.
    """
    _v.check_vn(mean_grad, mean_sq, shift)
    scale = _v.check_scale(scale)
    dev = _check_device("mean_grad", mean_grad)
    n = mean_grad.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float32, device=dev)
    num_tiles = _cdiv(n, BLOCK)
    tpp, progs = plan(num_tiles)
    part = torch.empty((4, progs), dtype=torch.float32, device=dev)
    s = mean_grad if shift is None else shift
    _variance_norms_kernel.launch(
        dev, (progs,), mean_grad, mean_sq, s, part, progs, n, num_tiles, tpp, scale,
        HAS_SHIFT=shift is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return _reduce(part, dev)


def square_pack(grad: Tensor, out: Tensor, shift: Optional[Tensor] = None) -> Tensor:
    """out[:n] = x, out[n:2n] = x^2 with x = grad - shift, in float32; returns ``out``."""
    _v.check_square_pack(grad, out, shift)
    _v.check_no_overlap([("out", out)], [("grad", grad), ("shift", shift)])
    dev = _check_device("grad", grad)
    n = grad.numel()
    if n == 0:
        return out
    num_tiles = _cdiv(n, BLOCK)
    tpp, progs = plan(num_tiles)
    s = grad if shift is None else shift
    _square_pack_kernel.launch(dev, (progs,), grad, s, out, n, num_tiles, tpp,
                               HAS_SHIFT=shift is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def accumulate_sq(grad: Tensor, prev: Tensor, sq: Tensor) -> None:
    """In place: d = grad - prev; sq += d^2; prev = grad (float32 arithmetic)."""
    _v.check_acc(grad, prev, sq)
    _v.check_no_overlap([("prev", prev), ("sq", sq)], [("grad", grad)])
    dev = _check_device("grad", grad)
    n = grad.numel()
    if n == 0:
        return None
    num_tiles = _cdiv(n, BLOCK)
    tpp, progs = plan(num_tiles)
    _accumulate_sq_kernel.launch(dev, (progs,), grad, prev, sq, n, num_tiles, tpp,
                                 BLOCK=BLOCK, num_warps=NUM_WARPS)
    return None


# --------------------------------------------------------------------------------------
# Multi-tensor launches: list plans and pointer tables
# --------------------------------------------------------------------------------------
# A *plan* is everything about a list call that depends only on the tensors' dtypes, sizes,
# devices and contiguity (not on their addresses): the arguments are fully validated once
# when a plan is made, then the plan is cached under that signature, so a later call on
# lists of the same signature (every training step) re-checks nothing but the signature.
# A plan holds its dtype groups, tile plans, the static table columns (numel, first tile)
# and the pointer tables built for it.
#
# A *pointer table* (device int64, one row per non-empty tensor: [ptr_a, ptr_b, ptr_c,
# numel, first_tile]) is cached in its plan by the tensors' addresses, so a cached table is
# always correct; the first call on new addresses builds it with one host tensor and one
# host-to-device copy. Each plan keeps its 16 most recently used tables. CUDA graphs: a
# graph captured around a launch keeps the table's device address, so a table handed out
# while the current CUDA stream is capturing is pinned (with its host source) for the life
# of the process: it is never evicted or freed, and replays of the graph always read it.
# Tables built during capture are copied from pinned host memory (a capturable copy).
_PLAN_CACHE: "OrderedDict[tuple, _Plan]" = OrderedDict()
_PLAN_CACHE_SIZE = 64  # plans hold host metadata and unpinned tables only: evicting is safe
_TABLES_PER_PLAN = 16
_PINNED_TABLES: list = []  # (host source, device table) handed out under capture; never freed
_CUDA = torch.cuda.is_available()
_CACHE_LOCK = threading.Lock()  # the caches may be used from several threads at once


def _capturing() -> bool:
    """True while the current CUDA stream captures a CUDA graph (False without CUDA)."""
    return _CUDA and torch.cuda.is_current_stream_capturing()


def _meta(t) -> tuple:
    """The part of a tensor's description the checks depend on (not its address)."""
    return (t.dtype, t.numel(), t.device, t.is_contiguous())


def _signature(op: str, lists) -> Optional[tuple]:
    """(op, work-split constants, per-list metas) of a call; None when an entry is not a
    tensor (the full checks then raise)."""
    try:
        return (op, BLOCK, MAX_PROGRAMS, MAX_TILES_PER_PROGRAM) + tuple(
            None if xs is None else tuple(None if t is None else _meta(t) for t in xs)
            for xs in lists)
    except (AttributeError, TypeError):
        return None


class _Plan:
    """Launch plan of a validated list signature (see above)."""

    __slots__ = ("device", "groups", "total_progs", "tables")

    def __init__(self, device: torch.device, groups: list, total_progs: int):
        self.device = device
        # groups: (indices, constexprs, static rows [(numel, first_tile)], tiles, tpp,
        #          programs, first partial column)
        self.groups = groups
        self.total_progs = total_progs
        self.tables: "OrderedDict[tuple, list]" = OrderedDict()


def _make_plan(device: torch.device, lists, key_fn, consts_fn) -> _Plan:
    """Group the non-empty tensors (lists[0][i] decides emptiness) by key_fn(i)."""
    by_key: "OrderedDict[tuple, list]" = OrderedDict()
    for i, a in enumerate(lists[0]):
        if a.numel() == 0:
            continue
        by_key.setdefault(key_fn(i), []).append(i)
    groups, col0 = [], 0
    for key, idx in by_key.items():
        rows, first = [], 0
        for i in idx:
            n = lists[0][i].numel()
            rows.append((n, first))
            first += _cdiv(n, BLOCK)
        tpp, progs = plan(first)
        groups.append((tuple(idx), consts_fn(key), rows, first, tpp, progs, col0))
        col0 += progs
    return _Plan(device, groups, col0)


def _get_plan(sig: Optional[tuple], validate, build) -> _Plan:
    """The cached plan of ``sig``; on a miss (or sig None) validate() raises or passes and
    build() makes the plan, which is cached."""
    if sig is not None:
        p = _PLAN_CACHE.get(sig)
        if p is not None:
            return p
    validate()
    p = build()
    if sig is not None:
        with _CACHE_LOCK:
            p = _PLAN_CACHE.setdefault(sig, p)
            while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
                _PLAN_CACHE.popitem(last=False)
    return p


def _tables(p: _Plan, lists, check_overlap=None) -> list:
    """Device tables of p's groups for these tensors (lists[2] entries None -> lists[0]).

    check_overlap(): called when the addresses are new, before anything is built (the ops
    with outputs check that no output shares memory with another argument; the result
    depends only on the addresses and sizes, so it holds for every cache hit).
    """
    a_l, b_l, c_l = lists
    ptrs = []
    for idx, *_ in p.groups:
        for i in idx:
            a = a_l[i]
            c = None if c_l is None else c_l[i]
            ptrs.append(a.data_ptr())
            ptrs.append(b_l[i].data_ptr())
            ptrs.append((a if c is None else c).data_ptr())
    key = tuple(ptrs)
    capturing = _capturing()
    with _CACHE_LOCK:
        tabs = p.tables.get(key)
        if tabs is not None:
            p.tables.move_to_end(key)
    if tabs is None:
        if check_overlap is not None:
            check_overlap()
        tabs, k = [], 0
        for idx, consts, rows, *_ in p.groups:
            flat = []
            for n, first in rows:
                flat += (ptrs[k], ptrs[k + 1], ptrs[k + 2], n, first)
                k += 3
            aligned = all(x % 16 == 0 for x in ptrs[k - 3 * len(rows):k])
            host = torch.tensor(flat, dtype=torch.int64)
            if p.device.type == "cuda" and capturing:
                host = host.pin_memory()
                dev = host.to(p.device, non_blocking=True)
            else:
                dev = host.to(p.device)
            tabs.append((host, dev, aligned))
        with _CACHE_LOCK:
            p.tables[key] = tabs
            while len(p.tables) > _TABLES_PER_PLAN:
                p.tables.popitem(last=False)
    if capturing:
        with _CACHE_LOCK:
            for t in tabs:
                if not any(t is q for q in _PINNED_TABLES):
                    _PINNED_TABLES.append(t)
    return tabs


def _check_vn_call(mean_grads, mean_sqs, sh) -> None:
    if len(mean_sqs) != len(mean_grads):
        raise ValueError(f"mean_sqs: expected {len(mean_grads)} tensors like mean_grads, got {len(mean_sqs)}")
    if len(sh) != len(mean_grads):
        raise ValueError(f"shifts: expected {len(mean_grads)} tensors like mean_grads, got {len(sh)}")
    for i, (d, q) in enumerate(zip(mean_grads, mean_sqs)):
        _v.check_vn(d, q, sh[i], suffix=f"s[{i}]")
    dev = _v.common_device("mean_grads", mean_grads)
    _v.common_device("mean_sqs", mean_sqs)
    _v.common_device("shifts", [s for s in sh if s is not None])
    for i, s in enumerate(sh):
        if s is not None and s.device != dev:
            raise ValueError(f"shifts[{i}]: expected device {dev} like mean_grads, got {s.device}")
    if mean_grads:
        _check_device("mean_grads[0]", mean_grads[0])


def variance_norms_multi(
    mean_grads: Sequence[Tensor],
    mean_sqs: Sequence[Tensor],
    scale: float,
    shifts: Optional[Sequence[Optional[Tensor]]] = None,
) -> Tensor:
    """Sum of variance_norms over lists (float32 Tensor[4]; zeros for empty lists).

    One launch per distinct (mean_grad dtype, shift dtype or None) combination over a
    device-side table of the non-empty tensors, then one fixed-order reduction of all
    partial slots. Arguments are validated once per list signature (see _Plan).
    """
    mean_grads = _v.check_list("mean_grads", mean_grads)
    mean_sqs = _v.check_list("mean_sqs", mean_sqs)
    if shifts is not None:
        shifts = _v.check_list("shifts", shifts)
        if not shifts and mean_grads:  # the op schema's form of "no shift at all"
            shifts = None
    scale = _v.check_scale(scale)
    sh = [None] * len(mean_grads) if shifts is None else shifts
    return _variance_norms_multi(mean_grads, mean_sqs, scale, sh,
                                 lambda: _check_vn_call(mean_grads, mean_sqs, sh))


def variance_norms_multi_unchecked(mean_grads: list, mean_sqs: list, scale: float,
                                   shifts: Optional[list] = None) -> Tensor:
    """``variance_norms_multi`` for lists and a scale the caller checked once itself
    (gns_kernels._validation.check_vn_lists and check_scale; the Triton path of
    gns_kernels.ops.variance_norms_multi_unchecked). Not part of the API. Only the device
    type is checked, on a new list signature. A plan it caches serves later checked calls
    of the same signature: what ``_check_vn_call`` checks is a function of the signature
    (dtypes, sizes, devices, contiguity, list lengths), and check_vn_lists plus the device
    type check all of it."""
    sh = [None] * len(mean_grads) if shifts is None else shifts
    return _variance_norms_multi(mean_grads, mean_sqs, scale, sh,
                                 lambda: mean_grads and _check_device("mean_grads[0]", mean_grads[0]))


def _variance_norms_multi(mean_grads: list, mean_sqs: list, scale: float, sh: list, validate) -> Tensor:
    """The launches of variance_norms_multi; validate(): the checks of a new signature."""
    p = _get_plan(
        _signature("vn", (mean_grads, mean_sqs, sh)),
        validate,
        lambda: _make_plan(
            mean_grads[0].device if mean_grads else torch.device("cpu"), (mean_grads, mean_sqs, sh),
            lambda i: (mean_grads[i].dtype, None if sh[i] is None else sh[i].dtype),
            lambda k: dict(G_DT=_TL_DTYPE[k[0]], S_DT=_TL_DTYPE[k[0] if k[1] is None else k[1]],
                           HAS_SHIFT=k[1] is not None)))
    dev = p.device
    if not p.groups:
        return torch.zeros(4, dtype=torch.float32, device=dev)
    tabs = _tables(p, (mean_grads, mean_sqs, sh))
    part = torch.empty((4, p.total_progs), dtype=torch.float32, device=dev)
    for (idx, consts, rows, tiles, tpp, progs, col0), (_, table, aligned) in zip(p.groups, tabs):
        _variance_norms_multi_kernel.launch(
            dev, (progs,), table, part[:, col0:], p.total_progs, len(rows), tiles, tpp, scale,
            ALIGNED=aligned, BLOCK=BLOCK, num_warps=NUM_WARPS, **consts)
    return _reduce(part, dev)


def _check_acc_call(grads, prevs, sqs) -> None:
    for name, xs in (("prevs", prevs), ("sqs", sqs)):
        if len(xs) != len(grads):
            raise ValueError(f"{name}: expected {len(grads)} tensors like grads, got {len(xs)}")
    for i, (g, p, s) in enumerate(zip(grads, prevs, sqs)):
        _v.check_acc(g, p, s, suffix=f"s[{i}]")
    _v.common_device("grads", grads)
    _v.common_device("prevs", prevs)
    _v.common_device("sqs", sqs)
    if grads:
        _check_device("grads[0]", grads[0])


def accumulate_sq_multi(grads: Sequence[Tensor], prevs: Sequence[Tensor], sqs: Sequence[Tensor]) -> None:
    """accumulate_sq over lists, in place; one launch per (grad dtype, prev dtype) pair."""
    grads = _v.check_list("grads", grads)
    prevs = _v.check_list("prevs", prevs)
    sqs = _v.check_list("sqs", sqs)
    p = _get_plan(
        _signature("acc", (grads, prevs, sqs)),
        lambda: _check_acc_call(grads, prevs, sqs),
        lambda: _make_plan(
            grads[0].device if grads else torch.device("cpu"), (grads, prevs, sqs),
            lambda i: (grads[i].dtype, prevs[i].dtype),
            lambda k: dict(G_DT=_TL_DTYPE[k[0]], P_DT=_TL_DTYPE[k[1]])))
    if not p.groups:
        return None

    def overlap():
        _v.check_no_overlap(
            [(f"prevs[{i}]", x) for i, x in enumerate(prevs)] + [(f"sqs[{i}]", x) for i, x in enumerate(sqs)],
            [(f"grads[{i}]", g) for i, g in enumerate(grads)],
        )

    tabs = _tables(p, (grads, prevs, sqs), overlap)
    dev = p.device
    for (idx, consts, rows, tiles, tpp, progs, _), (_, table, aligned) in zip(p.groups, tabs):
        _accumulate_sq_multi_kernel.launch(
            dev, (progs,), table, len(rows), tiles, tpp,
            ALIGNED=aligned, BLOCK=BLOCK, num_warps=NUM_WARPS, **consts)
    return None


def _check_pack_call(grads, outs, sh) -> None:
    if len(outs) != len(grads):
        raise ValueError(f"outs: expected {len(grads)} tensors like grads, got {len(outs)}")
    if len(sh) != len(grads):
        raise ValueError(f"shifts: expected {len(grads)} tensors like grads, got {len(sh)}")
    for i, (g, o) in enumerate(zip(grads, outs)):
        _v.check_square_pack(g, o, sh[i], suffix=f"s[{i}]")
    dev = _v.common_device("grads", grads)
    for name, xs in (("outs", outs), ("shifts", sh)):
        for i, t in enumerate(xs):
            if t is not None and t.device != dev:
                raise ValueError(f"{name}[{i}]: expected device {dev} like grads[0], got {t.device}")
    if grads:
        _check_device("grads[0]", grads[0])


def square_pack_multi(
    grads: Sequence[Tensor],
    outs: Sequence[Tensor],
    shifts: Optional[Sequence[Optional[Tensor]]] = None,
) -> None:
    """square_pack over lists: outs[i][:n_i] = x_i, outs[i][n_i:] = x_i^2 (float32),
    x_i = grads[i] - shifts[i] (grads[i] where there is no shift). One launch per
    (grad dtype, shift dtype or None) combination; no output may share memory with any
    other argument of the call."""
    grads = _v.check_list("grads", grads)
    outs = _v.check_list("outs", outs)
    if shifts is not None:
        shifts = _v.check_list("shifts", shifts)
        if not shifts and grads:  # the op schema's form of "no shift at all"
            shifts = None
    sh = [None] * len(grads) if shifts is None else shifts
    p = _get_plan(
        _signature("pack", (grads, outs, sh)),
        lambda: _check_pack_call(grads, outs, sh),
        lambda: _make_plan(
            grads[0].device if grads else torch.device("cpu"), (grads, outs, sh),
            lambda i: (grads[i].dtype, None if sh[i] is None else sh[i].dtype),
            lambda k: dict(G_DT=_TL_DTYPE[k[0]], S_DT=_TL_DTYPE[k[0] if k[1] is None else k[1]],
                           HAS_SHIFT=k[1] is not None)))
    if not p.groups:
        return None

    def overlap():
        _v.check_no_overlap(
            [(f"outs[{i}]", o) for i, o in enumerate(outs)],
            [(f"grads[{i}]", g) for i, g in enumerate(grads)]
            + [(f"shifts[{i}]", s) for i, s in enumerate(sh) if s is not None],
        )

    # table rows [grad, out, shift (grad when none), numel, tile0]
    tabs = _tables(p, (grads, outs, sh), overlap)
    dev = p.device
    for (idx, consts, rows, tiles, tpp, progs, _), (_, table, aligned) in zip(p.groups, tabs):
        _square_pack_multi_kernel.launch(
            dev, (progs,), table, len(rows), tiles, tpp,
            ALIGNED=aligned, BLOCK=BLOCK, num_warps=NUM_WARPS, **consts)
    return None
