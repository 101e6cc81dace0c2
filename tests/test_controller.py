"""AdaptiveBatchSize (Algorithm 1): every expected number below is worked out by hand."""
from __future__ import annotations

import copy
import json
import logging
import math
import random
from dataclasses import dataclass

import pytest

from gns_kernels import controller
from gns_kernels.controller import AdaptiveBatchSize, ControllerConfig
from gns_kernels.stats import GNSEstimate
from gns_kernels.schedule import Schedule


def Est(noise, signal, valid=True, step=None, **kw):
    """A GNSEstimate with these noise and signal (what the controller takes)."""
    try:
        gns = noise / signal
    except (TypeError, ZeroDivisionError):
        gns = float("nan")
    return GNSEstimate(gns=gns, noise=noise, signal=signal, valid=valid, signal_unbiased=None,
                       geometry="l1", num_samples=2, batch_size=8.0, bias_corrected=True,
                       step=step, **kw)


def ctrl(**kw):
    base = dict(initial_batch_size=4, theta=1.0, beta_noise=0.0, beta_signal=0.0, every=1)
    base.update(kw)
    return AdaptiveBatchSize(**base)


def test_defaults_match_design():
    c = AdaptiveBatchSize()
    assert (c.initial_batch_size, c.theta, c.beta_noise, c.beta_signal, c.every) == (64, 0.6, 0.9, 0.9, 100)
    assert (c.warmup_steps, c.max_batch_size, c.multiple_of, c.lr_scaling) == (0, None, 1, "sqrt")
    assert c.batch_size == 64 and c.lr_multiplier == 1.0
    assert c.noise_ema is None and c.signal_ema is None and c.gns_ema is None
    assert c.last_step is None and c.last_measured_step is None


def test_first_valid_measurement_starts_the_ema():
    # beta 0.9: a zero-initialised EMA would give N = 10, M = 0.1 after one step
    c = AdaptiveBatchSize(initial_batch_size=4, theta=1.0, every=1)
    c.update(0, Est(100.0, 1.0))
    assert c.noise_ema == 100.0 and c.signal_ema == 1.0
    assert c.batch_size == 100


def test_ema_arithmetic_by_hand():
    # theta = 0.5 -> theta^2 = 0.25 exactly; beta_noise 0.5, beta_signal 0.75
    c = AdaptiveBatchSize(initial_batch_size=4, theta=0.5, beta_noise=0.5, beta_signal=0.75, every=1)
    c.update(0, Est(8.0, 2.0))       # N = 8, M = 2 -> 8 / 0.5 = 16
    assert (c.noise_ema, c.signal_ema, c.batch_size) == (8.0, 2.0, 16)
    c.update(1, Est(16.0, 6.0))      # N = 4 + 8 = 12, M = 1.5 + 1.5 = 3 -> 12 / 0.75 = 16
    assert (c.noise_ema, c.signal_ema, c.batch_size) == (12.0, 3.0, 16)
    c.update(2, Est(4.0, 2.0))       # N = 6 + 2 = 8, M = 2.25 + 0.5 = 2.75 -> 11.64 -> 12 < 16
    assert (c.noise_ema, c.signal_ema, c.batch_size) == (8.0, 2.75, 16)
    assert c.target_batch_size == pytest.approx(8.0 / 0.6875, rel=1e-15)
    c.update(3, Est(100.0, 1.0))     # N = 4 + 50 = 54, M = 2.0625 + 0.25 = 2.3125 -> 93.405 -> 94
    assert (c.noise_ema, c.signal_ema, c.batch_size) == (54.0, 2.3125, 94)
    assert c.gns_ema == pytest.approx(54.0 / 2.3125, rel=1e-15)
    assert c.num_measurements == 4 and c.last_measured_step == 3


def test_period_only_measuring_steps_enter():
    c = AdaptiveBatchSize(initial_batch_size=1, theta=1.0, beta_noise=0.5, beta_signal=0.5, every=10)
    for k in range(26):
        c.update(k, Est(float(k + 1), 1.0))   # steps 0, 10, 20 carry noise 1, 11, 21
        if k < 10:
            assert c.batch_size == 1
    # N: 1 -> 0.5 + 5.5 = 6 -> 3 + 10.5 = 13.5; M stays 1
    assert c.noise_ema == 13.5 and c.signal_ema == 1.0
    assert c.num_measurements == 3 and c.last_measured_step == 20 and c.last_step == 25
    assert c.batch_size == 14


