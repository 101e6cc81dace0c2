"""Algorithm 1 of the paper: grow the global batch size from EMAs of GNS noise and signal.

The controller knows only numbers. Once per optimizer step k = 0, 1, 2, ... the training
loop calls ``ctrl.update(k, estimate)`` and then reads ``ctrl.batch_size`` (B_{k+1}, the
global batch of the next step) and ``ctrl.lr_multiplier`` (omega_{k+1}, to multiply the
scheduled learning rate eta_{k+1} with).

Rule (paper Algorithm 1 and eq. (var_ema_method)):

- Measuring steps are those with ``k % every == 0`` (F = ``every``). At a measuring step
  with a *valid* estimate the EMAs are updated, also during warm-up::

      N_k = beta_noise  * N_{k-1} + (1 - beta_noise)  * estimate.noise
      M_k = beta_signal * M_{k-1} + (1 - beta_signal) * estimate.signal

  The EMAs start at the first valid measurement (N = noise, M = signal), so there is no
  zero-initialisation bias to correct.
  An estimate that carries a pooled noise (``noise_pooled`` not None: a hook state with a
  noise pool, gns_kernels.stats.pool) has formed the noise EMA already, on the variances /
  covariances before their square roots: then N_k = estimate.noise_pooled (the pool's EMA
  factor ``pool_beta`` takes the place of beta_noise; a WARNING is logged once when the two
  differ) and only M is averaged here. A measurement whose noise_pooled is not a finite
  number >= 0 is invalid.
- A measurement is *invalid* (and skipped: EMAs and batch unchanged, a WARNING is logged)
  when ``estimate.valid`` is False, when noise or signal is not finite, when signal <= 0,
  or when noise < 0. ``estimate=None`` at a measuring step means "nothing was measured"
  and is skipped the same way (logged at DEBUG). Estimates passed at non-measuring steps
  are ignored, so a loop may pass the hook's last estimate every step. If the estimate
  carries an integer ``step`` attribute that differs from ``k`` it is stale (the hook did
  not measure at k) and is skipped with a WARNING.
- Only when ``k >= warmup_steps`` (I) and the measurement was valid::

      B_{k+1} = max(ceil(N_k / (theta^2 M_k)), B_k)

  then rounded *up* to a multiple of ``multiple_of`` and capped at ``max_batch_size``
  (the cap never takes B below B_k: B_k itself never exceeds the cap). Otherwise
  B_{k+1} = B_k. B is therefore non-decreasing.
- A quotient beyond the float range (a tiny signal EMA: theta^2 M may even underflow to
  0) counts as infinite: B_{k+1} = ``max_batch_size`` when one is set, else B_k is kept and
  a WARNING is logged. theta itself must have a positive finite square (about
  1e-154 < theta < 1e154; checked at construction).
- ``ceil`` of a float quotient: N/(theta^2 M) for an exact integer target can come out as
  64.00000000001 in floating point (theta = 0.6 has no exact binary form). A quotient within
  1e-9 relative of an integer is taken as that integer before ``ceil``; this changes the
  batch by at most one example in a case that is a rounding artefact anyway.
- Learning-rate multiplier, cumulative over the run: omega_{k+1} = omega_k sqrt(B_{k+1}/B_k)
  = sqrt(B_{k+1}/B_0) for ``lr_scaling="sqrt"`` (computed in the closed form from the final
  rounded and capped B, so it does not drift); ``"linear"``: B_{k+1}/B_0; ``"none"``: 1.

Units: noise and signal are those of the estimate (gns = noise/signal is a batch size in
examples); batch sizes are global (all ranks x micro-batches) numbers of examples.

Calls must come with strictly increasing steps (gaps are allowed: nothing happens at
non-measuring steps, so calling only at measuring steps is equivalent); a repeated or
decreasing step raises ``ValueError`` (typically a resume that forgot to load the state).

``state_dict()`` / ``load_state_dict()`` round-trip exactly (plain Python ints and floats):
a resumed controller continues the same trajectory as an uninterrupted one.

Layout: the settings are a ``ControllerConfig`` (gns_kernels/controller_config.py, validated
once), the pure steps of the rule and the checkpoint check are functions of numbers
(gns_kernels/controller_rule.py); ``AdaptiveBatchSize`` below calls them in the rule's order
and keeps the state.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from numbers import Real
from typing import Any, Optional

from ._settings_view import setting_of
from ._validation import check_int as _check_int
from .controller_config import LR_SCALINGS, ControllerConfig, config_differences
from .controller_rule import (STATE_VERSION, Trajectory, decide_batch, ema, invalid_reason,
                              lr_omega, pooled_noise, read_state_dict, target_batch)
from .stats.gns import GNSEstimate
from .schedule import Schedule

__all__ = ["AdaptiveBatchSize", "ControllerConfig", "LR_SCALINGS", "lr_omega"]

logger = logging.getLogger("gns_kernels.controller")

_LR_SCALINGS = LR_SCALINGS   # the old private name (gns_kernels.probe imports it)


def _setting(name: str) -> property:
    """A read-only attribute that reads the setting ``name`` of the controller's config."""
    return setting_of("_config", name, f"The ``{name}`` setting (``ControllerConfig.{name}``).")


