"""ControllerConfig (gns_kernels/controller_config.py): the controller's settings, checked
once in __post_init__; config_differences."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gns_kernels.controller import AdaptiveBatchSize
from gns_kernels.controller_config import (LR_SCALINGS, OLD_CHECKPOINT_DEFAULTS, ControllerConfig,
                                           config_differences)

NAN, INF = float("nan"), float("inf")

# (bad arguments, exception type, the start of the message: the argument's name first)
BAD = [
    (dict(initial_batch_size=0), ValueError, "initial_batch_size: expected an int >= 1, got 0"),
    (dict(initial_batch_size=True), TypeError, "initial_batch_size: expected an int >= 1"),
    (dict(initial_batch_size=8.0), TypeError, "initial_batch_size: expected an int >= 1"),
    (dict(theta=0.0), ValueError, "theta:"),
    (dict(theta=-0.6), ValueError, "theta:"),
    (dict(theta=NAN), ValueError, "theta:"),
    (dict(theta="0.6"), TypeError, "theta:"),
    (dict(theta=1e-170), ValueError, "theta: expected a value whose square is a positive finite"),
    (dict(theta=1e160), ValueError, "theta: expected a value whose square is a positive finite"),
    (dict(beta_noise=1.0), ValueError, "beta_noise must be in [0, 1), got 1.0"),
    (dict(beta_noise=-0.1), ValueError, "beta_noise must be in [0, 1), got -0.1"),
    (dict(beta_noise=None), TypeError, "beta_noise:"),
    (dict(beta_signal=1.5), ValueError, "beta_signal must be in [0, 1), got 1.5"),
    (dict(beta_signal=INF), ValueError, "beta_signal:"),
    (dict(every=0), ValueError, "every: expected an int >= 1, got 0"),
    (dict(every=2.5), TypeError, "every: expected an int >= 1"),
    (dict(warmup_steps=-1), ValueError, "warmup_steps: expected an int >= 0, got -1"),
    (dict(warmup_steps=1.0), TypeError, "warmup_steps: expected an int >= 0"),
    (dict(multiple_of=0), ValueError, "multiple_of: expected an int >= 1, got 0"),
    (dict(initial_batch_size=64, multiple_of=48), ValueError,
     "initial_batch_size (64) must be a multiple of multiple_of (48)"),
    (dict(max_batch_size=0), ValueError, "max_batch_size: expected an int >= 1, got 0"),
    (dict(max_batch_size=128.0), TypeError, "max_batch_size: expected an int >= 1"),
    (dict(initial_batch_size=64, max_batch_size=32), ValueError,
     "max_batch_size (32) must be >= initial_batch_size (64)"),
    (dict(initial_batch_size=64, multiple_of=8, max_batch_size=100), ValueError,
     "max_batch_size (100) must be a multiple of multiple_of (8) so that the capped batch"),
    (dict(lr_scaling="cubic"), ValueError, "lr_scaling must be one of ('sqrt', 'linear', 'none'), got 'cubic'"),
    (dict(lr_scaling=None), ValueError, "lr_scaling must be one of"),
    (dict(signal="unbiased"), ValueError, "signal: expected 'raw' (the paper's signal) or 'debiased'"),
    (dict(signal=None), ValueError, "signal: expected"),
    (dict(max_growth=1.0), ValueError, "max_growth: expected None or a finite number > 1, got 1.0"),
    (dict(max_growth=INF), ValueError, "max_growth: expected None or a finite number > 1"),
    (dict(max_growth=True), ValueError, "max_growth: expected None or a finite number > 1"),
    (dict(max_growth="2"), ValueError, "max_growth: expected None or a finite number > 1"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD, ids=[repr(b[0]) for b in BAD])
def test_each_bad_setting_raises_naming_it(kwargs, exc, message):
    with pytest.raises(Exception) as info:
        ControllerConfig(**kwargs)
    assert type(info.value) is exc
    assert str(info.value).startswith(message), str(info.value)
    # the constructor raises the same (it builds its settings with ControllerConfig)
    with pytest.raises(Exception) as ctor:
        AdaptiveBatchSize(**kwargs)
    assert (type(ctor.value), str(ctor.value)) == (exc, str(info.value))


@pytest.mark.parametrize("kwargs", [
    dict(theta=1e-150), dict(theta=1e150), dict(theta=4), dict(beta_noise=0), dict(beta_signal=0.999),
    dict(every=1), dict(warmup_steps=0), dict(initial_batch_size=48, multiple_of=48),
    dict(initial_batch_size=64, max_batch_size=64), dict(initial_batch_size=64, multiple_of=8, max_batch_size=104),
    dict(lr_scaling="linear"), dict(lr_scaling="none"), dict(signal="debiased"),
    dict(max_growth=1.0000001), dict(max_growth=3),
])
def test_boundary_settings_are_accepted(kwargs):
    cfg = ControllerConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(cfg, k) == v


def test_defaults_are_the_constructors():
    assert ControllerConfig() == AdaptiveBatchSize().settings
    assert ControllerConfig().to_dict() == AdaptiveBatchSize().config()
    assert list(ControllerConfig().to_dict()) == [
        "initial_batch_size", "theta", "beta_noise", "beta_signal", "every", "warmup_steps",
        "max_batch_size", "multiple_of", "lr_scaling", "signal", "max_growth"]
    assert "every" not in ControllerConfig().to_dict(every=False)
    assert LR_SCALINGS == ("sqrt", "linear", "none")


def test_values_are_kept_as_plain_python_numbers():
    cfg = ControllerConfig(initial_batch_size=np.int64(16), theta=np.float32(0.5), beta_noise=0,
                           every=np.int32(4), multiple_of=np.int64(8), max_batch_size=np.int64(64),
                           max_growth=2)
    assert type(cfg.initial_batch_size) is int and cfg.initial_batch_size == 16
    assert type(cfg.theta) is float and cfg.theta == 0.5
    assert type(cfg.beta_noise) is float
    assert type(cfg.every) is int and type(cfg.multiple_of) is int and type(cfg.max_batch_size) is int
    assert type(cfg.max_growth) is float and cfg.max_growth == 2.0


def test_frozen_and_keyword_only():
    cfg = ControllerConfig(theta=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.theta = 0.6
    with pytest.raises(TypeError):
        ControllerConfig(64)
    with pytest.raises(ValueError, match="theta"):          # replace validates again
        dataclasses.replace(cfg, theta=-1.0)
    assert dataclasses.replace(cfg, theta=0.6) == ControllerConfig()
    assert hash(cfg) == hash(ControllerConfig(theta=0.3))


def test_config_differences():
    mine = ControllerConfig(theta=0.3).to_dict()
    assert config_differences(mine, dict(mine)) == {}
    assert config_differences(mine, {**mine, "theta": 0.6, "every": 5}) == {"every": (5, 100), "theta": (0.6, 0.3)}
    assert config_differences(mine, {**mine, "theta": 0.6}, ignore=("theta",)) == {}
    old = {k: v for k, v in mine.items() if k not in OLD_CHECKPOINT_DEFAULTS}   # before the settings
    assert config_differences(mine, old) == {}
    assert config_differences({**mine, "signal": "debiased"}, old) == {"signal": ("raw", "debiased")}
    assert config_differences(ControllerConfig(theta=0.3).to_dict(every=False), mine) == {"every": (100, None)}
