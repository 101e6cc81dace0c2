"""The pure steps of Algorithm 1 (gns_kernels/controller_rule.py), each against numbers
worked out by hand."""
from __future__ import annotations

import copy
import math

import pytest

from gns_kernels.controller_config import ControllerConfig
from gns_kernels.controller_rule import (STATE_VERSION, Trajectory, ceil_tolerant, decide_batch, ema,
                                         invalid_reason, lr_omega, read_state_dict, target_batch)
from gns_kernels.stats import GNSEstimate

INF = math.inf

# (target N/(theta^2 M), B_k, settings, B_{k+1}, why)
DECISIONS = [
    (10.0, 4, {}, 10, "ceil of an integer target"),
    (10.2, 4, {}, 11, "ceil"),
    (21.96 / 0.6 ** 2, 4, {}, 61, "61.00000000000001 is 61 (1e-9 relative)"),
    (61.0000001, 4, {}, 62, "1.6e-9 relative above 61: ceil"),
    (3.0, 8, {}, 8, "never below B_k"),
    (0.0, 8, {}, 8, "zero noise"),
    (10.2, 8, dict(multiple_of=4), 12, "11 rounded up to a multiple of 4"),
    (12.0, 8, dict(multiple_of=4), 12, "already a multiple"),
    (10.2, 8, dict(multiple_of=4, max_batch_size=64), 12, "under the cap"),
    (100.0, 8, dict(multiple_of=4, max_batch_size=64), 64, "capped"),
    (61.5, 8, dict(multiple_of=4, max_batch_size=64), 64, "62 -> 64 is the cap itself"),
    (100.0, 72, dict(max_batch_size=64), 72, "the cap never takes B below B_k"),
    (INF, 8, dict(multiple_of=4, max_batch_size=64), 64, "overflow: the cap"),
    (INF, 8, {}, 8, "overflow without a cap: B_k kept"),
    (1000.0, 8, dict(multiple_of=8, max_growth=2.0), 16, "2 x 8"),
    (1000.0, 8, dict(multiple_of=8, max_growth=1.01), 16, "8.08 -> 8 (down to a multiple), at least 8 + 8"),
    (1000.0, 24, dict(multiple_of=8, max_growth=1.5), 32, "36 rounded down to 32"),
    (20.0, 16, dict(max_growth=2.0), 20, "under the bound"),
    (1000.0, 10, dict(max_growth=2.5), 25, "2.5 x 10"),
    (1000.0, 100, dict(max_growth=1.15), 115, "1.15 x 100 = 114.99999999999999 is 115"),
    (33.0, 16, dict(multiple_of=8, max_growth=2.0), 32, "33 -> 40 rounded, bounded at 32"),
    (INF, 8, dict(multiple_of=8, max_batch_size=1024, max_growth=2.0), 16, "overflow: the cap, bounded"),
    (1000.0, 48, dict(multiple_of=8, max_batch_size=64, max_growth=2.0), 64, "cap below the bound"),
]


@pytest.mark.parametrize("target,batch,kw,expected,why", DECISIONS, ids=[d[4] for d in DECISIONS])
def test_decide_batch_by_hand(target, batch, kw, expected, why):
    got = decide_batch(target, batch, **kw)
    assert type(got) is int and got == expected, why


def test_ceil_tolerant():
    assert [ceil_tolerant(x) for x in (0.0, 0.2, 1.0, 64.00000000001, 64.0000001, 1e8 + 0.5)] == \
        [0, 1, 1, 64, 65, 100000001]
    assert ceil_tolerant(1e9 + 0.5) == 10 ** 9              # within 1e-9 relative: 1 example at 1e9
    assert ceil_tolerant(0.9999999999) == 1


def test_target_batch():
    assert target_batch(8.0, 2.0, 0.5) == 16.0              # 8 / (0.25 x 2)
    assert target_batch(12.0, 3.0, 0.5) == 16.0
    assert target_batch(8.0, 2.75, 0.5) == 8.0 / 0.6875
    assert target_batch(1.0, 5e-324, 1e-3) == INF           # theta^2 M underflows to 0
    assert target_batch(0.0, 5e-324, 1e-3) == 0.0
    assert target_batch(1e300, 1e-300, 1.0) == INF          # the quotient overflows


def test_ema():
    assert ema(None, 5.0, 0.9) == 5.0                        # starts at the first value
    assert ema(12.0, 4.0, 0.5) == 8.0
    assert ema(3.0, 2.0, 0.75) == 2.75
    assert ema(3.0, 2.0, 0.0) == 2.0


def test_lr_omega():
    assert (lr_omega(4.0, "sqrt"), lr_omega(4.0, "linear"), lr_omega(4.0, "none")) == (2.0, 4.0, 1.0)
    assert lr_omega(7.0, "sqrt") == math.sqrt(7.0)


