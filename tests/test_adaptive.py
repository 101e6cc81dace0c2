"""AdaptiveBatching: the same trajectory as the hand-wired low-level objects, every
mis-use raises or warns once naming the fix, GradScaler unscaling, the growth bound, LR
schedulers and several optimizers, exact resume (also on another world size)."""
from __future__ import annotations

import io
from dataclasses import replace
import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk
from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.controller import AdaptiveBatchSize
from gns_kernels.data import MicroBatchSampler
from gns_kernels.distributed import GNSHookState, MicroBatchGNS
from gns_kernels.stats import GNSEstimate
from gns_kernels.lr import LRMultiplier


def _est(noise, signal, valid=True, B=8.0):
    return GNSEstimate(gns=noise / signal, noise=noise, signal=signal, valid=valid,
                       signal_unbiased=None, geometry="l1", num_samples=2, batch_size=B,
                       bias_corrected=True)


_OPTIMIZER_OF = {}  # id(state) -> the optimizer of a simulated loop (_ddp_coord)


def _backward(state, estimate=None):
    """What ddp_gns_hook does to its state in one synchronized backward, and the
    optimizer step the loop makes after it (coord.step() checks that it happened)."""
    k = state.step
    if state.is_measurement_step() and estimate is not None:
        state.estimate, state.estimate_step = estimate, k
    state.advance_step()
    if id(state) in _OPTIMIZER_OF:
        opt = _OPTIMIZER_OF[id(state)]
        for group in opt.param_groups:   # the gradients a real backward leaves
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        opt.step()


