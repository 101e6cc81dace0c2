"""MicroBatchGNS: gradient-accumulation micro-batches as the GNS samples.

One rank (no data parallelism) cannot form a variance across ranks, but gradient
accumulation gives A micro-batches of b examples each (B = A * b): their gradients are
samples too. With several DDP ranks the samples are ranks x micro-batches (S = R * A).

Loss-scaling convention (the usual one for accumulation): each micro-batch's loss is its
mean loss divided by A, so after the A backward passes ``.grad`` holds the mean gradient of
the whole (local) batch. The gradient of micro-batch a is then recovered as
g^a = A * (grad_a - grad_{a-1}), grad_a the accumulated ``.grad`` after micro-step a (and
grad_0 = 0: zero the gradients, or set them to None, before the first micro-batch).
``.grad`` must be float32: a difference of successive bf16 accumulations loses about
A * 2^-8 of its value (keep float32 master gradients, e.g. float32 parameters under autocast).

Per measurement step, with d_a = grad_a - grad_{a-1} (fused op ``accumulate_sq``):
    mean_a g^a       = grad_A                      (the accumulated .grad)
    mean_a (g^a)^2   = A * sum_a d_a^2              (l1 / l2, per coordinate)
    mean_a G^a G^aT  = A * sum_a gram(d_a)          (nuclear, per 2-D parameter)
and the variance scale is B / (S - 1) as for ranks. No shift (the accumulation op has none).

Usage, one process (``micro_batches`` = A, settable like ``batch_size``)::

    mb = gk.MicroBatchGNS(model.parameters(), geometry="l1", every=F, batch_size=B,
                          micro_batches=A)
    for a in range(A):
        (loss_fn(model(x[a]), y[a]) / A).backward()
        mb.micro_step()            # the A-th call finishes the step (estimate if measured)
    opt.step(); opt.zero_grad()

Several ranks: register it as the DDP comm hook state and keep the same loop, the first
A-1 backward passes under ``ddp.no_sync()``; the synchronized backward's hook adds the
last micro-batch and sends [g, A * sum d^2] (or the Grams) in its one all-reduce per bucket::

    ddp.register_comm_hook(mb, gk.ddp_gns_hook)
    for a in range(A):
        with (ddp.no_sync() if a < A - 1 else contextlib.nullcontext()):
            (loss / A).backward()
        mb.micro_step()

Memory on a measurement step: ``prev`` (one float32 copy of the measured gradients) and
``sq`` (another, l1/l2) or the m x m Grams (nuclear), from the first micro-step to the end
of the step. Non-measurement steps only count micro-steps.

The measurement on one rank (``_measure_local``, at the step's last micro-step) reads what
it needs once: the step's A (``micro_step`` reads it for the step and hands it on), then
the state's settings (``GNSHookState.settings``: configuration, schedule, noise pool and
keys, in one frozen record). One orchestrator (``_micro_measure.measure_micro_batches``)
then checks the tensor lists once and calls leaves that never call back into the state
(the unchecked fused op, the noise pool's fold, the solver); its result is recorded.
bench/trace_path.py counts the modules it passes through (tests/test_trace_path.py).
"""
from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from .._validation import warn_user as _warn_user
from ._measurement import LaggedMeasurement
from ._micro_measure import measure_micro_batches
from ._micro_sums import MicroSums, SyncMicro
from .config import GNSConfig, unique_params
from .state import GNSHookState

Tensor = torch.Tensor

__all__ = ["MicroBatchGNS"]