def test_decision_only_at_measuring_steps():
    c = AdaptiveBatchSize(initial_batch_size=1, theta=1.0, beta_noise=0.0, beta_signal=0.0, every=5)
    c.update(0, Est(3.0, 1.0))
    assert c.batch_size == 3
    for k in range(1, 5):
        c.update(k, Est(50.0, 1.0))     # ignored: not measuring steps
        assert c.batch_size == 3 and c.noise_ema == 3.0
    c.update(5, Est(7.0, 1.0))
    assert c.batch_size == 7


def test_warmup_freezes_batch_but_updates_emas():
    c = AdaptiveBatchSize(initial_batch_size=8, theta=1.0, beta_noise=0.5, beta_signal=0.0,
                          every=10, warmup_steps=15)
    c.update(0, Est(100.0, 1.0))
    assert c.batch_size == 8 and c.noise_ema == 100.0 and c.lr_multiplier == 1.0
    c.update(10, Est(300.0, 1.0))       # k = 10 < I = 15: EMA 200, batch frozen
    assert c.batch_size == 8 and c.noise_ema == 200.0
    c.update(15, Est(1e6, 1.0))         # k = 15 >= I but not a measuring step: nothing
    assert c.batch_size == 8 and c.noise_ema == 200.0
    c.update(20, Est(0.0, 1.0))         # EMA 100: first decision at k = 20
    assert c.noise_ema == 100.0 and c.batch_size == 100


def test_warmup_boundary_is_inclusive():
    c = AdaptiveBatchSize(initial_batch_size=8, theta=1.0, beta_noise=0.0, beta_signal=0.0,
                          every=10, warmup_steps=10)
    c.update(0, Est(50.0, 1.0))
    assert c.batch_size == 8
    c.update(10, Est(50.0, 1.0))        # k >= I at k == I
    assert c.batch_size == 50


def test_monotone_never_shrinks():
    c = ctrl()
    sizes = []
    for k, noise in enumerate([10.0, 40.0, 5.0, 0.0, 39.5, 41.0, 1.0]):
        sizes.append(c.update(k, Est(noise, 1.0)))
    assert sizes == [10, 40, 40, 40, 40, 41, 41]


def test_multiple_of_rounds_up():
    c = ctrl(initial_batch_size=8, multiple_of=8)
    c.update(0, Est(61.0, 1.0))
    assert c.batch_size == 64
    c.update(1, Est(64.0, 1.0))
    assert c.batch_size == 64
    c.update(2, Est(64.5, 1.0))
    assert c.batch_size == 72


def test_cap():
    c = ctrl(initial_batch_size=8, multiple_of=8, max_batch_size=96)
    c.update(0, Est(90.0, 1.0))
    assert c.batch_size == 96
    c.update(1, Est(1e9, 1.0))
    assert c.batch_size == 96
    assert c.lr_multiplier == pytest.approx(math.sqrt(12.0), rel=1e-15)


def test_cap_equal_to_initial_keeps_batch():
    c = ctrl(initial_batch_size=16, max_batch_size=16)
    c.update(0, Est(1e6, 1.0))
    assert c.batch_size == 16 and c.lr_multiplier == 1.0


@pytest.mark.parametrize("mode,expected", [("sqrt", 2.0), ("linear", 4.0), ("none", 1.0)])
def test_lr_multiplier_modes(mode, expected):
    c = ctrl(initial_batch_size=16, lr_scaling=mode)
    c.update(0, Est(64.0, 1.0))
    assert c.batch_size == 64
    assert c.lr_multiplier == expected


def test_lr_multiplier_is_cumulative_product():
    # omega_{k+1} = omega_k * sqrt(B_{k+1} / B_k), with omega_0 = 1
    c = ctrl(initial_batch_size=3, multiple_of=3)
    omega, prev = 1.0, 3
    for k, noise in enumerate([5.0, 5.0, 17.0, 2.0, 100.0, 101.0]):
        b = c.update(k, Est(noise, 1.0))
        omega *= math.sqrt(b / prev)
        prev = b
        assert c.lr_multiplier == pytest.approx(omega, rel=1e-13)
    assert c.batch_size == 102  # 101 rounded up to a multiple of 3


