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
  noise pool, gns_kernels.pooling) has formed the noise EMA already, on the variances /
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
"""
from __future__ import annotations

import logging
import math
from numbers import Integral, Real
from typing import Any, Optional

from ._validation import check_int as _check_int
from ._validation import check_real as _check_real
from ._validation import check_signal as _check_signal
from ._validation import warn_user as _warn_user
from .estimators import GNSEstimate
from .schedule import Schedule

__all__ = ["AdaptiveBatchSize"]

logger = logging.getLogger("gns_kernels.controller")

_LR_SCALINGS = ("sqrt", "linear", "none")


def lr_omega(ratio: float, lr_scaling: str) -> float:
    """omega(B / B_0): sqrt(ratio) ("sqrt"), ratio ("linear") or 1 ("none")."""
    if lr_scaling == "sqrt":
        return math.sqrt(ratio)
    if lr_scaling == "linear":
        return float(ratio)
    return 1.0

_STATE_VERSION = 1
# a quotient within this relative distance of an integer is taken as that integer before ceil
_CEIL_RTOL = 1e-9


def _optional_real(name: str, value: Any, lo: float, lo_open: bool) -> float | None:
    """None, or a finite real number > lo (lo_open) / >= lo, as float; errors name it."""
    if value is None:
        return None
    return _check_real(name, value, lo, lo_open=lo_open)


def _pooled_noise(estimate: Any) -> float | None:
    """estimate.noise_pooled as a float (nan when not a number), None when absent."""
    v = getattr(estimate, "noise_pooled", None)
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _ceil_tolerant(x: float) -> int:
    """ceil(x) for x >= 0, treating x within 1e-9 relative of an integer as that integer."""
    r = round(x)
    if abs(x - r) <= _CEIL_RTOL * max(1.0, abs(r)):
        return int(r)
    return int(math.ceil(x))


def _target_batch(noise: float, signal: float, theta: float) -> float:
    """N / (theta^2 M) for N >= 0, M > 0, theta^2 > 0, never dividing by zero.

    theta^2 * M can underflow to 0 (e.g. M = 5e-324) and N / (theta^2 M) can overflow:
    a quotient beyond the float range is returned as inf (0 when N = 0).
    """
    den = theta * theta * signal
    if den > 0.0:
        return noise / den  # a quotient beyond the float range comes out as inf
    return math.inf if noise > 0.0 else 0.0


class AdaptiveBatchSize:
    """Algorithm 1 (adaptive batch size from the GNS) with exact resume.

    Args:
        initial_batch_size: B_0, global batch of step 0 (examples); a multiple of
            ``multiple_of``.
        theta: the tolerance theta > 0 of B = N / (theta^2 M); smaller theta -> larger
            batches. The paper used 0.6 for l1 / nuclear and 0.3 for l2 on LLMs (vision
            runs up to 4).
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
        self.signal = _check_signal(signal)
        if max_growth is not None:
            if isinstance(max_growth, bool) or not isinstance(max_growth, Real) or not (
                    math.isfinite(max_growth) and max_growth > 1.0):
                raise ValueError(f"max_growth: expected None or a finite number > 1, got {max_growth!r}")
            max_growth = float(max_growth)
        self.max_growth = max_growth
        self.initial_batch_size = _check_int("initial_batch_size", initial_batch_size, 1)
        self.theta = _check_real("theta", theta, 0.0, lo_open=True)
        if not (0.0 < self.theta * self.theta < math.inf):
            raise ValueError(
                f"theta: expected a value whose square is a positive finite float "
                f"(about 1e-154 < theta < 1e154), got {theta!r}"
            )
        self.beta_noise = _check_real("beta_noise", beta_noise)
        self.beta_signal = _check_real("beta_signal", beta_signal)
        for name, b in (("beta_noise", self.beta_noise), ("beta_signal", self.beta_signal)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {b}")
        every = _check_int("every", every, 1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.multiple_of = _check_int("multiple_of", multiple_of, 1)
        if self.initial_batch_size % self.multiple_of:
            raise ValueError(
                f"initial_batch_size ({self.initial_batch_size}) must be a multiple of "
                f"multiple_of ({self.multiple_of})"
            )
        if max_batch_size is not None:
            max_batch_size = _check_int("max_batch_size", max_batch_size, 1)
            if max_batch_size < self.initial_batch_size:
                raise ValueError(
                    f"max_batch_size ({max_batch_size}) must be >= initial_batch_size "
                    f"({self.initial_batch_size})"
                )
            if max_batch_size % self.multiple_of:
                raise ValueError(
                    f"max_batch_size ({max_batch_size}) must be a multiple of multiple_of "
                    f"({self.multiple_of}) so that the capped batch still splits equally"
                )
        self.max_batch_size = max_batch_size
        if lr_scaling not in _LR_SCALINGS:
            raise ValueError(f"lr_scaling must be one of {_LR_SCALINGS}, got {lr_scaling!r}")
        self.lr_scaling = lr_scaling

        # F and B_k: this controller's own schedule, or the run's (a coordinator's, handed
        # over with ``schedule=``): then F is read from it and B_{k+1}, this controller's
        # decision, is written into it on the owner's behalf
        if schedule is None:
            schedule = Schedule(every=every, batch_size=self.initial_batch_size)
        elif not isinstance(schedule, Schedule):
            raise TypeError(f"schedule: expected a gns_kernels.schedule.Schedule, got {type(schedule).__name__}")
        elif schedule.every != every:
            raise ValueError(f"every: {every} given, the schedule's is {schedule.every}; pass the schedule's")
        self.schedule = schedule
        self._writer = schedule.owner or type(self).__name__
        # trajectory state
        self._noise_ema: float | None = None
        self._signal_ema: float | None = None
        self._target: float | None = None
        self._last_step: int | None = None
        self._last_measured_step: int | None = None
        self._num_measurements = 0
        self._num_skipped = 0
        self._warned_pool_beta = False

    # ------------------------------------------------------------------ read-outs
    @property
    def every(self) -> int:
        """F, the measuring period (the schedule's)."""
        return self.schedule.every

    @property
    def _shared(self) -> bool:
        """The schedule is a coordinator's: it saves F and B itself."""
        return self.schedule.owner is not None and self.schedule.owner != type(self).__name__

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
        return self._noise_ema

    @property
    def signal_ema(self) -> float | None:
        """M_k, EMA of the signal term (None before the first valid measurement)."""
        return self._signal_ema

    @property
    def gns_ema(self) -> float | None:
        """N_k / M_k, the smoothed GNS (examples); None before the first valid measurement."""
        if self._noise_ema is None or self._signal_ema is None:
            return None
        return self._noise_ema / self._signal_ema

    @property
    def target_batch_size(self) -> float | None:
        """Unrounded N_k/(theta^2 M_k) of the last batch decision (None before the first)."""
        return self._target

    @property
    def last_step(self) -> int | None:
        """The step of the last ``update`` call (None before the first)."""
        return self._last_step

    @property
    def last_measured_step(self) -> int | None:
        """The last step whose measurement entered the EMAs (None before the first)."""
        return self._last_measured_step

    @property
    def num_measurements(self) -> int:
        """Number of valid measurements that entered the EMAs."""
        return self._num_measurements

    @property
    def num_skipped(self) -> int:
        """Number of measuring steps skipped (invalid, stale or None estimate)."""
        return self._num_skipped

    # ------------------------------------------------------------------ the rule
    def _invalid_reason(self, step: int, estimate: Any) -> str | None:
        noise, signal = estimate.noise, estimate.signal  # a GNSEstimate (update checked it)
        est_step = estimate.step
        if isinstance(est_step, Integral) and not isinstance(est_step, bool) and est_step != step:
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
        pooled = _pooled_noise(estimate)
        if pooled is not None and not (math.isfinite(pooled) and pooled >= 0.0):
            return f"pooled noise not a finite number >= 0 ({pooled})"
        return None

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
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step must increase strictly between update() calls: got step {step} after "
                f"step {self._last_step} (repeated or out-of-order call, or a resume without "
                "load_state_dict?)"
            )
        self._last_step = step
        if step % self.every:
            return self._batch_size
        if estimate is None:
            self._num_skipped += 1
            logger.debug("step %d: no measurement (estimate None), skipped", step)
            return self._batch_size
        kind = getattr(estimate, "signal_kind", None)
        if isinstance(kind, str) and kind != self.signal:
            raise ValueError(
                f"signal: this controller was built with signal={self.signal!r} but the estimate "
                f"of step {step} carries the {kind!r} signal; build the controller (or "
                "AdaptiveBatching) and the estimator with the same signal")
        reason = self._invalid_reason(step, estimate)
        if reason is not None:
            self._num_skipped += 1
            logger.warning("step %d: invalid GNS measurement skipped: %s", step, reason)
            return self._batch_size

        noise, signal = float(estimate.noise), float(estimate.signal)
        pooled = _pooled_noise(estimate)
        if pooled is not None:
            self._check_pool_beta(getattr(estimate, "pool_beta", None))
        if self._noise_ema is None or self._signal_ema is None:
            self._noise_ema, self._signal_ema = noise, signal
        else:
            self._noise_ema = self.beta_noise * self._noise_ema + (1.0 - self.beta_noise) * noise
            self._signal_ema = (
                self.beta_signal * self._signal_ema + (1.0 - self.beta_signal) * signal
            )
        if pooled is not None:  # the hook's pool is the noise EMA
            self._noise_ema = pooled
        self._num_measurements += 1
        self._last_measured_step = step
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
        assert self._noise_ema is not None and self._signal_ema is not None
        old = self._batch_size
        target = _target_batch(self._noise_ema, self._signal_ema, self.theta)
        self._target = target
        if math.isfinite(target):
            new = max(_ceil_tolerant(target), old)
        elif self.max_batch_size is not None:
            new = self.max_batch_size
        else:
            logger.warning(
                "step %d: target batch size overflowed (N=%g, M=%g) and no max_batch_size: "
                "batch kept at %d", step, self._noise_ema, self._signal_ema, old,
            )
            return
        m = self.multiple_of
        new = -(-new // m) * m  # round up to a multiple of multiple_of (integer arithmetic)
        if self.max_batch_size is not None and new > self.max_batch_size:
            new = max(self.max_batch_size, old)
        if self.max_growth is not None and new > old:
            cap = max(old + m, int(math.floor(self.max_growth * old * (1 + 1e-12))) // m * m)
            new = min(new, cap)
        if new != old:
            self._batch_size = new
            logger.info(
                "step %d: batch size %d -> %d (gns_ema=%.6g, target=%.6g, lr x%.4g)",
                step, old, new, self.gns_ema, target, self.lr_multiplier,
            )

    # ------------------------------------------------------------------ resume
    # settings absent from checkpoints written before they existed, with the value the
    # controller then had
    _CONFIG_DEFAULTS = {"signal": "raw", "max_growth": None}

    def config(self) -> dict[str, Any]:
        """The settings (what ``state_dict()['config']`` holds and a strict load compares);
        ``every`` only when the schedule is this controller's own (a coordinator saves the
        run's F with its schedule)."""
        cfg = {
            "initial_batch_size": self.initial_batch_size,
            "theta": self.theta,
            "beta_noise": self.beta_noise,
            "beta_signal": self.beta_signal,
            "every": self.every,
            "warmup_steps": self.warmup_steps,
            "max_batch_size": self.max_batch_size,
            "multiple_of": self.multiple_of,
            "lr_scaling": self.lr_scaling,
            "signal": self.signal,
            "max_growth": self.max_growth,
        }
        if self._shared:
            del cfg["every"]
        return cfg

    def config_differences(self, saved: dict[str, Any], ignore: tuple = ()) -> dict[str, tuple]:
        """{name: (saved value, this controller's value)} for every setting whose saved
        value (``state_dict()['config']``) differs, in name order; a checkpoint from before
        a setting existed takes its old default; ``ignore``: names not compared."""
        saved = {**self._CONFIG_DEFAULTS, **saved}
        mine = self.config()
        if self._shared:   # F is the schedule's (its owner compares it)
            ignore = tuple(ignore) + ("every",)
        return {k: (saved.get(k), mine.get(k)) for k in sorted(set(mine) | set(saved))
                if k not in ignore and mine.get(k) != saved.get(k)}

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python snapshot (config + trajectory state); safe for torch.save / json."""
        sd = {
            "version": _STATE_VERSION,
            "config": self.config(),
            "batch_size": self._batch_size,
            "noise_ema": self._noise_ema,
            "signal_ema": self._signal_ema,
            "target_batch_size": self._target,
            "last_step": self._last_step,
            "last_measured_step": self._last_measured_step,
            "num_measurements": self._num_measurements,
            "num_skipped": self._num_skipped,
        }
        if self._shared:   # B is the schedule's, saved by its owner
            del sd["batch_size"]
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
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"state_dict has version {state_dict.get('version')!r}, expected {_STATE_VERSION}"
            )
        missing = [k for k in ("config",) + (() if self._shared else ("batch_size",))
                   + ("noise_ema", "signal_ema", "target_batch_size", "last_step",
                      "last_measured_step", "num_measurements", "num_skipped")
                   if k not in state_dict]
        if missing:
            raise ValueError(f"state_dict is missing keys {missing}")
        saved = state_dict["config"]
        if not isinstance(saved, dict):
            raise TypeError(f"state_dict['config']: expected a dict, got {type(saved).__name__}")
        if strict:
            diff = self.config_differences(saved)
            if diff:
                details = ", ".join(f"{k}: saved {a!r} vs {b!r}" for k, (a, b) in diff.items())
                raise ValueError(
                    f"state_dict configuration differs ({details}); construct the controller "
                    "with the saved settings or pass strict=False"
                )
        saved_kind = saved.get("signal", "raw")
        if not strict and saved_kind != self.signal and state_dict["signal_ema"] is not None:
            _warn_user(
                f"AdaptiveBatchSize.load_state_dict: the checkpoint's EMAs were formed with "
                f"signal={saved_kind!r}, this controller uses signal={self.signal!r}; its first "
                "decisions mix the two until the EMAs turn over", UserWarning)
        # check every entry before changing anything: a corrupt state leaves self as it was
        if self._shared:   # the schedule's owner has loaded B (a saved copy here is not read)
            batch = self._batch_size
        else:
            batch = _check_int("state_dict['batch_size']", state_dict["batch_size"], 1)
        if batch % self.multiple_of:
            raise ValueError(f"state_dict['batch_size'] ({batch}) is not a multiple of {self.multiple_of}")
        noise = _optional_real("state_dict['noise_ema']", state_dict["noise_ema"], 0.0, False)
        signal = _optional_real("state_dict['signal_ema']", state_dict["signal_ema"], 0.0, True)
        if (noise is None) != (signal is None):
            raise ValueError(
                "state_dict: noise_ema and signal_ema must both be None (nothing measured yet) "
                f"or both numbers, got {noise!r} and {signal!r}"
            )
        t = state_dict["target_batch_size"]
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, Real) or math.isnan(t) or t < 0:
                raise ValueError(
                    f"state_dict['target_batch_size']: expected None or a number >= 0 (inf "
                    f"allowed), got {t!r}"
                )
            t = float(t)
        last = state_dict["last_step"]
        last = None if last is None else _check_int("state_dict['last_step']", last, 0)
        measured = state_dict["last_measured_step"]
        if measured is not None:
            measured = _check_int("state_dict['last_measured_step']", measured, 0)
            if last is None or measured > last:
                raise ValueError(
                    f"state_dict['last_measured_step']: expected at most last_step ({last}), "
                    f"got {measured}"
                )
        n_meas = _check_int("state_dict['num_measurements']", state_dict["num_measurements"], 0)
        n_skip = _check_int("state_dict['num_skipped']", state_dict["num_skipped"], 0)
        # strict=False with a new cap or B_0: the batch is brought into [B_0, max_batch_size]
        # (both multiples of multiple_of), so no step runs outside this configuration
        low, high = self.initial_batch_size, self.max_batch_size
        if batch < low or (high is not None and batch > high):
            new = low if batch < low else high
            _warn_user(
                f"AdaptiveBatchSize.load_state_dict: the saved batch size {batch} is "
                f"{'below initial_batch_size' if batch < low else 'above max_batch_size'} "
                f"({new}) of this controller; continuing with {new} (the LR multiplier follows)")
            batch = new
        if batch != self._batch_size:
            self._batch_size = batch
        self._noise_ema, self._signal_ema, self._target = noise, signal, t
        self._last_step, self._last_measured_step = last, measured
        self._num_measurements, self._num_skipped = n_meas, n_skip

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"AdaptiveBatchSize({cfg}; batch_size={self._batch_size}, step={self._last_step})"
