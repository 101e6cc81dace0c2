"""AdaptiveBatching: one object that owns the optimizer-step counter, the measuring period,
the batch size and the learning-rate multiplier of an adaptive-batch run.

It ties together the lower-level pieces, which stay public: the GNS measurement
(``GNSHookState`` + ``ddp_gns_hook`` under DDP, ``MicroBatchGNS`` on one rank or under
DDP, the handle of ``attach_fsdp_gns`` under FSDP2), Algorithm 1 (``AdaptiveBatchSize``),
the LR multiplier (``gns_kernels.lr.LRMultiplier``) and the data stream
(``gns_kernels.data.MicroBatchSampler``).

Batch arithmetic: the micro-batch size b is fixed; the global batch of step k is
B_k = R x A_k x b (R data-parallel ranks, A_k micro-batches accumulated per rank), so B
moves in multiples of R x b (the controller's ``multiple_of``). On one rank the samples of
the GNS are the micro-batches, so A >= 2 there (B_0 >= 2 b).

A loop (DDP shown; the loss of a micro-batch is its mean loss divided by A, so that the
accumulated gradient is the mean over the global batch, as DDP's averaging expects)::

    coord = AdaptiveBatching(state, optimizers=[opt], micro_batch_size=8,
                             initial_batch_size=32, max_batch_size=512)
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=2)
    for k in coord.steps(max_samples=total):
        for (x, y), ctx in coord.micro_batches(loader, ddp):
            with ctx:                                   # no_sync() on the first A-1
                (loss_fn(ddp(x), y) / coord.accum_steps).backward()
        opt.step(); opt.zero_grad()
        coord.step()

``coord.step()`` after the optimizer step, at the end of step k:

1. checks that the hook state counted exactly one synchronized backward for step k and
   still has the batch size and period the coordinator gave it (raises, naming the fix);
2. takes the estimate only if it was measured at step k (``state.estimate_step == k``
   and, when the estimate carries ``step``, ``estimate.step == k``): a previous step's
   estimate is never reused; with a ``grad_scaler`` it divides noise and signal by the
   square of the loss scale the step's backward ran with;
3. ``AdaptiveBatchSize.update(k, estimate)`` (the estimate passed on carries its step),
   then the optional ``max_growth`` bound on B_{k+1} / B_k;
4. sets ``state.batch_size = B_{k+1}`` (and ``MicroBatchGNS.micro_batches = A_{k+1}``),
   steps the schedulers given to it and sets every param group's
   lr = scheduled_lr x omega_{k+1} (``LRMultiplier``).

Loop checks (what a mistake in the loop would change in the measurement; the table of
docs/coordinator.md, "Mis-uses", with what each costs): the constructor checks every
argument before the model or the optimizers change; each step's micro-batches begin with
no parameter frozen or unfrozen since construction, a micro-batch of b examples, and on a
measuring step a device flag of gradients that are not None or zero (read with the
estimate, the measurement's one host synchronization); a step without any backward, the
DDP forward through the wrapped module or under the user's own no_sync(), and a
measurement of exactly zero noise (the samples read the same examples) are named.
Warnings point at the user's line.

LR schedulers: pass them as ``schedulers=[...]`` and do not step them yourself; the
coordinator steps them once per optimizer step on the un-multiplied (scheduled) rates and
multiplies the result by omega, so chainable schedulers (CosineAnnealingLR) never see
omega. A param group whose lr was changed outside the coordinator is taken as a new
scheduled rate, with a one-time warning.

Checkpoint: ``state_dict()`` holds the controller, the step counter, the samples seen, the
sampler's consumed position, the LR multiplier and the schedulers, the hook state's
schedule; load the model and optimizers, then ``coord.load_state_dict(sd)``.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from dataclasses import replace
from collections.abc import Mapping
from numbers import Real
from typing import Any, Iterable, Iterator, Optional

import torch

from ._dcp_guard import refuse_unwrapped_dcp
from ._validation import check_int as _check_int
from ._validation import check_signal as _check_signal
from ._validation import warn_user as _warn_user
from .controller import AdaptiveBatchSize
from .estimators import GNSEstimate
from .distributed.microbatch import MicroBatchGNS
from .distributed.state import GNSHookState
from .lr import LRMultiplier
from .schedule import Schedule

__all__ = ["AdaptiveBatching", "Batch"]

# version 2 saves F, k and B once, as the run's schedule; version 1 (before) also loads
_STATE_VERSION = 2
_STATE_KEYS = ("schedule", "samples_seen", "world_size", "micro_batch_size", "controller",
               "lr_multiplier", "schedulers", "sampler", "hook")
_STATE_KEYS_V1 = ("step", "samples_seen", "world_size", "micro_batch_size", "controller",
                  "lr_multiplier", "schedulers", "sampler", "hook")
_OWNER = "AdaptiveBatching"   # the name the run's schedule gives its writer


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _item_size(item) -> Optional[int]:
    """The examples one part of a micro-batch holds, when it says so plainly: a tensor's
    leading dimension (0-d: None), or the length of a list / tuple of tensors or dicts
    (a detection collate's tuple of images); None for anything else."""
    if isinstance(item, torch.Tensor):
        return int(item.shape[0]) if item.dim() > 0 else None
    if isinstance(item, (list, tuple)) and not hasattr(item, "_fields") and item and all(
            isinstance(x, (torch.Tensor, Mapping)) for x in item):
        return len(item)
    return None


def _batch_len(batch) -> Optional[int]:
    """The number of examples of a micro-batch, when it is certain: a batch-first tensor;
    or a mapping (dict, ``BatchEncoding``) / a plain tuple or list (``(x, y)``, a detection
    collate's ``(images, targets)``) whose parts all report the same size (their leading
    dimensions or lengths). None -- nothing to check -- when the parts disagree (a
    sequence-first ``[T, b]`` input beside ``[b]`` labels), when no part reports one, or
    for any other object (a named tuple such as ``PackedSequence``, a dataclass)."""
    if isinstance(batch, torch.Tensor):
        return _item_size(batch)
    if isinstance(batch, Mapping):
        parts = list(batch.values())
    elif isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        parts = list(batch)
    else:
        return None
    sizes = {n for n in map(_item_size, parts) if n is not None}
    return sizes.pop() if len(sizes) == 1 else None


def _any_nonzero(grads: list):
    """A device bool tensor: some gradient in ``grads`` holds a value other than 0 (NaN
    counts), with no host synchronization (one foreach max-abs pass)."""
    by_device: dict = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    flags = []
    for gs in by_device.values():
        norms = torch._foreach_norm(gs, float("inf"))
        flags.append(torch.stack([n.float() for n in norms]).ne(0).any())
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f.cpu() for f in flags]).any()


def _param_names(model) -> dict:
    """{id(parameter): name} of ``model`` (empty without a model)."""
    return {id(p): n for n, p in model.named_parameters()} if hasattr(model, "named_parameters") else {}


def _refuse_layout(model, kind: str) -> None:
    """ValueError for a DDP model or a plain module whose parameters are DTensors (tensor,
    sequence or expert parallelism): the GNS samples are the data-parallel replicas, and
    under those layouts the ranks of the world are not all replicas (R would be taken as
    the world size; the measured values differ between the ranks of one replica). FSDP2's
    own checks are ``attach_fsdp_gns``'s."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            raise ValueError(
                f"model: parameter {name!r} is a DTensor on a mesh of shape "
                f"{tuple(mesh.shape)} (dims {mesh.mesh_dim_names}) with placements "
                f"{tuple(p.placements)} under {kind}: a layout the GNS measurement does not "
                "handle (tensor / sequence / expert parallelism). Supported: DDP, FSDP2 "
                "(fully_shard) over a 1-D data-parallel mesh, or one rank; the GNS samples are "
                "the data-parallel replicas")


def _discard_measurement(gns) -> None:
    """Undo what building a measurement did outside it (a refused constructor): the
    gradient hook a MicroBatchGNS put on one parameter."""
    handle = getattr(gns, "_grad_hook", None)
    if handle is not None:
        handle.remove()
        gns._grad_hook = None


def _check_budget(name: str, value) -> Optional[int]:
    """max_samples / max_steps: None, or a whole number >= 0 (an int, or an integral float
    such as 1e6); anything else raises naming the argument (nan, inf, a string: a loop that
    ran no step, or a bare TypeError in a comparison, before)."""
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        if not isinstance(value, (int, float, str)) and hasattr(value, "__index__"):
            value = value.__index__()  # numpy integers
        else:
            raise TypeError(f"{name}: expected an int >= 0 or None (no limit), got {value!r} "
                            f"({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0 or None (no limit), got {value}")
    return value


def _calling_grad_scaler():
    """The torch.amp.GradScaler whose step() is on the call stack (called from an
    optimizer's step post-hook), or None."""
    import sys

    scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_cls is None:
        return None
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, scaler_cls):
            return obj
        frame = frame.f_back
    return None


def _lr_moved(group: dict, multiplier: float) -> bool:
    """A param group's lr is not its scheduled lr x the multiplier: set outside the
    coordinator."""
    if "scheduled_lr" not in group:  # a group added after the coordinator (add_param_group)
        return False
    return not math.isclose(float(group["lr"]), group["scheduled_lr"] * multiplier,
                            rel_tol=1e-12, abs_tol=0.0)


class _FSDPSync:
    """Context: FSDP2 ``set_requires_gradient_sync(flag)`` inside, sync re-enabled after."""

    def __init__(self, model, flag: bool):
        self.model, self.flag = model, flag

    def __enter__(self):
        self.model.set_requires_gradient_sync(self.flag)
        return self

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False


