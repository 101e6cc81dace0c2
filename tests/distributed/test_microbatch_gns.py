"""MicroBatchGNS on one process (no process group) and GNSHookState's own checks.

Expected values: gk.estimate over the micro-batch gradients, each computed separately
from a fresh backward of that micro-batch (not by differencing, as MicroBatchGNS does).
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import gns_kernels as gk
from gns_kernels.distributed import GNSHookState, MicroBatchGNS
from _harness import rel as _rel

TOL = {"l2": 1e-5, "l1": 1e-5, "nuclear": 1e-3}
# the nuclear bias correction from eigenvalues alone, as the spectral ops apply it
ESTIMATE_KW = ({"nuclear_dof": "columns"}
               if "nuclear_dof" in inspect.signature(gk.estimate).parameters else {})


def _net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(11, 19), torch.nn.Tanh(), torch.nn.Linear(19, 7),
                               torch.nn.Linear(7, 3, bias=False)).to(dtype)


def _micro_batches(step, A, b, nan_in=None):
    g = torch.Generator().manual_seed(500 + step)
    xs = torch.randn(A, b, 11, generator=g)
    ys = torch.randn(A, b, 3, generator=g)
    if nan_in is not None:
        xs[nan_in, 0, 0] = float("nan")
    return xs, ys


def _sample_grads(model, xs, ys):
    """Mean gradient of each micro-batch (its own backward, no accumulation)."""
    out = []
    for x, y in zip(xs, ys):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("geometry", ["l2", "l1", "nuclear"])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("A", [2, 5])
def test_one_process_matches_estimate_over_micro_batches(geometry, bias_correction, A):
    b = 3
    model = _net(1)
    ref_model = _net(1)
    mb = MicroBatchGNS(model.parameters(), geometry=geometry, every=2, batch_size=A * b,
                       micro_batches=A, bias_correction=bias_correction)
    for step in range(4):
        xs, ys = _micro_batches(step, A, b)
        samples = _sample_grads(ref_model, xs, ys)
        model.zero_grad(set_to_none=True)
        for a in range(A):
            (F.mse_loss(model(xs[a]), ys[a]) / A).backward()  # loss divided by A
            mb.micro_step()
        assert mb.step == step + 1
        # the accumulated .grad is the mean gradient of the whole batch
        for p, *gs in zip(model.parameters(), *samples):
            mean = torch.stack([g.double() for g in gs]).mean(0)
            assert torch.allclose(p.grad.double(), mean, rtol=1e-5, atol=1e-7)
        if step % 2:
            assert mb.estimate_step == step - 1
            assert not mb.prev and not mb.sq  # nothing held on non-measurement steps
            continue
        ref = gk.estimate(samples, batch_size=A * b, geometry=geometry, bias_correction=bias_correction,
                          **ESTIMATE_KW)
        est = mb.estimate
        assert mb.estimate_step == step and est.valid and ref.valid
        assert est.num_samples == A and est.batch_size == A * b
        for what in ("gns", "noise", "signal"):
            assert _rel(getattr(est, what), getattr(ref, what)) <= TOL[geometry], what
        if geometry == "nuclear" and step == 0:
            # rank-deficient Grams (3 examples per sample): float64 eigenproblems, remembered
            # per parameter shape, so the step-2 measurement above takes the hinted path
            hints = mb.eig_hints.state_dict()
            assert set(hints) == {"19x11", "7x19", "3x7"}
            assert any(hints.values())
            assert mb.state_dict()["eig_float64"] == hints


@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
def test_one_process_nan_micro_batch_invalid_then_valid(geometry):
    A, b = 3, 2
    model = _net(2)
    mb = MicroBatchGNS(model.parameters(), geometry=geometry, every=1, batch_size=A * b, micro_batches=A)
    valid = []
    for step in range(2):
        xs, ys = _micro_batches(step, A, b, nan_in=1 if step == 0 else None)
        model.zero_grad(set_to_none=True)
        for a in range(A):
            (F.mse_loss(model(xs[a]), ys[a]) / A).backward()
            mb.micro_step()
        valid.append(mb.estimate.valid)
        if step == 0:
            assert math.isnan(mb.estimate.gns) and math.isnan(mb.estimate.noise)
    assert valid == [False, True]


def test_microbatch_bad_input():
    model = _net()
    with pytest.raises(ValueError, match="micro_batches"):
        MicroBatchGNS(model.parameters(), batch_size=8)
    with pytest.raises(ValueError, match="micro_batches"):
        MicroBatchGNS(model.parameters(), batch_size=8, micro_batches=0)
    with pytest.raises(ValueError, match="params"):
        MicroBatchGNS([p for p in model.parameters() if p.dim() == 1], geometry="nuclear",
                      batch_size=8, micro_batches=2)
    with pytest.raises(TypeError, match="params"):
        MicroBatchGNS(next(model.parameters()), batch_size=8, micro_batches=2)
    one = MicroBatchGNS(model.parameters(), batch_size=4, micro_batches=1)
    F.mse_loss(model(torch.randn(4, 11)), torch.randn(4, 3)).backward()
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        one.micro_step()
    bf = _net(dtype=torch.bfloat16)
    mbf = MicroBatchGNS(bf.parameters(), batch_size=4, micro_batches=2)
    F.mse_loss(bf(torch.randn(2, 11, dtype=torch.bfloat16)).float(), torch.randn(2, 3)).backward()
    with pytest.raises(TypeError, match="float32 .grad"):
        mbf.micro_step()


def test_state_schedule_and_resume():
    st = GNSHookState("l1", every=3, batch_size=16)
    assert st.estimate is None and st.step == 0
    assert [st.is_measurement_step(k) for k in range(7)] == [True, False, False, True, False, False, True]
    st.step = 5
    assert not st.is_measurement_step() and st.is_measurement_step(6)
    st.batch_size = 32
    sd = st.state_dict()
    st2 = GNSHookState("l1", every=1, batch_size=4)
    st2.load_state_dict(sd)
    assert (st2.step, st2.every, st2.batch_size) == (5, 3, 32)
    with pytest.raises(ValueError, match="geometry"):
        GNSHookState("l2", batch_size=4).load_state_dict(sd)
    # the nuclear eigensolver hints travel with the checkpoint (a resumed run reproduces the
    # same numbers); checkpoints without them load with none
    nuc = GNSHookState("nuclear", batch_size=8)
    nuc.eig_hints.load_state_dict({"256x1024": True, "256x256": False})
    sd = nuc.state_dict()
    nuc2 = GNSHookState("nuclear", batch_size=8)
    nuc2.load_state_dict(sd)
    assert nuc2.eig_hints.state_dict() == {"256x1024": True, "256x256": False}
    del sd["eig_float64"]
    nuc2.load_state_dict(sd)
    assert nuc2.eig_hints.state_dict() == {}
    with pytest.raises(ValueError, match="eig_float64"):
        nuc2.load_state_dict({**sd, "eig_float64": {"256x256": 1}})


def test_state_bad_input():
    with pytest.raises(ValueError, match="geometry"):
        GNSHookState("linf", batch_size=4)
    with pytest.raises(ValueError, match="every"):
        GNSHookState("l1", every=0, batch_size=4)
    with pytest.raises(TypeError, match="every"):
        GNSHookState("l1", every=1.5, batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        GNSHookState("l1")
    with pytest.raises(ValueError, match="batch_size"):
        GNSHookState("l1", batch_size=0)
    st = GNSHookState("l1", batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        st.batch_size = -2
    with pytest.raises(ValueError, match="step"):
        st.step = -1
    with pytest.raises(ValueError, match="shift"):
        GNSHookState("l1", batch_size=4, shift="momentum")
    with pytest.raises(TypeError, match="shift"):
        GNSHookState("l1", batch_size=4, shift=3)
    with pytest.raises(ValueError, match="params"):
        GNSHookState("l1", batch_size=4, params=[])
    p = torch.nn.Parameter(torch.zeros(3, 2))
    bad = GNSHookState("l1", batch_size=4, shift={p: torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="shape"):
        bad.shift_for(p)


def test_state_measured_subset_and_nuclear_matrices():
    w = torch.nn.Parameter(torch.zeros(3, 2))
    v = torch.nn.Parameter(torch.zeros(3))
    u = torch.nn.Parameter(torch.zeros(4, 4))
    st = GNSHookState("nuclear", batch_size=4, params=[w, v])
    assert st.measures(w) and not st.measures(v) and not st.measures(u)
    st = GNSHookState("l1", batch_size=4)
    assert st.measures(w) and st.measures(v)


@pytest.mark.parametrize("pool_beta", [None, 0.9])
def test_nuclear_solver_failure_is_an_invalid_measurement(monkeypatch, pool_beta):
    from gns_kernels import spectral
    from gns_kernels.distributed import _share_solve

    def failing(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    A, b = 2, 2
    model = _net(3)
    mb = MicroBatchGNS(model.parameters(), geometry="nuclear", every=1, batch_size=A * b, micro_batches=A,
                       pool_beta=pool_beta)
    xs, ys = _micro_batches(0, A, b)
    # without a pool the one-process path solves with spectral.nuclear_stats, with one the
    # shared-solve path (which also folds the pool)
    monkeypatch.setattr(spectral, "nuclear_stats", failing)
    monkeypatch.setattr(_share_solve, "nuclear_stats", failing)
    with pytest.warns(RuntimeWarning, match="marked invalid"):
        for a in range(A):
            (F.mse_loss(model(xs[a]), ys[a]) / A).backward()
            mb.micro_step()
    assert mb.estimate.valid is False and math.isnan(mb.estimate.gns)
    assert (mb.estimate.noise_pooled is None) == (pool_beta is None)
    assert pool_beta is None or math.isnan(mb.estimate.noise_pooled)
    assert mb.step == 1


def _run_step(model, mb, step, A, b, before_last=None):
    """One optimizer step of A micro-batches; ``before_last(model)`` runs just before the
    A-th micro_step()."""
    xs, ys = _micro_batches(step, A, b)
    model.zero_grad(set_to_none=True)
    for a in range(A):
        (F.mse_loss(model(xs[a]), ys[a]) / A).backward()
        if a == A - 1 and before_last is not None:
            before_last(model)
        mb.micro_step()
    return xs, ys


@pytest.mark.parametrize("fail_at", [4, 2])
def test_failed_micro_step_raises_once_then_measures(fail_at, monkeypatch):
    # A = 4, batch 6 per micro-batch: micro_step() raises at call fail_at of step 0 (an
    # out-of-memory in the accumulation op); the error is raised once, step 0 is not
    # measured, and the next steps measure and match gk.estimate
    from gns_kernels import ops

    A, b = 4, 6
    model, ref_model = _net(4), _net(4)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=A * b, micro_batches=A)
    real = ops.accumulate_sq_multi
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "accumulate_sq_multi", flaky)
    xs, ys = _micro_batches(0, A, b)
    model.zero_grad(set_to_none=True)
    raised = 0
    for a in range(A):
        (F.mse_loss(model(xs[a]), ys[a]) / A).backward()
        try:
            mb.micro_step()
        except RuntimeError as e:
            assert "simulated" in str(e)
            raised += 1
    assert raised == 1 and calls[0] == fail_at  # no accumulation after the failure
    assert mb.step == 1 and mb.count == 0 and mb.estimate is None
    assert not mb.prev and not mb.sq
    for step in (1, 2):
        xs, ys = _run_step(model, mb, step, A, b)
        ref = gk.estimate(_sample_grads(ref_model, xs, ys), batch_size=A * b, geometry="l1")
        assert mb.step == step + 1 and mb.estimate_step == step and mb.estimate.valid
        assert _rel(mb.estimate.gns, ref.gns) <= TOL["l1"]


def test_tied_weight_listed_twice_counts_once():
    torch.manual_seed(5)
    emb = torch.nn.Linear(9, 9, bias=False)
    head = torch.nn.Linear(9, 9)
    head.weight = emb.weight  # tied

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = emb, head

        def forward(self, x):
            return self.head(torch.tanh(self.emb(x)))

    model = Tied()
    unique = list(model.parameters())  # weight, bias: the tied weight once
    assert len(unique) == 2
    listed = [emb.weight, head.weight, head.bias]  # the tied weight passed explicitly twice
    A, b = 3, 4
    g = torch.Generator().manual_seed(9)
    xs, ys = torch.randn(A, b, 9, generator=g), torch.randn(A, b, 9, generator=g)
    samples = []
    for x, y in zip(xs, ys):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        samples.append([p.grad.clone() for p in unique])
    for geometry in ("l1", "l2", "nuclear"):
        mb = MicroBatchGNS(listed, geometry=geometry, every=1, batch_size=A * b, micro_batches=A)
        model.zero_grad(set_to_none=True)
        for a in range(A):
            (F.mse_loss(model(xs[a]), ys[a]) / A).backward()
            mb.micro_step()
        ref = gk.estimate(samples, batch_size=A * b, geometry=geometry, **ESTIMATE_KW)
        assert mb.estimate.valid and ref.valid
        assert _rel(mb.estimate.gns, ref.gns) <= TOL[geometry], geometry
    st = GNSHookState("l1", batch_size=4, params=listed)
    assert st.measures(emb.weight) and st.measures(head.bias)


def test_missing_micro_step_warns_once():
    A, b = 2, 3
    model = _net(6)
    mb = MicroBatchGNS(model.parameters(), geometry="l2", every=1, batch_size=A * b, micro_batches=A)
    xs, ys = _micro_batches(0, A, b)
    with pytest.warns(RuntimeWarning, match=r"micro_step\(\)") as rec:
        for _ in range(3):  # README's loop without mb.micro_step(): nothing would be measured
            model.zero_grad(set_to_none=True)
            for a in range(A):
                (F.mse_loss(model(xs[a]), ys[a]) / A).backward()
    assert len([w for w in rec if "micro_step" in str(w.message)]) == 1
    assert mb.estimate is None and mb.step == 0
    # the correct loop never warns
    ok = MicroBatchGNS(model.parameters(), geometry="l2", every=1, batch_size=A * b, micro_batches=A)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            _run_step(model, ok, step, A, b)
    assert ok.estimate_step == 1


def test_every_defaults_match_the_controller():
    controller_every = inspect.signature(gk.AdaptiveBatchSize).parameters["every"].default
    model = _net()
    assert GNSHookState("l1", batch_size=4).every == controller_every == 100
    assert MicroBatchGNS(model.parameters(), batch_size=4, micro_batches=2).every == controller_every


def test_estimate_carries_its_step():
    import dataclasses

    A, b = 2, 3
    model = _net(7)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=2, batch_size=A * b, micro_batches=A)
    for step in range(3):
        _run_step(model, mb, step, A, b)
    assert mb.estimate_step == 2
    if "step" in {f.name for f in dataclasses.fields(gk.GNSEstimate)}:
        assert mb.estimate.step == 2


def test_deleted_micro_batch_gns_leaves_no_hook():
    model = _net(8)
    p = next(model.parameters())
    before = len(p._post_accumulate_grad_hooks or {})
    mb = MicroBatchGNS(model.parameters(), every=1, batch_size=4, micro_batches=2)
    assert len(p._post_accumulate_grad_hooks or {}) == before + 1
    del mb
    import gc
    gc.collect()
    assert len(p._post_accumulate_grad_hooks or {}) == before


def test_nuclear_dof_and_signal_arguments_checked():
    """MicroBatchGNS keeps the 'columns' dof ('gauss-sums' needs per-micro-batch deviations);
    GNSHookState refuses 'data' (cross-sample terms); both name the argument."""
    from gns_kernels.distributed import GNSHookState

    params = list(torch.nn.Linear(4, 3).parameters())
    with pytest.raises(ValueError, match="nuclear_dof: expected one of \\('auto', 'columns'\\)"):
        gk.MicroBatchGNS(params, geometry="nuclear", batch_size=8, micro_batches=2, nuclear_dof="gauss-sums")
    with pytest.raises(ValueError, match="nuclear_dof: expected one of .*'data' needs cross-sample"):
        GNSHookState("nuclear", batch_size=8, nuclear_dof="data")
    with pytest.raises(ValueError, match="signal: expected 'raw'"):
        GNSHookState("l1", batch_size=8, signal="unbiased")
    st = GNSHookState("nuclear", batch_size=8)
    assert (st.nuclear_dof, st.signal) == ("auto", "raw")
    assert st.resolved_nuclear_dof(2) == "columns" and st.resolved_nuclear_dof(3) == "gauss-sums"
    assert st.resolved_nuclear_dof(8, per_sample=False) == "columns"
    with pytest.raises(ValueError, match="nuclear_dof: 'gauss-sums' needs at least 3"):
        GNSHookState("nuclear", batch_size=8, nuclear_dof="gauss-sums").resolved_nuclear_dof(2)
    # the state_dict is unaffected by nuclear_dof and signal (no new keys; 'pool' is the
    # noise pool's, empty before a measurement), and round-trips
    a = GNSHookState("nuclear", batch_size=8, nuclear_dof="columns", signal="debiased")
    a.step = 5
    sd = a.state_dict()
    assert set(sd) == {"step", "every", "batch_size", "geometry", "eig_float64", "pool"}
    assert sd["pool"] == {"rank": 0, "world": 1, "owners": {}, "beta": 0.9, "entries": {}}
    assert set(GNSHookState("nuclear", batch_size=8, pool_beta=None).state_dict()) == set(sd) - {"pool"}
    b = GNSHookState("nuclear", batch_size=16)
    b.load_state_dict(sd)
    assert b.state_dict() == sd and (b.nuclear_dof, b.signal) == ("auto", "raw")


@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
def test_one_process_debiased_signal_matches_estimate(geometry):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    A, b = 3, 4
    mb = gk.MicroBatchGNS(list(model.parameters()), geometry=geometry, every=1, batch_size=A * b,
                          micro_batches=A, signal="debiased")
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(A, b, 7, generator=g), torch.randn(A, b, 3, generator=g)
    samples = []
    for a in range(A):
        prev = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        (torch.nn.functional.mse_loss(model(xs[a]), ys[a]) / A).backward()
        samples.append([A * (p.grad - q) for p, q in zip(model.parameters(), prev)])
        mb.micro_step()
    ref = gk.estimate(samples, A * b, geometry, signal="debiased", nuclear_dof="columns")
    est = mb.estimate
    assert est.valid and est.signal_kind == "debiased"
    tol = 1e-4 if geometry == "l1" else 1e-3
    for f in ("gns", "noise", "signal", "signal_raw"):
        assert abs(getattr(est, f) - getattr(ref, f)) <= tol * abs(getattr(ref, f)), f