def _ddp_coord(every=2, **kw):
    """A coordinator on a GNSHookState as if on rank 0 of 2 DDP ranks (the hook simulated)."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = GNSHookState(geometry="l1", every=every, batch_size=8)
    args = dict(micro_batch_size=4, initial_batch_size=8, world_size=2, rank=0)
    args.update(kw)
    _OPTIMIZER_OF[id(state)] = opt
    return AdaptiveBatching(state, opt, **args), state, opt


# ----------------------------------------------------------------------------- one rank, real
def _problem(seed=0, n=600):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 6, generator=g)
    Y = X @ torch.randn(6, 1, generator=g) + 0.7 * torch.randn(n, 1, generator=g)
    return X, Y


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def test_one_rank_matches_the_hand_wired_low_level_loop():
    """Coordinator + DataLoader (2 workers) vs AdaptiveBatchSize + MicroBatchGNS +
    LRMultiplier wired by hand over the same index stream: same batches, LRs, weights."""
    X, Y = _problem()
    b, B0, F, steps = 4, 8, 2, 14
    kw = dict(theta=0.6, every=F, max_batch_size=48)

    # coordinator
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=F, batch_size=B0, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=b, initial_batch_size=B0, **kw)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X), seed=4),
                        num_workers=2)
    got = []
    for k in coord.steps(max_steps=steps):
        for (x, y), ctx in coord.micro_batches(loader):
            with ctx:
                (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
        opt.step(); opt.zero_grad(); coord.step()
        got.append((coord.metrics()["batch_size"], opt.param_groups[0]["lr"]))

    # by hand
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ctrl = AdaptiveBatchSize(initial_batch_size=B0, multiple_of=b, **kw)
    mb2 = MicroBatchGNS(model2.parameters(), geometry="l1", every=F, batch_size=B0, micro_batches=2)
    lrm = LRMultiplier([opt2])
    stream = MicroBatchSampler(len(X), b, 1, 0, seed=4)
    pos, want = 0, []
    for k in range(steps):
        B = ctrl.batch_size
        mb2.batch_size, mb2.micro_batches = B, B // b
        for _ in range(B // b):
            idx = stream.indices(pos, b)
            pos += b
            (torch.nn.functional.mse_loss(model2(X[idx]), Y[idx]) / (B // b)).backward()
            mb2.micro_step()
        opt2.step(); opt2.zero_grad()
        ctrl.update(k, mb2.estimate if mb2.estimate_step == k else None)
        lrm.step(ctrl.lr_multiplier)
        want.append((B, opt2.param_groups[0]["lr"]))
    assert got == want
    assert max(B for B, _ in got) > B0  # the batch grew
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert coord.sampler.position == pos == coord.samples_seen


# ----------------------------------------------------------------------------- mis-uses
def test_every_mismatch_raises_and_none_adopts_the_states():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = GNSHookState(geometry="l1", every=1, batch_size=8)
    with pytest.raises(ValueError, match="every=100.*every 1.*same every"):
        AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, every=100, world_size=2)
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2)
    assert coord.every == coord.controller.every == 1


def test_schedule_written_behind_the_coordinators_back_raises():
    """The hook state reads F, k, B and the loss scale from the run's schedule, which the
    coordinator owns: setting one through the state (the old README handshake line
    ``state.batch_size = ...``) raises at that line, naming the owner, and changes nothing
    (it raised at the next coord.step() before, after the step had run with it)."""
    coord, state, _ = _ddp_coord()
    _backward(state, _est(1.0, 1.0))
    coord.step()
    for field, value in (("batch_size", 64), ("every", 5), ("step", 7), ("grad_scale", 2.0)):
        before = getattr(state, field)
        with pytest.raises(RuntimeError, match=f"{field}: this schedule is owned by AdaptiveBatching"):
            setattr(state, field, value)
        assert getattr(state, field) == before
    assert state.batch_size == coord.batch_size and state.every == coord.every == coord.controller.every
    assert state.schedule is coord.schedule is coord.controller.schedule
    _backward(state)
    coord.step()
    assert state.step == coord.current_step == 2


def test_steps_counted_from_one_raise():
    coord, state, _ = _ddp_coord()
    _backward(state, _est(1.0, 1.0))
    with pytest.raises(ValueError, match="step\\(k=1\\).*optimizer step 0.*counts"):
        coord.step(k=1)
    coord.step(k=0)
    assert coord.current_step == 1


def test_steps_iterator_raises_when_step_is_forgotten():
    coord, state, _ = _ddp_coord()
    it = coord.steps(max_steps=3)
    assert next(it) == 0
    with pytest.raises(RuntimeError, match="without coord.step\\(\\)"):
        next(it)


def test_stale_estimate_is_never_reused():
    coord, state, _ = _ddp_coord(every=2)
    _backward(state, _est(4.0, 1.0))      # step 0 measured
    coord.step()
    _backward(state)                       # step 1
    coord.step()
    ema = coord.controller.noise_ema
    # step 2 is a measuring step but the hook did not measure: the estimate is step 0's
    state.advance_step()
    _OPTIMIZER_OF[id(state)].step()
    with pytest.warns(RuntimeWarning, match="no estimate of it \\(estimate_step = 0\\)"):
        coord.step()
    assert coord.controller.num_measurements == 1 and coord.controller.noise_ema == ema
    assert coord.controller.num_skipped == 1
    # ... and only once
    _backward(state); coord.step()
    state.advance_step()
    _OPTIMIZER_OF[id(state)].step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        coord.step()
    assert coord.controller.num_skipped == 2


def test_estimate_carrying_another_step_is_not_used():
    coord, state, _ = _ddp_coord(every=1)
    _backward(state, replace(_est(2.0, 1.0), step=7))
    with pytest.warns(RuntimeWarning, match="measured at step 7"):
        coord.step()
    assert coord.controller.num_measurements == 0


def test_estimate_passed_to_the_controller_carries_its_step():
    coord, state, _ = _ddp_coord(every=1)
    seen = []
    real = coord.controller.update
    coord.controller.update = lambda k, e: (seen.append((k, e)), real(k, e))[1]
    for _ in range(3):
        _backward(state, _est(3.0, 1.0))
        coord.step()
    assert [(k, e.step) for k, e in seen] == [(0, 0), (1, 1), (2, 2)]


def test_microbatchgns_without_micro_step_raises():
    X, Y = _problem(n=64)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8)
    for a in range(coord.accum_steps):  # the user's own loop, micro_step() forgotten
        (torch.nn.functional.mse_loss(model(X[4 * a:4 * a + 4]), Y[4 * a:4 * a + 4]) / 2).backward()
    opt.step(); opt.zero_grad()
    with pytest.raises(RuntimeError, match="micro_step\\(\\) must follow every micro-batch"):
        coord.step()


def test_hook_not_registered_and_extra_synchronizations_raise():
    coord, state, _ = _ddp_coord()
    with pytest.raises(RuntimeError, match="no synchronized backward.*register_comm_hook"):
        coord.step()
    _backward(state); _backward(state)  # two synchronized backwards in one step
    with pytest.raises(RuntimeError, match="counted 2 synchronized.*skip the synchronization"):
        coord.step()


def test_partially_consumed_micro_batches_raise():
    coord, state, _ = _ddp_coord(initial_batch_size=16)  # A = 2
    model = torch.nn.Linear(1, 1)
    model.no_sync = lambda: __import__("contextlib").nullcontext()
    gen = coord.micro_batches([[0], [1], [2]], model)
    next(gen)
    _backward(state)
    with pytest.raises(RuntimeError, match="1 of its 2 micro-batches"):
        coord.step()


def test_several_ranks_with_accumulation_need_the_model_for_no_sync():
    coord, state, _ = _ddp_coord(initial_batch_size=16)
    with pytest.raises(ValueError, match="pass the DDP or FSDP2 model"):
        next(coord.micro_batches([[0]] * 4))


@pytest.mark.parametrize("kw, match", [
    (dict(initial_batch_size=12), "multiple of world_size x micro_batch_size = 2 x 4 = 8"),
    (dict(max_batch_size=20), "max_batch_size.*multiple.*8"),
    (dict(max_growth=1.0), "max_growth"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        _ddp_coord(**kw)


def test_one_rank_needs_microbatchgns_and_two_micro_batches():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="MicroBatchGNS"):
        AdaptiveBatching(GNSHookState(geometry="l1", every=1, batch_size=8), opt,
                         micro_batch_size=4, initial_batch_size=8)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=4, micro_batches=1)
    with pytest.raises(ValueError, match=">= 2 x micro_batch_size = 8"):
        AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=4)


# ----------------------------------------------------------------------------- GradScaler
class _Scaler:
    def __init__(self):
        self.scale = 1.0

    def get_scale(self):
        return self.scale


def test_grad_scaler_noise_and_signal_are_unscaled_before_the_emas():
    """Measured noise and signal carry scale^2 (the hooks see scaled gradients). With the
    scaler the EMAs equal those of the unscaled run; without, the EMAs mix scales even
    though every single GNS ratio is unchanged."""
    truth = [(5.0, 1.0), (9.0, 2.0), (2.0, 0.5), (7.0, 1.5)]
    scales = [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 10]

    def run(scaled, scaler):
        coord, state, _ = _ddp_coord(every=1, grad_scaler=scaler, theta=1.0, max_batch_size=10**6)
        for (n, s), c in zip(truth, scales):
            if scaler is not None:
                scaler.scale = c
                coord.schedule.write("grad_scale", scaler.get_scale(), by="AdaptiveBatching")  # the scale of the step's backward
            f = c * c if scaled else 1.0
            _backward(state, _est(n * f, s * f))
            coord.step()
        return coord

    plain = run(False, None)
    unscaled = run(True, _Scaler())
    raw = run(True, None)
    assert unscaled.controller.noise_ema == pytest.approx(plain.controller.noise_ema, rel=1e-12)
    assert unscaled.controller.signal_ema == pytest.approx(plain.controller.signal_ema, rel=1e-12)
    assert unscaled.controller.batch_size == plain.controller.batch_size
    assert unscaled.metrics()["gns"] == pytest.approx(7.0 / 1.5)
    assert raw.metrics()["gns"] == pytest.approx(7.0 / 1.5)  # the ratio is scale-invariant
    assert raw.controller.gns_ema != pytest.approx(plain.controller.gns_ema, rel=1e-3)  # EMAs are not


def test_grad_scale_is_read_when_the_steps_micro_batches_begin():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    coord, state, _ = _ddp_coord(every=1, grad_scaler=scaler)
    assert coord.grad_scale == 256.0
    gen = coord.micro_batches([[0]])
    next(gen)
    _backward(state, _est(3.0 * 256 ** 2, 1.0 * 256 ** 2))
    with pytest.raises(StopIteration):
        next(gen)
    coord.step()
    m = coord.metrics()
    assert m["grad_scale"] == 256.0 and m["noise"] == pytest.approx(3.0) and m["signal"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- growth bound
def test_max_growth_bounds_each_decision():
    def run(max_growth):
        coord, state, _ = _ddp_coord(every=1, theta=0.6, max_growth=max_growth)
        seq = []
        for _ in range(4):
            _backward(state, _est(1000.0, 1.0))  # target ~2778: far above B
            coord.step()
            seq.append(coord.batch_size)
        return seq

    assert run(None)[0] == 2784  # Algorithm 1: one jump to ceil(target) rounded to 8
    bounded = run(2.0)
    assert bounded == [16, 32, 64, 128]
    run15 = run(1.5)
    assert run15 == [16, 24, 32, 48]  # 1.5 x 8 = 12 rounds down to 8: one R x b step instead
    # the LR multiplier follows the bounded batch
    coord, state, opt = _ddp_coord(every=1, max_growth=2.0)
    _backward(state, _est(1000.0, 1.0)); coord.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * math.sqrt(2.0))


# ----------------------------------------------------------------------------- LR
@pytest.mark.filterwarnings("ignore:.*no estimate of it", "ignore:Detected call of")
def test_two_optimizers_and_schedulers_compose_with_the_multiplier():
    torch.manual_seed(0)
    w, v = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    muon = torch.optim.Muon([w], lr=0.02)
    adam = torch.optim.AdamW([v], lr=3e-3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(muon, T_max=10)   # chainable
    lam = torch.optim.lr_scheduler.LambdaLR(adam, lambda k: 1.0 / (k + 1))
    state = GNSHookState(geometry="nuclear", every=1, batch_size=8)
    coord = AdaptiveBatching(state, [muon, adam], schedulers=[cos, lam], micro_batch_size=4,
                             initial_batch_size=8, world_size=2, max_batch_size=64)
    ests = [_est(20.0, 1.0), None, _est(60.0, 1.0), None, None]
    for k, e in enumerate(ests):
        _backward(state, e)
        muon.step(); adam.step()
        coord.step()
        omega = math.sqrt(coord.batch_size / 8)
        cos_k = 0.02 * (1 + math.cos(math.pi * (k + 1) / 10)) / 2
        assert muon.param_groups[0]["lr"] == pytest.approx(cos_k * omega, rel=1e-9)
        assert adam.param_groups[0]["lr"] == pytest.approx(3e-3 / (k + 2) * omega, rel=1e-9)
    assert coord.batch_size > 8


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_scheduler_not_passed_and_stepped_by_hand_raises():
    """A scheduler built on a passed optimizer but not passed to the coordinator: its
    step() sees the multiplied lr (a chainable one compounds omega every step); the first
    coord.step() after it changed the lr raises naming schedulers=[...]."""
    coord, state, opt = _ddp_coord(every=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _backward(state, _est(1.0, 1.0)); coord.step()
    sched.step()
    _backward(state, _est(1.0, 1.0))
    before = coord.state_dict()
    with pytest.raises(RuntimeError, match="schedulers=\\[sched\\]"):
        coord.step()
    assert coord.state_dict() == before


def test_passed_scheduler_also_stepped_by_hand_raises():
    """docs said this warns; the LR halved every step (stepped twice per step)."""
    coord, state, opt = _ddp_coord(every=1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    coord2 = AdaptiveBatching(state, opt, schedulers=[sched], micro_batch_size=4,
                              initial_batch_size=8, world_size=2, rank=0)
    _backward(state, _est(1.0, 1.0)); coord2.step()
    sched.step()
    _backward(state, _est(1.0, 1.0))
    with pytest.raises(RuntimeError, match="schedulers \\[0\\].*stepped outside the coordinator"):
        coord2.step()


def test_lr_set_by_hand_warns_once_and_becomes_the_scheduled_rate():
    coord, state, opt = _ddp_coord(every=1)
    _backward(state, _est(1.0, 1.0)); coord.step()
    opt.param_groups[0]["lr"] = 0.05          # a hand-written schedule, no scheduler object
    _backward(state, _est(1.0, 1.0))
    with pytest.warns(RuntimeWarning, match="schedulers=\\[...\\]"):
        coord.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # taken as the scheduled rate
    opt.param_groups[0]["lr"] = 0.025
    _backward(state, _est(1.0, 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        coord.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


# ----------------------------------------------------------------------------- metrics
def test_metrics_of_a_measurement_and_per_layer_hook():
    coord, state, opt = _ddp_coord(every=2)
    assert coord.metrics() == {}
    state.layer_stats = {"fc1": (2.0, 1.0), "fc2": (4.0, 3.0)}
    _backward(state, _est(6.0, 4.0))
    coord.step()
    m = coord.metrics()
    assert (m["step"], m["batch_size"], m["accum_steps"], m["samples_seen"]) == (0, 8, 1, 8)
    assert m["measured"] and m["valid"] and m["gns"] == 1.5
    assert (m["noise"], m["signal"], m["noise_ema"], m["signal_ema"]) == (6.0, 4.0, 6.0, 4.0)
    assert m["next_batch_size"] == 8 * math.ceil(6.0 / (0.36 * 4.0) / 8)
    assert m["lr_0"] == pytest.approx(0.1 * math.sqrt(m["next_batch_size"] / 8))
    assert m["noise/fc2"] == 4.0 and m["signal/fc1"] == 1.0
    _backward(state)
    coord.step()
    m = coord.metrics()
    assert not m["measured"] and math.isnan(m["gns"]) and "noise/fc1" not in m


# ----------------------------------------------------------------------------- resume
def _resumable(world_size=1, b=4, B0=8):
    X, Y = _problem(n=97)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.1 * k))
    mb = MicroBatchGNS(model.parameters(), geometry="l2", every=2, batch_size=B0, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, schedulers=sched, micro_batch_size=b, initial_batch_size=B0,
                             theta=0.3, max_batch_size=64)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)), num_workers=2)
    return model, opt, coord, loader


def _train(model, opt, coord, loader, n):
    rows = []
    for _ in range(n):
        for (x, y), ctx in coord.micro_batches(loader):
            with ctx:
                (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
        opt.step(); opt.zero_grad(); coord.step()
        rows.append(coord.metrics())
    return rows


def _same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_state_dict_resume_is_exact():
    model, opt, coord, loader = _resumable()
    ref = _train(model, opt, coord, loader, 16)
    ref_w = [p.detach().clone() for p in model.parameters()]

    model, opt, coord, loader = _resumable()
    part1 = _train(model, opt, coord, loader, 7)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "coord": coord.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model, opt, coord, loader = _resumable()
    model.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"]); coord.load_state_dict(ck["coord"])
    part2 = _train(model, opt, coord, loader, 9)
    rows = part1 + part2
    assert len(rows) == len(ref)
    for r, q in zip(rows, ref):
        assert r.keys() == q.keys() and all(_same(r[k], q[k]) for k in r), (r, q)
    assert max(r["batch_size"] for r in ref) > 8
    for p, q in zip(model.parameters(), ref_w):
        assert torch.equal(p, q)


@pytest.mark.filterwarnings("ignore:.*no estimate of it")
def test_resume_on_another_world_size_rounds_the_batch_and_keeps_the_stream():
    coord, state, _ = _ddp_coord(every=1, max_batch_size=64)  # R = 2, b = 4: multiples of 8
    coord.batch_sampler(100)
    _backward(state, _est(5.0, 1.0)); coord.step()            # B: 8 -> 16
    coord.sampler.advance(1)
    _backward(state); coord.step()
    sd = coord.state_dict()
    assert sd["schedule"]["batch_size"] == 16
    new, state3, opt3 = _ddp_coord(every=1, max_batch_size=96, world_size=3,
                                   initial_batch_size=12)    # R = 3, b = 4: multiples of 12
    new.batch_sampler(100)
    with pytest.warns(RuntimeWarning, match="saved batch 16 is not a multiple of 12, continuing with 24"):
        new.load_state_dict(sd, strict=False)
    assert new.batch_size == 24 and state3.batch_size == 24 and new.accum_steps == 2
    assert new.samples_seen == sd["samples_seen"] and new.current_step == 2 == state3.step
    assert new.sampler.position == 8  # the stream position carries over, re-sharded by 3 x 4
    assert new.sampler.micro_batch_at(new.sampler.position) == new.sampler.indices(8, 4)
    assert opt3.param_groups[0]["lr"] == pytest.approx(0.1 * math.sqrt(24 / 12))
    # the controller's settings must match unless strict=False
    other, _, _ = _ddp_coord(every=1, max_batch_size=96, world_size=3, initial_batch_size=12)
    with pytest.raises(ValueError, match="initial_batch_size.*strict=False"):
        other.load_state_dict(sd)


def test_real_grad_scaler_growing_scale_gives_the_unscaled_trajectory():
    """One rank, MicroBatchGNS on gradients of scaler.scale(loss) with the scale doubling
    every step: with grad_scaler= the measurements, EMAs and batches equal those of the
    run without loss scaling."""
    X, Y = _problem(n=400)

    def run(use_scaler):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_factor=2.0,
                                      growth_interval=1) if use_scaler else None
        mb = MicroBatchGNS(model.parameters(), geometry="l2", every=1, batch_size=8, micro_batches=2)
        coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, theta=0.3,
                                 max_batch_size=64, grad_scaler=scaler)
        loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
        rows = []
        for _ in coord.steps(max_steps=6):
            for (x, y), _ctx in coord.micro_batches(loader):
                loss = torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt); scaler.update()
            else:
                opt.step()
            opt.zero_grad(); coord.step()
            rows.append(coord.metrics())
        return rows

    plain, scaled = run(False), run(True)
    assert [r["grad_scale"] for r in scaled] == [2.0 ** (10 + i) for i in range(6)]
    assert [r["batch_size"] for r in scaled] == [r["batch_size"] for r in plain]
    for a, b in zip(scaled, plain):
        for key in ("noise", "signal", "gns", "noise_ema", "signal_ema"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def test_optimizers_must_be_optimizers():
    state = GNSHookState(geometry="l1", every=1, batch_size=8)
    with pytest.raises(TypeError, match="optimizers: expected a torch.optim.Optimizer"):
        AdaptiveBatching(state, [torch.nn.Linear(2, 1)], micro_batch_size=4, initial_batch_size=8,
                         world_size=2)


def test_iterable_dataset_of_fixed_micro_batches():
    """An IterableDataset cannot be sharded by index; a loader whose items are micro-batches
    of b works: the coordinator takes A of them per step and re-iterates at the end."""
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            X, Y = _problem(n=40)
            return iter(list(zip(X, Y)))

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, max_batch_size=32)
    loader = DataLoader(Stream(), batch_size=4)  # 10 micro-batches per pass
    seen = []
    for _ in coord.steps(max_steps=6):
        for (x, y), _ctx in coord.micro_batches(loader):
            (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
            seen.append(x.shape[0])
        opt.step(); opt.zero_grad(); coord.step()
    assert set(seen) == {4} and 4 * len(seen) == coord.samples_seen
    assert coord.samples_seen > 40  # crossed a pass boundary


def test_signal_is_the_states_and_a_mismatch_raises():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = GNSHookState(geometry="l1", every=1, batch_size=8, signal="debiased")
    with pytest.raises(ValueError, match="signal: AdaptiveBatching\\(signal='raw'\\).*'debiased'"):
        AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2, signal="raw")
    with pytest.raises(ValueError, match="signal: expected None, 'raw' or 'debiased'"):
        AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2, signal="x")
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2)
    assert coord.controller.signal == "debiased"
    raw = AdaptiveBatching(GNSHookState(geometry="l1", every=1, batch_size=8), opt, micro_batch_size=4,
                           initial_batch_size=8, world_size=2)
    assert raw.controller.signal == "raw"


def test_checkpoint_from_before_the_signal_option_loads_as_raw():
    """A coordinator checkpoint whose controller settings lack 'signal' (written before the
    option existed) loads strictly into a raw-signal coordinator and is refused by a
    debiased one."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def make(signal="raw"):
        return AdaptiveBatching(GNSHookState(geometry="l1", every=1, batch_size=8, signal=signal), opt,
                                micro_batch_size=4, initial_batch_size=8, world_size=2)
    sd = make().state_dict()
    del sd["controller"]["config"]["signal"]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    coord = make()
    coord.load_state_dict(loaded)
    assert coord.controller.signal == "raw"
    with pytest.raises(ValueError, match="signal: saved 'raw' vs 'debiased'"):
        make("debiased").load_state_dict(loaded)


