"""gns_kernels.pooling (the hooks' noise pools) against gns_kernels.reference.pooled_noise
(float64 loops, two-pass variances), and the pool in GNSHookState / MicroBatchGNS /
AdaptiveBatchSize."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import gns_kernels as gk
from gns_kernels import reference, stats
from gns_kernels.distributed import GNSHookState, MicroBatchGNS
from gns_kernels.spectral import pooled_sqrt_traces
from gns_kernels.stats import NoisePool, check_pool_beta


def _sequence(shapes, plan, seed=0, nan_at=None):
    """Measurements: plan = [(S, B, grad_scale)]; rank gradients with a parameter-dependent
    spread (gradients carry the loss scale); nan_at: a measurement with a NaN gradient."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t, (S, B, gs) in enumerate(plan):
        rg = [[gs * (0.3 + i) * torch.randn(sh, generator=g, dtype=torch.float64) + 0.1 * i
               for i, sh in enumerate(shapes)] for _ in range(S)]
        if t == nan_at:
            rg[-1][0] = rg[-1][0].clone()
            rg[-1][0].view(-1)[0] = float("nan")
        out.append((rg, B))
    return out


PLAN = [(3, 48, 1.0), (3, 48, 2.0), (5, 80, 2.0), (2, 64, 1.0), (4, 64, 4.0), (3, 96, 1.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fold_variance_matches_the_float64_pool(dtype):
    shapes = [(7, 5), (13,), (1,)]
    meas = _sequence(shapes, PLAN, nan_at=2)
    pool = NoisePool(0.9)
    got = []
    for t, (rg, B) in enumerate(meas):
        S, gs = len(rg), PLAN[t][2]
        vals = []
        for p in range(len(shapes)):
            x = torch.stack([r[p] for r in rg]).reshape(S, -1)
            vals.append(float(pool.fold_variance(("p", p), x.mean(0).to(dtype), (x * x).mean(0).to(dtype),
                                                 B / (S - 1), S, gs)))
        got.append(vals)
    want = reference.pooled_noise(meas, "l1", 0.9, [gs for _, _, gs in PLAN])
    tol = 2e-5 if dtype == torch.float32 else 1e-6  # the pool stores float32
    for t, (a, b) in enumerate(zip(got, want)):
        for i, (x, y) in enumerate(zip(a, b)):
            if t == 2 and i == 0:  # the NaN: nan for the parameter it touches, not folded
                assert math.isnan(x) and math.isnan(y)
                continue
            assert abs(x - y) <= tol * y, (t, i, x, y)
    # the first measurement alone is the c4-corrected ||s||_1 of that measurement
    rg, B = meas[0]
    s2 = reference.coordinate_variance([r[0] for r in rg], B)
    assert got[0][0] == pytest.approx(float(s2.sqrt().sum()) / stats.c4(3), rel=tol)


def test_fold_variance_scaled_statistics():
    """Statistics in units of grad_scale x gradient, folded with that grad_scale: the pool
    holds unscaled variances (a scale change between measurements mixes nothing) and
    reports in the measurement's units."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 11, generator=g, dtype=torch.float64) for _ in range(3)]
    a, b = NoisePool(0.8), NoisePool(0.8)
    for x, gs in zip(xs, (1.0, 1024.0, 8.0)):
        ra = a.fold_variance(0, x.mean(0), (x * x).mean(0), 5.0, 4)
        y = gs * x
        rb = b.fold_variance(0, y.mean(0), (y * y).mean(0), 5.0, 4, grad_scale=gs)
        assert float(rb) == pytest.approx(gs * float(ra), rel=1e-6)


def test_pooled_l1_is_unbiased_for_gaussian_samples():
    """E[pooled ||s||_1] = ||sigma||_1 for Gaussian rank means at R = 2 (the single
    measurement's c4 corrects it too; the pool keeps it unbiased at 1/U dof). 400 runs of
    30 measurements; margin 4 standard errors."""
    g = torch.Generator().manual_seed(11)
    sigma = torch.rand(64, generator=g, dtype=torch.float64) + 0.1
    R, b = 2, 8
    vals = []
    for _ in range(400):
        pool = NoisePool(0.9)
        for _ in range(30):
            x = sigma / math.sqrt(b) * torch.randn(R, 64, generator=g, dtype=torch.float64)
            v = pool.fold_variance(0, x.mean(0), (x * x).mean(0), R * b / (R - 1), R)
        vals.append(float(v))
    v = torch.tensor(vals)
    se = float(v.std()) / math.sqrt(len(vals))
    assert abs(float(v.mean()) - float(sigma.sum())) <= 4 * se, (float(v.mean()), float(sigma.sum()), se)


@pytest.mark.parametrize("method", ["eigh", "newton"])
def test_pooled_sqrt_traces_match_the_float64_pool(method):
    shapes = [(6, 9), (5, 3), (4, 4)]
    meas = _sequence(shapes, PLAN, seed=5, nan_at=3)
    pool = NoisePool(0.9)
    got = []
    for t, (rg, B) in enumerate(meas):
        S, gs = len(rg), PLAN[t][2]
        covs = [reference.row_covariance([r[p] for r in rg], B).float() for p in range(len(shapes))]
        out = pooled_sqrt_traces(pool, list(range(len(shapes))), covs, shapes, S, gs, method=method)
        got.append(out)
    want = reference.pooled_noise(meas, "nuclear", 0.9, [gs for _, _, gs in PLAN])
    tol = 2e-4 if method == "eigh" else 2e-3
    assert got[0][1].tolist() == [1.0, 1.0, 1.0] and got[0][0].tolist() == [0.0, 0.0, 0.0]
    for t in range(1, len(PLAN)):
        for i, (x, y) in enumerate(zip(got[t][0].tolist(), want[t])):
            if t == 3 and i == 0:  # the NaN: that matrix skips the measurement
                assert math.isnan(x) and math.isnan(y)
                continue
            assert got[t][1, i] == 0.0
            assert abs(x - y) <= tol * y, (t, i, x, y)


def test_pooled_newton_is_the_positive_part_when_the_pool_has_rounding_negatives(gen):
    """Covariances with small negative eigenvalues (the rounding of scale * (mean Gram -
    D D^T), at 1e-4 of ||C||): the pooled Newton value equals the eigenvalue path's (which
    clamps them) within the Newton tolerance and is finite. The shifted iteration, whose
    shift is relative to ||P||_F, gave an infinite or NaN pair sum here."""
    k = 48
    Q, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
    out = {}
    for method in ("eigh", "newton"):
        pool = NoisePool(0.9)
        g = torch.Generator().manual_seed(3)
        for t in range(4):
            lam = torch.logspace(0, -4, k, dtype=torch.float64) * (1 + 0.1 * torch.rand(k, generator=g, dtype=torch.float64))
            lam[-3:] = -1e-4
            C = ((Q * lam) @ Q.T).float()
            res = pooled_sqrt_traces(pool, ["w"], [C], [(k, 3 * k)], 4, 1.0, method=method)
        out[method] = float(res[0, 0])
    assert math.isfinite(out["newton"]) and out["eigh"] > 0
    assert abs(out["newton"] - out["eigh"]) <= 2e-3 * out["eigh"], out


def test_pooled_nuclear_dof_from_pairs_on_a_wishart():
    """At a fixed point the pair moments estimate one sample's dof: Gaussian rank means
    with n iid columns of covariance L L^T (the Wishart dof of one sample is n). 30 runs of
    80 measurements: the mean of nu_s (= nu * U) is n within 4 standard errors (one run's
    spread is about 20%)."""
    g = torch.Generator().manual_seed(2)
    m, n, R = 5, 7, 3
    L = torch.randn(m, m, generator=g, dtype=torch.float64)
    vals = []
    for _ in range(30):
        pool = NoisePool(0.9)
        for _ in range(80):
            xs = [L @ torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(R)]
            _, nu, _ = pool.fold_covariance("w", reference.row_covariance(xs, R), R)
        vals.append(float(nu * pool._entries["w"].U))
    v = torch.tensor(vals, dtype=torch.float64)
    se = float(v.std()) / math.sqrt(len(vals))
    assert abs(float(v.mean()) - n) <= 4 * se, (float(v.mean()), se)


def test_state_dict_round_trip_continues_exactly():
    meas = _sequence([(5, 6), (9,)], PLAN, seed=7)
    ref_pool, pool = NoisePool(0.85), NoisePool(0.85)

    def fold(p, t):
        rg, B = meas[t]
        S = len(rg)
        out = []
        for i in range(2):
            x = torch.stack([r[i] for r in rg])
            if i == 0:
                out.append(pooled_sqrt_traces(p, [i], [reference.row_covariance(list(x), B).float()],
                                              [(5, 6)], S, PLAN[t][2])[0, 0])
            else:
                out.append(p.fold_variance(i, x.mean(0), (x * x).mean(0), B / (S - 1), S, PLAN[t][2]))
        return torch.stack(out)

    for t in range(3):
        fold(ref_pool, t)
        fold(pool, t)
    sd = pool.state_dict()
    fresh = NoisePool(0.5)
    fresh.load_state_dict(sd)
    assert fresh.beta == 0.85 and len(fresh) == 2
    for t in range(3, 6):
        assert torch.equal(fold(fresh, t), fold(ref_pool, t))


def test_state_dict_checks_name_the_bad_entry():
    pool = NoisePool(0.9)
    x = torch.rand(3, 4, dtype=torch.float64)
    pool.fold_variance(0, x.mean(0), (x * x).mean(0), 2.0, 3)
    sd = pool.state_dict()
    bad = {"beta": 1.0, "entries": {}}
    with pytest.raises(ValueError, match=r"pool\['beta'\]: expected a number in \[0, 1\)"):
        NoisePool.check_state_dict(bad)
    with pytest.raises(TypeError, match=r"pool\['beta'\]: expected a number"):
        NoisePool.check_state_dict({"beta": None, "entries": {}})
    with pytest.raises(ValueError, match=r"pool\['entries'\]\[0\]: expected a dict with P, n, U"):
        NoisePool.check_state_dict({"beta": 0.9, "entries": {0: {"P": sd["entries"][0]["P"]}}})
    e = dict(sd["entries"][0], n=torch.tensor(float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\['n'\]: not finite"):
        NoisePool.check_state_dict({"beta": 0.9, "entries": {0: e}})
    e = dict(sd["entries"][0], P=-sd["entries"][0]["P"] - 1)
    with pytest.raises(ValueError, match="negative count, weight or variance"):
        NoisePool.check_state_dict({"beta": 0.9, "entries": {0: e}})
    e = dict(sd["entries"][0], num=torch.zeros((), dtype=torch.float64))
    with pytest.raises(ValueError, match="all of num, var, npair or none"):
        NoisePool.check_state_dict({"beta": 0.9, "entries": {0: e}})
    before = pool.state_dict()
    with pytest.raises(ValueError):
        pool.load_state_dict({"beta": 0.9, "entries": {0: e}})
    assert torch.equal(pool.state_dict()["entries"][0]["P"], before["entries"][0]["P"])  # unchanged


@pytest.mark.parametrize("bad,err", [(1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                     ("0.9", TypeError), (True, TypeError)])
def test_pool_beta_is_checked(bad, err):
    with pytest.raises(err, match="pool_beta"):
        check_pool_beta(bad)
    with pytest.raises(err, match="pool_beta"):
        GNSHookState("l1", batch_size=8, pool_beta=bad)


def test_fold_arguments_are_checked():
    pool = NoisePool(0.9)
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="num_samples: expected an integer >= 2"):
        pool.fold_variance(0, x, x, 1.0, 1)
    with pytest.raises(ValueError, match="grad_scale: expected a positive finite"):
        pool.fold_variance(0, x, x, 1.0, 2, grad_scale=0.0)
    with pytest.raises(ValueError, match="mean, mean_sq: expected two flat tensors"):
        pool.fold_variance(0, x, torch.zeros(4), 1.0, 2)
    with pytest.raises(ValueError, match="C: expected a square"):
        pool.fold_covariance(0, torch.zeros(2, 3), 2)


def test_no_pool_without_correction_or_for_l2():
    assert GNSHookState("l1", batch_size=8).pool is not None
    assert GNSHookState("nuclear", batch_size=8).pool is not None
    assert GNSHookState("l2", batch_size=8).pool is None
    assert GNSHookState("l1", batch_size=8, bias_correction=False).pool is None
    assert GNSHookState("l1", batch_size=8, pool_beta=None).pool is None


# --------------------------------------------------------------------------- in the hooks
def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _steps(model, mb, steps, A=3, b=4, seed=0):
    """Run steps of A micro-batches; returns the per-step micro-batch gradients."""
    out = []
    for k in range(steps):
        g = torch.Generator().manual_seed(seed + k)
        model.zero_grad(set_to_none=True)
        samples = []
        prev = [torch.zeros_like(p) for p in model.parameters()]
        for a in range(A):
            x, y = torch.randn(b, 6, generator=g), torch.randn(b, 4, generator=g)
            (F.mse_loss(model(x), y) / A).backward()
            cur = [p.grad.detach().clone() for p in model.parameters()]
            samples.append([A * (c - q) for c, q in zip(cur, prev)])
            prev = cur
            mb.micro_step()
        out.append(samples)
    return out


@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
def test_microbatch_pool_matches_reference_and_resumes(geometry):
    A, b, steps = 3, 4, 5
    model = _net()
    mb = MicroBatchGNS(model.parameters(), geometry=geometry, every=1, batch_size=A * b, micro_batches=A)
    pooled = []
    samples = []
    for k in range(steps):
        samples += _steps(model, mb, 1, A, b, seed=100 * k)
        pooled.append(mb.estimate.noise_pooled)
        assert mb.estimate.pool_beta == 0.9
        if k == 2:
            sd = mb.state_dict()
    hist = [([[t.double() for t in s] for s in smp], A * b) for smp in samples]
    want = reference.pooled_noise(hist, geometry, 0.9)
    tol = 1e-5 if geometry == "l1" else 1e-3
    for k in range(1, steps):
        assert pooled[k] == pytest.approx(sum(want[k]) ** 2, rel=tol)
    # a resumed state (from step 3's state_dict) continues exactly
    model2 = _net()
    mb2 = MicroBatchGNS(model2.parameters(), geometry=geometry, every=1, batch_size=A * b, micro_batches=A)
    mb2.load_state_dict(sd)
    model2.load_state_dict(model.state_dict())
    for k in range(3, steps):
        _steps(model2, mb2, 1, A, b, seed=100 * k)
        assert mb2.estimate.noise_pooled == pytest.approx(pooled[k], rel=1e-12)


def test_pool_is_not_mixed_across_ranks_or_unbound_orders():
    model = _net()
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=12, micro_batches=3)
    _steps(model, mb, 2)
    sd = mb.state_dict()
    assert sd["pool"]["rank"] == 0 and sd["pool"]["world"] == 1 and len(sd["pool"]["entries"]) == 4
    other = dict(sd, pool=dict(sd["pool"], rank=1, world=2))
    mb2 = MicroBatchGNS(_net().parameters(), geometry="l1", every=1, batch_size=12, micro_batches=3)
    with pytest.warns(RuntimeWarning, match="saved by rank 1 of 2, this is rank 0 of 1"):
        mb2.load_state_dict(other)
    assert len(mb2.pool) == 0
    with pytest.warns(RuntimeWarning, match="saved with pool_beta 0.9, this state has 0.5"):
        MicroBatchGNS(_net().parameters(), geometry="l1", every=1, batch_size=12, micro_batches=3,
                      pool_beta=0.5).load_state_dict(sd)
    # a state without a parameter order cannot key its pool for a checkpoint: it says so
    st = GNSHookState("l1", batch_size=8)
    p = torch.nn.Parameter(torch.zeros(3))
    x = torch.rand(2, 3)
    st.pool.fold_variance(st.pool_key(p), x.mean(0), (x * x).mean(0), 8.0, 2)
    with pytest.warns(RuntimeWarning, match="keyed by object identity"):
        assert st.state_dict()["pool"]["entries"] == {}
    st.bind_params([torch.nn.Parameter(torch.zeros(1)), p])  # re-keyed by position
    assert st.pool.keys() == [1] and list(st.state_dict()["pool"]["entries"]) == [1]


def test_controller_uses_the_pooled_noise(caplog):
    def est(noise, pooled, beta=0.9, valid=True):
        return gk.GNSEstimate(noise / 10, noise, 10.0, valid, None, "l1", 2, 16.0, True,
                              noise_pooled=pooled, pool_beta=beta)

    ctrl = gk.AdaptiveBatchSize(initial_batch_size=16, theta=1.0, every=1)
    ctrl.update(0, est(100.0, 120.0))
    assert ctrl.noise_ema == 120.0 and ctrl.signal_ema == 10.0 and ctrl.batch_size == 16
    ctrl.update(1, est(300.0, 330.0))
    assert ctrl.noise_ema == 330.0 and ctrl.signal_ema == 10.0 and ctrl.batch_size == 33
    # a pooled noise that is not a number >= 0 makes the measurement invalid (skipped)
    ctrl.update(2, est(300.0, float("nan")))
    assert ctrl.num_skipped == 1 and ctrl.noise_ema == 330.0
    # without a pooled noise the controller averages noise itself, as before
    ctrl.update(3, est(430.0, None))
    assert ctrl.noise_ema == pytest.approx(0.9 * 330.0 + 0.1 * 430.0)
    # a pool with another beta: warned once
    with caplog.at_level(logging.WARNING, logger="gns_kernels.controller"):
        ctrl.update(4, est(100.0, 50.0, beta=0.5))
        ctrl.update(5, est(100.0, 50.0, beta=0.5))
    assert sum("pool_beta 0.5" in r.getMessage() for r in caplog.records) == 1


def test_adaptive_batching_binds_the_order_and_the_grad_scale():
    class Scaler:
        def __init__(self):
            self.scale = 1024.0

        def get_scale(self):
            return self.scale

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = GNSHookState("l1", every=1, batch_size=8)
    scaler = Scaler()
    coord = gk.AdaptiveBatching(st, opt, micro_batch_size=4, initial_batch_size=8, world_size=2, rank=0,
                                grad_scaler=scaler)
    assert [st.pool_key(p) for p in model.parameters()] == [0, 1, 2, 3]
    assert st.grad_scale == 1024.0
    # a measurement carrying a pooled noise: the coordinator divides it by scale^2 like the
    # noise, and the controller takes it as its noise EMA
    est = gk.GNSEstimate(2.0, 1024.0 ** 2 * 3.0, 1024.0 ** 2 * 1.5, True, None, "l1", 2, 8.0, True,
                         step=0, noise_pooled=1024.0 ** 2 * 4.0, pool_beta=0.9)
    st.record_measurement(2, None, None, None, 0)
    st.estimate = est
    st.estimate_step = 0
    st.advance_step()
    opt.step()
    coord.step()
    assert coord.metrics()["noise_pooled"] == pytest.approx(4.0)
    assert coord.controller.noise_ema == pytest.approx(4.0)
    assert coord.controller.signal_ema == pytest.approx(1.5)


def test_owners_are_one_assignment_for_every_rank():
    """The matrix -> solving rank map is global: a state loading another rank's state_dict
    refuses that rank's pool but takes its owners (all ranks then agree); bind_params
    re-keys owners even when this rank's pool is empty."""
    st = GNSHookState("nuclear", batch_size=8)
    p, q = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(2, 5))
    st.bind_params([p, q])
    sd = st.state_dict()
    sd["pool"] = dict(sd["pool"], rank=1, world=1, owners={0: 0, 1: 0})
    with pytest.raises(ValueError, match=r"pool\['rank'\] must be an int"):
        GNSHookState("nuclear", batch_size=8).load_state_dict(dict(sd, pool=dict(sd["pool"], rank="1")))
    with pytest.raises(ValueError, match="names a rank >= the saved world size 1"):
        GNSHookState("nuclear", batch_size=8).load_state_dict(dict(sd, pool=dict(sd["pool"], owners={0: 1})))
    other = GNSHookState("nuclear", batch_size=8)
    with pytest.warns(RuntimeWarning, match="saved by rank 1 of 1"):
        other.load_state_dict(sd)
    assert other.pool_owners == {0: 0, 1: 0} and len(other.pool) == 0
    # a loaded pool keyed by positions, bound afterwards: positions stay (no old order)
    other.bind_params([p, q])
    assert other.pool_owners == {0: 0, 1: 0}
    # re-binding in another order moves the owners with their parameters
    other.bind_params([q, p])
    assert other.pool_owners == {1: 0, 0: 0} and other.pool_key(q) == 0


def test_first_flag_is_not_inferred_from_nu():
    """A pool that started from a zero covariance (a parameter without gradient yet) has a
    zero pair moment tr C tr P' + <C, P'> at its first pair, so its dof estimate sits at
    the floor of one per sample (nu = 1 / U); it has a pair, so its pooled value is
    reported, not the measurement's own."""
    from gns_kernels.stats import NU_S_MIN

    pool = NoisePool(0.9)
    zero, eye = torch.zeros(3, 3), torch.eye(3)
    _, nu, first = pool.fold_covariance(0, zero, 2)
    assert bool(first)
    _, nu, first = pool.fold_covariance(0, eye, 2)
    assert not bool(first) and float(nu) == pytest.approx(NU_S_MIN / float(pool._entries[0].U))
    fresh = NoisePool(0.9)
    assert pooled_sqrt_traces(fresh, [0], [zero], [(3, 3)], 2, 1.0)[1, 0] == 1.0
    assert pooled_sqrt_traces(fresh, [0], [eye], [(3, 3)], 2, 1.0)[1, 0] == 0.0


def test_nuclear_dof_floor_bounds_a_drifting_pool():
    """A covariance that shrinks tenfold from one measurement to the next (early training)
    makes ||C - P'||^2 large against the pair moment: the dof estimate is held at one per
    sample instead of collapsing towards 0 (which would apply the largest correction)."""
    from gns_kernels.stats import NU_S_MIN

    pool = NoisePool(0.9)
    eye = torch.eye(4)
    pool.fold_covariance(0, 100.0 * eye, 2)
    _, nu, _ = pool.fold_covariance(0, 1.0 * eye, 2)
    e = pool._entries[0]
    raw = float(e.num) / float(e.var)
    assert raw < NU_S_MIN and float(nu) == pytest.approx(NU_S_MIN / float(e.U))


@pytest.mark.parametrize("scale", [-4.0, 0.0, float("nan"), float("inf")])
def test_fold_variance_refuses_a_bad_scale_and_folds_nothing(scale):
    """NoisePool.fold_variance takes the same scale rule as variance_norms."""
    from gns_kernels.stats import NoisePool

    pool = NoisePool(0.9)
    m, sq = torch.randn(7), torch.rand(7) + 1
    pool.fold_variance("w", m, sq, 2.0, 2)
    before = pool.state_dict()
    with pytest.raises(ValueError, match="^scale: expected a positive finite number"):
        pool.fold_variance("w", m, sq, scale, 2)
    after = pool.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(before["entries"]["w"].values(), after["entries"]["w"].values()))


