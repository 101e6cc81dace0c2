"""This rank's deviation sums, the per-sample sums of the 'gauss-sums' degrees of freedom
(gns_kernels.stats.fourth_moments.dof_from_sample_sums).

Per matrix, q = ||d d^T||_F^2 and a = ||d||_F^4 of this rank's deviation d = G^j - G (m x n)
from the mean gradient (known after the bucket's all-reduce), from the Gram d d^T on the
smaller side; the hooks' share all-reduce sums them over the ranks (Q = sum_j q_j,
A = sum_j a_j: gns_kernels.distributed._share). float32 Grams, float64 sums, no host
synchronization; a matrix's values do not depend on the other matrices it is computed with.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .grams import aligned_in_stack, gram, smaller_side
from .precision import bmm

Tensor = torch.Tensor

__all__ = ["deviation_sums", "deviation_sums_parts"]


def deviation_sums(deviations: Sequence[Tensor], device) -> Tensor:
    """float64 Tensor[2, L]: per matrix [q, a] = [||d d^T||_F^2, ||d||_F^4] of this rank's
    deviation d = G^j - G (m x n) from the mean gradient, from the Gram d d^T on the smaller
    side (float32 matmul, sums in float64). No host synchronization. Each run of
    consecutive matrices of one shape is stacked into one float32 batch and multiplied by
    one bmm when every matrix of the stack starts on a 64-byte boundary (its size a
    multiple of 64 bytes: the CPU GEMM's bits depend on the operand's alignment, so a
    matrix's values must not depend on its place in the stack); other shapes go through
    spectral.gram per matrix (an aligned copy each). ``deviation_sums_parts`` takes the
    runs already formed."""
    if not deviations:
        return torch.zeros((2, 0), dtype=torch.float64, device=device)
    runs: list = []
    for i, d in enumerate(deviations):
        if runs and tuple(deviations[runs[-1][0]].shape) == tuple(d.shape):
            runs[-1].append(i)
        else:
            runs.append([i])
    stacks = []
    for idx in runs:
        m, n = deviations[idx[0]].shape
        stacks.append(torch.stack([deviations[i] for i in idx]) if aligned_in_stack(m * n)
                      else [deviations[i] for i in idx])
    qs, as_ = deviation_sums_parts(stacks)
    out = torch.stack([qs[0], as_[0]]) if len(qs) == 1 else torch.stack([torch.cat(qs), torch.cat(as_)])
    return out if out.device == torch.device(device) else out.to(device)


def deviation_sums_parts(runs: Sequence) -> tuple[list, list]:
    """``deviation_sums`` of runs already formed, as two lists of float64 vectors (q, a)
    whose concatenations are its rows (kept apart so a measurement joins them once: the
    hooks' ``SolveShare.add_part``). Each run: a 64-byte aligned contiguous Tensor (c, m, n)
    of c consecutive same-shape deviations (a fresh stack, or a view of a fresh tensor at a
    64-byte offset), or a list of 2-D deviations (a shape whose matrices are not a
    multiple of 64 bytes may come either way: those go through spectral.gram per matrix);
    the same values and bits as ``deviation_sums`` of the runs' matrices in order.
    Each run's float32 Grams come from one bmm (a stacked run) or per matrix; the Grams of
    one side k are joined and their sums taken together (one set of reductions per k, not
    per run: the values do not depend on the grouping, the reductions being per matrix)."""
    grams, ks = [], []
    for run in runs:
        if isinstance(run, Tensor) and aligned_in_stack(run.shape[-2] * run.shape[-1]):
            m, n = run.shape[-2:]
            X = run if run.dtype == torch.float32 else run.float()
            grams.append(bmm(X, X.transpose(-2, -1), "ieee") if m <= n else bmm(X.transpose(-2, -1), X, "ieee"))
            ks.append(min(m, n))
        else:
            for d in (run.unbind(0) if isinstance(run, Tensor) else run):
                (G,) = gram([d.float()], side=smaller_side(tuple(d.shape)))
                grams.append(G.unsqueeze(0))
                ks.append(G.shape[-1])
    if not grams:
        return [], []
    by_k: dict = {}
    for i, k in enumerate(ks):
        by_k.setdefault(k, []).append(i)
    sums: list = [None] * len(grams)
    for k, idx in by_k.items():
        G = (grams[idx[0]] if len(idx) == 1 else torch.cat([grams[i] for i in idx])).double()
        q = (G * G).sum((-2, -1))
        t = G.diagonal(dim1=-2, dim2=-1).sum(-1)
        a = t * t
        if len(by_k) == 1:
            return [q], [a]
        j = 0
        for i in idx:
            c = grams[i].shape[0]
            sums[i] = (q[j:j + c], a[j:j + c])
            j += c
    return [q for q, _ in sums], [a for _, a in sums]
