"""MicroBatchSampler: fixed micro-batches through a real DataLoader (workers, prefetch),
disjoint ranks, nothing lost or repeated across batch-size changes, resume and a new
world size."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gns_kernels.data import MicroBatchSampler

N = 23  # odd dataset size: rounds straddle epoch ends


def _dataset(n=N):
    return TensorDataset(torch.arange(n))  # item i is the int index i


def _stream(n, seed, epochs):
    """The documented order, rebuilt here: epoch e is default_rng([seed, e]).permutation(n)."""
    out, prev = [], None
    for e in range(epochs):
        rng = np.random.default_rng([seed, e])
        plain = rng.permutation(n)
        order = [int(i) for i in plain]
        W = n // 3
        if prev is not None and W > 0:  # the boundary window: no index of prev's last W first
            tail = {int(i) for i in prev[-W:]}
            clash = [i for i in range(W) if order[i] in tail]
            if clash:
                middle = [j for j in range(W, n - W) if order[j] not in tail]
                for i, j in zip(clash, rng.choice(middle, size=len(clash), replace=False)):
                    order[i], order[j] = order[j], order[i]
        out.append(np.array(order))
        prev = plain
    return np.concatenate(out)


class _Consumer:
    """A training loop's view: takes A micro-batches per step from a DataLoader, starts a
    new pass when one ends, and records them as consumed."""

    def __init__(self, sampler, workers=2):
        self.sampler = sampler
        self.loader = DataLoader(_dataset(sampler.num_samples), batch_sampler=sampler,
                                 num_workers=workers, prefetch_factor=2 if workers else None)
        self.it = None

    def take(self, A):
        out = []
        for _ in range(A):
            if self.it is None:
                self.it = iter(self.loader)
            try:
                (x,) = next(self.it)
            except StopIteration:
                self.it = iter(self.loader)
                (x,) = next(self.it)
            assert x.shape == (self.sampler.micro_batch_size,)
            out.append(x.tolist())
            self.sampler.advance(1)
        return out


def _run(samplers, accums, workers=2):
    """Per step, the micro-batches of every rank: steps[i][rank] = list of A lists."""
    cons = [_Consumer(s, workers) for s in samplers]
    return [[c.take(A) for c in cons] for A in accums]


def _flat(step):
    """Global order of one step: round t = rank 0's micro-batch t, rank 1's, ..."""
    A = len(step[0])
    return [i for t in range(A) for rank in step for i in rank[t]]


def test_two_ranks_dataloader_workers_follow_the_planned_stream_across_batch_changes():
    R, b, seed = 2, 3, 7
    samplers = [MicroBatchSampler(N, b, num_replicas=R, rank=r, seed=seed) for r in range(R)]
    accums = [1, 3, 2, 5, 1, 4, 2]  # A changes every step; prefetching workers run ahead
    steps = _run(samplers, accums, workers=2)
    expected = _stream(N, seed, 6)
    pos = 0
    for A, step in zip(accums, steps):
        assert [len(m) for m in step] == [A, A]
        assert all(len(mb) == b for rank in step for mb in rank)
        got = _flat(step)
        assert got == expected[pos:pos + R * A * b].tolist()  # exactly the planned indices
        # disjoint across ranks within each round (and so within the step) while an epoch lasts
        pos += R * A * b
    total = sum(accums) * R * b
    assert samplers[0].position == samplers[1].position == total
    # nothing lost or repeated: every full epoch of consumed positions holds each index once
    consumed = [i for st in steps for i in _flat(st)]
    for e in range(total // N):
        assert sorted(consumed[e * N:(e + 1) * N]) == list(range(N))


def test_ranks_are_disjoint_within_an_epoch():
    R, b = 3, 2
    samplers = [MicroBatchSampler(40, b, num_replicas=R, rank=r, seed=1) for r in range(R)]
    per_rank = [[i for mb in list(s)[:6] for i in mb] for s in samplers]  # 6 rounds = 36 < 40
    sets = [set(p) for p in per_rank]
    assert all(len(s) == 12 for s in sets)
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])


def test_len_and_passes_cover_each_epoch_once():
    R, b = 2, 4
    s = MicroBatchSampler(N, b, num_replicas=R, rank=0, shuffle=False)
    # epoch 0: rounds start at 0, 8, 16 (< 23): 3 items; the third takes 1 index of epoch 1
    assert len(s) == 3
    s.set_epoch(0)
    first = list(s)
    assert first == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]
    # epoch 1 starts at stream position 24 (= epoch 1's offset 1): rounds at 24, 32, 40
    assert s.epoch == 1 and len(s) == 3
    s.set_epoch(1)
    with pytest.raises(ValueError, match="set_epoch\\(3\\).*epoch 1"):
        s.set_epoch(3)
    second = list(s)
    assert second == [[1, 2, 3, 4], [9, 10, 11, 12], [17, 18, 19, 20]]


def test_resume_mid_prefetch_continues_exactly():
    R, b, seed = 2, 2, 3
    accums = [2, 1, 3, 2, 2, 4, 1]
    ref = _run([MicroBatchSampler(N, b, R, r, seed=seed) for r in range(R)], accums)
    # interrupted after 3 steps: the workers have prefetched beyond what was consumed
    first = [MicroBatchSampler(N, b, R, r, seed=seed) for r in range(R)]
    part1 = _run(first, accums[:3])
    saved = [s.state_dict() for s in first]
    assert saved[0] == saved[1]  # the consumed position is global
    assert saved[0]["position"] == sum(accums[:3]) * R * b
    resumed = [MicroBatchSampler(N, b, R, r, seed=seed) for r in range(R)]
    for s, sd in zip(resumed, saved):
        s.load_state_dict(sd)
    part2 = _run(resumed, accums[3:])
    assert part1 + part2 == ref


def test_resume_on_another_world_size_and_micro_batch():
    """The position is in samples: 2 ranks x b=3 -> 3 ranks x b=2 continue the same stream."""
    seed = 5
    first = [MicroBatchSampler(N, 3, 2, r, seed=seed) for r in range(2)]
    part1 = _run(first, [1, 2], workers=0)  # 18 positions
    sd = first[0].state_dict()
    second = [MicroBatchSampler(N, 2, 3, r, seed=seed) for r in range(3)]
    for s in second:
        s.load_state_dict(sd)
    part2 = _run(second, [2, 3], workers=0)  # 30 positions
    consumed = [i for st in part1 + part2 for i in _flat(st)]
    assert consumed == _stream(N, seed, 3)[:48].tolist()
    assert sorted(consumed[:N]) == list(range(N))
    assert sorted(consumed[N:2 * N]) == list(range(N))


@pytest.mark.parametrize("key, value", [("seed", 1), ("num_samples", N + 1), ("shuffle", False)])
def test_load_state_dict_refuses_another_order(key, value):
    s = MicroBatchSampler(N, 2, 1, 0, seed=0)
    s.advance(3)
    sd = s.state_dict()
    kw = dict(num_samples=N, micro_batch_size=2, num_replicas=1, rank=0, seed=0, shuffle=True)
    kw[key] = value
    other = MicroBatchSampler(**kw)
    with pytest.raises(ValueError, match=key):
        other.load_state_dict(sd)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        MicroBatchSampler(10, 2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        MicroBatchSampler(10, 0)
    with pytest.raises(TypeError, match="num_samples"):
        MicroBatchSampler(10.0, 2)
    with pytest.raises(ValueError, match="= 12 samples, more than the dataset's 10"):
        MicroBatchSampler(10, 3, num_replicas=4, rank=0)


def test_is_a_torch_sampler_and_counts_every_index_once_per_epoch():
    s = MicroBatchSampler(31, 5, num_replicas=1, rank=0, seed=2)
    assert isinstance(s, torch.utils.data.Sampler)
    seen = collections.Counter()
    for _ in range(5):  # five passes: 31 * 5 = 155 = 31 rounds of 5
        for mb in s:
            seen.update(mb)
    assert set(seen.values()) == {5} and len(seen) == 31


@pytest.mark.parametrize("N, R, b", [(97, 2, 4), (50, 1, 5), (64, 4, 2), (31, 3, 1)])
def test_no_example_twice_in_a_step_across_epoch_boundaries(N, R, b):
    """A step that crossed an epoch held 3-9 duplicates. With the boundary window every
    step of B <= N // 3 holds distinct examples, on all ranks together, while each epoch
    stays a full permutation and nothing is lost or repeated in the stream."""
    samplers = [MicroBatchSampler(N, b, R, r, seed=11) for r in range(R)]
    W = samplers[0].boundary_window
    assert W == N // 3
    rng = np.random.default_rng(0)
    pos, epochs_seen, crossings = 0, 40, 0
    while pos < epochs_seen * N:
        A = int(rng.integers(1, max(2, W // (R * b)) + 1))        # B = R A b <= W
        B = R * A * b
        if B > W:
            A, B = 1, R * b
        step = []
        for t in range(A):
            for s in samplers:
                step += s.micro_batch_at(pos + t * R * b)
        if pos // N != (pos + B - 1) // N:
            crossings += 1
        assert len(set(step)) == len(step), (pos, B)
        pos += B
    assert crossings >= 3
    s = samplers[0]
    for e in range(epochs_seen):
        assert sorted(s.indices(e * N, N)) == list(range(N))


def test_version_1_state_keeps_the_plain_permutations():
    s = MicroBatchSampler(40, 4, seed=2)
    old = {**s.state_dict(), "version": 1, "position": 48}
    s.load_state_dict(old)
    assert s.boundary_window == 0
    assert s.indices(40, 40) == np.random.default_rng([2, 1]).permutation(40).tolist()
    assert s.state_dict()["version"] == 1
    s2 = MicroBatchSampler(40, 4, seed=2)
    s2.load_state_dict({**old, "version": 2})
    assert s2.boundary_window == 13 and s2.indices(40, 40) != s.indices(40, 40)