def test_pool_warnings_name_the_class_of_the_state():
    """The pool's warnings named GNSHookState.load_state_dict on a MicroBatchGNS."""
    from gns_kernels.distributed import MicroBatchGNS

    model = torch.nn.Linear(4, 3)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
    sd = mb.state_dict()
    sd["pool"] = {**sd["pool"], "rank": 1, "world": 2}
    with pytest.warns(RuntimeWarning, match="^MicroBatchGNS.load_state_dict: the noise pool was saved by rank 1"):
        mb.load_state_dict(sd)


def test_checkpoint_waits_for_the_fold_stream(monkeypatch):
    """Issue 30 item 6: state_dict / load_state_dict / clear order the current CUDA stream
    after the stream of the last fold (a fold runs on the measurement's side stream), so a
    checkpoint taken before the estimate is read cannot copy a half-updated pool. CPU
    check with stand-in streams."""
    import torch

    from gns_kernels.stats import NoisePool

    waits = []

    class _Stream:
        device = "cuda:0"

        def wait_stream(self, other):
            waits.append(other)

    side = _Stream()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    pool = NoisePool(0.9)
    pool.fold_covariance(0, torch.eye(3), 4, 1.0)
    pool.stream = side
    sd = pool.state_dict()
    assert waits == [side]
    pool.load_state_dict(sd)
    pool.clear()
    assert waits == [side, side, side]


