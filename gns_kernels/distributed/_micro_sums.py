"""MicroSums: the per-parameter sums of one rank's micro-batches on a measurement step.

With grad_a the accumulated ``.grad`` after micro-batch a and d_a = grad_a - grad_{a-1}
(MicroBatchGNS's module docstring), per measured parameter (by id):

- ``prev``: grad_{a-1}, a float32 copy of the gradient after the previous micro-batch;
- ``sq``: sum_a d_a^2 (l1 / l2; fused op ``accumulate_sq``, which also updates ``prev``);
- ``gsum``: sum_a gram(d_a) (nuclear; None until the first micro-batch).

``SyncMicro`` hands the DDP hook the last micro-batch of a rank, whose gradient arrives in
the synchronized backward's bucket.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import ops
from .. import spectral

Tensor = torch.Tensor

__all__ = ["MicroSums", "SyncMicro"]


class MicroSums:
    """``prev``, ``sq`` and ``gsum`` of the measured parameters (see the module docstring);
    ``nuclear``: Grams (nuclear) instead of squares (l1 / l2)."""

    def __init__(self, nuclear: bool):
        self.nuclear = nuclear
        self.prev: dict[int, Tensor] = {}
        self.sq: dict[int, Tensor] = {}
        self.gsum: dict[int, Tensor] = {}

    def buffers(self, p: Tensor) -> None:
        """Make ``p``'s zero buffers on its first micro-batch."""
        if id(p) not in self.prev:
            self.prev[id(p)] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if self.nuclear:
                self.gsum[id(p)] = None
            else:
                self.sq[id(p)] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def add(self, live: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Add one micro-batch: ``live`` pairs (parameter, its float32 contiguous .grad)."""
        for p, _ in live:
            self.buffers(p)
        if self.nuclear:
            for p, g in live:  # one temporary difference at a time
                (G,) = spectral.gram([g - self.prev[id(p)]])
                acc = self.gsum[id(p)]
                self.gsum[id(p)] = G if acc is None else acc.add_(G)
                self.prev[id(p)].copy_(g)
        elif live:
            ops.accumulate_sq_multi([g for _, g in live], [self.prev[id(p)] for p, _ in live],
                                    [self.sq[id(p)] for p, _ in live])

    def poison(self) -> None:
        """Fill the sums with NaN: the measurement they make is invalid."""
        for t in list(self.sq.values()) + [g for g in self.gsum.values() if g is not None]:
            t.fill_(float("nan"))

    def clear(self) -> None:
        self.prev.clear()
        self.sq.clear()
        self.gsum.clear()


class SyncMicro:
    """The last micro-batch of a rank, taken from the bucket inside the DDP hook.

    ``sums``: the rank's MicroSums; ``count``: A, its micro-batches in this step.
    ``invalid``: a micro_step of this step raised on this rank, so its statistics are
    lost: the rank sends NaN statistics (its gradients are sent unchanged), which makes
    the measurement invalid on every rank through the all-reduce, with the same payload
    and sample count as the other ranks.
    """

    def __init__(self, sums: MicroSums, A: int, invalid: bool = False):
        self.sums = sums
        self.count = A
        self.invalid = invalid

    def accumulate_last(self, p: Tensor, flat_grad: Tensor) -> None:
        s = self.sums
        s.buffers(p)
        ops.accumulate_sq(flat_grad, s.prev[id(p)].view(-1), s.sq[id(p)].view(-1))
        if self.invalid:
            s.sq[id(p)].fill_(float("nan"))

    @property
    def sq(self):
        return self.sums.sq

    def accumulate_last_gram(self, p: Tensor, grad: Tensor) -> Tensor:
        s = self.sums
        s.buffers(p)
        (G,) = spectral.gram([grad.float() - s.prev[id(p)]])
        acc = s.gsum[id(p)]
        acc = G if acc is None else acc.add_(G)
        s.gsum[id(p)] = acc
        if self.invalid:
            acc.fill_(float("nan"))
        return acc.mul_(self.count)
