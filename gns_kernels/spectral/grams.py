"""Gram matrices G G^T / G^T G in float32: ``gram`` and its ops ``gram_list`` / ``gram_batched``.

Side names: 'row' is G G^T (m x m) of a 2-D G (m x n), 'col' is G^T G (n x n); 'auto' is
the smaller side (row when m <= n), the side every nuclear statistic of this package uses.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._workers import _map_cpu
from .precision import bmm as _bmm_in, fp32_matmul_flag

from ..stats.common import smaller_side

Tensor = torch.Tensor

GRAM_BLOCK = 64  # CPU: rows per strip of the upper-triangle Gram
_CPU_ALIGN = 64  # bytes: torch's CPU allocator aligns every new tensor to this (c10 gAlignment)
_SIDES = ("auto", "row", "col")


def resolve_side(shape: Sequence[int], side: str) -> str:
    """side ('auto' | 'row' | 'col') -> 'row' or 'col'; 'auto' is smaller_side(shape)."""
    if side not in _SIDES:
        raise ValueError(f"side: expected 'auto', 'row' or 'col', got {side!r}")
    return smaller_side(shape) if side == "auto" else side


def _gram_blocked_into(x: Tensor, out: Tensor) -> Tensor:
    """out (k, k) <- x x^T for x (k, n) float32 (any strides); returns out.

    Row strips of about GRAM_BLOCK rows: strip i is one GEMM x[rows_i] @ x[rows_i.start:]^T
    written straight into out[rows_i, rows_i.start:] (the diagonal block and everything to
    its right: (nb + 1) / (2 nb) of the full product's FLOPs for nb strips). The part left
    of the diagonal is copied, transposed, from the strips above, and each diagonal block
    is replaced by (blk + blk^T) / 2, so the result is exactly symmetric.
    """
    k = x.shape[0]
    nb = max(1, -(-k // GRAM_BLOCK))
    e = [i * k // nb for i in range(nb + 1)]
    # a process flag that lowers float32 matmuls (set_float32_matmul_precision("medium")
    # makes oneDNN use bf16 here) must not reach the Gram: C is a difference of Grams
    exact = fp32_matmul_flag(x.device) == "ieee"
    for i in range(nb):
        a, b = e[i], e[i + 1]
        if exact:
            torch.mm(x[a:b], x[a:].T, out=out[a:b, a:])
        else:
            out[a:b, a:].copy_(torch.mm(x[a:b].double(), x[a:].T.double()))
        d = out[a:b, a:b]
        d.copy_((d + d.T).mul_(0.5))
        if b < k:
            out[b:, a:b].copy_(out[a:b, b:].T)
    return out


def _gram_cpu(xs: Sequence[Tensor], col: bool) -> list[Tensor]:
    """Grams of equal-shape 2-D CPU tensors, float32, one separate (k, k) tensor each.

    No stacked copy of the inputs: one matrix per task on single-threaded workers
    (_map_cpu), each converted to float32 (if needed; an input that is not contiguous and
    64-byte aligned is copied to one that is, so the bits do not depend on its address or
    strides) and multiplied by _gram_blocked_into into its own freshly allocated output.
    """
    m, n = xs[0].shape
    k = n if col else m

    def one(x: Tensor) -> Tensor:
        x = x if x.dtype == torch.float32 else x.float()
        if x.data_ptr() % _CPU_ALIGN or not x.is_contiguous():
            # the CPU GEMM's bits depend on the input's address modulo its vector width (a
            # 10 x 64 Gram from a view 4 bytes off an aligned address differed in 65 of 100
            # entries) and on its strides: a view into a DDP bucket sits at an offset set by
            # the bucket layout, which DDP rebuilds after the first iteration (so a resumed
            # run's first step used another one). An aligned contiguous copy makes the Gram
            # a function of the values alone.
            x = torch.empty(x.shape, dtype=x.dtype).copy_(x)
        out = torch.empty((k, k), dtype=torch.float32)
        if x.shape[1 if not col else 0] == 0:  # empty reduction dimension: a zero Gram
            return out.zero_()
        return _gram_blocked_into(x.mT if col else x, out)

    return _map_cpu(one, list(xs))


_STACK_MAX_SIDE = 128  # CPU: Grams up to this side are formed as one stacked batch (gram())


def aligned_in_stack(numel: int) -> bool:
    """Whether float32 matrices of ``numel`` elements each start on a 64-byte boundary in a
    fresh contiguous stack (or in a fresh tensor at that offset): their size is a multiple
    of 64 bytes (the CPU allocator's alignment, which the CPU GEMM's bits depend on;
    ``_gram_cpu``). The one alignment rule of the stacked CPU products (Grams here, the DDP
    hook's deviation sums)."""
    return numel > 0 and (numel * 4) % _CPU_ALIGN == 0


def _stackable_cpu(shape: tuple, col: bool) -> bool:
    """Whether CPU Grams of (m, n) matrices go through one stacked bmm (``_gram_cpu_stacked``):
    a small Gram side (the per-matrix path's launches dominate there) and a matrix size that
    is a multiple of 64 bytes in float32, so every matrix of a fresh stack starts on the
    alignment the CPU GEMM's bits depend on (``_gram_cpu``): a matrix's Gram is then a
    function of its values, not of its place in the batch."""
    m, n = shape
    k = n if col else m
    return 0 < k <= _STACK_MAX_SIDE and aligned_in_stack(m * n)


def _gram_cpu_stacked(x: Tensor, col: bool) -> Tensor:
    """x x^T (or x^T x) of a contiguous float32 stack starting on a 64-byte boundary (x
    itself when it is one, else a fresh copy: aligned, see ``_stackable_cpu``), one bmm
    (float32 whatever the process flag says), symmetrized as (G + G^T) / 2. (L, k, k)
    float32."""
    return gram_groups_cpu([(x, col)])


_HALF = torch.tensor(0.5)  # a 0-d CPU operand: mul_(0.5) would wrap the number (4 more aten ops)


def gram_groups_cpu(groups: Sequence[tuple[Tensor, bool]]) -> Tensor | None:
    """The Grams of several stacks at once on CPU: groups [(x (n_g, m_g, n_g'), col)], one
    Gram side k for all, every shape ``_stackable_cpu``. One bmm per group and ONE
    symmetrization (G + G^T) / 2 of them all: (sum n_g, k, k) float32 in group order, bit
    for bit the concatenation of gram_batched's results per group (the same bmm on the
    same aligned operand; the symmetrization is elementwise). None when a group is not on
    the CPU, not stackable, or has another Gram side (the caller then takes gram_batched
    per group)."""
    ks = set()
    for x, col in groups:
        if x.device.type != "cpu" or x.dim() != 3 or not _stackable_cpu(tuple(x.shape[1:]), col):
            return None
        ks.add(x.shape[-1] if col else x.shape[-2])
    if len(ks) != 1:
        return None
    raw = []
    for x, col in groups:
        if not (x.dtype == torch.float32 and x.is_contiguous() and x.data_ptr() % _CPU_ALIGN == 0):
            x = torch.empty(x.shape, dtype=torch.float32).copy_(x)
        xt = x.transpose(-2, -1) if col else x
        raw.append(_bmm_in(xt, xt.transpose(-2, -1), "ieee"))
    G = raw[0] if len(raw) == 1 else torch.cat(raw)
    return torch.add(G, G.transpose(-2, -1)).mul_(_HALF)


@torch.library.custom_op("gns_kernels::gram_list", mutates_args=())
def gram_list(xs: list[Tensor], col: bool) -> list[Tensor]:
    """Grams in float32 of equal-shape 2-D tensors: xs[l] (m, n) -> out[l] = xs[l] xs[l]^T
    (m, m), or xs[l]^T xs[l] (n, n) if col. Any floating input dtype, products accumulated
    in float32. CPU: per matrix, upper-triangle strips (_gram_cpu); other devices: the
    stacked batch through gram_batched."""
    if xs[0].device.type == "cpu":
        return _gram_cpu(xs, col)
    # a custom op's outputs may not alias each other: one tensor per Gram (gram() itself
    # calls gram_batched on such devices and takes views of its result, no copy)
    return [G.clone() for G in gram_batched(torch.stack(xs), col).unbind(0)]


@gram_list.register_fake
def _(xs: list[Tensor], col: bool) -> list[Tensor]:
    m, n = xs[0].shape
    k = n if col else m
    return [x.new_empty((k, k), dtype=torch.float32) for x in xs]


@torch.library.custom_op("gns_kernels::gram_batched", mutates_args=())
def gram_batched(x: Tensor, col: bool) -> Tensor:
    """Batched Gram in float32: x (L, m, n) -> x x^T (L, m, m), or x^T x (L, n, n) if col.

    Any floating input dtype; products are accumulated in float32 (bf16/fp16 inputs are
    exact in float32, so this is the float32 Gram of the given values).
    CPU: per matrix, upper-triangle strips; CUDA: the Triton upper-triangle kernel
    (gns_kernels.triton.gram) when triton is importable, else torch.bmm.
    """
    if x.device.type == "cpu":
        if x.shape[0] == 0:
            k = x.shape[-1] if col else x.shape[-2]
            return x.new_empty((0, k, k), dtype=torch.float32)
        if _stackable_cpu(tuple(x.shape[1:]), col):
            return _gram_cpu_stacked(x, col)
        return torch.stack(_gram_cpu(list(x.unbind(0)), col))
    if x.device.type == "cuda" and x.dtype != torch.float64:
        tg = _triton_gram()
        if tg is not None:  # upper-triangle tiles only, bf16/fp16 read natively
            return tg(x, col)
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        xt = x.mT if col else x
        return torch.bmm(xt, xt.mT, out_dtype=torch.float32)
    xf = x if x.dtype == torch.float32 else x.float()
    if col:
        xf = xf.mT
    return _bmm_in(xf, xf.mT, "ieee")  # float32 whatever allow_tf32 says


@gram_batched.register_fake
def _(x: Tensor, col: bool) -> Tensor:
    k = x.shape[-1] if col else x.shape[-2]
    return x.new_empty((x.shape[0], k, k), dtype=torch.float32)


_TRITON_GRAM: list = []


def _triton_gram():
    """gns_kernels.triton.gram.gram_upper, or None without triton (imported on first CUDA use)."""
    if not _TRITON_GRAM:
        try:
            from ..triton.gram import gram_upper
        except ImportError:
            gram_upper = None
        _TRITON_GRAM.append(gram_upper)
    return _TRITON_GRAM[0]


def gram(tensors: Sequence[Tensor], side: str = "auto") -> list[Tensor]:
    """Per 2-D tensor G (m x n): its Gram G G^T ('row', m x m) or G^T G ('col', n x n).

    side: 'auto' (the smaller side: row when m <= n), 'row' or 'col'.
    Any floating dtype (bf16/fp16/fp32/fp64 gradients); the result is float32, accumulated
    in float32 (float64 inputs are rounded to float32 first). Tensors of equal shape, dtype
    and device go to one batched op call: on CPU torch.ops.gns_kernels.gram_list, without
    stacking them, one matrix per single-threaded worker, only upper-triangle strips
    multiplied and mirrored (small Grams, side <= 128 with 64-byte matrices: one stacked
    bmm, ``_stackable_cpu``); on CUDA torch.ops.gns_kernels.gram_batched on the stacked
    batch, a Triton kernel computing only upper-triangle tiles (the Grams are views of its
    result). A zero-size side gives a 0 x 0 Gram; an empty reduction dimension a zero Gram.
    Returns a list in input order.
    """
    tensors = list(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(tensors):
        if not isinstance(g, Tensor):
            raise ValueError(f"tensors[{i}]: expected a torch.Tensor, got {type(g).__name__}")
        if g.dim() != 2:
            raise ValueError(f"tensors[{i}]: expected a 2-D tensor (m, n), got shape {tuple(g.shape)}")
        if not g.is_floating_point():
            raise ValueError(f"tensors[{i}]: expected a floating dtype, got {g.dtype}")
        s = resolve_side(g.shape, side)
        groups.setdefault((tuple(g.shape), g.dtype, g.device, s), []).append(i)
    out: list[Tensor | None] = [None] * len(tensors)
    for (_, _, _, s), idx in groups.items():
        xs = [tensors[i].detach() for i in idx]
        if xs[0].device.type == "cpu" and not _stackable_cpu(tuple(xs[0].shape), s == "col"):
            res = torch.ops.gns_kernels.gram_list(xs, s == "col")
        else:  # one stacked batch; the Grams are views of its result
            res = torch.ops.gns_kernels.gram_batched(torch.stack(xs), s == "col").unbind(0)
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]


def grams_on_sides(tensors: Sequence[Tensor], sides: Sequence[str]) -> list[Tensor]:
    """gram() of each tensor on its own side ('row' / 'col'), batched by shape per side."""
    out: list[Tensor | None] = [None] * len(tensors)
    for s in ("row", "col"):
        idx = [i for i, si in enumerate(sides) if si == s]
        if idx:
            for i, G in zip(idx, gram([tensors[i] for i in idx], side=s)):
                out[i] = G
    return out  # type: ignore[return-value]


def grams64_on_sides(tensors: Sequence[Tensor], sides: Sequence[str]) -> list[Tensor]:
    """float64 Grams (G G^T for 'row', G^T G for 'col') of each tensor, products in float64
    (the Newton path's D D^T: the covariance scale (mean Gram - D D^T) cancels, and a
    float32 D D^T's rounding, about u sqrt(n) ||D||^2, is then a large part of C on steep
    spectra). Batched by (shape, side): one stack and one bmm per group; views of it."""
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, (g, s) in enumerate(zip(tensors, sides)):
        groups.setdefault((tuple(g.shape), g.device, s), []).append(i)
    for (_, _, s), idx in groups.items():
        X = torch.stack([tensors[i].detach() if tensors[i].requires_grad else tensors[i] for i in idx]).double()
        res = torch.bmm(X.mT, X) if s == "col" else torch.bmm(X, X.mT)
        for i, r in zip(idx, res.unbind(0)):
            out[i] = r
    return out  # type: ignore[return-value]
