"""The one measurement core under the three transports.

``ddp.py`` (the DDP comm hook), ``fsdp.py`` (the FSDP2 reduce-scatter) and
``microbatch.py`` (one-rank micro-batches) are siblings over this module; none imports
another's private names. It holds

- ``Sums``: the typed record of one measurement's summed statistics, what the transports
  hand to ``GNSHookState.record`` and what the state turns into the GNSEstimate on the
  first read of ``estimate`` (``Sums.read``: one host synchronization);
- ``MeasurementPlan`` / ``ParamPlan``: per parameter, whether it is measured, its shift,
  its noise-pool key and whether its mean gradient is kept as the next shift, resolved
  once per measurement from a plan the state hands out once (``GNSHookState.plan()``);
- ``LastMeans``: the kept mean gradients of ``shift="last"`` (owned by the state, written
  through the plan);
- ``Measurement``: one measurement in progress (sample count, variance scale, nuclear dof,
  the shared nuclear solve ``SolveShare``, the l1/l2 accumulators), and its recording (the
  DDP and FSDP2 hooks; one rank's micro-batch measurement, ``_micro_measure.py``, takes
  ``Sums`` and ``ShareReader`` from here and its settings from ``GNSHookState.settings``);
- ``ShareReader``: the totals of a ``SolveShare`` as the callables ``Sums`` carries;
- ``LaggedMeasurement``: a host-route nuclear measurement between its staging and its
  join at the next measurement (``GNSHookState.record_lagged``; docs/distributed.md, "The
  host route").
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from ._pool_keys import pool_key
from ._share import SolveShare
from ._stats import exact_sum

Tensor = torch.Tensor

__all__ = ["Sums", "ParamPlan", "MeasurementPlan", "LastMeans", "Measurement", "ShareReader",
           "LaggedMeasurement", "resolve_shift"]


# --------------------------------------------------------------------------- the record
class Sums(NamedTuple):
    """The summed statistics of the measurement of optimizer step ``step``.

    l_terms: float64 Tensor[4], [sum ||s||_1, sum ||g||_1, sum s2, sum ||g||_2^2] over the
        measured parameters (l1 / l2; None for nuclear), with a fifth entry, the debiased
        l1 signal sum sum_i sqrt(max(g_i^2 - s2_i / B, 0)), when ``signal`` is "debiased"
        and the geometry l1; or a Tensor[P, 4 or 5] of such rows, one per parameter,
        summed on the read with exactly rounded sums (a total that does not depend on the
        order of the rows: the DDP hook's, whose parameters come in the bucket layout's
        order);
    nuc_noise, nuc_signal: sums over the measured matrices of tr(C_l^{1/2})
        (bias-corrected when ``bias_correction``) and ||G_l||_S1 (nuclear);
    nuc_signal_debiased: sum_l tr((G_l G_l^T - C_l / B)_+^{1/2}) (nuclear with
        ``signal`` "debiased");
    nuclear_dof: the dof mode the nuclear correction used;
    noise_pooled: the noise pool's sum (l1: sum of the pooled corrected ||s||_1 parts;
        nuclear: sum_l of the pooled corrected tr(P_l^{1/2})), None without a pool.
    Each value may be a number, a tensor on any device or a callable returning one (with
    a ``device_type`` attribute when it is not the CPU's), read all together by ``read``.
    available_step: a lagged measurement's (the host route) step at which its sums became
        readable (its join, at the next measurement), None for a measurement readable at
        its own step; batch_size, grad_scale: the measured step's global batch and loss
        scale when they are carried (the lagged ones: the estimate uses the measured
        step's, not the reading step's), else None (the state's current B).
    """

    num_samples: int
    step: int
    l_terms: Any = None
    nuc_noise: Any = None
    nuc_signal: Any = None
    nuc_signal_debiased: Any = None
    nuclear_dof: Optional[str] = None
    noise_pooled: Any = None
    available_step: Optional[int] = None
    batch_size: Optional[float] = None
    grad_scale: Optional[float] = None

    def _values(self) -> tuple:
        return (self.l_terms, self.nuc_noise, self.nuc_signal, self.nuc_signal_debiased,
                self.noise_pooled)

    def on_host(self) -> bool:
        """Whether every value is already on the host (free to read)."""
        return all(not (isinstance(v, Tensor) and v.device.type != "cpu")
                   and getattr(v, "device_type", "cpu") == "cpu" for v in self._values())

    def read(self) -> "Sums":
        """The same record with host values: callables called (in field order), every
        device tensor copied to the host in ONE copy, per-parameter rows summed exactly."""
        vals = [v() if callable(v) else v for v in self._values()]
        tens = [v for v in vals if isinstance(v, Tensor)]
        if tens:  # one device-to-host copy for everything
            host = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tens]).cpu()
            out, i = [], 0
            for v in vals:
                if isinstance(v, Tensor):
                    n = v.numel()
                    h = host[i:i + n]
                    out.append(h.reshape(v.shape) if n != 1 or v.dim() > 0 else float(h[0]))
                    i += n
                else:
                    out.append(v)
            vals = out
        lt = vals[0]
        if isinstance(lt, Tensor) and lt.dim() == 2:  # one row per parameter: exactly rounded sums
            vals[0] = torch.tensor([exact_sum(c) for c in lt.T.tolist()], dtype=torch.float64)
        lt, noise, signal, deb, pooled = vals
        return self._replace(l_terms=lt, nuc_noise=noise, nuc_signal=signal,
                             nuc_signal_debiased=deb, noise_pooled=pooled)


# --------------------------------------------------------------------------- the plan
def resolve_shift(spec, last: "LastMeans", param: Tensor) -> Optional[Tensor]:
    """The shift tensor of ``param`` under the shift spec (GNSHookState's ``shift``):
    None, "last" (the kept mean gradient), a mapping or a callable; checked."""
    if spec is None:
        return None
    if isinstance(spec, str):  # "last"
        return last.get(param)
    s = spec.get(param) if isinstance(spec, Mapping) else spec(param)
    if s is None:
        return None
    if not isinstance(s, Tensor):
        raise TypeError(f"shift: expected a tensor (or None) for a parameter of shape "
                        f"{tuple(param.shape)}, got {type(s).__name__}")
    if s.shape != param.shape:
        raise ValueError(f"shift: expected a tensor of shape {tuple(param.shape)} like its "
                         f"parameter, got {tuple(s.shape)}")
    s = s.detach()
    return s if s.is_contiguous() else s.contiguous()


class LastMeans:
    """shift="last": the last measured mean gradient of each parameter (float32)."""

    def __init__(self):
        self._held: dict[int, Tensor] = {}

    def get(self, param: Tensor) -> Optional[Tensor]:
        return self._held.get(id(param))

    def keep(self, param: Tensor, mean_grad: Tensor) -> None:
        held = self._held.get(id(param))
        if held is None or held.shape != param.shape:
            held = torch.empty(param.shape, dtype=torch.float32, device=mean_grad.device)
            self._held[id(param)] = held
        held.copy_(mean_grad.reshape(param.shape))

    def __len__(self) -> int:
        return len(self._held)


class ParamPlan(NamedTuple):
    """One parameter's part in a measurement."""

    measured: bool
    shift: Optional[Tensor]  # None: no shift (always None for an unmeasured parameter)
    key: Any  # its noise-pool key
    keep: bool  # its mean gradient is kept as the next shift (shift="last")


class MeasurementPlan:
    """What a measurement does with each parameter, from the state's configuration at the
    measurement's start (``GNSHookState.plan()``); each parameter is resolved once, on
    first sight (``of``).

    ids: the measured parameters' ids (None: every parameter); matrices_only: nuclear (2-D
    parameters only); shift: the shift spec; last: the kept means (shift="last"); order:
    id -> position keying the noise pool (None: keys are ("id", id))."""

    def __init__(self, *, ids: Optional[set], matrices_only: bool, shift, last: LastMeans,
                 order: Optional[Mapping[int, int]]):
        self._ids = ids
        self._matrices_only = matrices_only
        self._shift = shift
        self._last = last
        self._keep = isinstance(shift, str)
        self._order = order
        self._params: dict[int, ParamPlan] = {}

    def measures(self, param: Tensor) -> bool:
        if self._ids is not None and id(param) not in self._ids:
            return False
        return param.dim() == 2 if self._matrices_only else True

    def key(self, param: Tensor):
        return pool_key(self._order, param)

    def of(self, param: Tensor) -> ParamPlan:
        """``param``'s plan (resolved on the first call of this measurement)."""
        pp = self._params.get(id(param))
        if pp is None:
            m = self.measures(param)
            pp = ParamPlan(m, resolve_shift(self._shift, self._last, param) if m else None,
                           self.key(param), m and self._keep)
            self._params[id(param)] = pp
        return pp

    def keep_mean(self, param: Tensor, pp: ParamPlan, mean_grad: Tensor) -> None:
        """Keep ``mean_grad`` as ``param``'s next shift when its plan says so."""
        if pp.keep:
            self._last.keep(param, mean_grad)


# --------------------------------------------------------------------------- a measurement
class Measurement:
    """One measurement in progress, shared by the DDP and FSDP2 transports (MicroBatchGNS
    as a DDP hook state included; a rank's own micro-batch measurement forms its ``Sums``
    from the state's ``settings()`` in _micro_measure.py, without this class).

    state: the GNSHookState; world, rank: of the process group (1, 0 for one rank);
    num_samples: S (ranks, or ranks x micro-batches); per_sample: each sample's own
    gradient is known ('gauss-sums' dof possible: DDP ranks). The variance scale is
    B / (S - 1). The nuclear solves go to ``share`` (SolveShare); l1 / l2 sums collect in
    ``l_rows`` (one float64 row per parameter, summed exactly on the read: DDP) or
    ``l_terms`` (partial sums: FSDP2), the l1 pool's parts in ``l_pool``.
    """

    def __init__(self, state, world: int, num_samples: int, rank: int = 0, *,
                 per_sample: bool = True, micro=None):
        self.state = state
        self.plan: MeasurementPlan = state.plan()
        self.world = world
        self.rank = rank
        self.num_samples = num_samples
        self.batch_size = float(state.batch_size)
        self.scale = self.batch_size / (num_samples - 1)
        self.step = state.step
        self.micro = micro  # DDP with MicroBatchGNS: this rank's micro-batch accumulator
        self.device: Optional[torch.device] = None  # of the first bucket / param group
        self.l_rows: list[Tensor] = []
        self.l_terms: Optional[Tensor] = None
        self.l_pool: list = []  # DDP: (pool key, part); FSDP2: partial sums
        self.dof = state.resolved_nuclear_dof(num_samples, per_sample=per_sample)
        self.share = SolveShare(world, rank, self.scale, state.bias_correction, num_samples,
                                self.batch_size, hints=state.eig_hints,
                                dof=self.dof or "columns", signal=state.signal,
                                pool=state.pool, grad_scale=state.grad_scale,
                                owners=state.pool_owners, method=state.method)

    def record_nuclear(self, group, all_reduce: Optional[Callable]) -> Optional[ShareReader]:
        """Launch the share's one all-reduce (not waited for) and record the totals as
        callables read with the estimate. Returns the reader.

        The host route (``SolveShare.is_host``): the share is staged and its host job
        submitted, and the state joins the previous host measurement now, with this one's
        collective (``GNSHookState.record_lagged``); returns None."""
        if self.share.is_host():
            self.share.launch(group, all_reduce, lag=True)
            self.state.record_lagged(self.lagged(), group, all_reduce)
            return None
        self.share.launch(group, all_reduce)
        reader = ShareReader(self.share)
        self.state.record(Sums(self.num_samples, self.step, nuc_noise=reader.noise,
                               nuc_signal=reader.signal, nuc_signal_debiased=reader.signal_deb,
                               nuclear_dof=self.dof, noise_pooled=reader.pooled))
        return reader

    def lagged(self) -> "LaggedMeasurement":
        """This measurement as a LaggedMeasurement (its share staged)."""
        return LaggedMeasurement(self.share, self.step, self.num_samples, self.dof,
                                 self.batch_size, self.share.solver.grad_scale)

    def record_l(self, l_terms, noise_pooled=None) -> None:
        """Record the l1 / l2 sums (a Tensor[4 or 5] or per-parameter rows)."""
        self.state.record(Sums(self.num_samples, self.step, l_terms=l_terms,
                               noise_pooled=noise_pooled))


# --------------------------------------------------------------------------- share reader
class ShareReader:
    """noise / signal / signal_deb / pooled: the totals of a SolveShare, read once
    (callables for ``Sums``; signal_deb None unless signal='debiased', pooled None
    without a pool)."""

    def __init__(self, share: SolveShare):
        self.share = share
        self.values = None
        dev = share.device
        self.noise = _Value(self, 0, dev)
        self.signal = _Value(self, 1, dev)
        self.signal_deb = _Value(self, 2, dev) if share.signal == "debiased" else None
        self.pooled = _Value(self, 3, dev) if share.pool is not None else None


class _Value:
    def __init__(self, reader: ShareReader, i: int, device):
        self.reader = reader
        self.i = i
        self.device_type = device.type if device is not None else "cpu"

    def __call__(self) -> float:
        r = self.reader
        if r.values is None:
            r.values = tuple(r.share.read()) + (r.share.pooled_total,)
        return r.values[self.i]


# --------------------------------------------------------------------------- the lag
class LaggedMeasurement:
    """A host-route nuclear measurement awaiting its join (docs/distributed.md, "The host
    route"): its share (staged; ``submit`` starts its host job), the measured step, its
    sample count and dof, and the measured step's global batch and loss scale (the
    estimate's, whenever it is read)."""

    def __init__(self, share: SolveShare, step: int, num_samples: int, dof: Optional[str],
                 batch_size: float, grad_scale: float):
        self.share = share
        self.step = step
        self.num_samples = num_samples
        self.dof = dof
        self.batch_size = float(batch_size)
        self.grad_scale = float(grad_scale)

    def submit(self) -> None:
        """Start the host job (``SolveShare.submit``)."""
        self.share.submit()

    def join(self, group, all_reduce: Optional[Callable], available_step: int,
             device=None) -> tuple["Sums", float, Optional[float]]:
        """(sums, waited, interval): wait for the host job, start the share all-reduce
        (``SolveShare.join``) and the Sums of the measurement, readable from
        ``available_step`` on; waited: seconds the join waited for the job; interval:
        seconds from the job's submit to this join (None for a restored measurement).
        device: the joining measurement's device (where a restored part goes)."""
        share = self.share
        t0 = time.monotonic()
        interval = None if share.submitted is None else t0 - share.submitted
        waited = share.wait()
        if share.device is None and device is not None:
            share.device = torch.device(device)
        share.join(group, all_reduce, device)
        reader = ShareReader(share)
        sums = Sums(self.num_samples, self.step, nuc_noise=reader.noise, nuc_signal=reader.signal,
                    nuc_signal_debiased=reader.signal_deb, nuclear_dof=self.dof,
                    noise_pooled=reader.pooled, available_step=available_step,
                    batch_size=self.batch_size, grad_scale=self.grad_scale)
        return sums, waited, interval

    def cancel(self) -> None:
        """Drop it: its host job is asked to stop (spectral.host.HostJob.cancel)."""
        if self.share.job is not None:
            self.share.job.cancel()
