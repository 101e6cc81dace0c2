"""The hooks' host route (issue 43 item 1; docs/distributed.md, "The host route"): the
measurement of step k is staged, solved on a host thread while training goes on and
joined at the next measurement k + F, whose one extra small all-reduce carries its shared
vector. Checked here on CPU tensors (the CUDA copy and event path only in the GPU window):

- the lag: ``estimate_step`` / ``estimate.step`` k - F, ``estimate_available_step`` /
  ``estimate.available_step`` k, at the measuring step k (none at the first); the values
  within float32-input rounding of an independent float64 computation;
- DDP (2 gloo ranks): identical estimates on both ranks, the join's one extra all-reduce on
  measuring steps (none at the first, none on other steps);
- the wait policy: injected delays (spectral.host._DELAY) give bit-identical estimates, and
  a join that waited warns once, naming the F at which the route keeps up;
- checkpoints: ``state_dict`` with a job in flight waits and records this rank's part; the
  resumed run is bit-exact against the uninterrupted one (one rank, and 2 DDP ranks with a
  coordinator); a part of another world size or other rows is dropped with a warning;
- the coordinator: the controller gets the lagged estimate (``est.step`` = k - F) and does
  not count it as skipped.
"""
from __future__ import annotations

import random
import tempfile
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

from gns_kernels.distributed import MicroBatchGNS
from gns_kernels.spectral import host as spectral_host
from _ddp_scenarios import nuclear_ref64
from _harness import rel, run_world

A, b = 4, 3


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5, bias=False),
                               torch.nn.Linear(5, 7))


def _matrices(model):
    return [p for p in model.parameters() if p.dim() == 2]


def _micro_run(method="host", every=1, steps=5, delay=None, pool_beta=0.9, signal="raw",
               model=None, mb=None, start=0, save_at=None):
    """One rank, A micro-batches a step, no optimizer step. Returns (records, mb, saved):
    per step (k, estimate_step, estimate_available_step, estimate fields, float64 reference
    of the step's samples); saved: the state_dict taken at the start of step save_at."""
    model = model if model is not None else _net()
    if mb is None:
        mb = MicroBatchGNS(model.parameters(), "nuclear", every=every, batch_size=A * b, micro_batches=A,
                           method=method, pool_beta=pool_beta, signal=signal)
    prev_delay = spectral_host._DELAY
    if delay is not None:
        spectral_host._DELAY = delay
    out, saved = [], None
    try:
        for k in range(start, steps):
            if k == save_at:
                saved = mb.state_dict()
            g = torch.Generator().manual_seed(100 + k)
            model.zero_grad(set_to_none=True)
            samples = []
            for a in range(A):
                x, y = torch.randn(b, 12, generator=g), torch.randn(b, 7, generator=g)
                before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in _matrices(model)]
                (F.mse_loss(model(x), y) / A).backward()
                samples.append([A * (p.grad - q) for p, q in zip(_matrices(model), before)])
                mb.micro_step()
            e = mb.estimate
            fields = None if e is None else (e.step, e.available_step, e.noise, e.signal, e.gns, e.valid,
                                             e.noise_pooled, e.signal_raw, e.batch_size)
            out.append((k, mb.estimate_step, mb.estimate_available_step, fields,
                        nuclear_ref64(samples, A * b) if k % every == 0 else None, mb.lagged_step))
    finally:
        spectral_host._DELAY = prev_delay
    return out, mb, saved


def _no_host_threads():
    return not [t for t in threading.enumerate() if t.name.startswith("gns_host") and t.is_alive()]


@pytest.mark.parametrize("every", [1, 2])
def test_micro_one_rank_lags_by_one_measurement(every):
    recs, mb, _ = _micro_run(every=every, steps=7)
    refs = {k: r for k, _, _, _, r, _ in recs if r is not None}
    for k, est_step, avail, e, _, lagged in recs:
        assert lagged == k - k % every  # the latest measurement awaits its join
        if k < every:  # the first measurement: staged, nothing to read yet
            assert e is None and est_step is None and avail is None
            continue
        last = k - k % every  # the latest measuring step up to k
        assert (est_step, avail) == (last - every, last)
        assert e[:2] == (last - every, last)
        assert e[5] and e[8] == A * b
        ref_noise, ref_signal = refs[last - every]
        assert rel(e[2], ref_noise) < 1e-5 and rel(e[3], ref_signal) < 1e-7, (k, e, refs[last - every])
    mb._lagged.share.wait()
    assert _no_host_threads()


