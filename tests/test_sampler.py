"""AdaptiveBatchSampler / plan_split: equal split arithmetic, no sample lost or repeated
across batch-size changes, epochs and a resume, bad input."""
import numpy as np
import pytest

from gns_kernels.sampler import AdaptiveBatchSampler, plan_split


@pytest.mark.parametrize("B,R,cap,minA,expected", [
    (64, 2, None, 1, (1, 32)),
    (64, 2, 32, 1, (1, 32)),
    (64, 2, 16, 1, (2, 16)),
    (64, 2, 10, 1, (4, 8)),      # 32 per rank: A must divide 32 and 32/A <= 10 -> A = 4
    (48, 2, 16, 1, (2, 12)),
    (40, 2, 16, 1, (2, 10)),
    (56, 2, 16, 1, (2, 14)),     # 28 per rank: A=2 -> 14 fits
    (38, 2, 16, 1, (19, 1)),     # 19 per rank is prime: only b = 1 fits under the cap
    (12, 1, None, 2, (2, 6)),
    (12, 1, None, 5, (6, 2)),    # smallest divisor of 12 >= 5
    (7, 7, 1, 1, (1, 1)),
])
def test_plan_split(B, R, cap, minA, expected):
    A, b = plan_split(B, R, cap, minA)
    assert (A, b) == expected
    assert R * A * b == B


def test_plan_split_properties_exhaustive():
    # independent brute force: the smallest A with R*A | B, b <= cap, A >= minA
    for R in (1, 2, 3, 4):
        for cap in (None, 1, 3, 8):
            for minA in (1, 2):
                for B in range(R * minA, 80, R):
                    local = B // R
                    brute = min(A for A in range(1, local + 1)
                                if local % A == 0 and A >= minA and (cap is None or local // A <= cap))
                    assert plan_split(B, R, cap, minA) == (brute, local // brute)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=63, num_replicas=2), "does not split equally across 2 ranks"),
    (dict(batch_size=0, num_replicas=2), "batch_size"),
    (dict(batch_size=8, num_replicas=0), "ranks"),
    (dict(batch_size=8, num_replicas=2, max_local_batch=0), "max_local_batch"),
    (dict(batch_size=4, num_replicas=2, min_accum_steps=3), "micro-batches"),
])
def test_plan_split_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_split(**kwargs)


def test_plan_split_non_integer_is_a_type_error():
    with pytest.raises(TypeError, match="batch_size: expected an int"):
        plan_split(batch_size=8.0, num_replicas=2)


def _ranks(R, **kw):
    return [AdaptiveBatchSampler(num_replicas=R, rank=r, **kw) for r in range(R)]


def _step_all(samplers):
    """One optimizer step on every rank; returns the global list of indices and checks
    the equal split (every micro-batch the same size)."""
    out = []
    for s in samplers:
        micro = s.next_step()
        assert len(micro) == s.accum_steps
        assert all(len(m) == s.micro_batch_size for m in micro)
        out.extend(i for m in micro for i in m)
    assert len(out) == samplers[0].batch_size
    return out


def test_no_loss_no_repeat_across_size_changes_epochs_and_resume():
    N, R = 101, 2                                  # odd N: batches straddle epoch ends
    kw = dict(num_samples=N, batch_size=4, max_local_batch=3, seed=7)
    samplers = _ranks(R, **kw)
    served = []
    sizes = [4, 4, 6, 6, 10, 16, 16, 30, 30, 30]   # grows mid-epoch
    for i, B in enumerate(sizes):
        for s in samplers:
            s.set_batch_size(B)
        served += _step_all(samplers)
        if i == 5:                                 # checkpoint and resume into fresh objects
            states = [s.state_dict() for s in samplers]
            samplers = _ranks(R, num_samples=N, batch_size=2, seed=7)
            for s, st in zip(samplers, states):
                s.load_state_dict(st)
            assert samplers[0].batch_size == 16 and samplers[0].accum_steps == 4
    total = sum(sizes)
    assert total > N                               # crossed into the second epoch
    assert sorted(served[:N]) == list(range(N))    # epoch 0: each sample exactly once
    rest = served[N:]
    assert len(set(rest)) == len(rest)             # epoch 1 so far: no repeats
    assert samplers[0].epoch == 1 and samplers[0].position == total - N
    assert samplers[0].samples_seen == total and samplers[0].steps == len(sizes)


def test_resume_gives_identical_future():
    kw = dict(num_samples=50, batch_size=6, seed=3, max_local_batch=2)
    a = _ranks(3, **kw)
    for _ in range(4):
        _step_all(a)
    b = _ranks(3, num_samples=50, batch_size=3, seed=3)
    for s, t in zip(b, a):
        s.load_state_dict(t.state_dict())
    for B in (6, 9, 12):
        for s in a + b:
            s.set_batch_size(B)
        assert _step_all(a) == _step_all(b)


def test_order_depends_on_seed_and_epoch_and_ranks_disjoint():
    a = AdaptiveBatchSampler(1000, 100, seed=0).next_step()[0]
    b = AdaptiveBatchSampler(1000, 100, seed=1).next_step()[0]
    assert a != b
    s = AdaptiveBatchSampler(10, 10, seed=0)
    e0, e1 = s.next_step()[0], s.next_step()[0]
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    r0, r1 = _ranks(2, num_samples=1000, batch_size=100)
    assert not set(r0.next_step()[0]) & set(r1.next_step()[0])
    assert AdaptiveBatchSampler(5, 5, shuffle=False).next_step() == [[0, 1, 2, 3, 4]]


def test_sampler_bad_input():
    with pytest.raises(ValueError, match="rank must be in"):
        AdaptiveBatchSampler(10, 4, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_samples"):
        AdaptiveBatchSampler(0, 4)
    with pytest.raises(ValueError, match="does not split"):
        AdaptiveBatchSampler(10, 5, num_replicas=2)
    s = AdaptiveBatchSampler(10, 4, num_replicas=2)
    with pytest.raises(ValueError, match="does not split"):
        s.set_batch_size(7)
    assert s.batch_size == 4                       # a rejected size leaves the old one
    other = AdaptiveBatchSampler(11, 4, num_replicas=2)
    with pytest.raises(ValueError, match="num_samples"):
        s.load_state_dict(other.state_dict())
