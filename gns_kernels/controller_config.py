"""The settings of Algorithm 1 (``gk.AdaptiveBatchSize``), typed and validated once.

``ControllerConfig`` is a frozen dataclass checked in ``__post_init__`` (as the configs of
facebookresearch/optimizers' ``distributed_shampoo/.../matrix_functions_types.py``): a
config that exists is a valid one, and the controller reads its settings from it instead of
re-checking them. ``AdaptiveBatchSize(**kwargs)`` builds one from its arguments (its
``settings``); ``AdaptiveBatchSize.from_config(cfg)`` takes a built one.

F (``every``) is the exception: the config holds the F the controller was built with, and
the run's F then lives in its ``Schedule`` (gns_kernels.schedule), which a coordinator may
own.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional

from ._validation import check_int, check_real, check_signal

__all__ = ["ControllerConfig", "LR_SCALINGS", "config_differences"]

LR_SCALINGS = ("sqrt", "linear", "none")

# settings absent from checkpoints written before they existed, with the value the
# controller then had
OLD_CHECKPOINT_DEFAULTS = {"signal": "raw", "max_growth": None}


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """The settings of ``AdaptiveBatchSize`` (its constructor's arguments but ``schedule``).

    Fields:
        initial_batch_size: B_0, global batch of step 0 (examples); a multiple of
            ``multiple_of``.
        theta: the tolerance theta > 0 of B = N / (theta^2 M); smaller theta -> larger
            batches. The paper used 0.6 for l1 / nuclear and 0.3 for l2 on LLMs (vision
            runs up to 4). Its square must be a positive finite float.
        beta_noise, beta_signal: EMA factors in [0, 1) (0 = use the last measurement only).
        every: F >= 1, measuring period in optimizer steps (measure at k % F == 0).
        warmup_steps: I >= 0; the batch is frozen while k < I (EMAs still update).
        max_batch_size: cap on B (a multiple of ``multiple_of``, >= initial), or None.
        multiple_of: B is always a multiple of this (ranks x micro-batches, so that every
            rank and micro-batch averages the same number of examples).
        lr_scaling: "sqrt" (paper, omega = sqrt(B/B_0)), "linear" (B/B_0) or "none" (1).
        signal: which signal the estimates carry, "raw" (default, the paper's) or
            "debiased" (``gk.estimate(..., signal="debiased")``, a hook state built with
            ``signal="debiased"``). An estimate with a ``signal_kind`` attribute that
            differs raises ValueError at ``update`` (theta means different things for the
            two: docs/controller.md, "The signal and theta").
        max_growth: opt-in bound on B_{k+1} / B_k per decision (e.g. 2.0), None (default)
            for Algorithm 1 unbounded. The bounded B is rounded down to a multiple of
            ``multiple_of`` but grows by at least one ``multiple_of`` when the rule asks
            for growth.

    A bad value raises TypeError (wrong type) or ValueError (out of range) naming the field;
    the values are kept as plain Python ints, floats and strings.
    """

    initial_batch_size: int = 64
    theta: float = 0.6
    beta_noise: float = 0.9
    beta_signal: float = 0.9
    every: int = 100
    warmup_steps: int = 0
    max_batch_size: Optional[int] = None
    multiple_of: int = 1
    lr_scaling: str = "sqrt"
    signal: str = "raw"
    max_growth: Optional[float] = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # the normalized value (frozen dataclass)
            object.__setattr__(self, name, value)

        put("signal", check_signal(self.signal))
        g = self.max_growth
        if g is not None:
            if isinstance(g, bool) or not isinstance(g, Real) or not (math.isfinite(g) and g > 1.0):
                raise ValueError(f"max_growth: expected None or a finite number > 1, got {g!r}")
            put("max_growth", float(g))
        b0 = check_int("initial_batch_size", self.initial_batch_size, 1)
        put("initial_batch_size", b0)
        theta = check_real("theta", self.theta, 0.0, lo_open=True)
        if not (0.0 < theta * theta < math.inf):
            raise ValueError(
                f"theta: expected a value whose square is a positive finite float "
                f"(about 1e-154 < theta < 1e154), got {self.theta!r}"
            )
        put("theta", theta)
        put("beta_noise", check_real("beta_noise", self.beta_noise))
        put("beta_signal", check_real("beta_signal", self.beta_signal))
        for name in ("beta_noise", "beta_signal"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        put("every", check_int("every", self.every, 1))
        put("warmup_steps", check_int("warmup_steps", self.warmup_steps, 0))
        m = check_int("multiple_of", self.multiple_of, 1)
        put("multiple_of", m)
        if b0 % m:
            raise ValueError(f"initial_batch_size ({b0}) must be a multiple of multiple_of ({m})")
        if self.max_batch_size is not None:
            cap = check_int("max_batch_size", self.max_batch_size, 1)
            if cap < b0:
                raise ValueError(
                    f"max_batch_size ({cap}) must be >= initial_batch_size ({b0})")
            if cap % m:
                raise ValueError(
                    f"max_batch_size ({cap}) must be a multiple of multiple_of ({m}) so that "
                    "the capped batch still splits equally")
            put("max_batch_size", cap)
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"lr_scaling must be one of {LR_SCALINGS}, got {self.lr_scaling!r}")

    def to_dict(self, every: bool = True) -> dict[str, Any]:
        """The settings as a plain dict in field order (a checkpoint's ``config``);
        ``every=False`` leaves F out (a schedule that a coordinator owns saves it)."""
        cfg = dataclasses.asdict(self)
        if not every:
            del cfg["every"]
        return cfg


def config_differences(mine: dict[str, Any], saved: dict[str, Any],
                       ignore: tuple = ()) -> dict[str, tuple]:
    """{name: (saved value, my value)} for every setting whose values differ, in name
    order; a ``saved`` config from before a setting existed takes its old default
    (``OLD_CHECKPOINT_DEFAULTS``); ``ignore``: names not compared."""
    saved = {**OLD_CHECKPOINT_DEFAULTS, **saved}
    return {k: (saved.get(k), mine.get(k)) for k in sorted(set(mine) | set(saved))
            if k not in ignore and mine.get(k) != saved.get(k)}