def test_micro_host_matches_eigh_route_and_its_pool():
    """The host route's estimate of step k equals the eigh route's of step k to float32
    rounding (noise, signal, pooled noise, debiased signal)."""
    for signal in ("raw", "debiased"):
        host, _, _ = _micro_run("host", steps=5, signal=signal)
        eigh, _, _ = _micro_run("eigh", steps=5, signal=signal)
        by_step = {r[3][0]: r[3] for r in eigh}
        for r in host[1:]:
            k, e = r[0], r[3]
            ref = by_step[e[0]]
            for i in (2, 3, 4, 6, 7):
                assert rel(e[i], ref[i]) < 1e-5, (signal, k, i, e, ref)


def test_wait_policy_is_bit_identical_under_injected_delays():
    """Random per-matrix delays (longer than the steps) change nothing: the join waits."""
    plain, _, _ = _micro_run(steps=5)
    rnd = random.Random(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the waits warn (next test)
        slow, _, _ = _micro_run(steps=5, delay=lambda i: rnd.uniform(0.0, 0.03))
    assert [r[:4] for r in plain] == [r[:4] for r in slow]


def test_a_join_that_waits_warns_once_with_the_f_that_keeps_up():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recs, _, _ = _micro_run(steps=4, delay=lambda i: 0.04)
    msgs = [str(w.message) for w in caught if "host solve" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "keeps up from about every=" in msgs[0] and "the join at step 1 waited" in msgs[0]
    assert recs[-1][3][:2] == (2, 3)


def _checkpointed_run(save_at=3, steps=6, delay=0.05, **kw):
    """The micro run with the job of step save_at - 1 delayed, checkpointed at the start
    of step save_at (before its micro-batches). Returns (records, saved, in_flight)."""
    model = _net()
    mb = MicroBatchGNS(model.parameters(), "nuclear", every=1, batch_size=A * b, micro_batches=A,
                       method="host", **kw)
    first, _, _ = _micro_run(model=model, mb=mb, steps=save_at - 1)
    spectral_host._DELAY = lambda i: delay  # step save_at - 1's job is slow
    try:
        rec, _, _ = _micro_run(model=model, mb=mb, start=save_at - 1, steps=save_at)
        in_flight = not mb._lagged.share.job.done()
        saved = mb.state_dict()  # waits for it
    finally:
        spectral_host._DELAY = None
    assert mb._lagged.share.job is None or mb._lagged.share.job.done()
    rest, _, _ = _micro_run(model=model, mb=mb, start=save_at, steps=steps)
    return first + rec + rest, saved, in_flight


@pytest.mark.parametrize("signal", ["raw", "debiased"])
def test_checkpoint_with_a_job_in_flight_resumes_bit_exact(signal):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        recs, saved, in_flight = _checkpointed_run(signal=signal)
    plain, _, _ = _micro_run(steps=6, signal=signal)
    assert [r[:4] for r in recs] == [r[:4] for r in plain]  # the checkpoint changed nothing
    assert in_flight
    lg = saved["lagged"]
    assert lg["step"] == 2 and lg["world"] == 1 and lg["num_samples"] == A and len(lg["part"]) == len(lg["rows"]) * lg["L"]
    with tempfile.TemporaryDirectory() as d:
        torch.save(saved, f"{d}/sd.pt")
        saved = torch.load(f"{d}/sd.pt", weights_only=True)
    model = _net()
    mb = MicroBatchGNS(model.parameters(), "nuclear", every=1, batch_size=A * b, micro_batches=A,
                       method="host", signal=signal)
    mb.load_state_dict(saved)
    assert mb.step == 3 and mb.lagged_step == 2
    resumed, _, _ = _micro_run(model=model, mb=mb, start=3, steps=6, signal=signal)
    assert [r[:4] for r in resumed] == [r[:4] for r in plain[3:]]


def test_a_lagged_part_of_another_world_or_rows_is_dropped_with_a_warning():
    _, saved, _ = _checkpointed_run(steps=3, delay=0.0)
    for bad, kw in ((dict(saved["lagged"], world=2), {}), (saved["lagged"], {"signal": "debiased"})):
        model = _net()
        mb = MicroBatchGNS(model.parameters(), "nuclear", every=1, batch_size=A * b, micro_batches=A,
                           method="host", **kw)
        with pytest.warns(RuntimeWarning, match="awaiting its join was saved by a world of"):
            mb.load_state_dict(dict(saved, lagged=bad))
        assert mb.lagged_step is None
        recs, _, _ = _micro_run(model=model, mb=mb, start=3, steps=5, **kw)
        assert recs[0][3] is None and recs[1][3][:2] == (3, 4)  # the lag chain restarts
    with pytest.raises(ValueError, match="lagged"):
        MicroBatchGNS(_net().parameters(), "nuclear", every=1, batch_size=A * b, micro_batches=A,
                      method="host").load_state_dict(dict(saved, lagged=dict(saved["lagged"], part=[1.0])))
    # without a measurement awaiting its join there is no "lagged" entry
    eigh_sd = _micro_run("eigh", steps=2)[1].state_dict()
    assert "lagged" not in eigh_sd


def test_switching_the_method_drops_the_measurement_awaiting_its_join():
    model = _net()
    mb = MicroBatchGNS(model.parameters(), "nuclear", every=1, batch_size=A * b, micro_batches=A,
                       method="host")
    _micro_run(model=model, mb=mb, steps=2)
    mb.method = "eigh"
    with pytest.warns(RuntimeWarning, match="step 1 awaiting its join is dropped"):
        _micro_run(model=model, mb=mb, start=2, steps=3)
    assert mb.lagged_step is None and mb.estimate_step == 2 and mb.estimate_available_step == 2


# ------------------------------------------------------------------ the coordinator
def test_coordinator_takes_the_lagged_estimate_without_skipping_it():
    from torch.utils.data import DataLoader, TensorDataset

    from gns_kernels.adaptive import AdaptiveBatching

    g = torch.Generator().manual_seed(0)
    X = torch.randn(800, 12, generator=g)
    Y = X @ torch.randn(12, 7, generator=g) + 0.5 * torch.randn(800, 7, generator=g)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    Fm = 2
    mb = MicroBatchGNS(model.parameters(), "nuclear", every=Fm, batch_size=8, micro_batches=2, method="host")
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, every=Fm, theta=0.5,
                             max_batch_size=64)
    seen = []
    update = coord.controller.update

    def spy(k, est):
        seen.append((k, None if est is None else (est.step, est.available_step, est.batch_size)))
        return update(k, est)

    coord.controller.update = spy
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X), seed=1))
    sizes = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "missing" / "stale" warning
        for k in coord.steps(max_steps=9):
            sizes[k] = coord.batch_size
            for (x, y), ctx in coord.micro_batches(loader):
                with ctx:
                    (F.mse_loss(model(x), y) / coord.accum_steps).backward()
            opt.step(); opt.zero_grad(); coord.step()
            row = coord.metrics()
            assert row["measured"] == (k % Fm == 0 and k >= Fm)
    measuring = [(k, e) for k, e in seen if k % Fm == 0]
    assert measuring[0] == (0, None)
    for k, e in measuring[1:]:
        assert e == (k - Fm, k, sizes[k - Fm])
    ctrl = coord.controller
    assert ctrl.num_skipped == 1 and ctrl.num_measurements == len(measuring) - 1