class AdaptiveBatchSize:
    """Algorithm 1 (adaptive batch size from the GNS) with exact resume.

    Args: the settings of ``ControllerConfig`` (gns_kernels.controller_config, which
    documents each: initial_batch_size B_0, theta, beta_noise, beta_signal, every F,
    warmup_steps I, max_batch_size, multiple_of, lr_scaling, signal, max_growth), checked
    there once and read back as attributes of the same names (``settings`` is the config);
    ``schedule``: the run's ``Schedule`` (gns_kernels.schedule) when a coordinator owns F and
    B_k, else None (the controller makes its own). ``AdaptiveBatchSize.from_config(cfg)``
    builds one from a ``ControllerConfig``.

    Read-outs: ``batch_size`` (B_{k+1}), ``lr_multiplier`` (omega_{k+1}), ``noise_ema``,
    ``signal_ema``, ``gns_ema`` (N/M), ``target_batch_size`` (unrounded N/(theta^2 M) of the
    last batch decision), ``last_step``, ``last_measured_step``, ``num_measurements``,
    ``num_skipped``.
    """

    def __init__(
        self,
        initial_batch_size: int = 64,
        theta: float = 0.6,
        beta_noise: float = 0.9,
        beta_signal: float = 0.9,
        every: int = 100,
        warmup_steps: int = 0,
        max_batch_size: int | None = None,
        multiple_of: int = 1,
        lr_scaling: str = "sqrt",
        signal: str = "raw",
        max_growth: float | None = None,
        schedule: Schedule | None = None,
    ) -> None:
        self._bind(ControllerConfig(
            initial_batch_size=initial_batch_size, theta=theta, beta_noise=beta_noise,
            beta_signal=beta_signal, every=every, warmup_steps=warmup_steps,
            max_batch_size=max_batch_size, multiple_of=multiple_of, lr_scaling=lr_scaling,
            signal=signal, max_growth=max_growth), schedule)

    @classmethod
    def from_config(cls, config: ControllerConfig,
                    schedule: Schedule | None = None) -> "AdaptiveBatchSize":
        """A controller with the settings ``config`` (checked when it was built) and
        ``schedule`` as in the constructor."""
        if not isinstance(config, ControllerConfig):
            raise TypeError(f"config: expected a ControllerConfig, got {type(config).__name__}")
        ctrl = cls.__new__(cls)
        ctrl._bind(config, schedule)
        return ctrl

    def _bind(self, config: ControllerConfig, schedule: Schedule | None) -> None:
        # F and B_k: this controller's own schedule, or the run's (a coordinator's, handed
        # over with ``schedule=``): then F is read from it and B_{k+1}, this controller's
        # decision, is written into it on the owner's behalf
        if schedule is None:
            schedule = Schedule(every=config.every, batch_size=config.initial_batch_size)
        elif not isinstance(schedule, Schedule):
            raise TypeError(f"schedule: expected a gns_kernels.schedule.Schedule, got {type(schedule).__name__}")
        elif schedule.every != config.every:
            raise ValueError(f"every: {config.every} given, the schedule's is {schedule.every}; pass the schedule's")
        self._config = config
        self.schedule = schedule
        self._writer = schedule.owner or type(self).__name__
        self._state = Trajectory()
        self._warned_pool_beta = False

    # ------------------------------------------------------------------ settings
    initial_batch_size = _setting("initial_batch_size")
    theta = _setting("theta")
    beta_noise = _setting("beta_noise")
    beta_signal = _setting("beta_signal")
    warmup_steps = _setting("warmup_steps")
    max_batch_size = _setting("max_batch_size")
    multiple_of = _setting("multiple_of")
    lr_scaling = _setting("lr_scaling")
    signal = _setting("signal")
    max_growth = _setting("max_growth")

    @property
    def every(self) -> int:
        """F, the measuring period (the schedule's)."""
        return self.schedule.every

    @property
    def settings(self) -> ControllerConfig:
        """The settings as a ``ControllerConfig``, with F the schedule's."""
        if self._config.every != self.schedule.every:
            self._config = dataclasses.replace(self._config, every=self.schedule.every)
        return self._config

    @property
    def _shared(self) -> bool:
        """The schedule is a coordinator's: it saves F and B itself."""
        return self.schedule.owner is not None and self.schedule.owner != type(self).__name__

    # ------------------------------------------------------------------ read-outs
    @property
    def _batch_size(self) -> int:
        return self.schedule.batch_size

    @_batch_size.setter
    def _batch_size(self, value: int) -> None:
        self.schedule.write("batch_size", value, by=self._writer)

    @property
    def batch_size(self) -> int:
        """B_{k+1}: global batch size for the step after the last ``update``."""
        return self._batch_size

    @property
    def lr_multiplier(self) -> float:
        """omega_{k+1}: multiply the scheduled learning rate with this (1 at the start)."""
        return lr_omega(self._batch_size / self.initial_batch_size, self.lr_scaling)

    @property
    def noise_ema(self) -> float | None:
        """N_k, EMA of the noise term (None before the first valid measurement)."""
        return self._state.noise_ema

    @property
    def signal_ema(self) -> float | None:
        """M_k, EMA of the signal term (None before the first valid measurement)."""
        return self._state.signal_ema

    @property
    def gns_ema(self) -> float | None:
        """N_k / M_k, the smoothed GNS (examples); None before the first valid measurement."""
        s = self._state
        if s.noise_ema is None or s.signal_ema is None:
            return None
        return s.noise_ema / s.signal_ema

    @property
    def target_batch_size(self) -> float | None:
        """Unrounded N_k/(theta^2 M_k) of the last batch decision (None before the first)."""
        return self._state.target_batch_size

    @property
    def last_step(self) -> int | None:
        """The step of the last ``update`` call (None before the first)."""
        return self._state.last_step

    @property
    def last_measured_step(self) -> int | None:
        """The last step whose measurement entered the EMAs (None before the first)."""
        return self._state.last_measured_step

    @property
    def num_measurements(self) -> int:
        """Number of valid measurements that entered the EMAs."""
        return self._state.num_measurements

    @property
    def num_skipped(self) -> int:
        """Number of measuring steps skipped (invalid, stale or None estimate)."""
        return self._state.num_skipped

    # ------------------------------------------------------------------ the rule
    def update(self, step: int, estimate: Optional[GNSEstimate] = None) -> int:
        """Feed the measurement of optimizer step ``step`` (k); returns B_{k+1}.

        ``estimate``: None or a ``gk.GNSEstimate`` (what ``gk.estimate`` and the hook states
        produce; its ``noise``, ``signal``, ``valid``, ``step`` and, with a noise pool,
        ``noise_pooled`` / ``pool_beta`` are read). TypeError for anything else. Only used
        when ``step % every == 0``. Raises ValueError if ``step`` does not exceed the
        previous one. A refused call changes nothing.
        """
        if estimate is not None and not isinstance(estimate, GNSEstimate):
            raise TypeError(f"estimate: expected a gns_kernels.GNSEstimate or None, got "
                            f"{type(estimate).__name__}")
        step = _check_int("step", step, 0)
        s = self._state
        if s.last_step is not None and step <= s.last_step:
            raise ValueError(
                f"step must increase strictly between update() calls: got step {step} after "
                f"step {s.last_step} (repeated or out-of-order call, or a resume without "
                "load_state_dict?)"
            )
        s.last_step = step
        # 1. only measuring steps k % F == 0 count, and only with a measurement
        if step % self.every:
            return self._batch_size
        if estimate is None:
            s.num_skipped += 1
            logger.debug("step %d: no measurement (estimate None), skipped", step)
            return self._batch_size
        kind = getattr(estimate, "signal_kind", None)
        if isinstance(kind, str) and kind != self.signal:
            raise ValueError(
                f"signal: this controller was built with signal={self.signal!r} but the estimate "
                f"of step {step} carries the {kind!r} signal; build the controller (or "
                "AdaptiveBatching) and the estimator with the same signal")
        # 2. an invalid measurement is skipped: EMAs and batch unchanged
        reason = invalid_reason(step, estimate)
        if reason is not None:
            s.num_skipped += 1
            logger.warning("step %d: invalid GNS measurement skipped: %s", step, reason)
            return self._batch_size
        # 3. the EMAs N_k and M_k, also during warm-up (a hook's noise pool is N_k)
        pooled = pooled_noise(estimate)
        if pooled is not None:
            self._check_pool_beta(getattr(estimate, "pool_beta", None))
        s.noise_ema = ema(s.noise_ema, float(estimate.noise), self.beta_noise)
        s.signal_ema = ema(s.signal_ema, float(estimate.signal), self.beta_signal)
        if pooled is not None:
            s.noise_ema = pooled
        s.num_measurements += 1
        s.last_measured_step = step
        # 4. the batch decision, once warm-up is over
        if step >= self.warmup_steps:
            self._decide(step)
        return self._batch_size

    def _check_pool_beta(self, pool_beta) -> None:
        if (isinstance(pool_beta, Real) and not isinstance(pool_beta, bool)
                and float(pool_beta) != self.beta_noise and not self._warned_pool_beta):
            self._warned_pool_beta = True
            logger.warning(
                "the estimates carry a noise pooled with pool_beta %s, which replaces this "
                "controller's noise EMA (beta_noise %s is not applied); build the hook state "
                "with pool_beta=%s to average over the window you chose", pool_beta,
                self.beta_noise, self.beta_noise)

    def _decide(self, step: int) -> None:
        s, cfg, old = self._state, self._config, self._batch_size
        target = s.target_batch_size = target_batch(s.noise_ema, s.signal_ema, cfg.theta)
        new = decide_batch(target, old, multiple_of=cfg.multiple_of,
                           max_batch_size=cfg.max_batch_size, max_growth=cfg.max_growth)
        if not math.isfinite(target) and cfg.max_batch_size is None:
            logger.warning(
                "step %d: target batch size overflowed (N=%g, M=%g) and no max_batch_size: "
                "batch kept at %d", step, s.noise_ema, s.signal_ema, old,
            )
        elif new != old:
            self._batch_size = new
            logger.info(
                "step %d: batch size %d -> %d (gns_ema=%.6g, target=%.6g, lr x%.4g)",
                step, old, new, self.gns_ema, target, self.lr_multiplier,
            )

    # ------------------------------------------------------------------ resume
    def config(self) -> dict[str, Any]:
        """The settings (what ``state_dict()['config']`` holds and a strict load compares);
        ``every`` only when the schedule is this controller's own (a coordinator saves the
        run's F with its schedule)."""
        return self.settings.to_dict(every=not self._shared)

    def config_differences(self, saved: dict[str, Any], ignore: tuple = ()) -> dict[str, tuple]:
        """{name: (saved value, this controller's value)} for every setting whose saved
        value (``state_dict()['config']``) differs, in name order; a checkpoint from before
        a setting existed takes its old default; ``ignore``: names not compared."""
        if self._shared:   # F is the schedule's (its owner compares it)
            ignore = tuple(ignore) + ("every",)
        return config_differences(self.config(), saved, ignore)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python snapshot (config + trajectory state); safe for torch.save / json."""
        sd = {"version": STATE_VERSION, "config": self.config()}
        if not self._shared:   # else B is the schedule's, saved by its owner
            sd["batch_size"] = self._batch_size
        sd.update(dataclasses.asdict(self._state))
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore a ``state_dict()``.

        strict=True: the saved configuration must equal this controller's (ValueError
        naming the differing keys). strict=False: keep this controller's configuration
        (e.g. a new ``max_batch_size``) and load only the trajectory state; a saved batch
        above this ``max_batch_size`` (or below this ``initial_batch_size``) is clamped to
        it with a RuntimeWarning, and ``lr_multiplier`` follows the clamped batch. A
        rejected state_dict leaves the controller as it was.
        """
        batch, state = read_state_dict(
            state_dict, self.settings, strict=strict,
            shared_batch=self._batch_size if self._shared else None)
        if batch != self._batch_size:
            self._batch_size = batch
        self._state = state

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"AdaptiveBatchSize({cfg}; batch_size={self._batch_size}, step={self._state.last_step})"