@pytest.mark.parametrize(
    "bad",
    [Est(float("nan"), 1.0), Est(1.0, float("nan")), Est(float("inf"), 1.0), Est(1.0, float("inf")),
     Est(1.0, 0.0), Est(1.0, -2.0), Est(-1.0, 1.0), Est(50.0, 1.0, valid=False)],
    ids=["nan-noise", "nan-signal", "inf-noise", "inf-signal", "zero-signal", "neg-signal",
         "neg-noise", "valid-false"],
)
def test_invalid_measurement_skipped(bad, caplog):
    c = ctrl(beta_noise=0.5, beta_signal=0.5)
    c.update(0, Est(10.0, 1.0))
    before = c.state_dict()
    with caplog.at_level(logging.WARNING, logger="gns_kernels.controller"):
        c.update(1, bad)
    after = c.state_dict()
    assert after["num_skipped"] == 1 and after["last_step"] == 1
    for key in ("batch_size", "noise_ema", "signal_ema", "num_measurements", "last_measured_step"):
        assert after[key] == before[key], key
    assert any("invalid" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    c.update(2, Est(30.0, 1.0))         # EMA continues from the last valid value
    assert c.noise_ema == 20.0 and c.batch_size == 20


def test_invalid_first_measurement_then_valid_starts_ema():
    c = AdaptiveBatchSize(initial_batch_size=2, theta=1.0, beta_noise=0.9, beta_signal=0.9, every=1)
    c.update(0, Est(float("nan"), 1.0))
    c.update(1, Est(5.0, 0.0))
    c.update(2, None)
    assert c.noise_ema is None and c.batch_size == 2 and c.num_skipped == 3
    c.update(3, Est(40.0, 2.0))
    assert (c.noise_ema, c.signal_ema, c.batch_size) == (40.0, 2.0, 20)


def test_none_at_measuring_step_keeps_everything():
    c = ctrl(beta_noise=0.5, beta_signal=0.5, every=2)
    c.update(0, Est(10.0, 1.0))
    c.update(1, None)
    c.update(2, None)
    assert c.noise_ema == 10.0 and c.batch_size == 10 and c.num_skipped == 1
    assert c.last_measured_step == 0 and c.last_step == 2


def test_stale_estimate_with_step_attribute_skipped():
    StepEst = Est

    c = ctrl(every=2)
    c.update(0, StepEst(10.0, 1.0, step=0))
    c.update(2, StepEst(90.0, 1.0, step=0))   # hook did not measure at 2: stale
    assert c.batch_size == 10 and c.num_skipped == 1
    c.update(4, StepEst(90.0, 1.0, step=4))
    assert c.batch_size == 90


def test_ceil_tolerates_float_noise():
    # 21.96 / 0.6^2 evaluates to 61.00000000000001 in float64: a naive ceil gives 62
    assert 21.96 / (0.6 * 0.6 * 1.0) > 61.0
    c = ctrl(theta=0.6)
    c.update(0, Est(21.96, 1.0))
    assert c.batch_size == 61
    c.update(1, Est(0.36 * 61.5, 1.0))     # a genuine fraction still rounds up
    assert c.batch_size == 62


def test_overflowing_target():
    c = ctrl(max_batch_size=1024)
    c.update(0, Est(1e300, 1e-300))
    assert c.batch_size == 1024
    c2 = ctrl()
    c2.update(0, Est(1e300, 1e-300))
    assert c2.batch_size == 4 and c2.noise_ema == 1e300


def test_logs_info_on_change(caplog):
    c = ctrl()
    with caplog.at_level(logging.INFO, logger="gns_kernels.controller"):
        c.update(0, Est(4.0, 1.0))       # target 4 == B: no change, no message
        assert not [r for r in caplog.records if r.levelno == logging.INFO]
        c.update(1, Est(9.0, 1.0))
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(msgs) == 1 and "4 -> 9" in msgs[0]


def test_steps_must_increase():
    c = ctrl()
    c.update(0, None)
    c.update(3, None)                   # gaps are fine
    with pytest.raises(ValueError, match="step"):
        c.update(3, None)
    with pytest.raises(ValueError, match="step"):
        c.update(1, None)
    with pytest.raises(ValueError, match="step"):
        c.update(-1, None)
    with pytest.raises(TypeError, match="step"):
        c.update(4.0, None)


def test_estimate_without_fields_is_a_type_error():
    c = ctrl()
    with pytest.raises(TypeError, match="estimate"):
        c.update(0, 3.5)


def _random_stream(seed, n):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.1:
            out.append(None)
        elif u < 0.2:
            out.append(Est(float("nan"), 1.0))
        else:
            out.append(Est(rng.uniform(0.0, 50.0) * (1 + len(out) / 10), rng.uniform(0.5, 2.0)))
    return out


def _trace(c, stream, start):
    return [(c.update(k, e), c.lr_multiplier, c.noise_ema, c.signal_ema, c.gns_ema)
            for k, e in enumerate(stream) if k >= start]


@pytest.mark.parametrize("cut", [7, 23, 40])
def test_state_round_trip_continues_same_trajectory(cut):
    kw = dict(initial_batch_size=8, theta=0.6, beta_noise=0.9, beta_signal=0.8, every=3,
              warmup_steps=10, max_batch_size=400, multiple_of=4)
    stream = _random_stream(cut, 60)
    full = AdaptiveBatchSize(**kw)
    whole = _trace(full, stream, 0)

    first = AdaptiveBatchSize(**kw)
    head = _trace(first, stream[:cut], 0)
    sd = json.loads(json.dumps(first.state_dict()))    # through a text checkpoint
    resumed = AdaptiveBatchSize(**kw)
    resumed.load_state_dict(copy.deepcopy(sd))
    assert resumed.state_dict() == first.state_dict()
    tail = _trace(resumed, stream, cut)
    assert head + tail == whole                          # exact, float for float
    assert full.state_dict() == resumed.state_dict()
    assert whole[-1][0] > 8                              # the trajectory did grow


# state_dicts as AdaptiveBatchSize wrote them before ControllerConfig (issue 41), copied from
# its output: AdaptiveBatchSize(initial_batch_size=8, theta=0.5, beta_noise=0.5,
# beta_signal=0.75, every=2, warmup_steps=2, max_batch_size=256, multiple_of=4,
# max_growth=4.0) after update(0, (8, 2)), update(2, (16, 6)), update(3, None), update(4, None)
SETTINGS_V1 = dict(initial_batch_size=8, theta=0.5, beta_noise=0.5, beta_signal=0.75, every=2,
                   warmup_steps=2, max_batch_size=256, multiple_of=4, max_growth=4.0)
STATE_V1 = {
    "version": 1,
    "config": {"initial_batch_size": 8, "theta": 0.5, "beta_noise": 0.5, "beta_signal": 0.75,
               "every": 2, "warmup_steps": 2, "max_batch_size": 256, "multiple_of": 4,
               "lr_scaling": "sqrt", "signal": "raw", "max_growth": 4.0},
    "batch_size": 16, "noise_ema": 12.0, "signal_ema": 3.0, "target_batch_size": 16.0,
    "last_step": 4, "last_measured_step": 2, "num_measurements": 2, "num_skipped": 1,
}
# the same settings but warmup 0, max_batch_size and max_growth None, under a coordinator's
# schedule (F and B are the schedule's: neither saved here), after update(0, (8, 2))
STATE_V1_SHARED = {
    "version": 1,
    "config": {"initial_batch_size": 8, "theta": 0.5, "beta_noise": 0.5, "beta_signal": 0.75,
               "warmup_steps": 0, "max_batch_size": None, "multiple_of": 4, "lr_scaling": "sqrt",
               "signal": "raw", "max_growth": None},
    "noise_ema": 8.0, "signal_ema": 2.0, "target_batch_size": 16.0, "last_step": 0,
    "last_measured_step": 0, "num_measurements": 1, "num_skipped": 0,
}


def test_a_state_dict_written_before_controller_config_loads_and_continues():
    c = AdaptiveBatchSize(**SETTINGS_V1)
    c.load_state_dict(copy.deepcopy(STATE_V1))
    assert c.state_dict() == STATE_V1
    assert list(c.state_dict()) == list(STATE_V1) and list(c.config()) == list(STATE_V1["config"])
    assert (c.batch_size, c.lr_multiplier, c.gns_ema) == (16, math.sqrt(2.0), 4.0)
    # N = 0.5 x 12 + 0.5 x 64 = 38, M = 0.75 x 3 + 0.25 x 2 = 2.75; 38 / (0.25 x 2.75) = 55.27
    # -> 56 (a multiple of 4, under 4 x 16 and 256)
    assert c.update(6, Est(64.0, 2.0, step=6)) == 56
    assert (c.noise_ema, c.signal_ema, c.target_batch_size) == (38.0, 2.75, 38.0 / 0.6875)
    assert c.lr_multiplier == math.sqrt(7.0)
    # the one written by the same controller without a resume
    d = AdaptiveBatchSize(**SETTINGS_V1)
    for k, e in ((0, Est(8.0, 2.0, step=0)), (2, Est(16.0, 6.0, step=2)), (3, None), (4, None)):
        d.update(k, e)
    assert d.state_dict() == STATE_V1


def test_a_shared_schedule_state_dict_written_before_controller_config_loads():
    kw = dict(initial_batch_size=8, theta=0.5, beta_noise=0.5, beta_signal=0.75, every=2, multiple_of=4)
    run = Schedule(every=2, batch_size=16, owner="AdaptiveBatching")   # the owner loaded F and B
    c = AdaptiveBatchSize(**kw, schedule=run)
    c.load_state_dict(copy.deepcopy(STATE_V1_SHARED))
    assert c.state_dict() == STATE_V1_SHARED and c.batch_size == 16
    d = AdaptiveBatchSize(**kw, schedule=Schedule(every=2, batch_size=8, owner="AdaptiveBatching"))
    d.update(0, Est(8.0, 2.0, step=0))
    assert d.state_dict() == STATE_V1_SHARED and d.batch_size == 16


def test_settings_are_one_controller_config():
    cfg = ControllerConfig(**SETTINGS_V1)
    c = AdaptiveBatchSize(**SETTINGS_V1)
    assert c.settings == cfg and c.config() == cfg.to_dict() == STATE_V1["config"]
    f = AdaptiveBatchSize.from_config(cfg)
    assert f.settings is cfg and f.config() == c.config() and f.batch_size == 8
    for name, value in SETTINGS_V1.items():
        assert getattr(f, name) == value
        with pytest.raises(AttributeError):
            setattr(f, name, value)                      # read-only: the config owns them
    f.load_state_dict(copy.deepcopy(STATE_V1))
    assert f.state_dict() == STATE_V1
    with pytest.raises(TypeError, match="config: expected a ControllerConfig, got dict"):
        AdaptiveBatchSize.from_config(SETTINGS_V1)
    with pytest.raises(ValueError, match="every: 2 given, the schedule's is 3"):
        AdaptiveBatchSize.from_config(cfg, schedule=Schedule(every=3, batch_size=8))
    run = Schedule(every=2, batch_size=8, owner="AdaptiveBatching")
    assert AdaptiveBatchSize.from_config(cfg, schedule=run).schedule is run
    # F is the schedule's: the settings follow it
    c.schedule.write("every", 5, by="AdaptiveBatchSize")
    assert c.every == 5 and c.settings.every == 5 and c.config()["every"] == 5


def test_lr_scalings_public_and_its_old_name():
    assert controller.LR_SCALINGS == ("sqrt", "linear", "none")
    assert controller._LR_SCALINGS is controller.LR_SCALINGS


def test_load_state_dict_config_mismatch():
    c = ctrl(initial_batch_size=8)
    c.update(0, Est(20.0, 1.0))
    sd = c.state_dict()
    other = ctrl(initial_batch_size=8, theta=0.5, max_batch_size=64)
    with pytest.raises(ValueError, match="theta"):
        other.load_state_dict(sd)
    other.load_state_dict(sd, strict=False)              # keep own config, load the state
    assert other.batch_size == 20 and other.theta == 0.5
    with pytest.raises(ValueError, match="multiple"):
        ctrl(initial_batch_size=8, multiple_of=8).load_state_dict(sd, strict=False)
    with pytest.raises(ValueError, match="version"):
        c.load_state_dict({**sd, "version": 99})
    with pytest.raises(ValueError, match="missing"):
        c.load_state_dict({k: v for k, v in sd.items() if k != "noise_ema"})


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        (dict(theta=0.0), ValueError, "theta"),
        (dict(theta=-0.6), ValueError, "theta"),
        (dict(theta=float("nan")), ValueError, "theta"),
        (dict(theta="0.6"), TypeError, "theta"),
        (dict(beta_noise=1.0), ValueError, "beta_noise"),
        (dict(beta_noise=-0.1), ValueError, "beta_noise"),
        (dict(beta_signal=1.5), ValueError, "beta_signal"),
        (dict(every=0), ValueError, "every"),
        (dict(every=2.5), TypeError, "every"),
        (dict(warmup_steps=-1), ValueError, "warmup_steps"),
        (dict(initial_batch_size=0), ValueError, "initial_batch_size"),
        (dict(initial_batch_size=True), TypeError, "initial_batch_size"),
        (dict(initial_batch_size=64, multiple_of=48), ValueError, "multiple_of"),
        (dict(multiple_of=0), ValueError, "multiple_of"),
        (dict(initial_batch_size=64, max_batch_size=32), ValueError, "max_batch_size"),
        (dict(initial_batch_size=64, multiple_of=8, max_batch_size=100), ValueError, "max_batch_size"),
        (dict(lr_scaling="cubic"), ValueError, "lr_scaling"),
    ],
)
def test_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        AdaptiveBatchSize(**kwargs)