# ------------------------------------------------------------------ DDP, 2 gloo ranks
DDP_SCENARIOS = {
    "host": dict(geometry="nuclear", method="host", every=2, steps=7),
    "host_delay": dict(geometry="nuclear", method="host", every=2, steps=7, delay=0.03),
    "host_micro": dict(geometry="nuclear", method="host", every=1, steps=4, accumulate=2, micro=True),
    "host_debiased": dict(geometry="nuclear", method="host", every=1, steps=3, signal="debiased"),
}


@pytest.fixture(scope="module")
def ddp_two():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return run_world("_ddp_scenarios", "run_many", 2, scenarios=DDP_SCENARIOS, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(DDP_SCENARIOS))
def test_ddp_two_ranks_lag_and_collectives(ddp_two, name):
    cfg = DDP_SCENARIOS[name]
    every = cfg["every"]
    recs = [ddp_two[r][name]["records"] for r in range(2)]
    keys = ("est", "est_steps", "estimate_step", "available_step", "lagged_step", "state_step",
            "hooked_seq", "plain_seq")
    assert [[rec[key] for key in keys] for rec in recs[0]] == [[rec[key] for key in keys] for rec in recs[1]]
    refs = {rec["step"]: rec["ref64"] for rec in recs[0] if rec["measuring"]}
    for rec in recs[0]:
        k = rec["step"]
        n_buckets = len(rec["buckets"])
        extra = rec["hooked_seq"] - rec["plain_seq"]
        if not rec["measuring"]:
            assert extra == 0 and len(rec["payloads"]) == n_buckets
            continue
        if k < every:  # the first measurement: staged, no collective of its own
            assert rec["est"] is None and rec["est_steps"] is None and rec["lagged_step"] == k
            assert extra == 0 and len(rec["payloads"]) == n_buckets
            continue
        # one small extra all-reduce: measurement k - F's shared vector (float64)
        assert extra == 1 and len(rec["payloads"]) == n_buckets + 1
        numel, dtype = rec["payloads"][-1]
        assert dtype == "torch.float64" and numel < 200
        assert rec["est_steps"] == (k - every, k)
        assert (rec["estimate_step"], rec["available_step"]) == (k - every, k)
        gns, noise, signal, valid = rec["est"][:4]
        assert valid
        ref_noise, ref_signal = refs[k - every]
        if cfg.get("signal", "raw") == "raw":
            assert rel(signal, ref_signal) < 1e-6
        # the noise: float64 of the float32 mean Grams; C has rank R - 1 = 1 here (R = 2), the
        # float32 inputs' rounding is a large part of its other eigenvalues
        assert rel(noise, ref_noise) < 1e-3


