"""The pure parts of Algorithm 1 (``gk.AdaptiveBatchSize``): functions of numbers that
change nothing, which the controller calls in the order of the rule.

- ``invalid_reason(step, estimate)``: why a measurement is skipped, or None.
- ``ema(prev, value, beta)``: one EMA step, starting at the first value.
- ``target_batch(noise, signal, theta)``: N / (theta^2 M), inf beyond the float range.
- ``decide_batch(target, batch, ...)``: B_{k+1} from the target and B_k (tolerant ceil,
  max with B_k, rounding up to ``multiple_of``, the cap, the growth bound).
- ``lr_omega(ratio, lr_scaling)``: the LR multiplier omega(B / B_0).
- ``read_state_dict(state_dict, config, ...)``: a checkpoint checked entry by entry, as the
  batch and a ``Trajectory`` (the EMAs and counters) to continue from.

The rule itself is documented in gns_kernels/controller.py and docs/controller.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Optional

from ._validation import check_int, check_real, warn_user
from .controller_config import ControllerConfig, config_differences

__all__ = ["Trajectory", "invalid_reason", "ema", "target_batch", "ceil_tolerant",
           "decide_batch", "lr_omega", "read_state_dict", "STATE_VERSION"]

STATE_VERSION = 1
# a quotient within this relative distance of an integer is taken as that integer before ceil
CEIL_RTOL = 1e-9


def lr_omega(ratio: float, lr_scaling: str) -> float:
    """omega(B / B_0): sqrt(ratio) ("sqrt"), ratio ("linear") or 1 ("none")."""
    if lr_scaling == "sqrt":
        return math.sqrt(ratio)
    if lr_scaling == "linear":
        return float(ratio)
    return 1.0


# ---------------------------------------------------------------------- measurements
def pooled_noise(estimate: Any) -> float | None:
    """estimate.noise_pooled as a float (nan when not a number), None when absent."""
    v = getattr(estimate, "noise_pooled", None)
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def invalid_reason(step: int, estimate: Any) -> str | None:
    """Why the measurement ``estimate`` (a GNSEstimate) of step ``step`` is skipped: stale
    (measured at another step; a lagged estimate -- one with an int ``available_step``, the
    hooks' host route -- is current when it became available at ``step`` and was measured
    at or before it), not valid, noise / signal not finite numbers, signal <= 0, noise < 0
    or a pooled noise that is not a finite number >= 0; None when it is used."""
    noise, signal = estimate.noise, estimate.signal
    est_step = estimate.step
    avail = getattr(estimate, "available_step", None)
    if _is_int(avail):
        if avail != step or (_is_int(est_step) and est_step > step):
            return f"stale estimate (measured at step {est_step}, available at step {avail})"
    elif _is_int(est_step) and est_step != step:
        return f"stale estimate (measured at step {est_step})"
    if not bool(estimate.valid):
        return "estimate.valid is False"
    try:
        noise = float(noise)
        signal = float(signal)
    except (TypeError, ValueError):
        return f"noise/signal not numbers ({noise!r}, {signal!r})"
    if not (math.isfinite(noise) and math.isfinite(signal)):
        return f"non-finite noise/signal ({noise}, {signal})"
    if signal <= 0.0:
        return f"signal <= 0 ({signal})"
    if noise < 0.0:
        return f"noise < 0 ({noise})"
    pooled = pooled_noise(estimate)
    if pooled is not None and not (math.isfinite(pooled) and pooled >= 0.0):
        return f"pooled noise not a finite number >= 0 ({pooled})"
    return None


def ema(prev: float | None, value: float, beta: float) -> float:
    """beta prev + (1 - beta) value; ``value`` itself when there is no ``prev`` (the EMAs
    start at the first valid measurement: no zero-initialisation bias)."""
    if prev is None:
        return value
    return beta * prev + (1.0 - beta) * value


# ---------------------------------------------------------------------- the batch
def target_batch(noise: float, signal: float, theta: float) -> float:
    """N / (theta^2 M) for N >= 0, M > 0, theta^2 > 0, never dividing by zero.

    theta^2 * M can underflow to 0 (e.g. M = 5e-324) and N / (theta^2 M) can overflow:
    a quotient beyond the float range is returned as inf (0 when N = 0).
    """
    den = theta * theta * signal
    if den > 0.0:
        return noise / den  # a quotient beyond the float range comes out as inf
    return math.inf if noise > 0.0 else 0.0


def ceil_tolerant(x: float) -> int:
    """ceil(x) for x >= 0, treating x within 1e-9 relative of an integer as that integer."""
    r = round(x)
    if abs(x - r) <= CEIL_RTOL * max(1.0, abs(r)):
        return int(r)
    return int(math.ceil(x))


def decide_batch(target: float, batch: int, *, multiple_of: int = 1,
                 max_batch_size: Optional[int] = None,
                 max_growth: Optional[float] = None) -> int:
    """B_{k+1} from the target N / (theta^2 M) (``target_batch``) and B_k = ``batch``.

    max(ceil(target), B_k) (``ceil_tolerant``), rounded up to a multiple of
    ``multiple_of``, capped at ``max_batch_size`` but never below B_k, and with
    ``max_growth`` at most max_growth x B_k rounded down to a multiple of ``multiple_of``,
    yet at least B_k + ``multiple_of`` when the rule grows the batch. An infinite target
    gives ``max_batch_size``, or B_k without a cap.
    """
    if math.isfinite(target):
        new = max(ceil_tolerant(target), batch)
    elif max_batch_size is not None:
        new = max_batch_size
    else:
        return batch
    m = multiple_of
    new = -(-new // m) * m  # round up to a multiple of multiple_of (integer arithmetic)
    if max_batch_size is not None and new > max_batch_size:
        new = max(max_batch_size, batch)
    if max_growth is not None and new > batch:
        cap = max(batch + m, int(math.floor(max_growth * batch * (1 + 1e-12))) // m * m)
        new = min(new, cap)
    return new


# ---------------------------------------------------------------------- checkpoints
@dataclass
class Trajectory:
    """The controller's state besides B: its EMAs, last decision and counters (the keys
    and order of its ``state_dict`` after ``batch_size``)."""

    noise_ema: Optional[float] = None           # N_k
    signal_ema: Optional[float] = None          # M_k
    target_batch_size: Optional[float] = None   # N/(theta^2 M) of the last decision
    last_step: Optional[int] = None
    last_measured_step: Optional[int] = None
    num_measurements: int = 0
    num_skipped: int = 0


_TRAJECTORY_KEYS = ("noise_ema", "signal_ema", "target_batch_size", "last_step",
                    "last_measured_step", "num_measurements", "num_skipped")


def _optional_real(name: str, value: Any, lo: float, lo_open: bool) -> float | None:
    """None, or a finite real number > lo (lo_open) / >= lo, as float; errors name it."""
    if value is None:
        return None
    return check_real(name, value, lo, lo_open=lo_open)


def read_state_dict(state_dict: Any, config: ControllerConfig, *, strict: bool,
                    shared_batch: Optional[int] = None) -> tuple[int, Trajectory]:
    """The batch and ``Trajectory`` that ``AdaptiveBatchSize.load_state_dict`` continues
    from, every entry checked (TypeError / ValueError naming it) before anything is used.

    ``config``: the loading controller's settings (its F the schedule's). ``strict``: the
    saved config must equal them; otherwise a saved batch outside [initial_batch_size,
    max_batch_size] is clamped into it (RuntimeWarning), and EMAs formed with the other
    ``signal`` warn (UserWarning). ``shared_batch``: the B of a schedule a coordinator owns
    (then F and B are its own, neither compared nor read here); None reads B from the dict.
    """
    shared = shared_batch is not None
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if state_dict.get("version") != STATE_VERSION:
        raise ValueError(
            f"state_dict has version {state_dict.get('version')!r}, expected {STATE_VERSION}")
    missing = [k for k in ("config",) + (() if shared else ("batch_size",)) + _TRAJECTORY_KEYS
               if k not in state_dict]
    if missing:
        raise ValueError(f"state_dict is missing keys {missing}")
    saved = state_dict["config"]
    if not isinstance(saved, dict):
        raise TypeError(f"state_dict['config']: expected a dict, got {type(saved).__name__}")
    if strict:
        diff = config_differences(config.to_dict(every=not shared), saved,
                                  ignore=("every",) if shared else ())
        if diff:
            details = ", ".join(f"{k}: saved {a!r} vs {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"state_dict configuration differs ({details}); construct the controller "
                "with the saved settings or pass strict=False")
    saved_kind = saved.get("signal", "raw")
    if not strict and saved_kind != config.signal and state_dict["signal_ema"] is not None:
        warn_user(
            f"AdaptiveBatchSize.load_state_dict: the checkpoint's EMAs were formed with "
            f"signal={saved_kind!r}, this controller uses signal={config.signal!r}; its first "
            "decisions mix the two until the EMAs turn over", UserWarning)
    if shared:   # the schedule's owner has loaded B (a saved copy here is not read)
        batch = shared_batch
    else:
        batch = check_int("state_dict['batch_size']", state_dict["batch_size"], 1)
    if batch % config.multiple_of:
        raise ValueError(f"state_dict['batch_size'] ({batch}) is not a multiple of {config.multiple_of}")
    noise = _optional_real("state_dict['noise_ema']", state_dict["noise_ema"], 0.0, False)
    signal = _optional_real("state_dict['signal_ema']", state_dict["signal_ema"], 0.0, True)
    if (noise is None) != (signal is None):
        raise ValueError(
            "state_dict: noise_ema and signal_ema must both be None (nothing measured yet) "
            f"or both numbers, got {noise!r} and {signal!r}")
    t = state_dict["target_batch_size"]
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, Real) or math.isnan(t) or t < 0:
            raise ValueError(
                f"state_dict['target_batch_size']: expected None or a number >= 0 (inf "
                f"allowed), got {t!r}")
        t = float(t)
    last = state_dict["last_step"]
    last = None if last is None else check_int("state_dict['last_step']", last, 0)
    measured = state_dict["last_measured_step"]
    if measured is not None:
        measured = check_int("state_dict['last_measured_step']", measured, 0)
        if last is None or measured > last:
            raise ValueError(
                f"state_dict['last_measured_step']: expected at most last_step ({last}), "
                f"got {measured}")
    n_meas = check_int("state_dict['num_measurements']", state_dict["num_measurements"], 0)
    n_skip = check_int("state_dict['num_skipped']", state_dict["num_skipped"], 0)
    # strict=False with a new cap or B_0: the batch is brought into [B_0, max_batch_size]
    # (both multiples of multiple_of), so no step runs outside this configuration
    low, high = config.initial_batch_size, config.max_batch_size
    if batch < low or (high is not None and batch > high):
        new = low if batch < low else high
        warn_user(
            f"AdaptiveBatchSize.load_state_dict: the saved batch size {batch} is "
            f"{'below initial_batch_size' if batch < low else 'above max_batch_size'} "
            f"({new}) of this controller; continuing with {new} (the LR multiplier follows)")
        batch = new
    return batch, Trajectory(noise, signal, t, last, measured, n_meas, n_skip)