def test_with_real_gns_estimates():
    # gk.GNSEstimate from gk.estimate drives the controller; batch from the oracle's numbers
    import torch

    import gns_kernels as gk
    from gns_kernels import reference

    g = torch.Generator().manual_seed(5)
    R, B = 4, 32
    c = AdaptiveBatchSize(initial_batch_size=4, theta=0.6, beta_noise=0.5, beta_signal=0.5,
                          every=1, multiple_of=4)
    N = M = None
    expected = 4
    for k in range(3):
        mean = torch.randn(5, 3, generator=g, dtype=torch.float64)
        rank_grads = [[mean + 2.0 * torch.randn(5, 3, generator=g, dtype=torch.float64)] for _ in range(R)]
        est = gk.estimate(rank_grads, batch_size=B, geometry="l1", bias_correction=False)
        n, s = reference.raw_gns(rank_grads, B, "l1")
        N = n if N is None else 0.5 * N + 0.5 * n
        M = s if M is None else 0.5 * M + 0.5 * s
        expected = max(expected, 4 * math.ceil(N / (0.36 * M) / 4))
        c.update(k, est)
        assert c.noise_ema == pytest.approx(N, rel=1e-10)
        assert c.signal_ema == pytest.approx(M, rel=1e-10)
        assert c.batch_size == expected
    bad = [[torch.full((5, 3), float("nan"), dtype=torch.float64)] for _ in range(R)]
    before = c.state_dict()
    c.update(3, gk.estimate(bad, batch_size=B, geometry="l1"))
    assert c.num_skipped == 1 and c.noise_ema == before["noise_ema"]


