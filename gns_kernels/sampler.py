"""Adaptive batch sampler: a global batch B split into R ranks x A micro-batches of b.

Equal split: every rank and every micro-batch averages the same number of
examples, B = R * A * b, so the rank (or rank x micro-batch) gradients are identically
distributed samples for the GNS estimators.

`plan_split(B, R, max_local_batch, min_accum_steps)` picks the SMALLEST number of
accumulation steps A such that R*A divides B, the micro-batch b = B/(R*A) fits under
`max_local_batch` (the memory cap), and A >= min_accum_steps. Always possible when R
divides B and B/R >= min_accum_steps (b = 1 in the worst case); choose the controller's
`multiple_of` as a multiple of R * (a power of two) so b stays large.

`AdaptiveBatchSampler` serves sample indices in [0, num_samples) in a seeded random order
per epoch (numpy Generator seeded with [seed, epoch]; the same on every rank). The global
stream of indices is consumed B at a time (the current batch size); step i's B indices are
cut into R contiguous rank slices of B/R, each cut into A micro-batches of b. A batch that
straddles the end of an epoch takes its tail from the next epoch's order. Changing B
between steps (`set_batch_size`) therefore never drops or repeats a sample within an
epoch, and `state_dict()` / `load_state_dict()` resume at exactly the same position.
"""
from __future__ import annotations

import math

import numpy as np

from ._validation import check_int as _check_int

__all__ = ["plan_split", "AdaptiveBatchSampler"]

_STATE_KEYS = ("num_samples", "num_replicas", "seed", "shuffle", "epoch", "position",
               "samples_seen", "steps", "batch_size", "max_local_batch", "min_accum_steps")