class AdaptiveBatching:
    """Adaptive batch size and LR for a DDP, FSDP2 or one-rank training loop.

    Args:
        gns: what measures the GNS: a ``GNSHookState`` registered as the DDP comm hook
            state (``ddp.register_comm_hook(state, gk.ddp_gns_hook)``; ranks are the
            samples), a ``MicroBatchGNS`` (one rank, or as the DDP hook state: ranks x
            micro-batches are the samples), or the ``FSDPGNSHandle`` of
            ``attach_fsdp_gns`` (ranks are the samples).
        optimizers: one optimizer or a list (e.g. [Muon, AdamW]); all of their param
            groups get the LR multiplier; their current lr is the scheduled (base) rate.
        micro_batch_size: b, examples per micro-batch per rank (fixed).
        initial_batch_size: B_0, global examples of step 0; a multiple of R x b
            (one rank: of b, and >= 2 b).
        max_batch_size: cap on B (a multiple of R x b), or None. Recommended: with the
            bias-corrected l1 GNS one decision multiplies B by about pi / (2 theta^2)
            (4.4x at theta 0.6) at pure noise, and by more when the EMAs mix
            measurements of different batches (not a bound; ``max_growth`` is one), see
            docs/controller.md.
        theta, beta_signal, warmup_steps, lr_scaling: as ``AdaptiveBatchSize``.
        beta_noise: the noise EMA factor. With a noise pool in the hook state (its
            ``pool_beta``, on by default) the pooled noise IS the noise EMA, so one value
            serves both: None (default) takes the state's ``pool_beta`` (0.9 without a
            pool); given with the model, the state is built with ``pool_beta=beta_noise``;
            given with a state whose ``pool_beta`` differs: ValueError.
        every: F, the measuring period; None takes the hook state's ``every``. Given and
            different from the state's: ValueError (one F drives both).
        schedulers: LR schedulers of ``optimizers`` (stepped by ``step()``, see the module
            docstring), or None.
        grad_scaler: a ``torch.amp.GradScaler`` when the backward runs on scaled losses:
            the hooks see gradients x scale, so noise and signal are divided by scale^2
            before they enter the EMAs (their ratio, the GNS, does not depend on it).
        max_growth: opt-in bound on B_{k+1} / B_k per decision (e.g. 2.0: LR at most
            x sqrt(2) per decision with "sqrt" scaling); None (default) is Algorithm 1
            unbounded. The bounded B is rounded down to a multiple of R x b but grows by
            at least one R x b.
        world_size, rank: R and this rank (default: from torch.distributed when
            initialised, else 1 and 0).
        lr_schedule: a function of the global examples seen (samples, an int >= 0) to a
            factor, e.g. ``lambda n: gk.warmup_cosine(n, total, 0.1 * total)``: every
            param group's scheduled lr is its base lr (its lr when the coordinator was
            built, kept as ``group["base_lr"]``) x ``lr_schedule(samples_seen)``, set for
            step 0 at construction and after every ``step()``; the effective lr is that x
            omega. A schedule on samples keeps its shape when the batch grows (a schedule
            on steps would stretch). Exclusive with ``schedulers``.
        signal: "raw" or "debiased", the signal the controller runs Algorithm 1 on; None
            (default) takes the hook state's ``signal`` (set where the state is built:
            ``GNSHookState(..., signal="debiased")``). Given and different from the
            state's: ValueError (the state computes the signal). theta's meaning depends
            on it (docs/controller.md).
    """

    def __init__(self, gns, optimizers, *, micro_batch_size: int, initial_batch_size: int,
                 max_batch_size: Optional[int] = None, theta: float = 0.6,
                 every: Optional[int] = None, warmup_steps: int = 0, beta_noise: Optional[float] = None,
                 beta_signal: float = 0.9, lr_scaling: str = "sqrt", schedulers=None,
                 grad_scaler=None, max_growth: Optional[float] = None,
                 world_size: Optional[int] = None, rank: Optional[int] = None,
                 signal: Optional[str] = None, lr_schedule=None, geometry: Optional[str] = None):
        # Every argument is checked before anything is attached to the model or written into
        # the optimizers' param groups: a refused constructor leaves both as they were, so a
        # corrected retry works (issue 39).
        opts = _as_list(optimizers)
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise TypeError("optimizers: expected a torch.optim.Optimizer or a list of them (every "
                            f"param group gets the LR multiplier), got {optimizers!r:.200}")
        b = _check_int("micro_batch_size", micro_batch_size, 1)
        B0 = _check_int("initial_batch_size", initial_batch_size, 1)
        if world_size is not None:
            world_size = _check_int("world_size", world_size, 1)
        if rank is not None:
            rank = _check_int("rank", rank, 0)
        if every is not None:
            every = _check_int("every", every, 1)
        if beta_noise is not None:
            from .pooling import check_pool_beta
            beta_noise = check_pool_beta(beta_noise, name="beta_noise", allow_none=False)
        model, attach = None, None
        if isinstance(gns, torch.nn.Module):  # the model: build the measurement, attach it last
            model = gns
            gns, attach = self._measurement_for(model, opts, geometry, 100 if every is None else every,
                                                B0, b, world_size, signal,
                                                0.9 if beta_noise is None else beta_noise)
            self._form = "model"
        elif geometry is not None:
            raise ValueError("geometry: given with a measurement object (GNSHookState, "
                             "MicroBatchGNS, FSDP handle), whose own geometry applies; pass "
                             "geometry= only with the model")
        else:
            self._form = "state"
        try:
            self._configure(gns, opts, b, B0, max_batch_size, theta, every, warmup_steps,
                            beta_noise, beta_signal, lr_scaling, schedulers, grad_scaler,
                            max_growth, world_size, rank, signal, lr_schedule)
            if attach is not None:
                attach()      # the one change to the model, after every check passed
        except BaseException:
            if model is not None:
                _discard_measurement(gns)
            raise
        # from here on nothing can refuse: the optimizers' param groups and step hooks
        self.optimizers = opts
        if lr_schedule is not None:
            f0 = self._schedule_factor(0)
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group.setdefault("base_lr", float(group["lr"]))
                    group["lr"] = group["base_lr"] * f0
                    group.pop("scheduled_lr", None)
        self._lrm = LRMultiplier(self.optimizers, self.schedulers)  # captures the base LRs
        # mistakes the loop can make, seen from here: optimizer.step() after coord.step(), a
        # GradScaler that steps the optimizers but was not passed, a passed scheduler also
        # stepped by hand (see _check_loop)
        self._opt_steps = [0] * len(self.optimizers)
        self._scaler_seen = None
        self._hooks = [opt.register_step_post_hook(self._on_optimizer_step) for opt in self.optimizers]
        self._sched_epochs = self._scheduler_epochs()
        self._model = model         # the model (given here or to micro_batches)
        self._model_checked = None  # the model whose layout _check_model accepted
        self._loaded = False        # load_state_dict was called
        self._auto_end = False      # batches(): the step ends when every optimizer has stepped
        self._in_batches = False    # a batches() loop is running
        self._micro_batches_used = False  # the loop draws its micro-batches from micro_batches()
        self.sampler = None
        self._pending_sampler: Optional[dict] = None  # loaded before batch_sampler() was made
        self._samples = 0
        self._loader = None
        self._iter = None
        self._consumed = 0          # micro-batches handed out in the current step
        self._served = False        # micro_batches() was used in the current step
        self._set_scale(self._read_scale())
        self._last: dict[str, Any] = {}
        self._warned: set = set()
        # what the loop checks compare against (_check_start, _check_state): the parameters
        # that required a gradient when the coordinator was built, and the gradients at the
        # start of a step (None / zero) and after it (changed by a backward)
        self._trainable = [p for opt in self.optimizers for g in opt.param_groups
                           for p in g["params"] if p.requires_grad]
        self._known = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        self._stale_grad = None     # device flag: a gradient was not zero at the step's first backward
        self._grad_marks = None     # (grad identity, version) of every parameter at the step's start
        self._no_backward = None    # at the first opt.step(): no gradient changed since then
        self._grads_none_at_step = False  # every gradient None at the first opt.step()
        self._early_step = None     # (micro-batches consumed, A) at an opt.step() inside the step
        self._zeroed_inside = None  # parameter names whose gradient was reset between micro-batches
        self._arm = None            # the one-shot hook that reads the gradients at the next backward
        self._held = None           # measuring step: the gradient objects after the last micro-batch
        self._zeroed_flag = None    # device flag: those gradients were all zero at the next backward
        self._forwards = None       # DDP: forwards through the model in the step, and under no_sync
        self._forward_hook = None   # the forward pre-hook that counts them
        # the hook state reads F, k, B and the loss scale from the run's schedule from here on
        self.state.use_schedule(self.schedule)
        self._sync_mark = self.state.synced_backwards   # synchronized backwards before step 0
        if self.kind == "micro":
            self.state.warn_missing_micro_step = False   # micro_batches() calls micro_step()
        if getattr(self.state, "pool", None) is not None and not self.state.has_param_order:
            # the noise pool is saved keyed by the optimizers' parameter order
            self.state.bind_params(p for opt in self.optimizers for g in opt.param_groups
                                   for p in g["params"])
        if model is not None:
            self._check_model(model)

    def _configure(self, gns, opts, b, B0, max_batch_size, theta, every, warmup_steps,
                   beta_noise, beta_signal, lr_scaling, schedulers, grad_scaler, max_growth,
                   world_size, rank, signal, lr_schedule) -> None:
        """The constructor's checks and pure settings (nothing outside self is changed)."""
        from .distributed.fsdp import FSDPGNSHandle

        if isinstance(gns, FSDPGNSHandle):
            self.kind, self.state, self.fsdp_handle = "fsdp", gns.state, gns
        elif isinstance(gns, MicroBatchGNS):
            self.kind, self.state, self.fsdp_handle = "micro", gns, None
        elif isinstance(gns, GNSHookState):
            self.kind, self.state, self.fsdp_handle = "ddp", gns, None
        else:
            raise TypeError("gns: expected a GNSHookState (DDP comm hook state), a MicroBatchGNS "
                            "or the FSDPGNSHandle returned by attach_fsdp_gns, got "
                            f"{type(gns).__name__}")
        R_dp, rank_dp = self._data_parallel(world_size)
        if world_size is not None and R_dp is not None and world_size != R_dp:
            raise ValueError(
                f"world_size: given {world_size}, but the data-parallel group the GNS is "
                f"measured over has {R_dp} ranks (the samples of the GNS, and the R of B = R x A x b); "
                "leave world_size=None to take it from there")
        if world_size is None:
            world_size = 1 if R_dp is None else R_dp
        if rank is None:
            rank = 0 if rank_dp is None else rank_dp
        self.world_size, self.rank = world_size, rank
        self.micro_batch_size = b
        R = self.world_size
        if R == 1 and self.kind != "micro":
            if self._form == "model":
                raise ValueError(
                    "gns: a DDP / FSDP2 model on one data-parallel rank has no ranks to sample; "
                    "on one rank pass the plain module (the micro-batches are the samples)")
            raise ValueError(
                "gns: one rank has no ranks to sample; measure with gk.MicroBatchGNS "
                "(gradient-accumulation micro-batches as the samples)")
        if B0 % (R * b):
            raise ValueError(f"initial_batch_size: expected a multiple of world_size x micro_batch_size "
                             f"= {R} x {b} = {R * b}, got {B0}")
        if R == 1 and B0 < 2 * b:
            raise ValueError(f"initial_batch_size: one rank needs at least 2 micro-batches per step "
                             f"(the GNS samples), so >= 2 x micro_batch_size = {2 * b}, got {B0}")
        if max_batch_size is not None:
            max_batch_size = _check_int("max_batch_size", max_batch_size, 1)
            if max_batch_size % (R * b):
                raise ValueError(f"max_batch_size: expected a multiple of world_size x micro_batch_size "
                                 f"= {R * b}, got {max_batch_size}")
        if every is None:
            every = self.state.every
        if every != self.state.every:
            raise ValueError(
                f"every: AdaptiveBatching(every={every}) but the hook state measures every "
                f"{self.state.every} steps; one period F must drive both: pass the same every to "
                "both, or leave AdaptiveBatching's every=None to take the state's")
        # the run's F, k, B_k and loss scale, owned here; the controller writes its decision
        # B_{k+1} into it and the hook state reads it (both get it below / at the end)
        self.schedule = Schedule(every=every, batch_size=B0, per_step=R * b, owner=_OWNER)
        pool_beta = getattr(self.state, "pool_beta", None)
        if beta_noise is None:
            beta_noise = 0.9 if pool_beta is None else pool_beta
        elif pool_beta is not None and float(beta_noise) != pool_beta:
            raise ValueError(
                f"beta_noise: AdaptiveBatching(beta_noise={beta_noise}) but the hook state pools "
                f"the noise with pool_beta={pool_beta}, and the pooled noise is the controller's "
                f"noise EMA; build the state with pool_beta={beta_noise}, or leave beta_noise=None "
                "to take the state's")
        state_signal = getattr(self.state, "signal", "raw")
        signal = _check_signal(signal, allow_none=True)
        if signal is None:
            signal = state_signal
        if signal != state_signal:
            raise ValueError(
                f"signal: AdaptiveBatching(signal={signal!r}) but the hook state computes the "
                f"{state_signal!r} signal; build the state with signal={signal!r}, or leave "
                "AdaptiveBatching's signal=None to take the state's")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(f"grad_scaler: expected a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        self.controller = AdaptiveBatchSize(
            initial_batch_size=B0, theta=theta, beta_noise=beta_noise, beta_signal=beta_signal,
            every=every, warmup_steps=warmup_steps, max_batch_size=max_batch_size,
            multiple_of=R * b, lr_scaling=lr_scaling, signal=signal, max_growth=max_growth,
            schedule=self.schedule)
        self.schedulers = _as_list(schedulers)
        for i, s in enumerate(self.schedulers):
            if not (callable(getattr(s, "step", None)) and callable(getattr(s, "state_dict", None))):
                raise TypeError(f"schedulers[{i}]: expected an LR scheduler (step(), state_dict()), "
                                f"got {type(s).__name__}")
        if lr_schedule is not None:
            if not callable(lr_schedule):
                raise TypeError(f"lr_schedule: expected a function of the samples seen, got "
                                f"{type(lr_schedule).__name__}")
            if self.schedulers:
                raise ValueError("lr_schedule and schedulers: pass one of them (both would own "
                                 "the scheduled learning rate)")
        self.lr_schedule = lr_schedule
        if lr_schedule is not None:
            self._schedule_factor(0)   # a schedule that refuses 0 refuses here, before any lr changes

    def _data_parallel(self, world_size):
        """(R, rank) of the data-parallel group the measurement runs over: the FSDP2 mesh's
        shard group, or the hook state's process group (the default group when None);
        (None, None) without torch.distributed (one process)."""
        import torch.distributed as dist

        if self.kind == "fsdp" and self.fsdp_handle.dp_size is not None:
            return self.fsdp_handle.dp_size, self.fsdp_handle.dp_rank
        if not (dist.is_available() and dist.is_initialized()):
            return None, None
        group = self.state.process_group
        return dist.get_world_size(group), dist.get_rank(group)

    @staticmethod
    def _measurement_for(model, optimizers, geometry, every, B0, b, world_size, signal, beta_noise):
        """The GNS measurement for ``model``, and a function that attaches it (called only
        once every argument passed its checks): a DDP model gets a GNSHookState registered
        as its comm hook (over DDP's own process group), an FSDP2 model one attached to its
        reduce-scatters, a plain module on one rank a MicroBatchGNS. Measured parameters: the
        first optimizer's (Muon's matrices in Muon + AdamW, as the paper measures); geometry:
        ``geometry`` or ``gk.geometry_for(optimizers)``; the noise pool's EMA factor is
        ``beta_noise`` (one setting: the pooled noise is the controller's noise EMA).
        Refuses here, before anything is attached, a layout the measurement does not handle
        (``_refuse_layout``) and a model that already carries a comm hook."""
        import torch.distributed as dist

        from .distributed import GNSHookState, ddp_gns_hook
        from .distributed.fsdp import _prepare_fsdp_gns
        from .optim import geometry_for

        geometry = geometry_for(optimizers) if geometry is None else geometry
        params = [p for g in optimizers[0].param_groups for p in g["params"]]
        mine = {id(p) for p in model.parameters()}
        fsdp = callable(getattr(model, "set_requires_gradient_sync", None))
        if not any(id(p) in mine for p in params):
            raise ValueError(
                "optimizers: the first optimizer's parameters (the measured ones) are not this "
                "model's parameters"
                + (": fully_shard replaces a module's parameters with sharded ones, so build the "
                   "optimizers AFTER fully_shard(model), from model.parameters()" if fsdp else
                   "; build the optimizers from model.parameters() of the model passed here"))
        kw = dict(geometry=geometry, every=every, pool_beta=beta_noise)
        if signal is not None:
            kw["signal"] = signal
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if not fsdp:
            _refuse_layout(model, "DDP" if ddp else "module")
        if ddp:
            if getattr(model, "_comm_hooks", None):
                hook, hstate = model._comm_hooks[0]
                name = getattr(hook, "__name__", type(hook).__name__)
                if isinstance(hstate, GNSHookState):
                    raise ValueError(
                        f"gns: this DDP model already has the comm hook {name} with a "
                        f"{type(hstate).__name__} (DDP takes one comm hook): pass that state "
                        "instead of the model, AdaptiveBatching(state, ...), or build DDP afresh")
                raise ValueError(
                    f"gns: this DDP model already has a comm hook ({name}); DDP takes one, and the "
                    "GNS hook does the gradient all-reduce itself: build DDP without "
                    "register_comm_hook and pass it here")
            state = GNSHookState(batch_size=B0, params=params, process_group=model.process_group, **kw)
            return state, lambda: model.register_comm_hook(state, ddp_gns_hook)
        if fsdp:  # FSDP2 (fully_shard)
            state = GNSHookState(batch_size=B0, params=params, **kw)
            handle, install = _prepare_fsdp_gns(model, state)
            return handle, install
        ready = dist.is_available() and dist.is_initialized()
        R = world_size if world_size is not None else (dist.get_world_size() if ready else 1)
        if R != 1:
            raise ValueError(
                f"gns: a plain module on {R} ranks; wrap it first (DistributedDataParallel, or "
                "fully_shard for FSDP2) and pass the wrapped model")
        A = B0 // b
        return MicroBatchGNS(params, batch_size=B0, micro_batches=A, **kw), None

    # ------------------------------------------------------------------ read-outs
    @property
    def max_growth(self) -> Optional[float]:
        """The bound on B_{k+1} / B_k per decision (the controller's setting), or None."""
        return self.controller.max_growth

    @property
    def every(self) -> int:
        """F, the measuring period (the run's schedule's)."""
        return self.schedule.every

    @property
    def _step(self) -> int:
        return self.schedule.step

    @property
    def _batch(self) -> int:
        return self.schedule.batch_size

    @property
    def _scale(self) -> float:
        return self.schedule.grad_scale

    def _set_scale(self, value: float) -> None:
        self.schedule.write("grad_scale", value, by=_OWNER)

    @property
    def current_step(self) -> int:
        """k, the optimizer step in progress (0, 1, 2, ...; advanced by ``step()``)."""
        return self._step

    @property
    def batch_size(self) -> int:
        """B_k, the global batch of the step in progress (examples, all ranks)."""
        return self._batch

    @property
    def accum_steps(self) -> int:
        """A_k = B_k / (R b): micro-batches per rank in the step in progress; divide each
        micro-batch's mean loss by it."""
        return self._batch // (self.world_size * self.micro_batch_size)

    @property
    def local_batch_size(self) -> int:
        """A_k x b: examples per rank in the step in progress."""
        return self._batch // self.world_size

    @property
    def samples_seen(self) -> int:
        """Global examples of the completed steps."""
        return self._samples

    @property
    def lr_multiplier(self) -> float:
        """omega of the step in progress (sqrt(B_k / B_0) with lr_scaling="sqrt")."""
        return self._lrm.multiplier

    @property
    def grad_scale(self) -> float:
        """The loss scale the step in progress runs its backward with (1 without a scaler)."""
        return self._scale

    # ------------------------------------------------------------------ helpers
    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _warn_user(f"AdaptiveBatching: {msg}")

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Post-hook of every optimizer's step(): counts the steps of the step in progress
        and notes a GradScaler that runs them (its step() calls optimizer.step())."""
        if self._grad_marks is not None and self._no_backward is None:
            # before any zero_grad: did a backward change a gradient since the step began?
            marks = self._grad_marks
            params = self._params()
            self._no_backward = len(marks) == len(params) and all(
                (p.grad is None and m is None)
                or (p.grad is not None and m == (id(p.grad), p.grad._version))
                for p, m in zip(params, marks))
            self._grads_none_at_step = all(p.grad is None for p in params)
        if self._served and self._consumed < self.accum_steps and self._early_step is None:
            self._early_step = (self._consumed, self.accum_steps)
        for i, opt in enumerate(self.optimizers):
            if opt is optimizer:
                self._opt_steps[i] += 1
        if self.grad_scaler is None and self._scaler_seen is None:
            self._scaler_seen = _calling_grad_scaler()
        if self._auto_end and all(self._opt_steps) and self._consumed == self.accum_steps:
            self._auto_end = False
            self._end_step()

    def _schedule_factor(self, samples: int) -> float:
        f = self.lr_schedule(samples)
        if isinstance(f, bool) or not isinstance(f, Real) or not (math.isfinite(f) and f >= 0):
            raise ValueError(f"lr_schedule({samples}) returned {f!r}; expected a finite number >= 0")
        return float(f)

    def _apply_schedule(self, f: float) -> None:
        """lr_schedule: scheduled lr = base lr x f, f = lr_schedule(samples seen)."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["scheduled_lr"] = group["base_lr"] * f

    def _scheduler_epochs(self) -> list:
        return [getattr(s, "last_epoch", None) for s in self.schedulers]

    def _read_scale(self) -> float:
        if self.grad_scaler is None:
            return 1.0
        s = float(self.grad_scaler.get_scale())
        return s if s > 0 and math.isfinite(s) else 1.0

    # ------------------------------------------------------------------ data
    def batch_sampler(self, num_samples: int, shuffle: bool = True, seed: int = 0):
        """A ``MicroBatchSampler`` over a map-style dataset of ``num_samples`` items for
        ``DataLoader(dataset, batch_sampler=...)``: each item one micro-batch of b indices
        of this rank; its consumed position is saved in ``state_dict()``. After
        ``load_state_dict`` it continues at the saved position; a saved position that does
        not fit (another ``num_samples``, ``shuffle`` or ``seed``) raises ValueError and
        leaves no sampler behind (``coord.sampler`` stays None)."""
        from .data import MicroBatchSampler

        if self.sampler is not None:
            raise RuntimeError("AdaptiveBatching.batch_sampler: a sampler was already made for this "
                               "coordinator; reuse coord.sampler")
        sampler = MicroBatchSampler(num_samples, self.micro_batch_size, self.world_size,
                                    self.rank, shuffle=shuffle, seed=seed)
        if self._pending_sampler is not None:
            # a position saved with another seed or dataset size is refused here; the
            # coordinator keeps no half-made sampler, so a retry with the saved arguments
            # still continues at the saved position
            sampler.load_state_dict(self._pending_sampler)
        self.sampler, self._pending_sampler = sampler, None
        return self.sampler

    def _next_item(self, loader):
        if self._iter is None or self._loader is not loader:
            self._loader, self._iter = loader, iter(loader)
        try:
            return next(self._iter)
        except StopIteration:  # the end of a pass (epoch): the stream goes on
            self._iter = iter(loader)
            try:
                return next(self._iter)
            except StopIteration:
                if iter(loader) is loader:
                    raise RuntimeError(
                        "AdaptiveBatching.micro_batches: the loader is an iterator (a generator?) "
                        "and it is exhausted; the coordinator draws micro-batches across passes, "
                        "so pass a re-iterable loader (a DataLoader, or an object whose __iter__ "
                        "starts a new pass)") from None
                raise RuntimeError("AdaptiveBatching.micro_batches: the loader yielded no batch "
                                   "(empty dataset?)") from None

    def _sync_contexts(self, model, A: int):
        """(no-sync context factory for micro-batches 0..A-2, context for the last)."""
        if A == 1:
            return None, contextlib.nullcontext
        if hasattr(model, "no_sync") and callable(model.no_sync):  # DDP
            return model.no_sync, contextlib.nullcontext
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            return (lambda: _FSDPSync(model, False)), (lambda: _FSDPSync(model, True))
        if self.world_size > 1:
            raise ValueError(
                "this step accumulates {A} micro-batches on {R} ranks, so the first {A1} must "
                "skip the gradient synchronization, and the coordinator does not know the model: "
                "pass the DDP or FSDP2 model, coord.batches(loader, ..., model=ddp) or "
                "coord.micro_batches(loader, ddp) (or build the coordinator from the model, "
                "AdaptiveBatching(ddp, ...))".format(A=A, R=self.world_size, A1=A - 1))
        return contextlib.nullcontext, contextlib.nullcontext

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
        if self._served:
            raise RuntimeError(
                f"micro_batches: step {self._step}'s micro-batches were already handed out; end "
                "the step first: opt.step(), then coord.step() (in a coord.batches(...) loop the "
                "step ends by itself at opt.step(); iterate each batch once)")
        A = self.accum_steps
        skip_sync, last = self._sync_contexts(model, A)
        if model is not None:
            self._model = model
        if self._model is not None and self._model is not self._model_checked:
            self._check_model(self._model)
        self._check_loader(loader)
        if self._step == 0 and not self._loaded and any(len(o.state) for o in self.optimizers):
            self._warn_once("resume", "the optimizers hold state (a checkpoint was loaded?) but "
                            "the coordinator starts at step 0 with B_0 and the data stream at "
                            "its start; to resume, call coord.load_state_dict(ckpt['coord']) "
                            "after loading the model and the optimizers. Going on without it, "
                            "the coordinator starts afresh: B_0, LR multiplier 1 on the loaded "
                            "scheduled rates")
            self._restart_lrs()
        self._check_start()
        self._served = self._micro_batches_used = True
        self._set_scale(self._read_scale())  # the pool stores statistics / scale^2
        # the coordinator's sampler feeds the loader unless the loader names another one (a
        # wrapper or generator around the DataLoader has no batch_sampler attribute)
        feeds_sampler = (self.sampler is not None
                         and getattr(loader, "batch_sampler", self.sampler) is self.sampler)
        measuring = self.state.is_measurement_step(self._step)
        for a in range(A):
            batch = self._next_item(loader)
            try:
                self.check_micro_batch(batch, a)
            except ValueError:
                if a == 0:
                    self._served = False   # nothing of the step was handed out
                    self._grad_marks = self._stale_grad = self._no_backward = None
                    self._disarm()
                raise
            if feeds_sampler:
                self.sampler.advance(1)
            self._consumed += 1
            yield batch, (skip_sync() if a < A - 1 else last())
            if self.kind == "micro":
                self.state.micro_step()
            if measuring and a < A - 1:
                self._hold_grads()
        if "coverage" not in self._warned:
            self._check_coverage()

    # ------------------------------------------------------------------ for trainer stacks
    def begin_step(self) -> None:
        """The checks of a step's start, for a trainer integration that draws the
        micro-batches itself instead of through ``micro_batches()`` (the Lightning
        callback): call before the step's first forward. Raises RuntimeError when a
        parameter was frozen, unfrozen or removed since the coordinator was built; on a
        measuring step it arms the check that the step's first backward starts from zero
        gradients (read at ``step()``)."""
        self._check_start()

    def check_micro_batch(self, batch, index: int = 0) -> None:
        """ValueError when ``batch`` (micro-batch ``index`` of the step in progress) holds
        a number of examples other than ``micro_batch_size``, as far as it can be told
        (``_batch_len``: batch-first tensors, dicts, tuples, lists; other objects are not
        checked). ``micro_batches()`` calls it for every micro-batch; a trainer integration
        that draws them itself calls it too."""
        n = _batch_len(batch)
        if n is None or n == self.micro_batch_size:
            return
        A = self.accum_steps
        raise ValueError(
            f"micro-batch {index} of step {self._step} holds {n} examples (the leading dimension "
            f"its tensors agree on), but micro_batch_size is {self.micro_batch_size}: the "
            f"coordinator counts B = R x A x b = {self.world_size} x {A} x "
            f"{self.micro_batch_size} examples per step, and the samples seen, the LR "
            "multiplier and the GNS's batch would all be off. Build the loader with "
            "DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds))), or one that "
            f"yields exactly {self.micro_batch_size} examples per item (batch_size="
            f"{self.micro_batch_size}, drop_last=True). (Batch-first [b, ...] tensors are "
            "expected; a sequence-first [T, b] batch whose every tensor leads with T cannot be "
            "told apart)")

    def _restart_lrs(self) -> None:
        """The optimizers were loaded from a checkpoint without the coordinator: their param
        groups carry the checkpoint's lr (scheduled x the saved multiplier). Going on, the
        coordinator starts afresh, so lr = the loaded scheduled rate x this coordinator's
        multiplier (with lr_schedule: base lr x lr_schedule(samples seen)); taking the loaded
        lr as a new scheduled rate multiplied it a second time at every step."""
        f = None if self.lr_schedule is None else self._schedule_factor(self._samples)
        for opt in self.optimizers:
            for group in opt.param_groups:
                if f is not None and "base_lr" in group:
                    group["scheduled_lr"] = group["base_lr"] * f
                else:
                    group.setdefault("scheduled_lr", float(group["lr"]))
        self._lrm.set_multiplier(self._lrm.multiplier)

    def _check_model(self, model) -> None:
        """Once per model: a layout the measurement handles (``_refuse_layout``); under DDP,
        the hook state reduces over DDP's own process group, and a forward pre-hook notes the
        forwards of each step through the DDP model and whether they ran under no_sync()
        (what ``_check_state`` names when no synchronized backward came)."""
        import torch.distributed as dist

        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self.kind != "fsdp":
            _refuse_layout(model, "DDP" if ddp else "module")
        if ddp and self.kind in ("ddp", "micro") and dist.is_available() and dist.is_initialized():
            mine = dist.get_process_group_ranks(self.state.process_group or dist.group.WORLD)
            theirs = dist.get_process_group_ranks(model.process_group)
            if mine != theirs:
                raise ValueError(
                    f"model: DDP reduces over ranks {theirs}, the hook state over {mine}: build the "
                    "state with process_group=ddp.process_group (or pass the DDP model to "
                    "AdaptiveBatching, which does)")
        if ddp:
            self._forwards = [0, 0]
            ref = weakref.ref(self)

            def note_forward(module, args, _ref=ref):
                coord = _ref()
                if coord is not None and coord._forwards is not None:
                    coord._forwards[0] += 1
                    coord._forwards[1] += not module.require_backward_grad_sync
            if self._forward_hook is not None:
                self._forward_hook.remove()
            self._forward_hook = model.register_forward_pre_hook(note_forward)
        self._model_checked = model

    def _params(self):
        return [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]

    def _check_start(self) -> None:
        """At the start of a step's micro-batches (before its first forward): no parameter
        was frozen or unfrozen since the coordinator was built (raises: the GNS would cover
        other parameters than before); on a measuring step, whether every gradient is None
        or zero (a device flag, read with the estimate at the end of the step: no host
        synchronization here; it costs nothing when the gradients are None, else one
        max-abs pass over them per measuring step); the gradients' identity and version,
        which a backward changes (``_check_state`` tells a step without any backward)."""
        params = self._params()
        known = self._known   # a param group added later (add_param_group) is not compared
        now = {id(p) for p in params if p.requires_grad and id(p) in known}
        was = {id(p) for p in self._trainable}
        if now != was:
            names = _param_names(self._model)
            current = {id(p) for p in params}
            removed = [names.get(id(p), f"#{i}") for i, p in enumerate(self._trainable)
                       if id(p) not in current]
            frozen = [names.get(id(p), f"#{i}") for i, p in enumerate(params)
                      if id(p) in was and id(p) not in now]
            thawed = [names.get(id(p), f"#{i}") for i, p in enumerate(params)
                      if id(p) in now and id(p) not in was]
            what = (f"removed from the optimizers' param groups: {', '.join(removed[:5])}" if removed else
                    f"frozen (requires_grad False): {', '.join(frozen[:5])}" if frozen else
                    f"unfrozen (requires_grad True): {', '.join(thawed[:5])}")
            raise RuntimeError(
                f"step {self._step}: parameters were {what} after the coordinator was built. The GNS "
                "is measured over the parameters that get gradients, so from this step on it would "
                "measure other parameters than its EMAs were formed on (docs/coordinator.md, "
                "'Mis-uses'), and DDP would stop its hook. Set requires_grad before building the "
                "optimizers and the coordinator; to change the trained set mid-run, build new "
                "ones over it (the GNS then starts afresh)")
        self._stale_grad = None
        self._disarm()
        if self.state.is_measurement_step(self._step) and any(p.grad is not None for p in params):
            # read when the step's first gradient arrives, not now: a loop may zero the
            # gradients inside its first micro-batch (before or after its forward)
            self._arm_read(params, self._read_stale)
        self._grad_marks = [None if p.grad is None else (id(p.grad), p.grad._version) for p in params]
        self._no_backward = None
        self._grads_none_at_step = False
        self._early_step = self._zeroed_inside = self._held = self._zeroed_flag = None
        if self._forwards is not None:
            self._forwards[0] = self._forwards[1] = 0

    def _arm_read(self, params, read) -> None:
        """Call ``read(params)`` once, when the next backward's first gradient is computed
        and before it is added to any ``.grad`` (a one-shot autograd hook on the
        parameters); under FSDP2, whose sharded parameters autograd never reaches, at the
        model's next forward instead. Costs one Python call per parameter in that one
        backward (measuring steps only)."""
        ref = weakref.ref(self)

        def fire(*_):
            coord = ref()
            if coord is not None and coord._arm is not None:
                coord._disarm()
                read(params)
        if self.kind == "fsdp":
            if self._model is None:
                read(params)   # no model to watch: read now
                return

            def on_output(module, args, output):
                # the backward's start: a hook on the model's output gradient fires before
                # any parameter gradient is accumulated (a loop may zero the gradients
                # between its forward and backward, as Lightning does)
                out = next((t for t in torch.utils._pytree.tree_leaves(output)
                            if isinstance(t, torch.Tensor) and t.requires_grad), None)
                if out is None:
                    fire()
                    return
                coord = ref()
                if coord is not None:
                    coord._disarm()
                    coord._arm = out.register_hook(lambda grad: fire())
            self._arm = self._model.register_forward_hook(on_output)
            return
        leaves = [p for p in params if p.requires_grad]
        if not leaves:
            return
        self._arm = torch.autograd.graph.register_multi_grad_hook(leaves, fire, mode="any")

    def _disarm(self) -> None:
        if self._arm is not None:
            self._arm.remove()
            self._arm = None

    def _read_stale(self, params) -> None:
        """A device flag: some gradient was not zero when the step's first backward began."""
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params if p.grad is not None]
        self._stale_grad = _any_nonzero(grads) if grads else None

    def _hold_grads(self) -> None:
        """Measuring steps, after each micro-batch but the last: note the gradient objects,
        and at the next backward check that none was reset (set to None or replaced)."""
        params = self._params()
        self._held = [(p.grad, None if p.grad is None else p.grad._version) for p in params]
        self._disarm()
        self._arm_read(params, self._read_reset)

    def _read_reset(self, params) -> None:
        """At a micro-batch's first backward (measuring steps): gradients the previous
        micro-batches left that are gone (None, or another tensor: ``zero_grad()``, which
        sets them to None), named at once; and a device flag, read at the step's end, for
        gradients that are all exactly zero again (``zero_grad(set_to_none=False)``)."""
        held, self._held = self._held, None
        if held is None or len(held) != len(params):
            return
        names = _param_names(self._model)
        reset = [names.get(id(p), f"#{i}") for i, (p, (g, _)) in enumerate(zip(params, held))
                 if g is not None and p.grad is not g]
        if reset and self._zeroed_inside is None:
            self._zeroed_inside = reset
        kept = [(g, v) for g, v in held if g is not None]
        # written in place since the last micro-batch's backward (every one of them: what
        # zero_grad(set_to_none=False) does) and all zero now; gradients that are exactly
        # zero by themselves (a saturated softmax) were not written, and are not flagged
        if kept and not reset and all(g._version != v for g, v in kept):
            zero = _any_nonzero([getattr(g, "_local_tensor", g) for g, _ in kept]).logical_not()
            self._zeroed_flag = zero if self._zeroed_flag is None else self._zeroed_flag | zero

    def _check_loader(self, loader) -> None:
        """An IterableDataset read by several DataLoader workers is copied into each worker:
        unless the dataset shards itself by worker, every sample comes num_workers times. A
        DistributedSampler kept from the loop before the coordinator (warned once)."""
        dataset = getattr(loader, "dataset", None)
        workers = getattr(loader, "num_workers", 0) or 0
        from .data import MicroBatchSampler

        own = getattr(loader, "batch_sampler", None)
        if isinstance(own, MicroBatchSampler) and own is not self.sampler:
            mine = (self.micro_batch_size, self.world_size, self.rank)
            theirs = (own.micro_batch_size, own.num_replicas, own.rank)
            if theirs != mine:
                raise ValueError(
                    f"loader: its MicroBatchSampler has micro_batch_size, num_replicas, rank = "
                    f"{theirs}, the coordinator {mine}; make it with coord.batch_sampler(len(ds))")
            self._warn_once("own-sampler", (
                "the loader's MicroBatchSampler was not made by coord.batch_sampler(...): the "
                "coordinator does not advance it, so coord.state_dict() does not save the "
                "stream's position and a resumed run restarts it; use coord.batch_sampler"))
        samplers = (getattr(loader, "sampler", None),
                    getattr(getattr(loader, "batch_sampler", None), "sampler", None))
        distributed = any(isinstance(s, torch.utils.data.DistributedSampler) for s in samplers)
        if (isinstance(loader, torch.utils.data.DataLoader) and not distributed
                and not isinstance(dataset, torch.utils.data.IterableDataset)
                and not isinstance(own, MicroBatchSampler)):
            self._warn_once("plain-loader", (
                "the loader does not draw from coord.batch_sampler(...): the coordinator cannot "
                "save where the data stream is, so coord.state_dict() holds no data position and "
                "a resumed run restarts the data from its start. Use DataLoader(ds, "
                "batch_sampler=coord.batch_sampler(len(ds))) (it also shards by rank and keeps "
                "every micro-batch at b examples)"))
        if distributed:
            self._warn_once("distributed-sampler", (
                "the loader draws from a DistributedSampler: its passes neither follow the "
                "coordinator's steps nor resume from coord.state_dict(), every pass repeats the "
                "same order unless set_epoch is called, and its last micro-batch of a pass is short "
                "(refused) unless drop_last=True. Use DataLoader(ds, "
                "batch_sampler=coord.batch_sampler(len(ds))): it shards by rank itself"))
        if isinstance(dataset, torch.utils.data.IterableDataset) and workers > 1:
            self._warn_once("iterable", (
                f"the loader reads an IterableDataset with num_workers={workers}: each worker "
                "iterates its own copy, so unless the dataset splits its stream with "
                "torch.utils.data.get_worker_info(), every sample is seen "
                f"{workers} times per pass; split it by worker (and by rank), or use "
                "num_workers <= 1, or a map-style dataset with coord.batch_sampler(...)"))

    def _check_coverage(self) -> None:
        """After a step's last backward: every parameter that received a gradient should
        belong to one of the optimizers the coordinator scales (Muon + AdamW: pass both)."""
        named = None
        if self._model is not None and hasattr(self._model, "named_parameters"):
            named = list(self._model.named_parameters())
        if not named:
            return
        self._warned.add("coverage")   # checked once, on the first step with a model
        mine = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        missing = [n for n, p in named if p.grad is not None and id(p) not in mine]
        if missing:
            first = "model" if self._form == "model" else "..."
            _warn_user(
                f"AdaptiveBatching: {len(missing)} parameters received gradients but are in none "
                f"of the optimizers passed to the coordinator (e.g. {', '.join(missing[:3])}): "
                "their learning rate is never multiplied as the batch grows. Pass every "
                f"optimizer as a list, e.g. AdaptiveBatching({first}, [muon, adamw], ...)")

    def _check_loop(self, k: int) -> None:
        """At coord.step(): the optimizers stepped since the last coord.step(), a GradScaler
        that steps them was passed, the passed schedulers were not stepped by hand."""
        if self._scaler_seen is not None and self.grad_scaler is None:
            raise RuntimeError(
                f"step {k}: a torch.amp.GradScaler steps the optimizers, but AdaptiveBatching "
                "was built without it: the hooks see gradients x the loss scale, so noise and "
                "signal read scale^2 too large and the EMAs mix scales. Pass "
                "AdaptiveBatching(..., grad_scaler=scaler)")
        twice = [i for i, n in enumerate(self._opt_steps) if n > 1]
        if twice:
            raise RuntimeError(
                f"step {k}: optimizer {twice[0]} (position in the list given to the coordinator) "
                f"stepped {self._opt_steps[twice[0]]} times in one step: every optimizer steps "
                "once per step (one opt.step() after the step's micro-batches)")
        if not any(self._opt_steps):
            skipped = (self.grad_scaler is not None and self._read_scale() < self._scale)
            if not skipped:  # a GradScaler skips the step of an inf / NaN gradient, then lowers its scale
                raise RuntimeError(
                    f"step {k}: coord.step() was called before optimizer.step(): the coordinator "
                    "then sets the next step's batch and LR before this step's update runs with "
                    "them. Call opt.step() (with a GradScaler: scaler.step(opt); scaler.update()) "
                    "and then coord.step()")
        elif not all(self._opt_steps):
            idle = [i for i, n in enumerate(self._opt_steps) if n == 0]
            self._warn_once("idle-opt", f"step {k}: optimizers {idle} (positions in the list given "
                            "to the coordinator) did not step; every optimizer passed should step "
                            "once per coord.step()")
        m = self._lrm.multiplier
        for i, opt in enumerate(self.optimizers):
            changed = any(_lr_moved(g, m) for g in opt.param_groups)
            if (changed and getattr(opt.step, "_wrapped_by_lr_sched", False)
                    and not any(getattr(s, "optimizer", None) is opt for s in self.schedulers)):
                raise RuntimeError(
                    f"step {k}: an LR scheduler built on optimizer {i} (position in the list given "
                    "to the coordinator) changed its lr outside the coordinator; stepped by hand "
                    "it sees the multiplied lr (a chainable one compounds the multiplier every "
                    "step). Pass it as AdaptiveBatching(..., schedulers=[sched]) and do not step "
                    "it yourself")
        now = self._scheduler_epochs()
        moved = [i for i, (a, b) in enumerate(zip(self._sched_epochs, now)) if a != b]
        if moved:
            raise RuntimeError(
                f"step {k}: schedulers {moved} (positions in schedulers=[...]) were stepped "
                f"outside the coordinator (last_epoch {self._sched_epochs[moved[0]]} -> "
                f"{now[moved[0]]}); the coordinator steps the schedulers it was given, once per "
                "coord.step(): remove your scheduler.step() call")

    def batches(self, loader: Iterable, max_samples: Optional[int] = None,
                max_steps: Optional[int] = None, model=None) -> Iterator["Batch"]:
        """The optimizer steps of the run, each as a ``Batch``: ``len(batch)`` is A_k, the
        micro-batches this rank accumulates, and iterating it yields them (the first A_k - 1
        under DDP's ``no_sync()`` / FSDP2's ``set_requires_gradient_sync(False)``, entered
        and left by the iteration itself). Stops before a step whose batch would exceed
        ``max_samples`` (global examples) or at ``max_steps``. The loop::

            for batch in coord.batches(loader, max_samples=total):
                for x, y in batch:
                    (loss_fn(model(x), y) / len(batch)).backward()
                opt.step(); opt.zero_grad()

        The step ends by itself when every optimizer passed has stepped (no
        ``coord.step()``); a step that a GradScaler skipped (inf gradient) ends when the
        next batch is drawn. The model for ``no_sync`` is the one given to the
        constructor, or ``model`` here (the DDP / FSDP2 model, when the coordinator was
        built from a hook state). ``max_samples`` and ``max_steps`` are checked here (an
        int >= 0, or None)."""
        max_samples = _check_budget("max_samples", max_samples)
        max_steps = _check_budget("max_steps", max_steps)
        self._refuse_nested("batches")
        if model is not None:
            self._model = model
        return self._batches(loader, max_samples, max_steps)

    def _refuse_nested(self, what: str) -> None:
        if self._in_batches:
            raise RuntimeError(
                f"coord.{what}(...): a coord.batches(...) loop of this coordinator is still running "
                "(a nested loop, or an earlier loop left with break whose iterator is still "
                "referenced: close() it); one loop draws the steps, each Batch once")

    def _batches(self, loader, max_samples, max_steps) -> Iterator["Batch"]:
        self._refuse_nested("batches")
        self._in_batches = True
        try:
            while self.fits(max_samples, max_steps):
                k = self._step
                batch = Batch(self, loader, k)
                self._auto_end = True
                try:
                    yield batch
                finally:
                    pending = self._auto_end and self._step == k
                    self._auto_end = False
                if pending:
                    self._finish_unended(k)
        finally:
            self._in_batches = False

    def fits(self, max_samples: Optional[int] = None, max_steps: Optional[int] = None) -> bool:
        """Whether the next step fits the budget: its batch in ``max_samples`` (global
        examples, counting the samples seen) and k < ``max_steps`` (None: no limit). What
        ``batches()`` and ``steps()`` stop on; for a trainer that runs its own loop."""
        max_samples = _check_budget("max_samples", max_samples)
        max_steps = _check_budget("max_steps", max_steps)
        if max_steps is not None and self._step >= max_steps:
            return False
        return max_samples is None or self._samples + self._batch <= max_samples

    def _finish_unended(self, k: int) -> None:
        """A batches() step whose optimizers did not all step: a GradScaler skipped it (inf
        gradient; the scale dropped), or the loop forgot opt.step() / left micro-batches."""
        if self._consumed != self.accum_steps:
            raise RuntimeError(
                f"step {k}: {self._consumed} of its {self.accum_steps} micro-batches were consumed; "
                "iterate each batch to the end, then call opt.step()")
        if any(self._opt_steps) or (self.grad_scaler is not None and self._read_scale() < self._scale):
            self._end_step()   # some optimizers stepped, or the scaler skipped an inf step
            return
        raise RuntimeError(f"step {k}: the batch ended without opt.step(); call opt.step() (with a "
                           "GradScaler: scaler.step(opt); scaler.update()) after its micro-batches")

    def steps(self, max_samples: Optional[int] = None, max_steps: Optional[int] = None) -> Iterator[int]:
        """Yield k = current_step while the next step's batch fits in ``max_samples``
        (global examples) and k < ``max_steps``; raises if a step ended without ``step()``.
        ``max_samples`` and ``max_steps`` are checked here (an int >= 0, or None)."""
        max_samples = _check_budget("max_samples", max_samples)
        max_steps = _check_budget("max_steps", max_steps)
        self._refuse_nested("steps")
        return self._steps(max_samples, max_steps)

    def _steps(self, max_samples, max_steps) -> Iterator[int]:
        while self.fits(max_samples, max_steps):
            k = self._step
            yield k
            if self._step == k:
                raise RuntimeError(f"AdaptiveBatching.steps: optimizer step {k} ended without "
                                   "coord.step(); call coord.step() after optimizer.step()")

    # ------------------------------------------------------------------ the step
    def _check_state(self, k: int) -> None:
        st = self.state
        synced = st.synced_backwards - self._sync_mark   # synchronized backwards in step k
        if self._served and self._consumed != self.accum_steps:
            raise RuntimeError(
                f"step {k}: {self._consumed} of its {self.accum_steps} micro-batches were consumed; "
                "iterate coord.micro_batches(...) to the end before coord.step()")
        if self._early_step is not None:
            c, A = self._early_step
            raise RuntimeError(
                f"step {k}: opt.step() ran after micro-batch {c} of the step's {A}, inside the "
                "loop over the batch: the optimizer must step once per step, after the last "
                "micro-batch's backward (for x, y in batch: ...backward(); then opt.step(); "
                "opt.zero_grad())")
        if self._no_backward and self._served and self._grads_none_at_step and \
                self.kind != "micro" and synced == 1:
            # the synchronized backward ran (the hook counted it), yet opt.step() found no gradient
            raise RuntimeError(
                f"step {k}: every gradient was None when opt.step() ran, after this step's "
                "backward passes: opt.zero_grad() was called between the backward and "
                "opt.step() (it clears the gradients the step should apply). Call "
                "opt.step() first, then opt.zero_grad()")
        if self._no_backward and self._served and (self.kind == "micro" or synced == 0):
            raise RuntimeError(
                f"step {k}: no backward ran in this step (no parameter's gradient changed "
                f"from its first micro-batch to opt.step()), so there was nothing to measure or "
                "to step: run loss.backward() on every micro-batch, inside the loop over the batch"
                + (" (the gradients were None at opt.step(): if the backward ran, "
                   "opt.zero_grad() came before opt.step())" if self._grads_none_at_step else ""))
        if synced == 1:
            return
        fw = self._forwards
        if synced == 0 and fw is not None and self._served and self.kind in ("ddp", "micro"):
            if fw[0] == 0:
                raise RuntimeError(
                    f"step {k}: no forward went through the DDP model in this step, so DDP "
                    "prepared no gradient synchronization and the GNS hook never ran: call the "
                    "DDP model (ddp(x)), not the module it wraps (ddp.module(x) or the model "
                    "DDP was built from)")
            if fw[1] == fw[0]:
                raise RuntimeError(
                    f"step {k}: every forward of this step ran under DDP's no_sync() ({fw[0]} of "
                    f"{fw[0]}), so no backward synchronized the gradients and the GNS hook never "
                    "ran: the coordinator's batch already runs the first A - 1 micro-batches "
                    "under no_sync() and the last one synchronized; remove your own "
                    "no_sync() around the micro-batches")
        if synced == 0 and not self._served and self._micro_batches_used:
            raise RuntimeError(
                f"step {k}: coord.step() without this step's micro-batches: no micro-batch was "
                "drawn since the last coord.step() (coord.step() called twice for one optimizer "
                "step?)")
        if synced == 0:
            model_form = self._form == "model"
            if self.kind == "micro":
                fix = ("MicroBatchGNS.micro_step() must follow every micro-batch's backward "
                       f"({self.accum_steps} per step; coord.micro_batches calls it)")
            elif self.kind == "fsdp":
                fix = ("did the backward run through the FSDP2 model given to AdaptiveBatching, "
                       "with set_requires_gradient_sync(True) for the last micro-batch?"
                       if model_form else
                       "is attach_fsdp_gns(model, state) attached to the model that ran backward?")
            else:
                fix = ("did the backward run through the DDP model given to AdaptiveBatching?"
                       if model_form else
                       "register the hook: ddp.register_comm_hook(state, gk.ddp_gns_hook)")
                frozen = [n for n, p in getattr(self._model, "named_parameters", lambda: [])()
                          if not p.requires_grad]
                fix = ("DDP runs the comm hook only once every gradient bucket is ready: a "
                       "parameter that got no gradient in this backward stops it (DDP itself "
                       "reports that at the next forward, unless find_unused_parameters=True). "
                       + (f"These parameters do not require a gradient now: {', '.join(frozen[:5])}"
                          f"{' ...' if len(frozen) > 5 else ''}; if they were frozen after DDP was "
                          "built, rebuild DDP (or build it with find_unused_parameters=True). "
                          if frozen else "A parameter unused in this forward does the same "
                          "(find_unused_parameters=True). ")
                       + "Otherwise: " + fix)
            raise RuntimeError(f"step {k}: the hook state saw no synchronized backward for this "
                               f"optimizer step; {fix}")
        raise RuntimeError(
            f"step {k}: the hook state counted {synced} synchronized backward passes for one "
            f"optimizer step (expected 1); the first accum_steps - 1 "
            "micro-batches must skip the synchronization (use the context micro_batches yields)")

    def _measurement(self, k: int) -> Optional[GNSEstimate]:
        """The hook state's estimate of step k as the controller sees it: noise, signal and
        the pooled noise divided by the square of the loss scale (a GradScaler); None when
        step k has no estimate."""
        st = self.state
        est = st.estimate
        if est is None or st.estimate_step != k:
            if self.kind != "micro" or self.world_size * self.accum_steps >= 2:
                self._warn_once("missing", f"step {k} is a measuring step but the hook state has no "
                                f"estimate of it (estimate_step = {st.estimate_step}); the batch "
                                "cannot adapt. Is the hook attached to the model that ran backward?")
            return None
        if not isinstance(est, GNSEstimate):
            raise TypeError(f"the hook state's estimate must be a GNSEstimate, got {type(est).__name__}")
        if est.step is not None and est.step != k:
            self._warn_once("stale", f"the estimate of step {k} says it was measured at step "
                            f"{est.step}; it is not used")
            return None
        if est.valid and est.noise == 0 and est.signal > 0:
            self._warn_once("zero-noise", (
                f"the noise measured at step {k} is exactly 0: every "
                f"{'micro-batch' if self.kind == 'micro' and self.world_size == 1 else 'rank'} "
                "computed the same gradient, so the GNS is 0 and the batch cannot grow. Do the "
                f"{'micro-batches' if self.world_size == 1 else 'ranks'} read the same examples "
                "(a loader that repeats one batch, or is not sharded by rank)? Use "
                "DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)))"))
        s2 = self._scale * self._scale
        if s2 == 1.0:
            return replace(est, step=k)
        div = (lambda v: None if v is None else float(v) / s2)
        return replace(est, noise=est.noise / s2, signal=est.signal / s2, step=k,
                       noise_pooled=div(est.noise_pooled), noise_raw=div(est.noise_raw),
                       signal_raw=div(est.signal_raw), signal_unbiased=div(est.signal_unbiased))

    def _sync_lrs(self) -> None:
        m = self._lrm.multiplier
        for opt in self.optimizers:
            for group in opt.param_groups:
                if "scheduled_lr" not in group:  # added by add_param_group: its lr is scheduled
                    group["scheduled_lr"] = float(group["lr"])
                    if self.lr_schedule is not None:
                        group.setdefault("base_lr", float(group["lr"]))
                    continue
                if _lr_moved(group, m):
                    self._warn_once(
                        "lr", "a param group's lr was changed outside the coordinator (a scheduler "
                        "stepped by hand?); it is taken as the new scheduled rate. Pass "
                        "schedulers=[...] to AdaptiveBatching and do not step them yourself, so "
                        "they never see the multiplier")
                    group["scheduled_lr"] = float(group["lr"])

    def step(self, k: Optional[int] = None) -> int:
        """End optimizer step k (call after ``optimizer.step()``; with a GradScaler after
        ``scaler.update()``); returns B_{k+1}. ``k``, if given, must be ``current_step``.
        Not needed in a ``batches()`` loop, where the step ends by itself when every
        optimizer has stepped."""
        if k is not None:
            k = _check_int("k", k, 0)
            if k != self._step:
                raise ValueError(
                    f"step(k={k}): this is optimizer step {self._step}; the coordinator counts "
                    "optimizer steps from 0 itself, so call coord.step() without k (or pass "
                    "coord.current_step)")
        if self._auto_end or self._in_batches:
            raise RuntimeError("coord.step(): in a coord.batches(...) loop the step ends by itself "
                               "when the optimizers step; remove the coord.step() call")
        return self._end_step()

    def _end_step(self) -> int:
        k = self._step
        self._disarm()
        self._check_state(k)
        self._check_loop(k)
        measure = k % self.every == 0
        if measure and self._zeroed_inside:
            raise RuntimeError(
                f"step {k}: gradients were reset between the step's micro-batches (e.g. "
                f"{', '.join(self._zeroed_inside[:3])}): opt.zero_grad() inside the loop over "
                "the batch keeps only the last micro-batch's gradient, so the step trains on 1/A "
                "of its batch and its GNS measurement is wrong. Call opt.zero_grad() once per "
                "step, after opt.step() (or before the first micro-batch); the measurement of "
                "this step is not used")
        est = self._measurement(k) if measure else None   # the estimate's read: its host sync
        if measure and self._zeroed_flag is not None and bool(self._zeroed_flag):
            raise RuntimeError(
                f"step {k}: the gradients were zeroed between the step's micro-batches "
                "(opt.zero_grad(set_to_none=False) inside the loop over the batch): only the "
                "last micro-batch's gradient is left, so the step trains on 1/A of its batch and "
                "its GNS measurement is wrong. Call opt.zero_grad() once per step, after "
                "opt.step() (or before the first micro-batch); the measurement of this step is "
                "not used")
        if measure and self._stale_grad is not None and bool(self._stale_grad):
            # read after the estimate (the device has finished its work: no wait)
            raise RuntimeError(
                f"step {k}: the gradients were not zero when this step's first micro-batch "
                "began, so its backward passes added to the previous step's gradients "
                "(opt.zero_grad() missing after opt.step()?): the step and its GNS measurement "
                "mix two steps (one rank: the GNS came out 2-3x too large and B reached its cap). "
                "Call opt.zero_grad() after every opt.step(); the measurement of this step is "
                "not used")
        f_next = (None if self.lr_schedule is None
                  else self._schedule_factor(self._samples + self._batch))
        ctrl = self.controller
        A_used, B_used, scale_used = self.accum_steps, self._batch, self._scale
        ctrl.update(k, est)     # writes B_{k+1} into the run's schedule
        new = ctrl.batch_size
        self._samples += B_used
        self.schedule.write("step", k + 1, by=_OWNER)   # B_{k+1} is in it already (the controller's)
        self._sync_mark = self.state.synced_backwards
        self._served = False
        self._consumed = 0
        self._stale_grad = self._grad_marks = self._no_backward = None
        self._early_step = self._zeroed_inside = self._held = self._zeroed_flag = None
        self._sync_lrs()
        if f_next is not None:
            self._apply_schedule(f_next)
        self._lrm.step(ctrl.lr_multiplier)
        self._sched_epochs = self._scheduler_epochs()
        self._opt_steps = [0] * len(self.optimizers)
        self._set_scale(self._read_scale())
        self._last = self._record(k, B_used, A_used, scale_used, measure, est)
        return new

    # ------------------------------------------------------------------ metrics
    def _record(self, k, B, A, scale, measure, est) -> dict:
        ctrl = self.controller
        nan = float("nan")
        row: dict[str, Any] = {
            "step": k, "samples_seen": self._samples, "batch_size": B, "accum_steps": A,
            "micro_batch_size": self.micro_batch_size, "next_batch_size": self._batch,
            "lr_multiplier": self._lrm.multiplier, "measuring_step": measure,
            "measured": est is not None,
            "valid": bool(est.valid) if est is not None else None,  # None: nothing measured
            "gns": est.gns if est is not None else nan,
            "noise": est.noise if est is not None else nan,
            "noise_pooled": (est.noise_pooled if est is not None and est.noise_pooled is not None
                             else nan),
            "signal": est.signal if est is not None else nan,
            "noise_ema": nan if ctrl.noise_ema is None else ctrl.noise_ema,
            "signal_ema": nan if ctrl.signal_ema is None else ctrl.signal_ema,
            "gns_ema": nan if ctrl.gns_ema is None else ctrl.gns_ema,
            "target_batch_size": nan if ctrl.target_batch_size is None else ctrl.target_batch_size,
            "grad_scale": scale,
        }
        i = 0
        for opt in self.optimizers:
            for group in opt.param_groups:
                row[f"lr_{i}"] = float(group["lr"])
                i += 1
        # per-layer terms, when the measuring object exposes them as {name: (noise, signal)}
        layers = getattr(self.state, "layer_stats", None) if est is not None else None
        if isinstance(layers, dict):
            s2 = scale * scale
            for name, (n, s) in layers.items():
                row[f"noise/{name}"] = float(n) / s2
                row[f"signal/{name}"] = float(s) / s2
        return row

    def metrics(self) -> dict:
        """The last completed step as a flat dict of plain Python values: step,
        samples_seen, batch_size (B_k), accum_steps, micro_batch_size, next_batch_size
        (B_{k+1}), lr_multiplier (omega_{k+1}), lr_<i> (every param group's next lr),
        measuring_step, measured, valid (None when step k was not measured, so a logger
        skips it instead of plotting a failure), gns, noise, noise_pooled, signal (the
        measurement of step k, divided by grad_scale^2; nan when not measured; noise_pooled nan without
        a noise pool), noise_ema (the pooled noise when the hook pools), signal_ema, gns_ema,
        target_batch_size, grad_scale; and ``noise/<layer>``, ``signal/<layer>`` when the
        hook state exposes a ``layer_stats`` dict {name: (noise, signal)}. Empty before the
        first ``step()``."""
        return dict(self._last)

    def to_tensorboard(self, writer, step: Optional[int] = None, prefix: str = "gns/") -> None:
        """Write ``metrics()`` as scalars to a ``torch.utils.tensorboard.SummaryWriter``."""
        from .metrics import to_tensorboard

        to_tensorboard(writer, self.metrics(), step=step, prefix=prefix)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything to resume: the run's schedule (F, k, B_k), the samples seen, the
        controller, the sampler position, the LR state (multiplier, schedulers) and the hook
        state's (eigensolver hints, this rank's noise pool). Plain Python values (and the
        schedulers' own state dicts); version 2 (version 1, from before, also loads). For
        torch.distributed.checkpoint wrap the coordinator in
        ``gns_kernels.integrations.dcp.DCPState`` (the state is per rank); handed to DCP as
        it is, this raises RuntimeError."""
        refuse_unwrapped_dcp("AdaptiveBatching")
        sched = self.schedule
        return {
            "version": _STATE_VERSION,
            "schedule": {"every": sched.every, "step": sched.step, "batch_size": sched.batch_size},
            "samples_seen": self._samples, "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "controller": self.controller.state_dict(),
            "lr_multiplier": self._lrm.state_dict(),
            "schedulers": [s.state_dict() for s in self.schedulers],
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "hook": self.state.state_dict(),
        }

    @staticmethod
    def check_state_dict(sd) -> dict:
        """``sd`` as a state_dict of this version, or ValueError / KeyError when it is not
        one this class wrote (any version; nothing is loaded): what a trainer integration
        checks before it loads anything else. Version 1 kept F, k and B at the top level
        and in the controller's and the hook's entries (which a coordinated controller and
        hook state no longer read)."""
        if not isinstance(sd, dict) or sd.get("version") not in (1, _STATE_VERSION):
            got = sd.get("version") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"AdaptiveBatching.load_state_dict: version {got!r}, expected a "
                             f"state_dict of version 1 or {_STATE_VERSION}")
        keys = _STATE_KEYS_V1 if sd["version"] == 1 else _STATE_KEYS
        missing = [k for k in keys if k not in sd]
        if missing:
            raise KeyError(f"AdaptiveBatching.load_state_dict: a dict without keys {missing}")
        if not isinstance(sd["controller"], dict) or not isinstance(sd["controller"].get("config"), dict):
            raise ValueError("AdaptiveBatching.load_state_dict: 'controller' is not a controller state_dict")
        if sd["version"] == 1:
            ctrl = sd["controller"]
            schedule = {"every": sd.get("every", ctrl["config"].get("every")), "step": sd["step"],
                        "batch_size": ctrl.get("batch_size")}
            sd = {k: v for k, v in sd.items() if k not in ("step", "batch_size", "every")}
            sd.update(version=_STATE_VERSION, schedule=schedule)
        return sd

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
        sd = self.check_state_dict(sd)
        if not isinstance(sd["schedulers"], (list, tuple)) or not isinstance(sd["hook"], dict):
            raise ValueError("AdaptiveBatching.load_state_dict: 'schedulers' must be a list and 'hook' a dict")
        if not isinstance(sd["schedule"], dict):
            raise ValueError("AdaptiveBatching.load_state_dict: 'schedule' must be a dict")
        saved, attrs = self.state_dict(), dict(self.__dict__)
        try:
            self._load_state_dict(sd, strict)
        except BaseException:
            self.__dict__.update(attrs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._load_state_dict(saved, strict=False)
            raise

    def _load_state_dict(self, sd: dict, strict: bool) -> None:
        ctrl = self.controller
        csd = dict(sd["controller"])
        csd["config"] = dict(csd["config"])
        sched = sd["schedule"]
        m = ctrl.multiple_of
        every = _check_int("state_dict['schedule']['every']", sched.get("every"), 1)
        step = _check_int("state_dict['schedule']['step']", sched.get("step"), 0)
        batch = _check_int("state_dict['schedule']['batch_size']", sched.get("batch_size"), 1)
        if strict:
            diff = ctrl.config_differences(csd["config"], ignore=("multiple_of",))
            if every != self.every:
                diff["every"] = (every, self.every)
            if diff:
                details = ", ".join(f"{k}: saved {a!r} vs {b!r}" for k, (a, b) in sorted(diff.items()))
                raise ValueError(f"AdaptiveBatching.load_state_dict: the controller's settings differ "
                                 f"({details}); construct it with the saved settings or pass strict=False")
        new = -(-batch // m) * m       # a multiple of this run's R x b,
        if ctrl.max_batch_size is not None:
            new = min(new, ctrl.max_batch_size)
        new = max(new, ctrl.initial_batch_size)   # within [B_0, max_batch_size]
        if new != batch:
            why = (f"not a multiple of {m}" if batch % m else
                   f"below this run's initial_batch_size {ctrl.initial_batch_size}"
                   if batch < ctrl.initial_batch_size else
                   f"above this run's max_batch_size {ctrl.max_batch_size}")
            _warn_user(
                f"AdaptiveBatching: resumed with world_size x micro_batch_size = {self.world_size} x "
                f"{self.micro_batch_size} = {m} (saved: {sd['world_size']} x {sd['micro_batch_size']}); "
                f"the saved batch {batch} is {why}, continuing with {new} (the LR multiplier follows)")
        self.schedule.write("batch_size", new, by=_OWNER)
        self.schedule.write("step", step, by=_OWNER)
        ctrl.load_state_dict(csd, strict=False)     # B is the schedule's: not read from csd
        self._samples = _check_int("state_dict['samples_seen']", sd["samples_seen"], 0)
        if len(sd["schedulers"]) != len(self.schedulers):
            raise ValueError(f"AdaptiveBatching.load_state_dict: {len(sd['schedulers'])} schedulers "
                             f"saved, {len(self.schedulers)} given")
        for s, ssd in zip(self.schedulers, sd["schedulers"]):
            s.load_state_dict(ssd)
        if self.sampler is not None and sd["sampler"] is not None:
            self.sampler.load_state_dict(sd["sampler"])
        elif sd["sampler"] is not None:
            self._pending_sampler = sd["sampler"]
        self.state.load_state_dict(dict(sd["hook"]))   # F, k, B there (version 1) are not read
        self._sync_mark = self.state.synced_backwards
        self._lrm.set_multiplier(ctrl.lr_multiplier)
        self._loader = self._iter = None
        self._served, self._consumed = False, 0
        self._set_scale(self._read_scale())
        self._sched_epochs = self._scheduler_epochs()
        self._opt_steps = [0] * len(self.optimizers)
        self._loaded = True


class Batch:
    """One optimizer step of ``AdaptiveBatching.batches``: ``len()`` is A_k, iterating
    yields this rank's A_k micro-batches, each inside its synchronization context;
    ``step`` is k."""

    def __init__(self, coord: AdaptiveBatching, loader, step: int):
        self._coord, self._loader, self.step = coord, loader, step
        self._iterated = False

    def __len__(self) -> int:
        return self._coord.accum_steps

    def __iter__(self) -> Iterator[Any]:
        coord = self._coord
        if coord.current_step != self.step:
            raise RuntimeError(f"the batch of step {self.step} iterated at step {coord.current_step}: "
                               "iterate each batch inside its own step of the coord.batches(...) loop")
        if self._iterated:
            raise RuntimeError(
                f"the batch of step {self.step} was already iterated: a Batch is iterated once (it "
                "draws its micro-batches from the loader as it goes); keep what you need from "
                "the first pass instead of iterating it again")
        self._iterated = True
        return self._micro_batches()

    def _micro_batches(self) -> Iterator[Any]:
        coord = self._coord
        for batch, ctx in coord.micro_batches(self._loader, coord._model):
            with ctx:
                yield batch

    def __repr__(self) -> str:
        return f"Batch(step={self.step}, micro_batches={len(self)})"
