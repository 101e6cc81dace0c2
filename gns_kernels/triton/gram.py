"""Triton Gram kernel: X X^T (or X^T X) of a batch of matrices, upper-triangle tiles only.

For x of shape (L, m, n) the Gram side has K rows (K = m for 'row', n for 'col'; the
column side is read through strides, no transpose copy) and the reduction runs over the
other N. The K x K output is cut into T = ceil(K / BLOCK) tile rows; only the
T (T + 1) / 2 tiles (i, j) with i <= j are computed (program id 0 enumerates them
row-major, id 1 is the matrix index), each one accumulated in float32 by tl.dot over
BLOCK_N-wide slabs of N, stored at (i, j) and, transposed, at (j, i). That is
(T + 1) / (2 T) of the full product's FLOPs (0.58 at K = 768, BLOCK = 64) and no atomics:
every output element is written by exactly one program, so results are deterministic.

Inputs: float32, bfloat16 or float16, converted to float32 in registers after the load.
``precision`` (an explicit argument: the kernel never follows torch's process flags):
  "ieee" (default)  tl.dot with input_precision="ieee": the float32 Gram of the given
                    values (bf16/fp16 products are exact in float32), FFMA only;
  "tf32"            the operands are rounded to nearest with a 10-bit mantissa in
                    registers (integer ops on the loaded tile: no truncation bias, and
                    the same values the interpreter multiplies), then tl.dot with
                    input_precision="tf32" (tensor cores; exact for tf32-valued
                    operands), float32 accumulation;
  "bf16"            bfloat16 inputs only: tl.dot on the bf16 operands (tensor cores),
                    float32 accumulation; the products are exact, so the result is
                    "ieee"'s up to summation order. Under the interpreter (numpy has no
                    bfloat16) the operands are converted to float32 first: the same
                    products.
Which precision keeps the nuclear statistics within their budget is
gns_kernels.spectral.precision.gram_precision_rule (docs/spectral.md, "Precision").
Output: float32 (L, K, K), contiguous.

The kernel is a gns_kernels.triton._runtime.DualKernel: CUDA tensors run the compiled
kernel, CPU tensors Triton's interpreter (tests, tests/triton/test_gram.py). It calls only
Triton builtins (no tl.zeros / tl.cdiv, which are standard-library JIT functions), the
restriction DualKernel documents. Ahead-of-time compilation for sm_80 / sm_90 (registers,
spills, PTX statistics): ``python tools/gram_aot.py`` in the source tree (bench/RESULTS.md).
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._runtime import dual_kernel

__all__ = ["gram_upper"]

BLOCK = 64  # output tile edge
BLOCK_N = 16  # reduction slab width
NUM_WARPS = 4

_TL_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dual_kernel
def _gram_upper_kernel(
    x_ptr, out_ptr, K, N, T,
    stride_xl, stride_xk, stride_xn, stride_ol, stride_oi,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
):
    # MODE 0: ieee float32; 1: tf32 (operands rounded to nearest, 10-bit mantissa);
    # 2: bf16 operands into tl.dot (compiled runs only)
    p = tl.program_id(0)
    lidx = tl.program_id(1).to(tl.int64)
    # tile pair (ti, tj), ti <= tj, from p = start(ti) + (tj - ti),
    # start(i) = i (2T - i + 1) / 2; float estimate then integer correction.
    b = 2 * T + 1
    disc = (b * b - 8 * p).to(tl.float32)
    ti = ((b.to(tl.float32) - tl.sqrt(disc)) * 0.5).to(tl.int32)
    ti = tl.where(ti < 0, 0, ti)
    ti = tl.where((ti + 1) * (2 * T - ti) // 2 <= p, ti + 1, ti)
    ti = tl.where(ti * (2 * T - ti + 1) // 2 > p, ti - 1, ti)
    tj = p - ti * (2 * T - ti + 1) // 2 + ti

    rk = tl.arange(0, BLOCK)
    rn = tl.arange(0, BLOCK_N)
    ri = ti * BLOCK + rk
    rj = tj * BLOCK + rk
    base = x_ptr + lidx * stride_xl
    pa = base + ri[:, None].to(tl.int64) * stride_xk
    pb = base + rj[:, None].to(tl.int64) * stride_xk
    mi = ri[:, None] < K
    mj = rj[:, None] < K
    acc = tl.full((BLOCK, BLOCK), 0.0, tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + rn
        mc = cols[None, :] < N
        off = cols[None, :].to(tl.int64) * stride_xn
        a = tl.load(pa + off, mask=mi & mc, other=0.0)
        bt = tl.load(pb + off, mask=mj & mc, other=0.0)
        if MODE == 2:
            acc += tl.dot(a, tl.trans(bt), out_dtype=tl.float32)
        elif MODE == 1:
            # round to nearest, ties to even, keeping 10 of 23 mantissa bits (finite inputs)
            ai = a.to(tl.float32).to(tl.int32, bitcast=True)
            bi = bt.to(tl.float32).to(tl.int32, bitcast=True)
            ai = ((ai + 0xFFF + ((ai >> 13) & 1)) >> 13) << 13
            bi = ((bi + 0xFFF + ((bi >> 13) & 1)) >> 13) << 13
            acc += tl.dot(ai.to(tl.float32, bitcast=True), tl.trans(bi.to(tl.float32, bitcast=True)),
                          input_precision="tf32")
        else:
            acc += tl.dot(a.to(tl.float32), tl.trans(bt.to(tl.float32)), input_precision="ieee")
    # diagonal tiles: the two triangles come from different dot products; average them
    # so the output is exactly symmetric (off-diagonal tiles are mirrored copies)
    diag = (rk[:, None] * 0 + (tj - ti)) == 0
    acc_t = tl.trans(acc)
    acc = tl.where(diag, 0.5 * (acc + acc_t), acc)
    obase = out_ptr + lidx * stride_ol
    m_out = (ri[:, None] < K) & (rj[None, :] < K)
    tl.store(obase + ri[:, None].to(tl.int64) * stride_oi + rj[None, :], acc, mask=m_out)
    # mirror: tile (tj, ti) = acc^T; skipped (masked off) on diagonal tiles
    m_mir = (rj[:, None] < K) & (ri[None, :] < K) & (rk[None, :] < BLOCK * (tj - ti))
    tl.store(obase + rj[:, None].to(tl.int64) * stride_oi + ri[None, :], acc_t, mask=m_mir)


GRAM_KERNEL_PRECISIONS = ("ieee", "tf32", "bf16")


def gram_upper(x: torch.Tensor, col: bool = False, block: int = BLOCK, block_n: int = BLOCK_N, *,
               precision: str = "ieee") -> torch.Tensor:
    """Batched Gram of x (L, m, n): x x^T (L, m, m), or x^T x (L, n, n) when col; float32.

    x: float32, bfloat16 or float16 (float64 is rounded to float32 first), CUDA (compiled)
    or CPU (Triton interpreter). Any strides. block, block_n: tile sizes (powers of two >= 16).
    precision: "ieee" (default), "tf32" or "bf16" (bfloat16 x only), module docstring.
    """
    if precision not in GRAM_KERNEL_PRECISIONS:
        raise ValueError(f"precision: expected 'ieee', 'tf32' or 'bf16', got {precision!r}")
    if precision == "bf16" and x.dtype != torch.bfloat16:
        raise ValueError(f"precision: 'bf16' needs bfloat16 x (rounding float32 gradients to bf16 "
                         f"leaves the budget), got {x.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x: expected a 3-D tensor (L, m, n), got shape {tuple(x.shape)}")
    if x.dtype not in _TL_DTYPES:
        if not x.is_floating_point():
            raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
        x = x.float()
    L, m, n = x.shape
    if col:
        K, N, sk, sn = n, m, x.stride(2), x.stride(1)
    else:
        K, N, sk, sn = m, n, x.stride(1), x.stride(2)
    out = torch.empty((L, K, K), dtype=torch.float32, device=x.device)
    if L == 0 or K == 0:
        return out
    if N == 0:
        return out.zero_()
    T = -(-K // block)
    grid = (T * (T + 1) // 2, L)
    mode = {"ieee": 0, "tf32": 1, "bf16": 2}[precision]
    if mode == 2 and x.device.type != "cuda":
        mode = 0  # the interpreter cannot multiply bfloat16: the same exact products in float32
    _gram_upper_kernel.launch(
        x.device, grid, x, out, K, N, T, x.stride(0), sk, sn, out.stride(0), out.stride(1),
        num_warps=NUM_WARPS, BLOCK=block, BLOCK_N=block_n, MODE=mode,
    )
    return out
