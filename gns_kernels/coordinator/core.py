"""AdaptiveBatching: the thin coordinator of an adaptive-batch run. Its rooms:
``config`` (the settings, checked once), ``attach`` (the measurement built from the model),
``stream`` (the micro-batch stream), ``watch`` and ``guard`` (the loop checks), ``lrs``
(the learning rates), ``reading`` (the estimate and the metrics row), ``checkpoint`` (the
state_dict format). The module docstring of ``gns_kernels.adaptive`` describes the loop.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

from .._validation import check_int
from ..schedule import Schedule
from . import checkpoint, loops
from .attach import discard, measurement_for, resolve
from .config import OWNER, CoordinatorConfig, check_budget
from .guard import LoopGuard, StepProgress
from .loops import Batch
from .lrs import LRControl
from .reading import controller_estimate, loss_scale, step_row
from .stream import DataStream, batch_len, micro_batch_error
from .watch import GradWatch

__all__ = ["AdaptiveBatching", "Batch"]

def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


class AdaptiveBatching:
    """Adaptive batch size and LR for a DDP, FSDP2 or one-rank training loop.

    Args:
        gns: the model (a DDP model, an FSDP2 model, or a plain module on one rank: the
            coordinator builds and attaches the GNS measurement, in the geometry of the
            first optimizer), or what measures the GNS: a ``GNSHookState`` registered as
            the DDP comm hook state, a ``MicroBatchGNS`` (one rank, or as the DDP hook
            state), or the ``FSDPGNSHandle`` of ``attach_fsdp_gns``.
        optimizers: one optimizer or a list (e.g. [Muon, AdamW]); all of their param
            groups get the LR multiplier; their current lr is the scheduled (base) rate.
        schedulers: LR schedulers of ``optimizers`` (stepped by the coordinator, see
            ``gns_kernels.adaptive``), or None.
        grad_scaler: a ``torch.amp.GradScaler`` when the backward runs on scaled losses:
            the hooks see gradients x scale, so noise and signal are divided by scale^2
            before they enter the EMAs (their ratio, the GNS, does not depend on it).
        lr_schedule: a function of the global examples seen to a factor of each param
            group's base lr (its lr when the coordinator was built, kept as
            ``group["base_lr"]``), e.g. ``lambda n: gk.warmup_cosine(n, total, 0.1 * total)``;
            the effective lr is that x omega. Exclusive with ``schedulers``.
        micro_batch_size, initial_batch_size, max_batch_size, theta, every, warmup_steps,
            beta_noise, beta_signal, lr_scaling, max_growth, world_size, rank, signal,
            geometry: ``CoordinatorConfig``'s fields (its docstring says what each is),
            checked before anything is attached to the model or written into the
            optimizers: a refused constructor leaves both as they were.

    ``schedule``: the run's ``Schedule`` (F, k, B_k, loss scale), which the hook state and
    the controller read and only the coordinator (and the controller's decision) writes.
    """

    def __init__(self, gns, optimizers, *, micro_batch_size: int, initial_batch_size: int,
                 max_batch_size: Optional[int] = None, theta: float = 0.6,
                 every: Optional[int] = None, warmup_steps: int = 0, beta_noise: Optional[float] = None,
                 beta_signal: float = 0.9, lr_scaling: str = "sqrt", schedulers=None,
                 grad_scaler=None, max_growth: Optional[float] = None,
                 world_size: Optional[int] = None, rank: Optional[int] = None,
                 signal: Optional[str] = None, lr_schedule=None, geometry: Optional[str] = None):
        opts = _as_list(optimizers)
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise TypeError("optimizers: expected a torch.optim.Optimizer or a list of them (every "
                            f"param group gets the LR multiplier), got {optimizers!r:.200}")
        cfg = CoordinatorConfig(
            micro_batch_size=micro_batch_size, initial_batch_size=initial_batch_size,
            max_batch_size=max_batch_size, theta=theta, every=every, warmup_steps=warmup_steps,
            beta_noise=beta_noise, beta_signal=beta_signal, lr_scaling=lr_scaling,
            max_growth=max_growth, world_size=world_size, rank=rank, signal=signal, geometry=geometry)
        model, gns, attach = measurement_for(gns, opts, cfg)   # built from a model, not attached
        try:
            self._configure(gns, cfg, "model" if model is not None else "state",
                            _as_list(schedulers), grad_scaler, lr_schedule)
            if attach is not None:
                attach()      # the one change to the model, after every check passed
        except BaseException:
            if model is not None:
                discard(gns)
            raise
        # from here on nothing can refuse: the optimizers' param groups and step hooks
        self.optimizers = opts
        self.lrs = LRControl(opts, self._schedulers, lr_schedule)
        self.progress = StepProgress(opt_steps=[0] * len(opts))
        self.watch = GradWatch(fsdp=self.kind == "fsdp")
        self.guard = LoopGuard(self.kind, self._form, opts, self.state, self.progress, self.watch)
        self.stream = DataStream(self.micro_batch_size, self.world_size, self.rank)
        self._hooks = [opt.register_step_post_hook(self._on_optimizer_step) for opt in opts]
        self._last: dict[str, Any] = {}
        self.schedule.write("grad_scale", loss_scale(grad_scaler), by=OWNER)
        self.state.use_schedule(self.schedule)   # F, k, B, scale: read from the run's schedule
        self.progress.sync_mark = self.state.synced_backwards
        if self.kind == "micro":
            self.state.warn_missing_micro_step = False   # micro_batches() calls micro_step()
        if getattr(self.state, "pool", None) is not None and not self.state.has_param_order:
            self.state.bind_params(self.guard.params())  # the pool is saved keyed by this order
        if model is not None:
            self.guard.use_model(model)

    def _configure(self, gns, cfg: CoordinatorConfig, form: str, schedulers: list,
                   grad_scaler, lr_schedule) -> None:
        """The constructor's checks and settings (nothing outside self is changed)."""
        self.kind, self.state, self.fsdp_handle, self.config = resolve(gns, cfg, form, grad_scaler)
        c, self._form, self.grad_scaler = self.config, form, grad_scaler
        self.world_size, self.rank, self.micro_batch_size = c.world_size, c.rank, c.micro_batch_size
        # F, k, B_k, the loss scale: the controller writes B_{k+1} into it, the hook state reads it
        self.schedule = Schedule(every=c.every, batch_size=c.initial_batch_size,
                                 per_step=c.world_size * c.micro_batch_size, owner=OWNER)
        self.controller = c.controller(self.schedule)
        LRControl.check(schedulers, lr_schedule)
        self._schedulers = schedulers

    # ------------------------------------------------------------------ read-outs
    every = property(lambda self: self.schedule.every, doc="F, the measuring period.")
    max_growth = property(lambda self: self.controller.max_growth,
                          doc="The bound on B_{k+1} / B_k per decision, or None.")
    schedulers = property(lambda self: self.lrs.schedulers, doc="The schedulers the coordinator steps.")
    lr_schedule = property(lambda self: self.lrs.lr_schedule, doc="The schedule on samples, or None.")
    sampler = property(lambda self: self.stream.sampler, doc="The MicroBatchSampler of batch_sampler().")
    current_step = property(lambda self: self.schedule.step,
                            doc="k, the optimizer step in progress (0, 1, 2, ...; advanced by step()).")
    batch_size = property(lambda self: self.schedule.batch_size,
                          doc="B_k, the global batch of the step in progress (examples, all ranks).")
    accum_steps = property(lambda self: self.schedule.accum_steps,
                           doc="A_k = B_k / (R b): micro-batches per rank in the step in progress; "
                               "divide each micro-batch's mean loss by it.")
    local_batch_size = property(lambda self: self.batch_size // self.world_size,
                                doc="A_k x b: examples per rank in the step in progress.")
    samples_seen = property(lambda self: self.progress.samples,
                            doc="Global examples of the completed steps.")
    lr_multiplier = property(lambda self: self.lrs.multiplier,
                             doc="omega of the step in progress (sqrt(B_k / B_0) with lr_scaling='sqrt').")
    grad_scale = property(lambda self: self.schedule.grad_scale,
                          doc="The loss scale the step in progress runs its backward with (1 without a scaler).")

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Every optimizer's step post-hook; in ``batches()`` the step ends at the last."""
        pr = self.progress
        self.watch.on_optimizer_step(self.guard.params(), pr.served, pr.consumed, self.accum_steps)
        self.guard.on_optimizer_step(optimizer, self.grad_scaler)
        if pr.auto_end and all(pr.opt_steps) and pr.consumed == self.accum_steps:
            pr.auto_end = False
            self.end_step()

    # ------------------------------------------------------------------ data
    def batch_sampler(self, num_samples: int, shuffle: bool = True, seed: int = 0):
        """A ``MicroBatchSampler`` over a map-style dataset of ``num_samples`` items for
        ``DataLoader(dataset, batch_sampler=...)``: each item one micro-batch of b indices
        of this rank; its consumed position is saved in ``state_dict()``. After
        ``load_state_dict`` it continues at the saved position; a saved position that does
        not fit (another ``num_samples``, ``shuffle`` or ``seed``) raises ValueError and
        leaves no sampler behind (``coord.sampler`` stays None)."""
        return self.stream.make_sampler(num_samples, shuffle=shuffle, seed=seed)

    def micro_batches(self, loader: Iterable, model=None) -> Iterator[tuple[Any, Any]]:
        """The A_k micro-batches of the step in progress, as (batch, context) pairs.

        ``loader``: an iterable of micro-batches (normally a DataLoader over
        ``batch_sampler(...)``); it is iterated across steps and re-iterated when a pass
        ends. ``model``: the DDP or FSDP2 model (its ``no_sync()`` /
        ``set_requires_gradient_sync(False)`` is the context of the first A-1
        micro-batches; the last synchronizes); None on one rank. Run the forward and
        backward of each micro-batch inside its context, with the loss divided by
        ``accum_steps``. After each backward this calls ``MicroBatchGNS.micro_step()``.
        """
        return loops.micro_batches(self, loader, model)

    # ------------------------------------------------------------------ for trainer stacks
    def begin_step(self) -> None:
        """The checks of a step's start, for a trainer integration that draws the
        micro-batches itself instead of through ``micro_batches()`` (the Lightning
        callback): call before the step's first forward. Raises RuntimeError when a
        parameter was frozen, unfrozen or removed since the coordinator was built; on a
        measuring step it arms the check that the step's first backward starts from zero
        gradients (read at ``step()``)."""
        self.guard.check_start(self.current_step)
        self.watch.begin(self.guard.params(), self.state.is_measurement_step(self.current_step))

    def check_micro_batch(self, batch, index: int = 0) -> None:
        """ValueError when ``batch`` (micro-batch ``index`` of the step in progress) holds a
        number of examples other than ``micro_batch_size``, as far as it can be told
        (``stream.batch_len``: batch-first tensors, dicts, tuples, lists; other objects are
        not checked). ``micro_batches()`` calls it for every micro-batch; a trainer
        integration that draws them itself calls it too."""
        n = batch_len(batch)
        if n is not None and n != self.micro_batch_size:
            raise micro_batch_error(n, index, self.current_step, self.world_size, self.accum_steps,
                                    self.micro_batch_size)

    # ------------------------------------------------------------------ the loops
    def batches(self, loader: Iterable, max_samples: Optional[int] = None,
                max_steps: Optional[int] = None, model=None) -> Iterator["Batch"]:
        """The optimizer steps of the run, each as a ``Batch``: ``len(batch)`` is A_k, the
        micro-batches this rank accumulates, and iterating it yields them (the first A_k - 1
        under DDP's ``no_sync()`` / FSDP2's ``set_requires_gradient_sync(False)``). Stops
        before a step whose batch would exceed ``max_samples`` (global examples) or at
        ``max_steps`` (each an int >= 0 or None, checked here). The step ends by itself when
        every optimizer passed has stepped (no ``coord.step()``); a step that a GradScaler
        skipped (inf gradient) ends when the next batch is drawn. ``model``: the DDP /
        FSDP2 model for ``no_sync``, when the coordinator was built from a hook state. The
        loop::

            for batch in coord.batches(loader, max_samples=total):
                for x, y in batch:
                    (loss_fn(model(x), y) / len(batch)).backward()
                opt.step(); opt.zero_grad()
        """
        max_samples = check_budget("max_samples", max_samples)
        max_steps = check_budget("max_steps", max_steps)
        loops.refuse_nested(self, "batches")
        if model is not None:
            self.guard.model = model
        return loops.batches(self, loader, max_samples, max_steps)

    def fits(self, max_samples: Optional[int] = None, max_steps: Optional[int] = None) -> bool:
        """Whether the next step's batch fits in ``max_samples`` (global examples, samples
        seen included) and k < ``max_steps`` (None: no limit): where batches() stops."""
        return loops.fits(self, check_budget("max_samples", max_samples),
                          check_budget("max_steps", max_steps))

    def steps(self, max_samples: Optional[int] = None, max_steps: Optional[int] = None) -> Iterator[int]:
        """Yield k = current_step while the next step fits (``fits``; the budgets checked
        here); raises if a step ended without ``step()``."""
        max_samples = check_budget("max_samples", max_samples)
        max_steps = check_budget("max_steps", max_steps)
        loops.refuse_nested(self, "steps")
        return loops.steps(self, max_samples, max_steps)

    # ------------------------------------------------------------------ the step
    def step(self, k: Optional[int] = None) -> int:
        """End optimizer step k (call after ``optimizer.step()``; with a GradScaler after
        ``scaler.update()``); returns B_{k+1}. ``k``, if given, must be ``current_step``.
        Not needed in a ``batches()`` loop, where the step ends by itself when every
        optimizer has stepped."""
        if k is not None:
            k = check_int("k", k, 0)
            if k != self.current_step:
                raise ValueError(
                    f"step(k={k}): this is optimizer step {self.current_step}; the coordinator counts "
                    "optimizer steps from 0 itself, so call coord.step() without k (or pass "
                    "coord.current_step)")
        if self.progress.auto_end or self.progress.in_batches:
            raise RuntimeError("coord.step(): in a coord.batches(...) loop the step ends by itself "
                               "when the optimizers step; remove the coord.step() call")
        return self.end_step()

    def end_step(self) -> int:
        """The end of step k (``step()`` once its own checks passed; a ``batches()`` loop
        calls it when the optimizers stepped): the loop's checks, the measurement of step k
        (if it measures) to Algorithm 1, which writes B_{k+1} into the schedule; then k + 1,
        the LRs, the next loss scale, the metrics row. Returns B_{k+1}."""
        k, pr, ctrl, scale = self.current_step, self.progress, self.controller, self.grad_scale
        self.watch.disarm()
        self.guard.check_state(k, self.state.synced_backwards - pr.sync_mark, self.accum_steps)
        self.guard.check_loop(k, self.grad_scaler,
                              self.grad_scaler is not None and loss_scale(self.grad_scaler) < scale,
                              pr.warn_once)
        self.lrs.check_hand_steps(k)
        measure = k % self.every == 0
        est = None
        if measure:
            self.watch.check_before_read(k)
            samples = self.world_size * self.accum_steps if self.kind == "micro" else 2
            est = controller_estimate(self.state, k, scale, samples,
                                      self.kind == "micro" and self.world_size == 1, pr.warn_once)
            self.watch.check_after_read(k)   # after the estimate's read: the device is idle
        f_next = self.lrs.factor(pr.samples + self.batch_size)
        A_used, B_used = self.accum_steps, self.batch_size
        ctrl.update(k, est)     # writes B_{k+1} into the run's schedule
        pr.samples += B_used
        self.schedule.write("step", k + 1, by=OWNER)
        pr.new_step(self.state.synced_backwards, len(self.optimizers))
        self.watch.reset()
        self.lrs.step(ctrl.lr_multiplier, f_next, pr.warn_once)
        self.schedule.write("grad_scale", loss_scale(self.grad_scaler), by=OWNER)
        self._last = step_row(k, pr.samples, B_used, A_used, self.micro_batch_size, self.batch_size,
                              self.lrs.multiplier, measure, est, ctrl, scale, self.optimizers,
                              self.state)
        return ctrl.batch_size

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """The last completed step as a flat dict of plain Python values: step,
        samples_seen, batch_size (B_k), accum_steps, micro_batch_size, next_batch_size
        (B_{k+1}), lr_multiplier (omega_{k+1}), lr_<i> (every param group's next lr),
        measuring_step, measured, valid (None when step k was not measured, so a logger
        skips it instead of plotting a failure), gns, noise, noise_pooled, signal (the
        measurement of step k, divided by grad_scale^2; nan when not measured;
        noise_pooled nan without a noise pool), noise_ema (the pooled noise when the hook
        pools), signal_ema, gns_ema, target_batch_size, grad_scale; and
        ``noise/<layer>``, ``signal/<layer>`` when the hook state exposes a
        ``layer_stats`` dict {name: (noise, signal)}. Empty before the first ``step()``."""
        return dict(self._last)

    def to_tensorboard(self, writer, step: Optional[int] = None, prefix: str = "gns/") -> None:
        """Write ``metrics()`` as scalars to a ``torch.utils.tensorboard.SummaryWriter``."""
        from ..metrics import to_tensorboard
        to_tensorboard(writer, self.metrics(), step=step, prefix=prefix)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything to resume (``coordinator.checkpoint`` lists it): the run's schedule
        (F, k, B_k), the samples seen, the controller, the sampler position, the LR state
        and the hook state's (eigensolver hints, this rank's noise pool). Plain Python
        values (and the schedulers' own state dicts); version 2 (version 1 also loads). For
        torch.distributed.checkpoint wrap the coordinator in
        ``gns_kernels.integrations.dcp.DCPState`` (the state is per rank); handed to DCP as
        it is, this raises RuntimeError."""
        return checkpoint.save(self)

    check_state_dict = staticmethod(checkpoint.check_state_dict)

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Resume from ``state_dict()`` (after loading the model and the optimizers).

        A different world size or micro-batch size is allowed: the sampler continues at
        the saved sample position re-sharded over the new ranks, the samples seen and the
        EMAs carry over, and a saved batch that is not a multiple of the new R x b is
        rounded up to one (capped at max_batch_size) with a warning; the LR multiplier
        follows the batch. strict: the controller's other settings and F must equal the
        saved ones (as ``AdaptiveBatchSize.load_state_dict``); strict=False keeps this
        run's. A rejected state_dict leaves the coordinator, its schedule, controller,
        sampler, schedulers and hook state as they were."""
        checkpoint.load(self, sd, strict)