def _algorithm1(stream, B0, theta, bN, bM, F, I, cap, mult):
    """Algorithm 1 transcribed from the paper, with the controller's documented rules (valid-only
    EMAs, rounding, cap)."""
    B, omega, N, M, out = B0, 1.0, None, None, []
    for k, e in enumerate(stream):
        if k % F == 0 and e is not None and e.valid and math.isfinite(e.noise) \
                and math.isfinite(e.signal) and e.signal > 0 and e.noise >= 0:
            N = e.noise if N is None else bN * N + (1 - bN) * e.noise
            M = e.signal if M is None else bM * M + (1 - bM) * e.signal
            if k >= I:
                Bn = max(math.ceil(N / (theta ** 2 * M)), B)
                Bn = ((Bn + mult - 1) // mult) * mult
                if cap is not None:
                    Bn = max(min(Bn, cap), B)
                omega *= math.sqrt(Bn / B)
                B = Bn
        out.append((B, omega))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_trajectories_match_transcribed_algorithm(seed):
    rng = random.Random(seed)
    mult = rng.choice([1, 2, 8])
    B0 = mult * rng.randint(1, 4)
    cap = rng.choice([None, B0 * rng.randint(4, 40)])
    kw = dict(initial_batch_size=B0, theta=rng.choice([0.3, 0.5, 0.6, 1.7]),
              beta_noise=rng.uniform(0, 0.95), beta_signal=rng.uniform(0, 0.95),
              every=rng.randint(1, 5), warmup_steps=rng.randint(0, 20), max_batch_size=cap,
              multiple_of=mult)
    stream = _random_stream(100 + seed, 150)
    expected = _algorithm1(stream, B0, kw["theta"], kw["beta_noise"], kw["beta_signal"],
                           kw["every"], kw["warmup_steps"], cap, mult)
    c = AdaptiveBatchSize(**kw)
    got = [(c.update(k, e), c.lr_multiplier) for k, e in enumerate(stream)]
    assert [b for b, _ in got] == [b for b, _ in expected]
    for (_, w), (_, w_ref) in zip(got, expected):
        assert w == pytest.approx(w_ref, rel=1e-12)


# ----------------------------------------------------------------------------- signal
def KindEst(noise, signal, signal_kind, valid=True):
    return Est(noise, signal, valid, signal_kind=signal_kind)


def test_signal_option_checked_against_the_estimates():
    assert AdaptiveBatchSize().signal == "raw"
    with pytest.raises(ValueError, match="signal: expected 'raw'.*'debiased', got 'unbiased'"):
        ctrl(signal="unbiased")
    c = ctrl(signal="debiased")
    # noise 8 / (theta^2 = 1 x signal 2) = 4 -> batch stays 4; then 40 / 2 = 20
    assert c.update(0, KindEst(8.0, 2.0, "debiased")) == 4
    assert c.update(1, KindEst(40.0, 2.0, "debiased")) == 20
    with pytest.raises(ValueError, match="signal: this controller was built with signal='debiased'"):
        c.update(2, KindEst(40.0, 2.0, "raw"))
    assert c.update(3, KindEst(80.0, 2.0, "debiased")) == 40


@dataclass
class _NotAnEstimate:
    noise: float
    signal: float


def test_the_controller_takes_a_gnsestimate():
    """One type reaches the controller (it probed any object with getattr before)."""
    c = ctrl()
    before = c.state_dict()
    with pytest.raises(TypeError, match="estimate: expected a gns_kernels.GNSEstimate or None, got _NotAnEstimate"):
        c.update(0, _NotAnEstimate(1.0, 1.0))
    assert c.state_dict() == before          # refused: nothing changed, step 0 still next
    assert c.update(0, Est(8.0, 1.0)) == 8


def test_state_dict_without_signal_loads_as_raw_and_round_trips():
    c = ctrl()
    c.update(0, Est(40.0, 2.0))
    sd = c.state_dict()
    assert sd["config"]["signal"] == "raw"
    old = copy.deepcopy(sd)
    del old["config"]["signal"]  # written before the option existed
    d = ctrl()
    d.load_state_dict(old)
    assert d.state_dict() == sd
    with pytest.raises(ValueError, match="signal"):
        ctrl(signal="debiased").load_state_dict(sd)


def test_non_strict_load_across_signal_kinds_warns():
    c = ctrl()
    sd_empty = c.state_dict()
    c.update(0, Est(40.0, 2.0))
    sd = c.state_dict()
    d = ctrl(signal="debiased")
    with pytest.warns(UserWarning, match="signal='raw'.*signal='debiased'"):
        d.load_state_dict(sd, strict=False)
    assert d.noise_ema == c.noise_ema and d.signal == "debiased"
    import warnings as _w
    with _w.catch_warnings():
        _w.simplefilter("error")
        ctrl(signal="debiased").load_state_dict(sd_empty, strict=False)  # no EMAs yet: silent
        ctrl().load_state_dict(sd, strict=False)  # same kind: silent


def test_max_growth_is_the_controllers_setting_and_saved():
    """max_growth moved from the coordinator (which wrote the controller's private batch)
    into the controller: B_{k+1} <= g B_k, rounded down to multiple_of, at least one step."""
    c = ctrl(initial_batch_size=8, multiple_of=8, max_growth=2.0)
    assert c.update(0, Est(1000.0, 1.0)) == 16
    assert c.update(1, Est(1000.0, 1.0)) == 32
    c3 = ctrl(initial_batch_size=8, multiple_of=8, max_growth=1.01)
    assert c3.update(0, Est(1000.0, 1.0)) == 16      # at least one multiple_of
    assert c.config()["max_growth"] == 2.0
    with pytest.raises(ValueError, match="max_growth: saved 2.0 vs None"):
        ctrl(initial_batch_size=8, multiple_of=8).load_state_dict(c.state_dict())
    old = c.state_dict()
    del old["config"]["max_growth"]                   # a checkpoint from before the setting
    ctrl(initial_batch_size=8, multiple_of=8).load_state_dict(old)
    for bad in (1.0, 0.5, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="max_growth"):
            ctrl(max_growth=bad)