@pytest.mark.distributed
def test_ddp_delays_give_bit_identical_estimates(ddp_two):
    for r in range(2):
        a = [(rec["est"], rec["est_steps"]) for rec in ddp_two[r]["host"]["records"]]
        b = [(rec["est"], rec["est_steps"]) for rec in ddp_two[r]["host_delay"]["records"]]
        assert a == b


# ------------------------------------------------------------------ DDP resume, 2 ranks
@pytest.mark.distributed
def test_ddp_resume_with_a_job_in_flight_is_bit_exact():
    from test_ddp_resume import SAVE_AT, _bits

    names = ["nuclear_host", "nuclear_micro_host"]
    with tempfile.TemporaryDirectory(prefix="gns_resume_") as folder:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            full = run_world("_resume_workers", "run_many", 2, folder=folder, names=names, timeout=300)
            resumed = run_world("_resume_workers", "run_many", 2, folder=folder, names=names,
                                resume=True, timeout=300)
    for name in names:
        for rank in range(2):
            f, r = full[rank][name], resumed[rank][name]
            assert f["inflight_at_save"] and f["lagged_saved"]
            rows_f, rows_r = f["rows"][SAVE_AT:], r["rows"]
            assert [row["step"] for row in rows_r] == list(range(SAVE_AT, 6))
            assert all(row["measured"] and row["valid"] for row in rows_r)
            assert not f["rows"][0]["measured"]  # the first step: nothing to read yet
            for a, b in zip(rows_f, rows_r):
                diff = {k: (a[k], b[k]) for k in a if _bits(a[k]) != _bits(b[k])}
                assert not diff, f"{name} rank {rank} step {a['step']}: {diff}"
            for p, q in zip(f["weights"], r["weights"]):
                assert torch.equal(p, q)


# ------------------------------------------------------------------ FSDP2, 2 gloo ranks
@pytest.mark.distributed
def test_fsdp_two_ranks_host_route_lags_and_matches_the_eigh_route():
    """FSDP2 (its final callback joins): the estimate of step k - 1 at step k, equal on both
    ranks and to the eigenvalue route's estimate of step k - 1 to float32 rounding (FSDP2's
    D D^T is the float32 sum of the shards' Grams on both routes); the first measurement
    issues no share all-reduce, the later ones one, as the eigenvalue route's."""
    scen = {"host": dict(geometry="nuclear", method="host", every=1, steps=4, ddp=False),
            "eigh": dict(geometry="nuclear", every=1, steps=4, ddp=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_world("_fsdp_workers", "run_many", 2, timeout=300, scenarios=scen)
    for r in range(2):
        host, eigh = res[r]["host"]["records"], res[r]["eigh"]["records"]
        assert [rec["est"] for rec in host] == [rec["est"] for rec in res[0]["host"]["records"]]
        assert host[0]["est"] is None
        assert host[0]["hooked_seq"] - host[0]["plain_seq"] == eigh[0]["hooked_seq"] - eigh[0]["plain_seq"] - 1
        for k in range(1, 4):
            assert (host[k]["estimate_step"], host[k]["available_step"]) == (k - 1, k)
            assert host[k]["hooked_seq"] - host[k]["plain_seq"] == eigh[k]["hooked_seq"] - eigh[k]["plain_seq"]
            got, want = host[k]["est"], eigh[k - 1]["est"]
            assert got[3] and all(rel(got[i], want[i]) < 1e-5 for i in (0, 1, 2, 4)), (k, got, want)


def test_a_failed_host_job_warns_and_marks_the_measurement_invalid():
    """As the other routes' solver failures: a warning and an invalid estimate, no
    exception inside backward; the next measurement is valid."""
    calls = []

    def boom(i):
        calls.append(i)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return 0.0

    model = _net()
    mb = MicroBatchGNS(model.parameters(), "nuclear", every=1, batch_size=A * b, micro_batches=A,
                       method="host")
    spectral_host._DELAY = boom
    try:
        with pytest.warns(RuntimeWarning, match="host solve of nuclear statistics failed"):
            recs, _, _ = _micro_run(model=model, mb=mb, steps=3)
    finally:
        spectral_host._DELAY = None
    assert recs[1][3][:2] == (0, 1) and not recs[1][3][5]  # invalid
    assert recs[2][3][:2] == (1, 2) and recs[2][3][5]
