"""A ``torch.utils.data`` batch sampler whose items are fixed-size micro-batches.

The adaptive batch B = R x A x b changes the number A of micro-batches each rank
accumulates per optimizer step; the micro-batch size b never changes. So the loader never
has to change its batch size: every item it yields is ONE micro-batch of b samples, and
the training loop (``gk.AdaptiveBatching.micro_batches``) takes the next A of them for
each step. Prefetching workers therefore never hold a batch of the wrong size: a
prefetched micro-batch is simply the first micro-batch of the next step.

The stream (identical arithmetic on every rank):

- Positions p = 0, 1, 2, ... of an endless stream of sample indices; position p holds
  ``order(e)[p - e N]`` with e = p // N the epoch and ``order(e)`` a permutation of
  0..N-1 seeded by (seed, e) (numpy ``default_rng([seed, e])``; 0..N-1 when
  ``shuffle=False``). Every epoch is one full pass: nothing is dropped at its end.
- Round t covers the R x b positions starting at ``start + t R b``; rank r's micro-batch
  of round t is the slice [r b, (r + 1) b) of it, so the ranks take disjoint positions
  (disjoint examples too, within an epoch and across its boundary, see below).
- A step of A micro-batches per rank consumes A rounds = R A b = B positions. When A
  changes between steps, the stream does not: the next step just takes a different number
  of rounds. Nothing is lost or repeated across batch-size changes.
- A round (or a step of A rounds) that starts before the end of epoch e and extends past
  it takes its tail from epoch e + 1's order. So that such a window never holds one index
  twice, epoch e + 1's first W positions hold no index of epoch e's last W positions,
  W = N // 3 (the boundary window): the epoch's random permutation has each of its first W
  entries that is among epoch e's last W swapped with a random entry of its middle part
  [W, N - W) that is not (the middle always has enough when W <= N / 3; no epoch's last
  W positions are ever moved, so each epoch depends only on its own and the previous
  epoch's permutation). A step of B <= N // 3 samples therefore never repeats an example,
  also across an epoch boundary; larger steps can, at a boundary. Every epoch is still a
  full permutation. (State dicts of version 1, from before this rule, keep the plain
  permutations, so that a resumed run continues its own order.) Each call of ``iter(sampler)``
  (one DataLoader pass) yields the rounds that START in one epoch, so ``len(sampler)`` is
  the number of micro-batches this rank gets in that pass, and ``set_epoch(e)`` checks
  that the pass about to start is epoch e.

Consumed vs yielded: a DataLoader with workers draws indices from the sampler ahead of
the training loop (``prefetch_factor x num_workers`` micro-batches). The resume position
is therefore not what the sampler has yielded but what the loop has *consumed*:
``advance(n)`` records n consumed micro-batches (``gk.AdaptiveBatching`` calls it for
each micro-batch it hands out), ``state_dict()`` saves the consumed position in samples,
and ``load_state_dict()`` makes the next ``iter()`` start exactly there.

Resume on another world size or micro-batch size: the saved position is a stream
position in samples, the same on every rank; rounds restart there with the new R x b, so
the new ranks continue the same stream, disjoint, with nothing lost or repeated. The
dataset size, seed and shuffle flag must match (another order would repeat or skip
samples): ``load_state_dict`` raises ValueError otherwise.

Iterable datasets cannot be sharded by index: use this sampler with map-style datasets
(``__getitem__(int)`` and ``__len__``). With an ``IterableDataset``, make each rank's
dataset yield its own disjoint stream of fixed-size micro-batches (b samples each, e.g.
``batch_size=b`` in the DataLoader) and pass that loader to ``micro_batches``: the
coordinator only counts items, so it works the same; resuming the stream position is
then the dataset's job.
"""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch.utils.data

from ._validation import check_int as _check_int

__all__ = ["MicroBatchSampler"]

_STATE_VERSION = 2   # 2: the epoch-boundary window (1: plain permutations, still loaded)