def test_fold_covariances_blocks_follow_any_key_lists():
    """The stacked blocks of fold_covariances (one per key list) give every key the values
    of folding it alone, whatever lists the keys come in (a list repeated, a sub-list, a
    reordering, a dropped key, a reload), and P is the EMA of the key's covariances."""
    g = torch.Generator().manual_seed(11)
    k, beta, S = 5, 0.8, 4

    def cov():
        x = torch.randn(k, 2 * k, generator=g, dtype=torch.float64)
        return (x @ x.T / (2 * k)).float()

    lists = [[0, 1, 2], [0, 1, 2], [2, 0], [1], [0, 1, 2], "drop 1", [0, 1, 2], "reload", [2, 1, 0],
             "reset 0", [0, 1, 2], [0, 1, 2], "rekey", [3, 0, 1]]
    pool, alone = NoisePool(beta), NoisePool(beta)
    ema: dict = {}
    for step in lists:
        if step == "drop 1":
            pool.drop(1)
            alone.drop(1)
            ema.pop(1)
            continue
        if step == "reload":
            fresh = NoisePool(0.5)
            fresh.load_state_dict(pool.state_dict())
            pool = fresh
            continue
        if step == "reset 0":  # another shape under key 0: its pool starts afresh (warned)
            for p in (pool, alone):
                p._warned_reset = False
                with pytest.warns(RuntimeWarning, match="starts afresh"):
                    p.fold_covariance(0, torch.eye(3), S)
            ema.pop(0)
            continue
        if step == "rekey":  # key 2 becomes 3
            pool.rekey(lambda key: 3 if key == 2 else key)
            alone.rekey(lambda key: 3 if key == 2 else key)
            ema[3] = ema.pop(2)
            continue
        C = torch.stack([cov() for _ in step])
        P, nu, first = pool.fold_covariances(step, C, S)
        for i, key in enumerate(step):
            P1, nu1, first1 = alone.fold_covariance(key, C[i], S)
            assert torch.equal(P[i], P1) and torch.equal(nu[i], nu1) and bool(first[i]) == bool(first1)
            ema[key] = C[i].double() if key not in ema else beta * ema[key] + (1 - beta) * C[i].double()
            torch.testing.assert_close(P[i].double(), ema[key], rtol=1e-5, atol=1e-6)
    sd = pool.state_dict()
    assert sorted(sd["entries"]) == [0, 1, 3]
    saved = {key: e["P"].clone() for key, e in sd["entries"].items()}
    pool.fold_covariances([3, 0, 1], torch.stack([cov() for _ in range(3)]), S)
    for key, e in sd["entries"].items():  # a state_dict is a copy, not a view of the blocks
        assert e["P"].shape == (k, k) and torch.equal(e["P"], saved[key])
        assert e["P"].untyped_storage().nbytes() == k * k * 4
