"""The deterministic assignment of the nuclear sqrt-trace solves to ranks (no processes)."""
from __future__ import annotations

import itertools

import pytest
import torch

from gns_kernels import spectral
from gns_kernels.distributed._share import SolveShare, assign_solves, share_totals

SHAPES_160M = [(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]


def _loads(costs, owners, world):
    out = [0] * world
    for c, o in zip(costs, owners):
        out[o] += c
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_assignment_is_a_balanced_partition(world):
    ks = [min(s) for s in SHAPES_160M] * 12
    costs = [k ** 3 for k in ks] * 2  # noise and signal
    owners = assign_solves(costs, [0] * world)
    assert len(owners) == len(costs) and set(owners) <= set(range(world))
    loads = _loads(costs, owners, world)
    # greedy LPT: the most loaded rank exceeds the least by at most one solve
    assert max(loads) - min(loads) <= max(costs)
    if world > 1:  # 168 solves of the same cost: an even split
        assert max(loads) == -(-len(costs) // world) * 768 ** 3


def test_assignment_bound_mixed_costs():
    """LPT: max load <= 4/3 of the optimum; checked against brute force on small cases."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        costs = [int(c) for c in torch.randint(1, 50, (7,), generator=g) ** 3]
        owners = assign_solves(costs, [0, 0, 0])
        best = min(max(_loads(costs, o, 3)) for o in itertools.product(range(3), repeat=7))
        assert max(_loads(costs, owners, 3)) <= 4 / 3 * best


def test_assignment_is_deterministic_and_carries_loads():
    costs = [5, 9, 9, 1, 5]
    a, b = [0, 0], [0, 0]
    assert assign_solves(costs, a) == assign_solves(list(costs), b) and a == b
    # the loads carry over: a second part starts on the less loaded rank
    loads = [0, 0]
    assign_solves([10], loads)
    assert assign_solves([3], loads) == [1]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("shift", [False, True])
def test_shares_sum_to_the_full_solve(world, bias_correction, shift, gen):
    """The ranks' vectors, summed (what the share all-reduce does), give the per-matrix
    values of nuclear_stats on all matrices bitwise, and the same solver report."""
    shapes = [(13, 29), (40, 11), (17, 17), (9, 30)]
    R, B = 4, 16.0
    samples = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(R)]
    S = [0.3 * torch.randn(s, generator=gen) if shift else None for s in shapes]
    grams, grads = [], []
    for i, s in enumerate(shapes):
        side = spectral.smaller_side(s)
        xs = [x[i] - (S[i] if S[i] is not None else 0) for x in samples]
        grams.append(torch.stack(spectral.gram(xs, side=side)).mean(0))
        grads.append(torch.stack(xs).mean(0))
    scale = B / (R - 1)
    kw = dict(scale=scale, shifts=S if shift else None, bias_correction=bias_correction,
              num_samples=R, batch_size=B)
    hints = spectral.EigHints()
    noise, signal = spectral.nuclear_stats(grams, grads, eig_hints=hints, **kw)
    total = None
    ranks_hints = []
    for rank in range(world):
        h = spectral.EigHints()
        sh = SolveShare(world, rank, scale, bias_correction, R, B, hints=h)
        sh.add_grads(grams[:2], grads[:2], (S[:2] if shift else None))
        sh.add_grads(grams[2:], grads[2:], (S[2:] if shift else None))
        v = sh.vector()
        total = v if total is None else total + v
        ranks_hints.append((sh, h))
    L = len(shapes)
    assert torch.equal(total[:L], noise.double()) and torch.equal(total[L:2 * L], signal.double())
    t = share_totals(total)
    assert torch.equal(t, torch.stack([total[:L].sum(), total[L:2 * L].sum()]))
    hints.apply()
    for sh, h in ranks_hints:  # every rank records the summed report: the same hints
        sh.reduced = total
        sh.read()
        h.apply()
        assert h.state_dict() == hints.state_dict()


@pytest.mark.parametrize("world", [2, 3, 8])
def test_a_matrix_noise_and_signal_go_to_one_rank(world):
    """Both solves of a matrix read the Gram of its mean gradient: they are owned by the
    same rank, so that Gram is formed once over all ranks; the matrices still split evenly."""
    ks = [min(s) for s in SHAPES_160M] * 12
    shares = [SolveShare(world, r, 1.0, True, world, 8.0) for r in range(world)]
    owned = [sh._owners(ks) for sh in shares]   # one flag per matrix: both its solves
    # every matrix has exactly one owner, and the owners' matrix counts differ by at most 1
    counts = [sum(own) for own in owned]
    assert [sum(o[l] for o in owned) for l in range(len(ks))] == [1] * len(ks)
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_flag_sees_every_nan_and_inf(dtype):
    from gns_kernels.distributed._stats import all_finite as _finite

    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(37, 53, generator=g).to(dtype), torch.randn(11, generator=g).to(dtype)]
    assert bool(_finite(ts, "cpu")) and bool(_finite([], "cpu"))
    assert bool(_finite(ts + [torch.empty(0, 3, dtype=dtype)], "cpu"))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in ((0, 0), (36, 52), (17, 29)):
            t = ts[0].clone()
            t[pos] = bad
            assert not bool(_finite([ts[1], t], "cpu")), (bad, pos)
    # a tensor of all NaN but one finite value, and a huge finite one, are told apart
    t = torch.full((9,), float("nan"), dtype=dtype)
    t[4] = 1.0
    assert not bool(_finite([t], "cpu"))
    assert bool(_finite([torch.full((5,), torch.finfo(dtype).max, dtype=dtype)], "cpu"))
    # mixed dtypes in one call: a float64 value beyond float32's range is still finite
    big = torch.full((3,), 1e300, dtype=torch.float64)
    assert bool(_finite([ts[0], big], "cpu"))
    assert not bool(_finite([ts[0], big, torch.tensor([float("nan")], dtype=dtype)], "cpu"))


def test_gauss_sums_on_too_few_ranks_is_refused_at_construction(tmp_path):
    """nuclear_dof='gauss-sums' with fewer than 3 ranks raises when the state is built
    (a process group exists), not at the first measurement inside backward()."""
    import torch.distributed as dist

    from gns_kernels.distributed.state import GNSHookState

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="'gauss-sums' needs at least 3 ranks as samples, "
                                             "this process group has 1"):
            GNSHookState("nuclear", every=1, batch_size=8, nuclear_dof="gauss-sums")
        # the same with no correction, another geometry, or 'auto' is fine
        GNSHookState("nuclear", every=1, batch_size=8, nuclear_dof="gauss-sums",
                     bias_correction=False)
        GNSHookState("l1", every=1, batch_size=8, nuclear_dof="gauss-sums")
        GNSHookState("nuclear", every=1, batch_size=8, nuclear_dof="auto")
    finally:
        dist.destroy_process_group()


def test_totals_do_not_depend_on_the_matrix_order():
    """DDP presents the matrices of a resumed run's first step in another order and other
    buckets (its first-iteration layout) than the uninterrupted run: the totals read() gives
    (noise, signal, debiased signal, pooled noise) are exactly rounded sums of the
    per-matrix values, the same in any order and grouping. A plain float64 sum of the same
    columns depends on the order (the premise: the pooled values of a second measurement
    carry float64 mantissas)."""
    from gns_kernels.stats import NoisePool

    gen = torch.Generator().manual_seed(7)  # fixed data: the premise below holds for it
    L, R, B = 12, 2, 16.0
    shapes = [(5 + i, 9 + 2 * i) for i in range(L)]
    scale = B / (R - 1)
    mags = [10.0 ** (i % 5 - 2) for i in range(L)]  # spread magnitudes: rounding shows
    meas = []
    for _ in range(2):  # two measurements: the second one's pooled values are float64
        samples = [[m * torch.randn(s, generator=gen) for s, m in zip(shapes, mags)] for _ in range(R)]
        meas.append(([torch.stack(spectral.gram([x[i] for x in samples])).mean(0) for i in range(L)],
                     [torch.stack([x[i] for x in samples]).mean(0) for i in range(L)]))

    def read(order, split):
        pool, owners, hints = NoisePool(0.9), {}, spectral.EigHints()
        for grams, grads in meas:
            sh = SolveShare(1, 0, scale, True, R, B, hints=hints, signal="debiased", pool=pool,
                            owners=owners)
            for part in (order[:split], order[split:]):
                sh.add_grads([grams[i] for i in part], [grads[i] for i in part], None, keys=list(part))
            sh.launch(None, None)
            tot = sh.read()
            hints.apply()
        return tot, sh.pooled_total, share_totals(sh.reduced, sh.rows, R, scale)

    base, pooled, plain = read(list(range(L)), 5)
    g = torch.Generator().manual_seed(11)
    plain_differs = False
    for _ in range(8):
        order = torch.randperm(L, generator=g).tolist()
        split = int(torch.randint(0, L + 1, (1,), generator=g))
        tot, pl, pt = read(order, split)
        assert tot == base and pl == pooled, (order, split)
        plain_differs |= not torch.equal(pt, plain)
    assert plain_differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deviation_sums_of_mixed_sides_match_float64(dtype):
    """deviation_sums on runs of several shapes and Gram sides (stacked runs, odd shapes
    that go per matrix, sides 3, 5, 8 interleaved): per matrix q = ||d d^T||_F^2 and
    a = ||d||_F^4 in the input order, against float64."""
    from gns_kernels.spectral import deviation_sums

    g = torch.Generator().manual_seed(5)
    shapes = [(8, 16), (8, 16), (5, 7), (16, 8), (3, 11), (3, 11), (8, 16), (32, 8), (5, 7)]
    ds = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    out = deviation_sums(ds, "cpu")
    assert out.shape == (2, len(shapes)) and out.dtype == torch.float64
    for i, d in enumerate(ds):
        x = d.double()
        G = x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x
        torch.testing.assert_close(out[0, i], (G * G).sum(), rtol=2e-6, atol=0)
        torch.testing.assert_close(out[1, i], (x * x).sum() ** 2, rtol=2e-6, atol=0)


def test_column_index_spreads_owned_columns():
    from gns_kernels.distributed._share_solve import column_index

    idx = column_index([1, 4, 5], 7, "cpu")
    assert idx.tolist() == [3, 0, 3, 3, 1, 2, 3]
    part = torch.tensor([[10.0, 40.0, 50.0]], dtype=torch.float64)
    out = torch.cat([part, part.new_zeros((1, 1))], dim=1).index_select(1, idx)
    assert out.tolist() == [[0.0, 10.0, 0.0, 0.0, 40.0, 50.0, 0.0]]