class MicroBatchGNS(GNSHookState):
    """GNS from gradient-accumulation micro-batches (x ranks, when used as a DDP hook state).

    Args:
        params: the parameters whose ``.grad`` is read (and measured; for "nuclear" the
            2-D ones). A tensor listed twice (a tied weight) is one parameter.
        geometry, every, batch_size, process_group, bias_correction: as GNSHookState
            (``every`` defaults to 100).
        micro_batches: A, micro-batches per optimizer step on each rank (settable).
        nuclear_dof: "auto" (default) or "columns": the nuclear correction's dof is always
            'columns' here. The 'gauss-sums' dof needs each sample's deviation from the
            mean gradient, d_a = g^a - g; the mean is known only after the last
            micro-batch, and its quartic sums ||d_a d_a^T||_F^2 cannot be formed from the
            accumulated Grams without keeping every micro-batch's gradient (A copies).
        signal: "raw" (default) or "debiased", as GNSHookState.
        pool_beta: the noise pool's EMA factor (default 0.9) or None, as GNSHookState. The
            pool's parameter order is ``params``' (so ``state_dict()`` keeps it).

    ``MicroBatchGNS.from_config(config, every=F, batch_size=B, micro_batches=A)`` builds it
    from a GNSConfig whose ``params`` are set and ``shift`` is None.

    ``micro_step()`` must follow every micro-batch's backward: it is what counts the
    micro-batches and optimizer steps. A second backward through the measured parameters
    without ``micro_step()`` in between warns once (RuntimeWarning; a gradient hook on one
    measured parameter counts the backward passes, removed when this object is deleted).
    A weight that reentrant activation checkpointing accumulates several times in one
    backward can trigger it spuriously; non-reentrant checkpointing does not.

    If ``micro_step()`` raises (e.g. a non-float32 ``.grad``), the error is raised once and
    the step it belongs to is not measured: the call still counts as that step's
    micro-batch, the step ends at its A-th call as usual, and the next measurement step
    measures normally.
    """

    micro_batch_samples = True
    # the nuclear_dof values it accepts: fewer than GNSConfig's (checked before the config)
    _NUCLEAR_DOFS = ("auto", "columns")
    _NUCLEAR_DOF_HINT = (" ('gauss-sums' needs each micro-batch's deviation from the final mean "
                         "gradient, which would mean keeping every micro-batch's gradient)")

    def __init__(
        self,
        params: Iterable[Tensor],
        geometry: str = "l1",
        every: int = 100,
        batch_size: Optional[float] = None,
        micro_batches: Optional[int] = None,
        process_group=None,
        bias_correction: bool = True,
        nuclear_dof: str = "auto",
        signal: str = "raw",
        pool_beta: Optional[float] = 0.9,
        method: str = "auto",
    ):
        plist = unique_params(params)
        self._check_nuclear_dof(nuclear_dof)
        config = GNSConfig(geometry=geometry, shift=None, params=plist, process_group=process_group,
                           bias_correction=bias_correction, nuclear_dof=nuclear_dof, signal=signal,
                           pool_beta=pool_beta, method=method)
        self._start(config, every, batch_size, micro_batches)

    @classmethod
    def _check_nuclear_dof(cls, nuclear_dof) -> None:
        if nuclear_dof not in cls._NUCLEAR_DOFS:
            raise ValueError(f"nuclear_dof: expected one of {cls._NUCLEAR_DOFS} for "
                             f"{cls.__name__}, got {nuclear_dof!r}{cls._NUCLEAR_DOF_HINT}")

    @classmethod
    def _check_config(cls, config: GNSConfig) -> None:
        if config.params is None:
            raise ValueError(f"params: {cls.__name__} reads the .grad of config.params, got None")
        if config.shift is not None:
            raise ValueError(f"shift: {cls.__name__} has no shift (the accumulation op has none), "
                             f"got {config.shift!r}")
        cls._check_nuclear_dof(config.nuclear_dof)

    def _start(self, config: GNSConfig, every: int, batch_size: Optional[float],
               micro_batches: Optional[int] = None) -> None:
        super()._start(config, every, batch_size)
        self._params = [p for p in config.params if self.measures(p)]
        if not self._params:
            what = "2-D parameters" if config.geometry == "nuclear" else "parameters"
            raise ValueError(f"params: expected at least one of the {what} this geometry measures, got none")
        if micro_batches is None:
            raise ValueError("micro_batches: expected the number of micro-batches per step (an int >= 1), got None")
        self.micro_batches = micro_batches
        self._count = 0
        self._synced = False
        self._failed = False  # a micro_step of the current step raised: it is not measured
        self._poisoned = False  # a micro-batch of the current step had no backward: invalid
        self._marks = None  # (id, version) of the measured .grad after the last micro_step
        # the sums of this step's micro-batches (measurement steps only)
        self._sums = MicroSums(nuclear=config.geometry == "nuclear")
        self.prev, self.sq, self.gsum = self._sums.prev, self._sums.sq, self._sums.gsum
        # backward passes seen since the last micro_step() (a gradient hook on one
        # measured parameter); 2 means micro_step() was left out
        self._backwards = 0
        self._warned_no_micro_step = False
        self._warned_no_backward = False
        # warn at a second backward without micro_step() (a hand-wired loop that left it
        # out); gk.AdaptiveBatching calls micro_step() itself and turns this off
        self.warn_missing_micro_step = True
        self._grad_hook = None
        watched = next((p for p in self._params if p.requires_grad and p.is_leaf), None)
        if watched is not None:
            self._grad_hook = watched.register_post_accumulate_grad_hook(_backward_seen(self))

    def detach(self) -> None:
        """Remove the gradient hook this object put on one measured parameter (it counts the
        backward passes between micro_step() calls); what a refused coordinator undoes."""
        handle, self._grad_hook = getattr(self, "_grad_hook", None), None
        if handle is not None:
            handle.remove()

    def __del__(self):
        self.detach()

    @property
    def micro_batches(self) -> int:
        """A, micro-batches per optimizer step on this rank: settable on its own; under a
        coordinator the run's A_k = B_k / (R b), read from the schedule it owns."""
        A = self.schedule.accum_steps
        return self._micro_batches if A is None else A

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        self.schedule.check_writer("micro_batches", type(self).__name__)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"micro_batches: expected an int >= 1, got {value!r}")
        self._micro_batches = value

    @property
    def count(self) -> int:
        """Micro-steps taken in the current optimizer step."""
        return self._count

    # -------------------------------------------------------------- accumulation
    def _grad(self, p: Tensor) -> Optional[Tensor]:
        g = p.grad
        if g is None:
            return None
        if g.dtype != torch.float32:
            raise TypeError(
                f"MicroBatchGNS: expected float32 .grad (accumulate gradients in float32), got "
                f"{str(g.dtype).replace('torch.', '')} for a parameter of shape {tuple(p.shape)}")
        return g if g.is_contiguous() else g.contiguous()

    def _accumulate(self) -> None:
        live = [(p, g) for p in self._params if (g := self._grad(p)) is not None]
        # a backward changes some measured gradient (a new tensor, or its version counter):
        # no measured gradient at all, or none changed since the previous micro_step(), means
        # this micro-batch had no backward, and its difference d_a = 0 would count as a
        # sample (host reads only)
        marks = [(id(p.grad), p.grad._version) for p, _ in live]
        if not self._poisoned and (not live or (self._count > 1 and marks == self._marks)):
            self._poisoned = True
            if not self._warned_no_backward:   # the step is marked invalid every time; said once
                self._warned_no_backward = True
                _warn_user(
                    f"MicroBatchGNS: micro-batch {self._count} of step {self.step} had no backward "
                    "through the measured parameters before the next micro-batch (a micro-batch "
                    "skipped, its backward run after the loop over the batch, or micro_step() "
                    "called twice): its gradient would count as a zero sample, so the step's "
                    "measurement is marked invalid (the controller skips it; said once). Run "
                    "each micro-batch's backward inside the loop over the batch (hand-wired: "
                    "before its micro_step())")
        self._marks = marks
        self._sums.add(live)

    def _reset(self) -> None:
        self._count = 0
        self._synced = False
        self._failed = False
        self._poisoned = False
        self._marks = None
        self._sums.clear()

    def micro_step(self) -> None:
        """Call after each micro-batch's backward (all A of them, see the module docstring)."""
        self._backwards = 0
        self._count += 1
        if self._synced:  # DDP: the synchronized backward's hook took this micro-batch
            count = self._count
            self._reset()
            if count != self.micro_batches:
                raise RuntimeError(
                    f"MicroBatchGNS: the synchronized backward was micro-step {count} of the "
                    f"step, but micro_batches is {self.micro_batches}")
            return
        A = self.micro_batches
        last = self._count >= A
        try:
            if not self._failed and self.is_measurement_step():
                self._accumulate()
                if last:
                    self._measure_local(A)
        except BaseException:
            # this step is not measured; the error is the caller's, raised once
            self._failed = True
            self._sums.clear()
            raise
        finally:
            if last:  # the step's A micro-batches are done, measured or not
                self.advance_step()
                self._reset()

    def skip_step(self) -> None:
        """End the optimizer step in progress without measuring it: call it in place of
        the step's last ``micro_step()`` (after that micro-batch's backward) when the
        caller knows the step cannot be measured, e.g. a trainer's step with one
        micro-batch, or with micro-batches of unequal size (an epoch's partial last
        batch). The micro-batches counted so far are dropped, the step counter k
        advances as at a step's last ``micro_step()``, and the estimate, the noise pool
        and the measuring schedule are unchanged. One rank only: under DDP the
        synchronized backward has already ended the step (RuntimeError)."""
        if self._synced:
            raise RuntimeError("MicroBatchGNS.skip_step: this step's synchronized (DDP) backward has "
                               "already run and measured it; skip_step is for one rank without DDP")
        self._backwards = 0
        self.advance_step()
        self._reset()

    def _measure_local(self, A: int) -> None:
        """Measure this step from its A micro-batches on this rank (the step's A, read once
        by micro_step): the settings read once (``settings``), the statistics formed by
        ``measure_micro_batches`` (_micro_measure.py), which calls back into nothing here,
        and recorded."""
        if A < 2:
            raise ValueError("micro_batches: one rank needs at least 2 micro-batches to measure, got 1")
        live = [p for p in self._params if p.grad is not None]
        grads = [self._grad(p) for p in live]
        if self._poisoned:  # a micro-batch without backward: the measurement is invalid (NaN sums)
            self._sums.poison()
        self._read_host_pending()  # an unread CPU measurement reports its eigensolver hints first
        settings = self.settings(live, num_samples=A, per_sample=False)
        res = measure_micro_batches(settings, A, self._sums, live, grads)
        if isinstance(res, LaggedMeasurement):  # the host route: joins the previous one
            self.record_lagged(res, None, None)
        else:
            self.record(res)

    def _backward_seen(self) -> None:
        self._backwards += 1
        if self._backwards >= 2 and self.warn_missing_micro_step and not self._warned_no_micro_step:
            self._warned_no_micro_step = True
            _warn_user(
                "MicroBatchGNS: two backward passes without micro_step() in between: if each is "
                "a micro-batch, call mb.micro_step() after each one's backward (without it no "
                "micro-batch is counted and nothing is measured); two backward passes of one "
                "micro-batch are fine (said once)")

    # -------------------------------------------------------------- DDP hook side
    def micro_batches_for_sync(self):
        """The accumulator of this rank's micro-batches for the synchronized backward's
        hook (None when this step is not measured or has one micro-batch). Raises
        RuntimeError (and drops the step's accumulation) when the synchronized backward
        is not the A-th micro-batch."""
        if self._count + 1 != self.micro_batches:
            count = self._count
            self._reset()
            raise RuntimeError(
                f"MicroBatchGNS: synchronized backward after {count} micro-steps, expected "
                f"{self.micro_batches - 1} (call micro_step() after every micro-batch backward, "
                "the first micro_batches-1 of them under ddp.no_sync())")
        if self._count == 0 or not self.is_measurement_step():
            return None
        return SyncMicro(self._sums, self._count + 1, invalid=self._failed or self._poisoned)

    def accepts_samples(self, num_samples: int) -> bool:
        """False (with a RuntimeWarning) for 1 rank x 1 micro-batch: that step is not
        measured (the batch may grow later), the estimate is unchanged."""
        if num_samples < 2:
            _warn_user("MicroBatchGNS: 1 rank x 1 micro-batch = 1 sample, this step is not "
                       "measured (needs >= 2 samples)")
            return False
        return True

    def end_sync(self) -> None:
        super().end_sync()
        self._synced = True


def _backward_seen(mb: MicroBatchGNS):
    """Gradient hook counting backward passes (holds the MicroBatchGNS weakly)."""
    ref = weakref.ref(mb)

    def hook(_param) -> None:
        owner = ref()
        if owner is not None:
            owner._backward_seen()

    return hook
