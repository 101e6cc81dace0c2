"""GNSHookState: configuration, schedule and results of the distributed GNS hooks.

One object per model, shared by the DDP comm hook (``ddp_gns_hook``), the micro-batch
estimator (``MicroBatchGNS``, a subclass) and the FSDP2 hooks. It holds

- the schedule (its base ``ScheduleReader``, _schedule_reader.py): ``step`` k counts
  optimizer steps = synchronized backward passes (one per DDP gradient synchronization;
  no_sync() micro-steps do not count). A backward is a *measurement step* when
  k % every == 0 -- the schedule of ``gk.AdaptiveBatchSize`` (its ``every``), so one F
  drives both. ``step`` may be set on resume.
- ``batch_size``: the current GLOBAL batch B (examples per optimizer step, all ranks and
  micro-batches together). The trainer keeps it current; the variance scale is
  B / (S - 1) with S the number of samples (ranks, or ranks x micro-batches).
- its configuration ``config`` (a GNSConfig, gns_kernels.distributed.config: checked
  once, frozen): ``geometry`` ("l2", "l1", "nuclear"), ``bias_correction`` (as
  gk.estimate), ``params`` (the measured subset; nuclear uses its 2-D members only),
  ``shift``, ``process_group``, ``nuclear_dof``, ``signal``, ``pool_beta``, ``method``;
  each readable as an attribute of the state.
- ``estimate``: the GNSEstimate of the last measurement (None before the first),
  identical on every rank; ``estimate_step``: the k it was measured at. The hooks leave
  the statistics of a measurement as device tensors (no host synchronization inside the
  backward); they are turned into the GNSEstimate on the first read of ``estimate``: one
  synchronization per measurement, paid by the reader. (A measurement on the CPU that was
  never read is materialized when the next one starts, so the eigensolver hints it
  reports are in effect for it.)
- the host route (nuclear, ``method="host"``, and "auto" on GPUs): the measurement of
  step k is solved on a host thread while training goes on and joins at the next
  measurement k' (k + F), whose one extra collective carries its shared vector
  (``record_lagged``). The estimate is then that of step k (``estimate_step`` and
  ``estimate.step`` k, its batch size and loss scale k's: ``estimate_grad_scale``),
  readable from step k' on (``estimate_available_step`` and ``estimate.available_step``
  k'). ``lagged_step``: the measurement awaiting its join. The join waits for the host
  job when it is not done (one job in flight at most; deterministic: the values never
  depend on timing), with a one-time RuntimeWarning when it waited longer than 5% of the
  time since the job started (and 10 ms) that names the F at which the route keeps up
  on this machine. ``state_dict()`` waits for the job and records this rank's part
  (gns_kernels.distributed._checkpoint, "lagged"), so a resumed run joins it as the
  uninterrupted run would (bit-exact).

A measurement reads the state once, where it starts: ``settings()`` returns a frozen
``Settings`` (_settings.py: the configuration, the nuclear dof for its samples, the noise
pool's keys, the schedule's k, B and loss scale, the pool, its owners and the hints), the
one read of the micro-batch measurement; the DDP and FSDP2 transports take ``plan()`` (the
per-parameter plan) through the core's ``Measurement``. ``estimate`` reads the
configuration and B once when it builds the GNSEstimate.

Shift: var = mean_j (g^j - S)^2 - (g - S)^2 holds algebraically for any S
identical on all ranks. ``shift`` may be

- None: no shift;
- a mapping {parameter: tensor} or a callable ``parameter -> tensor | None`` (e.g.
  ``lambda p: opt.state[p].get("momentum_buffer")``): user tensors, read at every
  measurement, which MUST be identical on all ranks (the momentum buffer of a DDP model
  is; nothing checks it: checking would need a collective);
- "last": keep the last measured mean gradient of the measured parameters (float32, one
  gradient copy held between measurements: opt-in; the first measurement is unshifted).

Noise pool (``pool_beta``, default 0.9; l1 and nuclear with bias correction): every
measurement also folds its per-coordinate variances (l1) or per-matrix covariances
(nuclear) into an EMA with factor ``pool_beta`` and reports the noise of the pooled
statistics as ``estimate.noise_pooled`` (gns_kernels.stats.pool): the noise EMA the
controller needs, without the small-sample bias of square roots taken per measurement
(docs/fidelity.md). ``gk.AdaptiveBatchSize`` uses it in place of its own noise EMA, so
``pool_beta`` plays the role of its ``beta_noise`` (keep the two equal; the controller warns
when they differ). ``pool_beta=None`` turns pooling off (``noise_pooled`` is then None and
the controller averages ``noise`` itself, as before). Memory: l1 one float32 per measured
coordinate divided among the ranks (each rank pools its own share of every parameter: DDP
its 1/R slice, FSDP2 its shard), nuclear one k x k float32 covariance (k the smaller side)
per measured matrix on the rank that solves it, plus a few numbers per parameter.
The pool holds this rank's share: ``state_dict()`` carries it keyed by the parameters'
positions in the state's parameter order (``params``, or ``bind_params``; without one the
pool is not saved and a warning says so) and tagged with this rank and the world size;
save and load every rank's state_dict (``load_state_dict`` of another rank's or another
world size's refuses the pool with a warning and starts it afresh). ``grad_scale`` (settable,
default 1): the loss scale of the measured backward (a GradScaler's); the pool stores
statistics divided by its square, so a scale that changes between measurements does not
mix units (``gk.AdaptiveBatching`` keeps it current).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch

from .._dcp_guard import refuse_unwrapped_dcp
from ..stats.gns import GEOMETRIES
from ..stats.pool import NoisePool
from ..spectral.hints import EigHints
from ._checkpoint import hook_state_dict, load_hook_state_dict
from ._measurement import LaggedMeasurement, LastMeans, Sums
from ._pool_keys import PoolKeys
from ._schedule_reader import ScheduleReader
from ._state_lag import HostLag
from ._state_plan import MeasurementPlanning
from .config import HOOK_METHODS, GNSConfig, ShiftSpec, check_hook_method, config_field

Tensor = torch.Tensor

# HOOK_METHODS and check_hook_method live in .config (re-exported: they were imported from here)
__all__ = ["GNSHookState", "GNSConfig", "GEOMETRIES", "HOOK_METHODS", "check_hook_method"]


def _estimate_has_step() -> bool:
    from ..stats.gns import GNSEstimate
    return "step" in {f.name for f in dataclasses.fields(GNSEstimate)}


_HAS_STEP_FIELD = _estimate_has_step()


class GNSHookState(ScheduleReader, MeasurementPlanning, HostLag):
    """State of the gradient-noise-scale comm hooks (see the module docstring): its
    configuration ``config`` (a GNSConfig, checked once) and its runtime state (the
    schedule it reads, the noise pool, the measurement in progress, the estimate).

    Args:
        geometry, shift, params, process_group, bias_correction, nuclear_dof, signal,
            pool_beta, method: the configuration, as GNSConfig's fields (documented there);
            readable here as attributes (``method`` also settable, checked).
        every: F >= 1, measure at optimizer steps k with k % F == 0 (default 100, the
            paper's F and ``gk.AdaptiveBatchSize``'s default).
        batch_size: global batch size B (examples per optimizer step); settable.

    ``GNSHookState.from_config(config, every=F, batch_size=B)`` builds the same state from
    a ready GNSConfig.
    """

    # whether the samples are gradient-accumulation micro-batches (MicroBatchGNS), which
    # a transport may not support (FSDP2)
    micro_batch_samples = False

    def __init__(
        self,
        geometry: str = "l1",
        every: int = 100,
        batch_size: Optional[float] = None,
        shift: ShiftSpec = None,
        params: Optional[Iterable[Tensor]] = None,
        process_group=None,
        bias_correction: bool = True,
        nuclear_dof: str = "auto",
        signal: str = "raw",
        pool_beta: Optional[float] = 0.9,
        method: str = "auto",
    ):
        config = GNSConfig(geometry=geometry, shift=shift, params=params,
                           process_group=process_group, bias_correction=bias_correction,
                           nuclear_dof=nuclear_dof, signal=signal, pool_beta=pool_beta,
                           method=method)
        self._start(config, every, batch_size)

    @classmethod
    def from_config(cls, config: GNSConfig, every: int = 100, batch_size: Optional[float] = None,
                    **runtime) -> "GNSHookState":
        """The state of ``config`` (used as it is: it was checked when made), measuring
        every ``every`` steps at global batch ``batch_size``; ``runtime``: a subclass's
        other arguments (``MicroBatchGNS``: ``micro_batches``)."""
        if not isinstance(config, GNSConfig):
            raise TypeError(f"config: expected a GNSConfig, got {type(config).__name__}")
        cls._check_config(config)
        self = cls.__new__(cls)
        self._start(config, every, batch_size, **runtime)
        return self

    @classmethod
    def _check_config(cls, config: GNSConfig) -> None:
        """What a subclass refuses of a checked GNSConfig (nothing here)."""

    def _start(self, config: GNSConfig, every: int, batch_size: Optional[float]) -> None:
        self._config = config
        # F, k, B and the loss scale: this state's own schedule until a coordinator hands it
        # the run's (use_schedule)
        self._own_schedule(every, batch_size)
        self._param_ids = None if config.params is None else {id(p) for p in config.params}
        # the parameter order keying the noise pool and the pooled matrices' solve owners
        self._keys = PoolKeys(config.params)
        # the noise pool (l1 / nuclear with bias correction); keys: positions in the
        # parameter order (params / bind_params), else ("id", id(param))
        self.pool: Optional[NoisePool] = NoisePool(config.pool_beta) if config.pooled else None
        self._estimate = None
        self._pending = None  # statistics of the last measurement, not yet read
        self.estimate_step: Optional[int] = None
        # the host route: the step the estimate became readable at (its own step when it
        # did not lag), the measured step's loss scale (None: not carried), and the
        # measurement awaiting its join (a LaggedMeasurement)
        self.estimate_available_step: Optional[int] = None
        self.estimate_grad_scale: Optional[float] = None
        self._lagged: Optional[LaggedMeasurement] = None
        self._warned_wait = False
        self._last_mean = LastMeans()  # shift="last": the kept float32 mean gradients
        self._current = None  # the transport's context of the synchronized backward in progress
        # nuclear eigensolver cost hints by parameter shape (spectral.EigHints), applied
        # when a measurement finishes and checkpointed (a resumed run reproduces the numbers)
        self.eig_hints = EigHints()

    # ---------------------------------------------------------------- configuration
    @property
    def config(self) -> GNSConfig:
        """The configuration (a frozen GNSConfig); ``method`` is the one setting that may
        change, which replaces it."""
        return self._config

    geometry = config_field("geometry")
    shift = config_field("shift")
    process_group = config_field("process_group")
    bias_correction = config_field("bias_correction")
    nuclear_dof = config_field("nuclear_dof")
    signal = config_field("signal")
    pool_beta = config_field("pool_beta")

    @property
    def method(self):
        """The nuclear sqrt-trace solver of the hooks ("auto", "eigh", "newton", "host" or
        a HostConfig; GNSConfig.method); settable: a new config, checked ("newton-tf32" is
        refused: ``check_hook_method``)."""
        return self._config.method

    @method.setter
    def method(self, value: str) -> None:
        self._config = dataclasses.replace(self._config, method=value)  # checked there

    @property
    def l1_debiased(self) -> bool:
        """l1 with signal='debiased': each parameter's row carries a fifth sum, the debiased
        signal sum_i sqrt(max(g_i^2 - s2_i / B, 0)) (the transports' one test of it)."""
        return self._config.l1_debiased

    def resolved_nuclear_dof(self, num_samples: int, per_sample: bool = True) -> Optional[str]:
        """The dof mode of a nuclear measurement (``GNSConfig.resolved_nuclear_dof``)."""
        return self._config.resolved_nuclear_dof(num_samples, per_sample)

    # ---------------------------------------------------------------- hook protocol
    # What ddp_gns_hook and attach_fsdp_gns call, in this order, per synchronized backward:
    # micro_batches_for_sync() (DDP) and accepts_samples(S) at its start (a measurement
    # step), plan() once per measurement (the core's Measurement takes it: which
    # parameters, shifts and pool keys), begin_sync(context), sync_context while its
    # buckets / param groups are reduced, end_sync() once the last one is launched,
    # record(Sums) when the statistics are final. MicroBatchGNS overrides the first two
    # and end_sync().
    def micro_batches_for_sync(self):
        """Micro-batch statistics the synchronized backward's hook adds to each bucket.

        None here: each rank's gradient is one sample. ``MicroBatchGNS`` returns the
        accumulator of its rank's micro-batches (an object with ``count`` = A).
        """
        return None

    def accepts_samples(self, num_samples: int) -> bool:
        """Whether a measurement with ``num_samples`` samples S can be made this step.

        Raises ValueError for S < 2: one rank of a GNSHookState can never measure.
        """
        if num_samples < 2:
            raise ValueError(
                f"GNSHookState: measuring needs at least 2 samples, got {num_samples} (a process "
                "group of 1 rank); on a single rank use gk.MicroBatchGNS (gradient-accumulation "
                "micro-batches as samples) with DDP or on its own")
        return True

    def begin_sync(self, context=None) -> None:
        """Start of a synchronized backward: ``context`` is the hook's measurement in
        progress (None: this backward is not measured)."""
        if context is not None:
            self._read_host_pending()
        self._current = context

    def _read_host_pending(self) -> None:
        """Build the estimate of an unread measurement whose statistics are on the host
        (free to read), so the eigensolver hints it reports apply to the next one."""
        if self._pending is not None and self._pending.on_host():
            self._materialize()

    @property
    def sync_context(self):
        """The context given to ``begin_sync`` for the synchronized backward in progress."""
        return self._current

    def end_sync(self) -> None:
        """The last bucket / param group of the synchronized backward is launched: the
        step is counted (``step`` += 1) and the context dropped."""
        self._current = None
        self.advance_step()

    def record(self, sums: Sums) -> None:
        """Record a measurement's summed statistics (a ``Sums``, the transports' one
        record): ``estimate`` (identical on every rank) is built from them on its first
        read, and ``estimate_step`` = ``sums.step`` now (``estimate_available_step``:
        ``sums.available_step``, or ``sums.step`` when it did not lag). A measurement that
        did not lag while a host measurement awaits its join (the method or the device
        changed) drops that one, with a warning."""
        if self._lagged is not None and sums.available_step is None:
            self._drop_lagged(f"the measurement of step {sums.step} did not run the host route")
        self._pending = sums
        self.estimate_step = sums.step
        self.estimate_available_step = sums.step if sums.available_step is None else sums.available_step
        self.estimate_grad_scale = sums.grad_scale

    def record_measurement(self, num_samples: int, l_terms: Optional[Tensor], nuc_noise,
                           nuc_signal, step: int, *, nuc_signal_debiased=None,
                           nuclear_dof: Optional[str] = None, noise_pooled=None) -> None:
        """Record the summed statistics of the measurement of optimizer step ``step``:
        ``record`` of the ``Sums`` these fields make (_measurement.Sums says what each
        holds: a number, a tensor on any device, read on the first read of ``estimate``,
        or a callable returning one)."""
        self.record(Sums(num_samples, step, l_terms, nuc_noise, nuc_signal, nuc_signal_debiased,
                         nuclear_dof, noise_pooled))

    # ---------------------------------------------------------------- results
    @property
    def estimate(self):
        """The GNSEstimate of the last measurement (None before the first); built from the
        recorded statistics on first read (one host synchronization per measurement)."""
        if self._pending is not None:
            self._materialize()
        return self._estimate

    @estimate.setter
    def estimate(self, value) -> None:
        self._pending = None
        self._estimate = value

    def _materialize(self) -> None:
        """Read the pending measurement's sums (``Sums.read``) and turn them into the
        estimate, after applying the eigensolver hints it reported."""
        from ._estimate import estimate_from_sums

        pending, self._pending = self._pending, None
        cfg, batch_size = self._config, self.schedule.batch_size  # read once, before the sums
        if pending.batch_size is not None:  # a lagged measurement: the measured step's B
            batch_size = pending.batch_size
        sums = pending.read()
        self.eig_hints.apply()
        est = estimate_from_sums(
            cfg.geometry, sums, batch_size, cfg.bias_correction, signal=cfg.signal,
            pool_beta=cfg.pool_beta if sums.noise_pooled is not None else None)
        self.estimate_step = sums.step
        if est is not None and _HAS_STEP_FIELD:
            est = dataclasses.replace(est, step=sums.step)
            if sums.available_step is not None:
                est = dataclasses.replace(est, available_step=sums.available_step)
        self._estimate = est

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Schedule, configuration, the nuclear eigensolver hints and THIS RANK's noise pool,
        to resume (the estimate and a 'last' shift are not kept; gns_kernels.distributed.
        _checkpoint says what is saved). Reads a measurement not yet read (its hints). The
        pool is saved only with a parameter order (``params`` or ``bind_params``; otherwise
        a RuntimeWarning says it is left out). A host-route measurement awaiting its join:
        waits for its host job and records this rank's part ("lagged")."""
        refuse_unwrapped_dcp(type(self).__name__)  # the pool is this rank's
        if self._pending is not None:
            self._materialize()
        return hook_state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Resume from ``state_dict()``. Every entry is checked before anything changes: a
        rejected state_dict leaves this state as it was."""
        if not isinstance(sd, dict):
            raise TypeError(f"state_dict: expected a dict, got {type(sd).__name__}")
        if self._pending is not None:  # an unread measurement reports before the hints change
            self._materialize()
        load_hook_state_dict(self, sd)

    def __repr__(self) -> str:
        return (f"GNSHookState(geometry={self.geometry!r}, every={self.every}, "
                f"batch_size={self.batch_size}, step={self.step}, shift={self.shift!r}, "
                f"nuclear_dof={self.nuclear_dof!r}, signal={self.signal!r}, "
                f"pool_beta={self.pool_beta!r}"
                + (f", method={self.method!r})" if self.method != "auto" else ")"))