def test_lr_schedule_on_samples_keeps_its_shape_when_the_batch_grows():
    """lr_schedule=f(samples seen): the scheduled lr of each step is base x f(samples
    before the step), times omega; a resume continues it exactly."""
    from gns_kernels.lr import warmup_cosine

    total = 400
    f = lambda n: warmup_cosine(n, total, 40, 0.1)  # noqa: E731
    model, opt, coord, loader = _resumable_sched(f)
    seen = []
    for k in coord.steps(max_samples=total):
        seen.append((coord.samples_seen, coord.lr_multiplier, opt.param_groups[0]["lr"]))
        for (x, y), ctx in coord.micro_batches(loader):
            with ctx:
                (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
        opt.step(); opt.zero_grad(); coord.step()
    assert max(coord.metrics()["batch_size"], coord.batch_size) > 8   # the batch grew
    for n, omega, lr in seen:
        assert lr == pytest.approx(0.05 * f(n) * omega, rel=1e-12)
    with pytest.raises(ValueError, match="lr_schedule and schedulers"):
        _resumable_sched(f, with_scheduler=True)
    with pytest.raises(ValueError, match="lr_schedule\\(0\\) returned nan"):
        _resumable_sched(lambda n: float("nan"))


def _resumable_sched(f, with_scheduler=False):
    X, Y = _problem(n=400)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0) if with_scheduler else None
    mb = MicroBatchGNS(model.parameters(), geometry="l2", every=1, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, theta=0.3,
                             max_batch_size=64, lr_schedule=f, schedulers=sched)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    return model, opt, coord, loader