def _est(noise=8.0, signal=2.0, valid=True, step=None, **kw):
    return GNSEstimate(gns=noise / signal if signal else math.nan, noise=noise, signal=signal,
                       valid=valid, signal_unbiased=None, geometry="l1", num_samples=2,
                       batch_size=8.0, bias_corrected=True, step=step, **kw)


@pytest.mark.parametrize("est,reason", [
    (_est(), None),
    (_est(step=3), None),
    (_est(step=2), "stale estimate (measured at step 2)"),
    (_est(valid=False), "estimate.valid is False"),
    (_est(noise=math.nan), "non-finite noise/signal (nan, 2.0)"),
    (_est(signal=0.0), "signal <= 0 (0.0)"),
    (_est(noise=-1.0), "noise < 0 (-1.0)"),
    (_est(noise_pooled=-1.0), "pooled noise not a finite number >= 0 (-1.0)"),
    (_est(noise_pooled=9.0), None),
])
def test_invalid_reason(est, reason):
    assert invalid_reason(3, est) == reason


# a checkpoint of AdaptiveBatchSize(initial_batch_size=8, theta=0.5, beta_noise=0.5,
# beta_signal=0.75, every=2, warmup_steps=2, max_batch_size=256, multiple_of=4, max_growth=4.0)
CFG = ControllerConfig(initial_batch_size=8, theta=0.5, beta_noise=0.5, beta_signal=0.75, every=2,
                       warmup_steps=2, max_batch_size=256, multiple_of=4, max_growth=4.0)
SD = {"version": 1, "config": CFG.to_dict(), "batch_size": 16, "noise_ema": 12.0, "signal_ema": 3.0,
      "target_batch_size": 16.0, "last_step": 4, "last_measured_step": 2, "num_measurements": 2,
      "num_skipped": 1}


def test_read_state_dict_returns_the_checked_trajectory():
    before = copy.deepcopy(SD)
    batch, traj = read_state_dict(SD, CFG, strict=True)
    assert batch == 16 and STATE_VERSION == 1
    assert traj == Trajectory(noise_ema=12.0, signal_ema=3.0, target_batch_size=16.0, last_step=4,
                              last_measured_step=2, num_measurements=2, num_skipped=1)
    assert SD == before                                      # the dict is only read
    # a coordinator's schedule: its B is used, the saved one (and F) neither read nor compared
    shared = {k: v for k, v in SD.items() if k != "batch_size"}
    shared["config"] = {k: v for k, v in SD["config"].items() if k != "every"}
    assert read_state_dict(shared, CFG, strict=True, shared_batch=32)[0] == 32
    assert read_state_dict({**shared, "batch_size": "junk"}, CFG, strict=True, shared_batch=32)[0] == 32


def test_read_state_dict_clamps_only_when_not_strict():
    small = ControllerConfig(initial_batch_size=8, theta=0.5, beta_noise=0.5, beta_signal=0.75, every=2,
                             warmup_steps=2, max_batch_size=12, multiple_of=4, max_growth=4.0)
    with pytest.raises(ValueError, match=r"max_batch_size: saved 256 vs 12"):
        read_state_dict(SD, small, strict=True)
    with pytest.warns(RuntimeWarning, match="saved batch size 16 is above max_batch_size \\(12\\)"):
        assert read_state_dict(SD, small, strict=False)[0] == 12


@pytest.mark.parametrize("change,exc,message", [
    (dict(version=2), ValueError, "state_dict has version 2, expected 1"),
    (dict(batch_size=18), ValueError, r"state_dict\['batch_size'\] \(18\) is not a multiple of 4"),
    (dict(batch_size=16.0), TypeError, r"state_dict\['batch_size'\]"),
    (dict(noise_ema=None), ValueError, "noise_ema and signal_ema must both be None"),
    (dict(signal_ema=0.0), ValueError, r"state_dict\['signal_ema'\]"),
    (dict(target_batch_size=-1.0), ValueError, r"state_dict\['target_batch_size'\]"),
    (dict(last_measured_step=5), ValueError, r"last_measured_step'\]: expected at most last_step \(4\)"),
    (dict(num_skipped=-1), ValueError, r"state_dict\['num_skipped'\]"),
    (dict(config=[]), TypeError, r"state_dict\['config'\]: expected a dict"),
])
def test_read_state_dict_refuses_naming_the_entry(change, exc, message):
    with pytest.raises(exc, match=message):
        read_state_dict({**SD, **change}, CFG, strict=False)
    with pytest.raises(ValueError, match=r"missing keys \['num_skipped'\]"):
        read_state_dict({k: v for k, v in SD.items() if k != "num_skipped"}, CFG, strict=True)