def _avoid_tail(order: np.ndarray, tail: np.ndarray, W: int, rng: np.random.Generator) -> np.ndarray:
    """``order`` with each of its first W entries that is in ``tail`` swapped with a random
    entry of ``order[W:N-W]`` that is not (N >= 3 W guarantees enough of them). The last W
    entries are never moved (the next epoch's rule reads them from the plain permutation)."""
    N = len(order)
    in_tail = np.zeros(N, dtype=bool)
    in_tail[tail] = True
    clash = np.flatnonzero(in_tail[order[:W]])
    if clash.size == 0:
        return order
    middle = W + np.flatnonzero(~in_tail[order[W:N - W]])
    partners = rng.choice(middle, size=clash.size, replace=False)
    order = order.copy()
    order[clash], order[partners] = order[partners], order[clash].copy()
    return order


class MicroBatchSampler(torch.utils.data.Sampler):
    """This rank's micro-batches of ``micro_batch_size`` indices (see the module docstring).

    Args:
        num_samples: N, the dataset size (indices 0..N-1).
        micro_batch_size: b, indices per item (fixed for the whole run).
        num_replicas, rank: R data-parallel ranks and this rank (default: from
            ``torch.distributed`` when initialised, else 1 and 0).
        shuffle: a new random order every epoch (False: 0..N-1 every epoch).
        seed: seed of the order; must be the same on every rank.

    Use as ``DataLoader(dataset, batch_sampler=sampler, num_workers=...)``. Each item is a
    list of b ints. ``position`` is the consumed stream position (samples, global).
    """

    def __init__(self, num_samples: int, micro_batch_size: int, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0):
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.micro_batch_size = _check_int("micro_batch_size", micro_batch_size, 1)
        if num_replicas is None or rank is None:
            import torch.distributed as dist
            ready = dist.is_available() and dist.is_initialized()
            if num_replicas is None:
                num_replicas = dist.get_world_size() if ready else 1
            if rank is None:
                rank = dist.get_rank() if ready else 0
        self.num_replicas = _check_int("num_replicas", num_replicas, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank: expected an int in [0, {self.num_replicas}), got {self.rank}")
        if self.num_samples < self.round_size:
            raise ValueError(
                f"num_samples: a round (one micro-batch on every rank) takes num_replicas x "
                f"micro_batch_size = {self.round_size} samples, more than the dataset's "
                f"{self.num_samples}; use a smaller micro_batch_size")
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, 0)
        self._position = 0       # consumed stream position (samples, global)
        self._next_start = 0     # stream position where the next iter() begins
        self._orders: dict[int, np.ndarray] = {}
        self._boundary_window = True   # False only for a stream resumed from a version-1 state

    # ------------------------------------------------------------------ geometry
    @property
    def round_size(self) -> int:
        """R x b: stream positions per round (one micro-batch on every rank)."""
        return self.num_replicas * self.micro_batch_size

    @property
    def position(self) -> int:
        """Consumed stream position in samples (all ranks together)."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` pass serves (the epoch its first round starts in)."""
        return self._next_start // self.num_samples

    def _pass_rounds(self, start: int) -> int:
        """Rounds starting at positions start, start + Rb, ... that are < end of start's epoch."""
        end = (start // self.num_samples + 1) * self.num_samples
        return -(-(end - start) // self.round_size)

    def __len__(self) -> int:
        """Micro-batches this rank gets from the next ``iter()`` pass (rounds starting in
        the current epoch, from the current position)."""
        return self._pass_rounds(self._next_start)

    def set_epoch(self, epoch: int) -> None:
        """Check that the next pass serves ``epoch``. The stream is continuous (an epoch's
        last round may take its tail from the next epoch), so the epoch follows from the
        position: a different ``epoch`` would skip or repeat samples and raises ValueError.
        Provided so that loops written for ``DistributedSampler`` keep working."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            raise ValueError(
                f"set_epoch({epoch}): the next pass of this stream is epoch {self.epoch} "
                f"(position {self._next_start} of {self.num_samples} samples per epoch); skipping "
                "or repeating epochs would skip or repeat samples (call set_epoch(sampler.epoch), "
                "or load_state_dict to resume)")

    # ------------------------------------------------------------------ the stream
    @property
    def boundary_window(self) -> int:
        """W: epoch e + 1's first W positions hold none of epoch e's last W indices (0 when
        shuffling is off, or for a stream resumed from a version-1 state)."""
        if not (self.shuffle and self._boundary_window):
            return 0
        return self.num_samples // 3

    def _permutation(self, epoch: int) -> tuple[np.ndarray, np.random.Generator]:
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.num_samples), rng

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            if not self.shuffle:
                order = np.arange(self.num_samples)
            else:
                order, rng = self._permutation(epoch)
                W = self.boundary_window
                if epoch > 0 and W > 0:
                    order = _avoid_tail(order, self._permutation(epoch - 1)[0][-W:], W, rng)
            if len(self._orders) >= 2:  # keep the current and the next epoch only
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def indices(self, start: int, count: int) -> list[int]:
        """Stream positions [start, start + count) as sample indices."""
        out: list[int] = []
        N = self.num_samples
        while count > 0:
            e, off = divmod(start, N)
            take = min(count, N - off)
            out.extend(self._order(e)[off:off + take].tolist())
            start += take
            count -= take
        return out

    def micro_batch_at(self, round_start: int) -> list[int]:
        """This rank's micro-batch of the round that starts at stream position ``round_start``."""
        b = self.micro_batch_size
        return self.indices(round_start + self.rank * b, b)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: nothing happens until the first item is drawn. DataLoader calls
        # iter() on its batch sampler twice when it starts a multi-worker pass and
        # discards the first iterator unused, so the pass must not begin at iter().
        start = self._next_start
        rounds = self._pass_rounds(start)
        # the pass after this one starts where this one's rounds end
        self._next_start = start + rounds * self.round_size
        for t in range(rounds):
            yield self.micro_batch_at(start + t * self.round_size)

    # ------------------------------------------------------------------ consumption
    def advance(self, micro_batches: int = 1) -> None:
        """Record that the training loop consumed ``micro_batches`` more items (rounds)."""
        n = _check_int("micro_batches", micro_batches, 0)
        self._position += n * self.round_size

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Plain Python values: the consumed position (samples) and the stream's identity."""
        return {"version": _STATE_VERSION if self._boundary_window else 1, "position": self._position,
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "num_replicas": self.num_replicas, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream at the saved consumed position (the next ``iter()`` starts
        there). R and b may differ from the saved run's; N, seed and shuffle may not."""
        if not isinstance(state, dict) or state.get("version") not in (1, _STATE_VERSION):
            raise ValueError(f"MicroBatchSampler.load_state_dict: expected a state_dict of version "
                             f"{_STATE_VERSION} (or 1), got {state!r:.200}")
        missing = [k for k in ("num_samples", "seed", "shuffle", "position") if k not in state]
        if missing:
            raise ValueError(f"MicroBatchSampler.load_state_dict: the state_dict misses {missing} "
                             "(not a MicroBatchSampler.state_dict())")
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"MicroBatchSampler.load_state_dict: the saved stream has {key}={state[key]!r}, "
                    f"this sampler has {getattr(self, key)!r}; another order would repeat or skip "
                    f"samples: construct the sampler with {key}={state[key]!r}")
        pos = _check_int("state['position']", state["position"], 0)
        self._position = pos
        self._next_start = pos
        window = state["version"] >= 2
        if window != self._boundary_window:
            self._boundary_window = window
            self._orders.clear()

    def __repr__(self) -> str:
        return (f"MicroBatchSampler(num_samples={self.num_samples}, micro_batch_size="
                f"{self.micro_batch_size}, num_replicas={self.num_replicas}, rank={self.rank}, "
                f"position={self._position})")
