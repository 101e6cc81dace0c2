"""GNSHookState: schedule, configuration and results of the distributed GNS hooks.

One object per model, shared by the DDP comm hook (``ddp_gns_hook``), the micro-batch
estimator (``MicroBatchGNS``, a subclass) and the FSDP2 hooks. It holds

- the schedule: ``step`` k counts optimizer steps = synchronized backward passes (one
  per DDP gradient synchronization; no_sync() micro-steps do not count). A backward is a
  *measurement step* when k % every == 0 -- the schedule of ``gk.AdaptiveBatchSize``
  (its ``every``), so one F drives both. ``step`` may be set on resume.
- ``batch_size``: the current GLOBAL batch B (examples per optimizer step, all ranks and
  micro-batches together). The trainer keeps it current; the variance scale is
  B / (S - 1) with S the number of samples (ranks, or ranks x micro-batches).
- ``geometry`` ("l2", "l1", "nuclear"), ``bias_correction`` (as gk.estimate), ``params``
  (the measured subset; nuclear uses its 2-D members only), ``shift`` and
  ``process_group``.
- ``estimate``: the GNSEstimate of the last measurement (None before the first),
  identical on every rank; ``estimate_step``: the k it was measured at. The hooks leave
  the statistics of a measurement as device tensors (no host synchronization inside the
  backward); they are turned into the GNSEstimate on the first read of ``estimate``: one
  synchronization per measurement, paid by the reader. (A measurement on the CPU that was
  never read is materialized when the next one starts, so the eigensolver hints it
  reports are in effect for it.)

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
statistics as ``estimate.noise_pooled`` (gns_kernels.pooling): the noise EMA the
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
from typing import Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist


from ..bias import GAUSS_SUMS_MIN_SAMPLES, resolve_nuclear_dof
from .._validation import check_signal
from .._validation import warn_user as _warn_user
from ..estimators import GEOMETRIES
from .._dcp_guard import refuse_unwrapped_dcp
from ..pooling import NoisePool, check_pool_beta
from ._measurement import LastMeans, MeasurementPlan, Sums, resolve_shift
from ..spectral.hints import EigHints
from ..spectral.trace import METHODS as SOLVE_METHODS
from ..schedule import Schedule, check_batch_size

Tensor = torch.Tensor

__all__ = ["GNSHookState", "GEOMETRIES", "HOOK_METHODS", "check_hook_method"]

# The solvers the hook states run. "newton-tf32" (gk.sqrt_trace / gk.nuclear_stats keep it
# as an explicit experiment) is refused: the hooks' noise and pool chains are float64
# whatever the method, so TF32 reaches only the signal Grams, and there its rounding of a
# steep spectrum loses the tail that carries much of the sqrt-trace (docs/spectral.md).
HOOK_METHODS = tuple(m for m in SOLVE_METHODS if m != "newton-tf32")


def check_hook_method(method) -> str:
    """``method`` if the hook states accept it, else ValueError naming ``method``."""
    if isinstance(method, str) and method == "newton-tf32":
        raise ValueError(
            "method: 'newton-tf32' is not accepted by the hook states: TF32 products of the "
            "signal Grams lose the tail of their steep spectra, and the signal came out 18% low "
            "(3.04e-13 against 3.73e-13 with 'newton', bench/bench_hook_ops.py's 160M/32 "
            "shapes, CPU emulation), while the noise and the pool stay float64 anyway; use "
            "'newton' (TF32 stays an experiment of gk.sqrt_trace / gk.nuclear_stats)")
    if not isinstance(method, str) or method not in HOOK_METHODS:
        raise ValueError(f"method: expected one of {HOOK_METHODS}, got {method!r}")
    return method

ShiftSpec = Union[None, str, Mapping, Callable]


def _estimate_has_step() -> bool:
    from ..estimators import GNSEstimate
    return "step" in {f.name for f in dataclasses.fields(GNSEstimate)}


_HAS_STEP_FIELD = _estimate_has_step()


def _check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _unique(params: Iterable[Tensor]) -> list:
    """The parameters in order, each tensor once (by identity: a tied weight passed twice
    is one parameter with one gradient)."""
    out, seen = [], set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"params[{i}]: expected a parameter tensor, got {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class GNSHookState:
    """State of the gradient-noise-scale comm hooks (see the module docstring).

    Args:
        geometry: "l2", "l1" or "nuclear" (the optimizer's geometry).
        every: F >= 1, measure at optimizer steps k with k % F == 0 (default 100, the
            paper's F and ``gk.AdaptiveBatchSize``'s default).
        batch_size: global batch size B (examples per optimizer step); settable.
        shift: None, "last", {param: tensor} or callable(param) -> tensor | None.
        params: iterable of parameters to measure (default: all the hook sees; a tensor
            listed twice, e.g. a tied weight, counts once). For "nuclear" only the 2-D
            ones are used (as gk.estimate does).
        process_group: the data-parallel group (default: the default group).
        bias_correction: as gk.estimate (default True: the c4 l1 correction and the
            spectral ops' nuclear correction; False: the paper's raw estimators).
        nuclear_dof: the degrees of freedom of the nuclear correction, as gk.estimate's:
            "auto" (default): "gauss-sums" when each sample is one rank's gradient (DDP,
            ranks as samples) and there are >= 3 of them, else "columns" (2 ranks; FSDP2,
            whose ranks hold only a shard of the mean gradient; ``MicroBatchGNS``, which
            keeps no per-micro-batch gradient); "gauss-sums" (DDP ranks, >= 3; the hook
            raises ValueError at a measurement with fewer samples); "columns".
            With the default the DDP hook's estimate equals gk.estimate's default on the
            ranks' gradients.
        signal: "raw" (default, the paper's signal) or "debiased" (as gk.estimate's:
            the estimate's ``signal`` is then the bias-reduced one, ``signal_raw`` the
            paper's); costs one more sqrt-trace per matrix (nuclear) or one pass over the
            reduced gradient (l1) on measurement steps.
        pool_beta: the noise pool's EMA factor in [0, 1) (default 0.9, AdaptiveBatchSize's
            beta_noise) or None (no pool); see the module docstring. Used for l1 and
            nuclear with ``bias_correction`` (l2 is linear: its noise EMA needs no pool;
            the paper's raw estimator has none). Costs on measurement steps: l1 a few
            passes over this rank's share of the reduced gradient and, under DDP, one more
            all-reduce of one float64; nuclear one more sqrt-trace per matrix (of its pooled
            covariance), solved by the rank that solves its noise.
        method: the nuclear sqrt-trace solver the hooks run, as ``gk.nuclear_stats``'s
            and ``gk.sqrt_trace``'s: "auto" (default: eigenvalues on CPU tensors, the
            coupled Newton iteration on GPUs), "eigh" or "newton" (e.g. the GPU path on
            CPU tensors, for tests and bench/bench_hook_ops.py). Not saved by
            ``state_dict()`` (configuration, like ``signal``). "newton-tf32" is refused
            (ValueError): in the hooks TF32 reaches only the signal, which it left 18%
            low on the hook benchmark (CPU emulation); it stays available on
            ``gk.sqrt_trace`` / ``gk.nuclear_stats`` as an experiment.
    """

    # nuclear_dof values this state accepts (the hooks cannot form 'data': it needs
    # cross-sample fourth moments)
    _NUCLEAR_DOFS = ("auto", "gauss-sums", "columns")
    _NUCLEAR_DOF_HINT = " ('data' needs cross-sample terms a hook cannot form)"
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
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry: expected one of {GEOMETRIES}, got {geometry!r}")
        self.geometry = geometry
        if batch_size is None:
            raise ValueError("batch_size: expected the global batch size (a positive number), got None")
        # F, k, B and the loss scale: this state's own schedule until a coordinator hands it
        # the run's (use_schedule)
        self.schedule = Schedule(every=_check_positive_int("every", every),
                                 batch_size=check_batch_size(batch_size))
        self.synced_backwards = 0   # synchronized backward passes seen (each ends a step)
        if isinstance(shift, str):
            if shift != "last":
                raise ValueError(f"shift: the only string accepted is 'last', got {shift!r}")
        elif not (shift is None or isinstance(shift, Mapping) or callable(shift)):
            raise TypeError(
                "shift: expected None, 'last', a mapping {parameter: tensor} or a callable "
                f"parameter -> tensor, got {type(shift).__name__}"
            )
        self.shift = shift
        if params is not None:
            if isinstance(params, Tensor):
                raise TypeError("params: expected an iterable of parameters, got a single tensor")
            plist = _unique(params)
            self._param_ids = {id(p) for p in plist}
            if not self._param_ids:
                raise ValueError("params: expected at least one parameter, got an empty iterable")
        else:
            plist = None
            self._param_ids = None
        self.process_group = process_group
        self.bias_correction = bool(bias_correction)
        if nuclear_dof not in self._NUCLEAR_DOFS:
            raise ValueError(f"nuclear_dof: expected one of {self._NUCLEAR_DOFS} for "
                             f"{type(self).__name__}, got {nuclear_dof!r}{self._NUCLEAR_DOF_HINT}")
        self.nuclear_dof = nuclear_dof
        if (nuclear_dof == "gauss-sums" and self.bias_correction and geometry == "nuclear"
                and dist.is_available() and dist.is_initialized()):
            world = dist.get_world_size(process_group)
            if world < GAUSS_SUMS_MIN_SAMPLES:  # said here, not at the first measurement in backward()
                raise ValueError(f"nuclear_dof: 'gauss-sums' needs at least {GAUSS_SUMS_MIN_SAMPLES} "
                                 f"ranks as samples, "
                                 f"this process group has {world} (use 'auto', which falls back "
                                 "to 'columns' below 3)")
        self.signal = check_signal(signal)
        self._method = check_hook_method(method)
        self.pool_beta = check_pool_beta(pool_beta)
        # the noise pool (l1 / nuclear with bias correction); keys: positions in the
        # parameter order (params / bind_params), else ("id", id(param))
        self.pool: Optional[NoisePool] = (
            NoisePool(self.pool_beta) if (self.pool_beta is not None and self.bias_correction
                                          and geometry != "l2") else None)
        self._order: Optional[dict[int, int]] = None
        # nuclear with a pool: pool key -> the rank that solves (and pools) that matrix
        self.pool_owners: dict = {}
        if plist is not None:
            self._order = {id(p): i for i, p in enumerate(plist)}
        self._estimate = None
        self._pending = None  # statistics of the last measurement, not yet read
        self.estimate_step: Optional[int] = None
        self._last_mean = LastMeans()  # shift="last": the kept float32 mean gradients
        self._current = None  # the transport's context of the synchronized backward in progress
        # nuclear eigensolver cost hints by parameter shape (spectral.EigHints), applied
        # when a measurement finishes and checkpointed (a resumed run reproduces the numbers)
        self.eig_hints = EigHints()

    @property
    def l1_debiased(self) -> bool:
        """l1 with signal='debiased': each parameter's row carries a fifth sum, the debiased
        signal sum_i sqrt(max(g_i^2 - s2_i / B, 0)) (the transports' one test of it)."""
        return self.signal == "debiased" and self.geometry == "l1"

    # ---------------------------------------------------------------- schedule
    # F, k, B and the loss scale live in ``self.schedule`` (gns_kernels.schedule): this
    # state's own, or the run's when a coordinator owns it (then they are read-only here)
    def use_schedule(self, schedule: Schedule) -> None:
        """Read F, k, B and the loss scale from ``schedule`` from now on (a coordinator's,
        which writes them; this state's setters then raise, naming the owner)."""
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule: expected a gns_kernels.schedule.Schedule, got {type(schedule).__name__}")
        self.schedule = schedule

    def _write(self, field: str, value) -> None:
        self.schedule.write(field, value, by=type(self).__name__)

    @property
    def every(self) -> int:
        """F: measure at optimizer steps k with k % F == 0 (settable unless a coordinator
        owns the schedule)."""
        return self.schedule.every

    @every.setter
    def every(self, value: int) -> None:
        self._write("every", _check_positive_int("every", value))

    @property
    def step(self) -> int:
        """k: the optimizer step in progress; on its own the state counts the synchronized
        backward passes (settable on resume), under a coordinator it reads the run's k."""
        return self.schedule.step

    @step.setter
    def step(self, value: int) -> None:
        self._write("step", _check_positive_int("step", value, minimum=0))

    @property
    def batch_size(self) -> float:
        """Global batch size B of the current step (settable; the trainer keeps it current)."""
        return self.schedule.batch_size

    @batch_size.setter
    def batch_size(self, value: float) -> None:
        self._write("batch_size", check_batch_size(value))

    @property
    def grad_scale(self) -> float:
        """The loss scale of the measured backward (settable; 1 without a GradScaler)."""
        return self.schedule.grad_scale

    @grad_scale.setter
    def grad_scale(self, value: float) -> None:
        self._write("grad_scale", value)

    def bind_params(self, params: Iterable[Tensor]) -> None:
        """Fix the parameter order that keys the noise pool in ``state_dict()`` (the
        position of each parameter in ``params``, e.g. the optimizer's param_groups order;
        a tensor listed twice counts once). ``params=`` at construction does the same.
        Entries already pooled under another key are re-keyed."""
        if isinstance(params, Tensor):
            raise TypeError("params: expected an iterable of parameters, got a single tensor")
        plist = _unique(params)
        if not plist:
            raise ValueError("params: expected at least one parameter, got an empty iterable")
        order = {id(p): i for i, p in enumerate(plist)}
        old_ids = {v: k for k, v in self._order.items()} if self._order is not None else None

        def remap(key):
            """The key under the new order: ("id", id) -> its position; a position of the
            old order -> the same parameter's new position; with no old order (e.g. a pool
            loaded from a checkpoint before any order was bound) positions stay."""
            if isinstance(key, tuple):
                return order.get(key[1])
            if old_ids is None:
                return key
            return order.get(old_ids.get(key))

        if self.pool is not None and len(self.pool):
            self.pool.rekey(remap)
        owners = ((remap(k), o) for k, o in self.pool_owners.items())
        self.pool_owners = {k: o for k, o in owners if k is not None}
        self._order = order

    @property
    def has_param_order(self) -> bool:
        """Whether a parameter order keys the noise pool (``params=`` or ``bind_params``),
        so that ``state_dict()`` can save it."""
        return self._order is not None

    def pool_key(self, param: Tensor):
        """The noise pool's key of ``param``: its position in the parameter order, else
        ("id", id(param)) (not saved by ``state_dict()``)."""
        return self.plan().key(param)

    def is_measurement_step(self, step: Optional[int] = None) -> bool:
        """True when optimizer step k (default: the next one, ``self.step``) measures."""
        return self.schedule.measures(step)

    def resolved_nuclear_dof(self, num_samples: int, per_sample: bool = True) -> Optional[str]:
        """The dof mode of a nuclear measurement with ``num_samples`` samples: 'gauss-sums'
        or 'columns' (bias.resolve_nuclear_dof; per_sample: each sample's deviation from
        the mean is available). None when there is no nuclear correction (bias_correction
        False, or another geometry).
        Raises ValueError for nuclear_dof='gauss-sums' that cannot be honoured."""
        if not self.bias_correction or self.geometry != "nuclear":
            return None
        if self.nuclear_dof == "gauss-sums" and not per_sample:
            raise ValueError("nuclear_dof: 'gauss-sums' needs each sample's own gradient (ranks as "
                             "samples); these samples are micro-batches or shards, use 'auto' or "
                             "'columns'")
        return resolve_nuclear_dof(self.nuclear_dof, num_samples, per_sample=per_sample)

    def advance_step(self) -> None:
        """One optimizer step (a synchronized backward) is done: ``synced_backwards`` += 1,
        and k += 1 when this state owns its schedule (a coordinator advances the run's k)."""
        self.synced_backwards += 1
        if self.schedule.owner is None:
            self.schedule.write("step", self.schedule.step + 1, by=type(self).__name__)

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
        read, and ``estimate_step`` = ``sums.step`` now."""
        self._pending = sums
        self.estimate_step = sums.step

    def record_measurement(self, num_samples: int, l_terms: Optional[Tensor], nuc_noise,
                           nuc_signal, step: int, *, nuc_signal_debiased=None,
                           nuclear_dof: Optional[str] = None, noise_pooled=None) -> None:
        """Record the summed statistics of the measurement of optimizer step ``step``
        (``record`` of the ``Sums`` these fields make; their meaning is ``Sums``'s).

        l_terms: float64 Tensor[4] (l1 / l2; a fifth entry, the debiased l1 signal sum,
            with ``signal`` "debiased"), or a Tensor[P, 4 or 5] of per-parameter rows,
            summed exactly on the read; nuc_noise, nuc_signal: sums over the measured
            matrices of tr(C_l^{1/2}) and ||G_l||_S1 (nuclear); nuc_signal_debiased,
            nuclear_dof, noise_pooled: as ``Sums``. Each may be a number, a tensor on any
            device (read, all together, on the first read of ``estimate``: the one host
            synchronization of the measurement) or a callable returning one.
        The estimate carries ``step`` as well when GNSEstimate has a ``step`` field.
        """
        self.record(Sums(num_samples, step, l_terms, nuc_noise, nuc_signal, nuc_signal_debiased,
                         nuclear_dof, noise_pooled))

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
        pending, self._pending = self._pending, None
        sums = pending.read()
        self._finish(sums)
        est = self._estimate
        if est is not None and _HAS_STEP_FIELD:
            self._estimate = dataclasses.replace(est, step=sums.step)

    # ---------------------------------------------------------------- parameters
    @property
    def method(self) -> str:
        """The nuclear sqrt-trace solver of the hooks ("auto", "eigh" or "newton");
        settable, checked ("newton-tf32" is refused: ``check_hook_method``)."""
        return self._method

    @method.setter
    def method(self, value: str) -> None:
        self._method = check_hook_method(value)

    def plan(self) -> MeasurementPlan:
        """The plan of a measurement starting now: per parameter, whether it is measured,
        its shift, its noise-pool key and whether its mean is kept (``shift="last"``),
        each resolved once (``MeasurementPlan.of``). The transports ask for it once per
        measurement."""
        return MeasurementPlan(ids=self._param_ids, matrices_only=self.geometry == "nuclear",
                               shift=self.shift, last=self._last_mean, order=self._order)

    def measures(self, param: Tensor) -> bool:
        """Whether ``param`` contributes to the statistics of this geometry."""
        return self.plan().measures(param)

    def shift_for(self, param: Tensor) -> Optional[Tensor]:
        """The shift tensor of ``param`` for the current measurement (None: no shift)."""
        return resolve_shift(self.shift, self._last_mean, param)

    def keep_mean(self, param: Tensor, mean_grad: Tensor) -> None:
        """Store the measured mean gradient as the next shift (only when shift == 'last')."""
        if isinstance(self.shift, str):  # only shift == "last" keeps the mean
            self._last_mean.keep(param, mean_grad)

    # ---------------------------------------------------------------- results
    def _finish(self, sums: Sums) -> None:
        """Turn a measurement's summed statistics, read to the host (``Sums.read``), into
        ``self.estimate``."""
        from ._estimate import estimate_from_sums

        self.eig_hints.apply()
        self._estimate = estimate_from_sums(
            self.geometry, sums, self.batch_size, self.bias_correction, signal=self.signal,
            pool_beta=self.pool_beta if sums.noise_pooled is not None else None)
        self.estimate_step = sums.step

    # ---------------------------------------------------------------- checkpoints
    def _rank_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return 0, 1

    def state_dict(self) -> dict:
        """Schedule, configuration, the nuclear eigensolver hints and THIS RANK's noise pool,
        to resume (the estimate and a 'last' shift are not kept). Reads a measurement not yet
        read (its hints). The pool is saved only with a parameter order (``params`` or
        ``bind_params``; otherwise a RuntimeWarning says it is left out)."""
        refuse_unwrapped_dcp(type(self).__name__)  # the pool is this rank's
        if self._pending is not None:
            self._materialize()
        sd = {"geometry": self.geometry, "eig_float64": self.eig_hints.state_dict()}
        if self.schedule.owner is None:   # a coordinator saves the run's schedule itself
            sd.update(step=self.step, every=self.every, batch_size=self.batch_size)
        if self.pool is not None:
            unkeyed = [k for k in self.pool.keys() if isinstance(k, tuple)]
            if unkeyed:
                _warn_user(
                    f"{type(self).__name__}.state_dict: {len(unkeyed)} noise-pool entries are keyed by "
                    "object identity (no parameter order: pass params= or call bind_params), so "
                    "they are not saved; a resumed run starts their pool afresh")
            rank, world = self._rank_world()
            pool = self.pool.state_dict(key_map=lambda k: None if isinstance(k, tuple) else k)
            owners = {k: int(o) for k, o in self.pool_owners.items() if not isinstance(k, tuple)}
            sd["pool"] = {"rank": rank, "world": world, "owners": owners, **pool}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Resume from ``state_dict()``. Every entry is checked before anything changes: a
        rejected state_dict leaves this state as it was."""
        if not isinstance(sd, dict):
            raise TypeError(f"state_dict: expected a dict, got {type(sd).__name__}")
        if self._pending is not None:  # an unread measurement reports before the hints change
            self._materialize()
        # the schedule is this state's to load when it owns it; a coordinator loads the
        # run's itself (and a checkpoint's copy here, from before, is not read)
        own = self.schedule.owner is None
        for key in (("step", "every", "batch_size") if own else ()) + ("geometry",):
            if key not in sd:
                raise KeyError(f"state_dict: missing key {key!r}")
        if sd["geometry"] != self.geometry:
            raise ValueError(f"state_dict: geometry {sd['geometry']!r} differs from this state's {self.geometry!r}")
        if own:
            every = _check_positive_int("state_dict: every", sd["every"])
            step = _check_positive_int("state_dict: step", sd["step"], minimum=0)
            batch_size = check_batch_size(sd["batch_size"])
        # absent in checkpoints written before the hints existed
        hints = type(self.eig_hints)()
        hints.load_state_dict(sd.get("eig_float64", {}), name="state_dict: eig_float64")
        pool_sd = sd.get("pool")  # absent before the noise pool existed, or without one
        use_pool = False
        if pool_sd is not None and self.pool is not None:
            if not isinstance(pool_sd, dict) or not {"rank", "world"} <= set(pool_sd):
                raise ValueError("state_dict: 'pool' must be a dict with rank, world, beta, entries")
            for name, lo in (("rank", 0), ("world", 1)):
                v = pool_sd[name]
                if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                    raise ValueError(f"state_dict: pool[{name!r}] must be an int >= {lo}, got {v!r}")
            NoisePool.check_state_dict({k: v for k, v in pool_sd.items() if k in ("beta", "entries")},
                                       "state_dict: pool")
            owners = pool_sd.get("owners", {})
            if not isinstance(owners, dict) or not all(
                    isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in owners.values()):
                raise ValueError("state_dict: pool['owners'] must map keys to rank numbers >= 0")
            rank, world = self._rank_world()
            if any(o >= pool_sd["world"] for o in owners.values()):
                raise ValueError(f"state_dict: pool['owners'] names a rank >= the saved world "
                                 f"size {pool_sd['world']}")
            if (pool_sd["rank"], pool_sd["world"]) != (rank, world):
                _warn_user(
                    f"{type(self).__name__}.load_state_dict: the noise pool was saved by rank "
                    f"{pool_sd['rank']} of {pool_sd['world']}, this is rank {rank} of {world}: "
                    "it is not loaded (each rank pools its own share; save and load every "
                    "rank's state_dict) and starts afresh")
            elif float(pool_sd["beta"]) != self.pool_beta:
                _warn_user(
                    f"{type(self).__name__}.load_state_dict: the noise pool was saved with pool_beta "
                    f"{pool_sd['beta']}, this state has {self.pool_beta}: it is not loaded and "
                    "starts afresh")
            else:
                use_pool = True
        self.eig_hints.load_state_dict(sd.get("eig_float64", {}), name="state_dict: eig_float64")
        if self.pool is not None:
            if use_pool:
                self.pool.load_state_dict({k: v for k, v in pool_sd.items() if k in ("beta", "entries")},
                                          name="state_dict: pool")
            else:
                self.pool.clear()
            # which rank solves (and pools) each matrix is one global assignment: every rank
            # takes the saved one whenever the world size matches (also when its own pool
            # is refused), so all ranks agree on it
            same_world = pool_sd is not None and pool_sd.get("world") == self._rank_world()[1]
            self.pool_owners = dict(pool_sd.get("owners", {})) if same_world else {}
        if own:
            self.every, self.step, self.batch_size = every, step, batch_size

    def __repr__(self) -> str:
        return (f"GNSHookState(geometry={self.geometry!r}, every={self.every}, "
                f"batch_size={self.batch_size}, step={self.step}, shift={self.shift!r}, "
                f"nuclear_dof={self.nuclear_dof!r}, signal={self.signal!r}, "
                f"pool_beta={self.pool_beta!r}"
                + (f", method={self.method!r})" if self.method != "auto" else ")"))