def plan_split(batch_size: int, num_replicas: int = 1, max_local_batch: int | None = None,
               min_accum_steps: int = 1) -> tuple[int, int]:
    """(A, b): accumulation steps and micro-batch size with B = R * A * b (see module doc).

    Raises ValueError naming the argument when B does not split equally across the ranks
    or cannot give at least `min_accum_steps` micro-batches per rank.
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    num_replicas = _check_int("num_replicas (ranks)", num_replicas, 1)
    min_accum_steps = _check_int("min_accum_steps (micro-batches)", min_accum_steps, 1)
    if max_local_batch is not None:
        max_local_batch = _check_int("max_local_batch", max_local_batch, 1)
    if batch_size % num_replicas:
        raise ValueError(f"batch_size {batch_size} does not split equally across "
                         f"{num_replicas} ranks (must be a multiple of {num_replicas})")
    local = batch_size // num_replicas
    if local < min_accum_steps:
        raise ValueError(f"batch_size {batch_size} gives {local} samples per rank, fewer than "
                         f"the {min_accum_steps} micro-batches per rank asked for")
    lower = min_accum_steps
    if max_local_batch is not None:
        lower = max(lower, math.ceil(local / max_local_batch))
    for accum in range(lower, local + 1):
        if local % accum == 0:
            return accum, local // accum
    raise AssertionError("unreachable: accum = local always divides local")


class AdaptiveBatchSampler:
    """Serves this rank's micro-batches of sample indices for each optimizer step.

    Args:
        num_samples: dataset size N (indices 0..N-1).
        batch_size: initial GLOBAL batch size B (all ranks, all micro-batches).
        num_replicas, rank: data-parallel world size R and this rank.
        max_local_batch: cap on the micro-batch size b (None: no cap, A = min_accum_steps).
        min_accum_steps: at least this many micro-batches per rank per step.
        shuffle: random order per epoch (False: 0..N-1 every epoch).
        seed: seed of the order (must be equal on all ranks).

    Use: ``for micro_batches in sampler`` (infinite) or ``sampler.next_step()``; each is a
    list of A lists of b indices. ``sampler.set_batch_size(B)`` before a step changes B.
    """

    def __init__(self, num_samples: int, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 max_local_batch: int | None = None, min_accum_steps: int = 1,
                 shuffle: bool = True, seed: int = 0):
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.num_replicas = _check_int("num_replicas (ranks)", num_replicas, 1)
        rank = _check_int("rank", rank, 0)
        if rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas}), got {rank}")
        self.rank = rank
        self.max_local_batch = max_local_batch
        self.min_accum_steps = min_accum_steps
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, 0)
        self.epoch = 0
        self.position = 0          # samples of the current epoch already served (globally)
        self.samples_seen = 0      # total samples served (globally), all epochs
        self.steps = 0             # optimizer steps served
        self._order_epoch = -1
        self._order = None
        self.set_batch_size(batch_size)

    # -- batch size -----------------------------------------------------------------------
    def set_batch_size(self, batch_size: int) -> None:
        """Use global batch size `batch_size` from the next step on (validated first)."""
        self.accum_steps, self.micro_batch_size = plan_split(
            batch_size, self.num_replicas, self.max_local_batch, self.min_accum_steps)
        self.batch_size = int(batch_size)

    @property
    def local_batch_size(self) -> int:
        """Samples per rank per step, A * b = B / R."""
        return self.batch_size // self.num_replicas

    # -- order ----------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._order = rng.permutation(self.num_samples)
            else:
                self._order = np.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def _take_global(self, count: int) -> np.ndarray:
        out = []
        while count > 0:
            order = self._epoch_order(self.epoch)
            take = min(count, self.num_samples - self.position)
            out.append(order[self.position:self.position + take])
            self.position += take
            count -= take
            if self.position == self.num_samples:
                self.epoch += 1
                self.position = 0
        return np.concatenate(out) if len(out) > 1 else out[0]

    def next_step(self) -> list[list[int]]:
        """This rank's A micro-batches (lists of b indices) of the next optimizer step."""
        glob = self._take_global(self.batch_size)
        self.samples_seen += self.batch_size
        self.steps += 1
        local = glob[self.rank * self.local_batch_size:(self.rank + 1) * self.local_batch_size]
        b = self.micro_batch_size
        return [local[i * b:(i + 1) * b].tolist() for i in range(self.accum_steps)]

    def __iter__(self):
        while True:
            yield self.next_step()

    # -- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return dict(num_samples=self.num_samples, num_replicas=self.num_replicas,
                    seed=self.seed, shuffle=self.shuffle, epoch=self.epoch,
                    position=self.position, samples_seen=self.samples_seen, steps=self.steps,
                    batch_size=self.batch_size, max_local_batch=self.max_local_batch,
                    min_accum_steps=self.min_accum_steps)

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position. The dataset size, seed and shuffle must match
        (another order would silently repeat or skip samples); the rank count may differ
        as long as the saved batch size splits across the new ranks.

        Every entry is checked before anything is changed: a state that is not a dict,
        lacks a key or holds a value of the wrong type or range raises (naming the key) and
        leaves this sampler as it was.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state: expected a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"state: missing keys {missing}")
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler has "
                                 f"{getattr(self, key)!r}; cannot resume at the same position")
        max_local = state["max_local_batch"]
        if max_local is not None:
            max_local = _check_int("state['max_local_batch']", max_local, 1)
        min_accum = _check_int("state['min_accum_steps']", state["min_accum_steps"], 1)
        batch = _check_int("state['batch_size']", state["batch_size"], 1)
        accum, micro = plan_split(batch, self.num_replicas, max_local, min_accum)
        epoch = _check_int("state['epoch']", state["epoch"], 0)
        position = _check_int("state['position']", state["position"], 0)
        if position >= self.num_samples:
            raise ValueError(f"state['position']: expected an int in [0, {self.num_samples}), got {position}")
        samples_seen = _check_int("state['samples_seen']", state["samples_seen"], 0)
        steps = _check_int("state['steps']", state["steps"], 0)
        self.max_local_batch, self.min_accum_steps = max_local, min_accum
        self.accum_steps, self.micro_batch_size, self.batch_size = accum, micro, batch
        self.epoch, self.position = epoch, position
        self.samples_seen, self.steps = samples_seen, steps
