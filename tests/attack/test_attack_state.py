"""Attack suite: AdaptiveBatchSize, MicroBatchSampler, LRMultiplier /
warmup_cosine and the optimizers' hyperparameters.

Bad constructor arguments, out-of-order calls, extreme measurements (5e-324 signals,
1e-200 thetas, NaN / inf) and corrupted or mismatched state_dicts: every rejection names
the argument (or state key), a rejected load leaves the object unchanged, and no input
ends in ZeroDivisionError, OverflowError, KeyError or a silent wrong state.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

import gns_kernels as gk
from gns_kernels.stats import estimate_from_stats
from gns_kernels.controller import AdaptiveBatchSize
from gns_kernels.lr import LRMultiplier, warmup_cosine
from gns_kernels.optim import SignSGD, Signum, SpecSGD
from gns_kernels.data import MicroBatchSampler


def Est(noise, signal, valid=True, step=None):
    """A GNSEstimate carrying these (possibly wrong) values."""
    try:
        gns = noise / signal
    except (TypeError, ZeroDivisionError):
        gns = math.nan
    return gk.GNSEstimate(gns=gns, noise=noise, signal=signal, valid=valid, signal_unbiased=None,
                          geometry="l1", num_samples=2, batch_size=8.0, bias_corrected=True,
                          step=step)


# ----------------------------------------------------------------------------------------
# controller
# ----------------------------------------------------------------------------------------
_CTRL_BAD = [
    ("initial_batch_size", 0, ValueError), ("initial_batch_size", 8.0, TypeError),
    ("initial_batch_size", True, TypeError), ("initial_batch_size", "8", TypeError),
    ("theta", 0.0, ValueError), ("theta", -0.5, ValueError), ("theta", math.nan, ValueError),
    ("theta", math.inf, ValueError), ("theta", 1e-200, ValueError), ("theta", 1e200, ValueError),
    ("theta", "0.6", TypeError), ("theta", None, TypeError),
    ("beta_noise", 1.0, ValueError), ("beta_noise", -0.1, ValueError), ("beta_noise", math.nan, ValueError),
    ("beta_signal", 1.5, ValueError), ("every", 0, ValueError), ("every", 2.0, TypeError),
    ("warmup_steps", -1, ValueError), ("multiple_of", 0, ValueError), ("multiple_of", 3, ValueError),
    ("max_batch_size", 4, ValueError), ("max_batch_size", 12, ValueError), ("max_batch_size", 16.0, TypeError),
    ("lr_scaling", "cubic", ValueError),
]


@pytest.mark.parametrize("name,value,exc", _CTRL_BAD, ids=[f"{n}={v!r}" for n, v, _ in _CTRL_BAD])
def test_controller_bad_config(name, value, exc):
    kw = dict(initial_batch_size=8, multiple_of=8 if name == "max_batch_size" else 1)
    kw[name] = value
    with pytest.raises(exc, match=name):
        AdaptiveBatchSize(**kw)


@pytest.mark.parametrize("signal", [5e-324, 1e-310, 1e-300])
@pytest.mark.parametrize("max_batch_size", [None, 64])
@pytest.mark.parametrize("theta", [1e-150, 0.6, 1e150])
def test_controller_extreme_ratios(signal, max_batch_size, theta):
    c = AdaptiveBatchSize(initial_batch_size=8, every=1, theta=theta, max_batch_size=max_batch_size)
    b = c.update(0, Est(1.0, signal))
    assert isinstance(b, int) and 8 <= b
    if max_batch_size is not None:
        assert b <= max_batch_size
    want = 1.0 / (theta * theta * signal) if theta * theta * signal > 0 else math.inf
    if math.isinf(want):  # beyond the float range: the cap, or B kept (with a warning)
        assert b == (max_batch_size or 8)
    elif max_batch_size is not None:
        assert b == min(max(math.ceil(want), 8), max_batch_size)
    else:
        assert b >= want * (1 - 1e-9) and (want < 8 or b <= want * (1 + 1e-9) + 1)
    assert c.lr_multiplier == pytest.approx(math.sqrt(b / 8))
    c.update(1, Est(0.0, signal))  # zero noise: no growth, no error
    assert c.batch_size == b


def test_controller_inf_target_round_trips_through_state():
    c = AdaptiveBatchSize(initial_batch_size=8, every=1, max_batch_size=64)
    c.update(0, Est(1.0, 5e-324))
    assert c.target_batch_size == math.inf
    d = AdaptiveBatchSize(initial_batch_size=8, every=1, max_batch_size=64)
    d.load_state_dict(copy.deepcopy(c.state_dict()))
    assert d.state_dict() == c.state_dict()


@pytest.mark.parametrize("est", [
    Est(math.nan, 1.0), Est(1.0, math.nan), Est(math.inf, 1.0), Est(1.0, math.inf), Est(1.0, 0.0),
    Est(1.0, -1.0), Est(-1.0, 1.0), Est(1.0, 1.0, valid=False), Est("x", 1.0), Est(None, 1.0),
    Est(1.0, 1.0, step=3),
], ids=lambda e: repr(e))
def test_controller_skips_invalid(est):
    c = AdaptiveBatchSize(initial_batch_size=8, every=1)
    before = c.state_dict()
    assert c.update(0, est) == 8
    after = c.state_dict()
    assert after["num_skipped"] == 1 and after["noise_ema"] is None and after["last_step"] == 0
    assert {k: v for k, v in after.items() if k not in ("num_skipped", "last_step")} == \
        {k: v for k, v in before.items() if k not in ("num_skipped", "last_step")}


def test_controller_stale_estimate_with_gnsestimate_step():
    c = AdaptiveBatchSize(initial_batch_size=8, every=1)
    stale = estimate_from_stats("l2", 80.0, 1.0, 2, 8, step=0)
    assert c.update(0, stale) > 8           # measured at 0, fed at 0: used
    c2 = AdaptiveBatchSize(initial_batch_size=8, every=1)
    c2.update(0, None)
    assert c2.update(1, stale) == 8 and c2.num_skipped == 2  # measured at 0, fed at 1: stale


@pytest.mark.parametrize("step,exc", [(-1, ValueError), (1.0, TypeError), ("1", TypeError), (None, TypeError),
                                      (True, TypeError)])
def test_controller_bad_steps(step, exc):
    c = AdaptiveBatchSize(initial_batch_size=8, every=1)
    with pytest.raises(exc, match="step"):
        c.update(step, None)
    assert c.last_step is None


def test_controller_out_of_order_and_bad_estimate_type():
    c = AdaptiveBatchSize(initial_batch_size=8, every=1)
    c.update(5, None)
    for s in (5, 4, 0):
        with pytest.raises(ValueError, match="step must increase"):
            c.update(s, None)
    with pytest.raises(TypeError, match="estimate"):
        c.update(6, 3.0)


def _trained():
    c = AdaptiveBatchSize(initial_batch_size=8, every=2, max_batch_size=256, multiple_of=4)
    for k, e in enumerate([Est(40.0, 1.0), None, Est(60.0, 1.5), None, Est(math.nan, 1.0)]):
        c.update(k, e)
    return c


_CORRUPT = [
    ("not_a_dict", lambda sd: [sd], TypeError, "state_dict"),
    ("version", lambda sd: {**sd, "version": 2}, ValueError, "version"),
    ("missing", lambda sd: {k: v for k, v in sd.items() if k != "signal_ema"}, ValueError, "missing"),
    ("config_type", lambda sd: {**sd, "config": None}, TypeError, "config"),
    ("config_theta", lambda sd: {**sd, "config": {**sd["config"], "theta": 0.5}}, ValueError, "theta"),
    ("batch_str", lambda sd: {**sd, "batch_size": "16"}, TypeError, "batch_size"),
    ("batch_float", lambda sd: {**sd, "batch_size": 16.0}, TypeError, "batch_size"),
    ("batch_zero", lambda sd: {**sd, "batch_size": 0}, ValueError, "batch_size"),
    ("batch_multiple", lambda sd: {**sd, "batch_size": 18}, ValueError, "batch_size"),
    ("noise_nan", lambda sd: {**sd, "noise_ema": math.nan}, ValueError, "noise_ema"),
    ("noise_neg", lambda sd: {**sd, "noise_ema": -1.0}, ValueError, "noise_ema"),
    ("noise_str", lambda sd: {**sd, "noise_ema": "1.0"}, TypeError, "noise_ema"),
    ("signal_zero", lambda sd: {**sd, "signal_ema": 0.0}, ValueError, "signal_ema"),
    ("signal_inf", lambda sd: {**sd, "signal_ema": math.inf}, ValueError, "signal_ema"),
    ("half_none", lambda sd: {**sd, "signal_ema": None}, ValueError, "noise_ema and signal_ema"),
    ("target_nan", lambda sd: {**sd, "target_batch_size": math.nan}, ValueError, "target_batch_size"),
    ("last_step_neg", lambda sd: {**sd, "last_step": -3}, ValueError, "last_step"),
    ("last_step_float", lambda sd: {**sd, "last_step": 4.0}, TypeError, "last_step"),
    ("measured_after_last", lambda sd: {**sd, "last_measured_step": 9}, ValueError, "last_measured_step"),
    ("count_neg", lambda sd: {**sd, "num_measurements": -1}, ValueError, "num_measurements"),
    ("count_str", lambda sd: {**sd, "num_skipped": "1"}, TypeError, "num_skipped"),
]


@pytest.mark.parametrize("case,mutate,exc,pat", _CORRUPT, ids=[c[0] for c in _CORRUPT])
def test_controller_corrupt_state_rejected_unchanged(case, mutate, exc, pat):
    src = _trained()
    target = AdaptiveBatchSize(initial_batch_size=8, every=2, max_batch_size=256, multiple_of=4)
    target.update(0, Est(10.0, 1.0))
    before = target.state_dict()
    with pytest.raises(exc, match=pat):
        target.load_state_dict(mutate(copy.deepcopy(src.state_dict())))
    assert target.state_dict() == before


def test_controller_resume_round_trip_after_invalid_measurements():
    a = _trained()
    b = AdaptiveBatchSize(initial_batch_size=8, every=2, max_batch_size=256, multiple_of=4)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for k in range(5, 12):
        e = Est(10.0 * k, 1.0) if k % 2 == 0 else None
        assert a.update(k, e) == b.update(k, e)
    assert a.state_dict() == b.state_dict()


# ----------------------------------------------------------------------------------------
# sampler (MicroBatchSampler, the one the coordinator makes)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,exc,pat", [
    (dict(num_samples=0), ValueError, "num_samples"), (dict(num_samples=10.0), TypeError, "num_samples"),
    (dict(micro_batch_size=0), ValueError, "micro_batch_size"),
    (dict(micro_batch_size=2.0), TypeError, "micro_batch_size"),
    (dict(rank=-1), ValueError, "rank"), (dict(rank=2, num_replicas=2), ValueError, "rank"),
    (dict(num_replicas=0), ValueError, "num_replicas"), (dict(num_replicas=True), TypeError, "num_replicas"),
    (dict(seed=-1), ValueError, "seed"), (dict(seed=1.5), TypeError, "seed"),
    (dict(num_samples=7, micro_batch_size=4, num_replicas=2), ValueError, "num_samples"),
])
def test_sampler_bad_config(kw, exc, pat):
    args = dict(num_samples=100, micro_batch_size=4, num_replicas=1, rank=0)
    args.update(kw)
    with pytest.raises(exc, match=pat):
        MicroBatchSampler(**args)


def _sampler():
    s = MicroBatchSampler(100, 4, num_replicas=2, rank=0, seed=3)
    s.advance(7)
    return s


_SAMPLER_CORRUPT = [
    ("not_a_dict", lambda st: list(st.items()), ValueError, "state_dict"),
    ("version", lambda st: {**st, "version": 9}, ValueError, "version"),
    ("missing", lambda st: {k: v for k, v in st.items() if k != "position"}, ValueError, "position"),
    ("num_samples", lambda st: {**st, "num_samples": 99}, ValueError, "num_samples"),
    ("seed", lambda st: {**st, "seed": 4}, ValueError, "seed"),
    ("shuffle", lambda st: {**st, "shuffle": False}, ValueError, "shuffle"),
    ("position_neg", lambda st: {**st, "position": -1}, ValueError, "position"),
    ("position_float", lambda st: {**st, "position": 3.0}, TypeError, "position"),
]


@pytest.mark.parametrize("case,mutate,exc,pat", _SAMPLER_CORRUPT, ids=[c[0] for c in _SAMPLER_CORRUPT])
def test_sampler_corrupt_state_rejected_unchanged(case, mutate, exc, pat):
    target = MicroBatchSampler(100, 4, num_replicas=2, rank=0, seed=3)
    target.advance(2)
    before = target.state_dict()
    with pytest.raises(exc, match=pat):
        target.load_state_dict(mutate(_sampler().state_dict()))
    assert target.state_dict() == before


def test_sampler_resume_continues_the_same_indices():
    a = _sampler()
    b = MicroBatchSampler(100, 4, num_replicas=2, rank=0, seed=3)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    a._next_start = a.position   # a continues from its consumed position too
    assert list(iter(a))[:30] == list(iter(b))[:30]


# ----------------------------------------------------------------------------------------
# learning rate
# ----------------------------------------------------------------------------------------
def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.mark.parametrize("bad,exc", [(0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                                     (math.inf, ValueError), ("2", TypeError), (True, TypeError),
                                     (torch.tensor(2.0), TypeError)])
def test_lr_multiplier_bad(bad, exc):
    m = LRMultiplier(_opt())
    with pytest.raises(exc, match="multiplier"):
        m.set_multiplier(bad)
    with pytest.raises(exc, match="multiplier"):
        m.step(bad)
    with pytest.raises(exc, match="multiplier"):
        m.load_state_dict({"multiplier": bad})
    assert m.multiplier == 1.0 and m.lrs == [0.1]


@pytest.mark.parametrize("state", [{}, None, [2.0], {"mult": 2.0}])
def test_lr_state_missing(state):
    with pytest.raises(ValueError, match="multiplier"):
        LRMultiplier(_opt()).load_state_dict(state)


@pytest.mark.parametrize("kw,pat", [
    (dict(t=math.nan), "t"), (dict(total=0.0), "total"), (dict(total=math.nan), "total"),
    (dict(warmup=-1.0), "warmup"), (dict(warmup=10.0), "warmup"), (dict(min_ratio=1.5), "min_ratio"),
    (dict(min_ratio=math.nan), "min_ratio"), (dict(t="3"), "t"),
])
def test_warmup_cosine_bad(kw, pat):
    args = dict(t=3.0, total=10.0, warmup=2.0, min_ratio=0.1)
    args.update(kw)
    with pytest.raises((TypeError, ValueError), match=f"warmup_cosine: {pat}"):
        warmup_cosine(**args)


def test_warmup_cosine_values():
    assert warmup_cosine(0, 10, 0) == 1.0
    assert warmup_cosine(10, 10, 0, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(1e9, 10, 0, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(0, 10, 3) == 0.25


# ----------------------------------------------------------------------------------------
# optimizers
# ----------------------------------------------------------------------------------------
_HYPER = [("lr", -1.0, ValueError), ("lr", math.nan, ValueError), ("lr", "0.1", TypeError),
          ("lr", True, TypeError), ("weight_decay", -0.1, ValueError), ("weight_decay", math.inf, ValueError),
          ("momentum", 1.0, ValueError), ("momentum", -0.5, ValueError)]


@pytest.mark.parametrize("cls,name,value,exc", [(c, *h) for c in (SignSGD, Signum, SpecSGD) for h in _HYPER
                                                if not (c is SignSGD and h[0] == "momentum")])
def test_optimizer_hyperparameters(cls, name, value, exc):
    with pytest.raises(exc, match=f"^{name}: "):
        cls([torch.nn.Parameter(torch.zeros(2, 2))], **{name: value})


@pytest.mark.parametrize("cls", [SignSGD, Signum, SpecSGD])
def test_optimizer_nan_gradient_is_not_hidden(cls):
    p = torch.nn.Parameter(torch.ones(3, 3))
    p.grad = torch.full((3, 3), math.nan)
    cls([p], lr=0.1).step()
    assert not torch.isfinite(p).all()  # a NaN gradient shows in the parameters