# ----------------------------------------------------------------------------- the README loop
def _readme_run(new, steps=None, total=400, mistake=None):
    X, Y = _problem(n=400)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if new:
        coord = AdaptiveBatching(model, opt, every=1, micro_batch_size=4, initial_batch_size=8,
                                 max_batch_size=64)
    else:
        mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
        coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, max_batch_size=64)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    rows = []
    if new:
        for batch in coord.batches(loader, max_samples=total, max_steps=steps):
            for i, (x, y) in enumerate(batch):
                (torch.nn.functional.mse_loss(model(x), y) / len(batch)).backward()
                if mistake == "partial":
                    break
            if mistake == "coord.step":
                coord.step()
            if mistake != "no opt.step":
                opt.step()
            opt.zero_grad()
            rows.append(coord.metrics())
    else:
        for k in coord.steps(max_samples=total, max_steps=steps):
            for (x, y), ctx in coord.micro_batches(loader):
                with ctx:
                    (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
            opt.step(); opt.zero_grad(); coord.step()
            rows.append(coord.metrics())
    return rows, [p.detach().clone() for p in model.parameters()], coord


def test_readme_loop_one_rank_equals_the_explicit_loop():
    """AdaptiveBatching(model, opt) builds the MicroBatchGNS itself (geometry from the
    optimizer: AdamW -> l1); coord.batches ends each step when the optimizer steps."""
    old, w_old, _ = _readme_run(False)
    new, w_new, coord = _readme_run(True)
    assert coord.state.geometry == "l1" and isinstance(coord.state, MicroBatchGNS)
    assert len(new) == len(old) > 10 and max(r["batch_size"] for r in new) > 8
    for a, b in zip(new, old):
        assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    assert all(torch.equal(p, q) for p, q in zip(w_new, w_old))


@pytest.mark.parametrize("mistake, match", [
    ("no opt.step", "ended without opt.step\\(\\)"),
    ("coord.step", "ends by itself.*remove the coord.step\\(\\)"),
    ("partial", "1 of its 2 micro-batches were consumed"),
])
def test_readme_loop_mistakes_raise(mistake, match):
    with pytest.raises(RuntimeError, match=match):
        _readme_run(True, steps=3, mistake=mistake)


def test_model_form_arguments():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="plain module on 2 ranks.*DistributedDataParallel"):
        AdaptiveBatching(model, opt, micro_batch_size=4, initial_batch_size=8, world_size=2)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
    with pytest.raises(ValueError, match="geometry: given with a measurement object"):
        AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, geometry="l1")
    muon = torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=0.02)
    adam = torch.optim.AdamW([p for p in model.parameters() if p.dim() != 2], lr=1e-3)
    coord = AdaptiveBatching(model, [muon, adam], micro_batch_size=4, initial_batch_size=8)
    assert coord.state.geometry == "nuclear" and coord.every == 100
    assert len(coord.state._params) == 2          # Muon's matrices are measured


def test_beta_noise_and_pool_beta_are_one_setting():
    """The hook's pool_beta silently replaced the controller's beta_noise; now the
    coordinator takes the state's, builds the state with its own, or refuses a mismatch."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2,
                       pool_beta=0.8)
    assert AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8).controller.beta_noise == 0.8
    with pytest.raises(ValueError, match="beta_noise=0.95.*pool_beta=0.8"):
        AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, beta_noise=0.95)
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    c = AdaptiveBatching(model2, opt2, micro_batch_size=4, initial_batch_size=8, beta_noise=0.95)
    assert c.state.pool_beta == 0.95 == c.controller.beta_noise
