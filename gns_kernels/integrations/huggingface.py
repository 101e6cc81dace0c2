"""Hugging Face ``Trainer``: ``GNSTrainerCallback`` measures and logs the GNS of a run's
gradient-accumulation micro-batches. What the user adds::

    from gns_kernels.integrations.huggingface import GNSTrainerCallback
    args = TrainingArguments(..., gradient_accumulation_steps=4, max_grad_norm=0.0)
    trainer = Trainer(model, args, ..., callbacks=[GNSTrainerCallback(every=10)])

How: at ``on_train_begin`` it builds a ``gk.MicroBatchGNS`` on the model's trainable
parameters (geometry from the optimizer, ``gk.geometry_for``: AdamW -> l1) with
B = per_device_train_batch_size x gradient_accumulation_steps and A =
gradient_accumulation_steps micro-batches as the samples; it calls ``micro_step()`` after
every micro-batch's backward (``on_substep_end``, and ``on_pre_optimizer_step`` for the
last). Every ``every`` optimizer steps the measurement's gns, noise, signal (and the
pooled noise) are put into the Trainer's next ``logs`` (``gns/gns``, ...; the callback sets
``control.should_log`` on a measured step; also in ``trainer.state.log_history``), kept in ``callback.history``, and written to
``writer`` (anything with ``write(dict)``: ``gk.CSVWriter``, ``WandbWriter``) when given.

What it does not do: change the batch (a callback cannot change the Trainer's loop:
``gradient_accumulation_steps`` is fixed for the run), support several processes (the
Trainer's DDP model is not handed to callbacks, so the DDP comm hook cannot be
registered; one process only, a RuntimeError says so otherwise), or measure clipped
gradients (``max_grad_norm`` must be 0: the Trainer clips before the last micro-step is
read). The noise/signal scale follows the Trainer's loss normalization (divided by the
accumulation steps, or by the number of items with ``num_items_in_batch``); the GNS, a
ratio, does not depend on a constant scale. Reporters that run before this callback
(``report_to``) log the same step's ``logs`` only if they read them after it; use
``writer=`` for a logger of its own.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from ._common import missing, scalars

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError as exc:  # pragma: no cover
    raise missing("transformers", "hf", "gns_kernels.integrations.huggingface") from exc

__all__ = ["GNSTrainerCallback"]


class GNSTrainerCallback(_TrainerCallback):
    """GNS of the gradient-accumulation micro-batches of a Hugging Face ``Trainer`` run
    (the module docstring).

    Args:
        every: measure every ``every`` optimizer steps.
        geometry: "l1", "l2" or "nuclear"; None: ``gk.geometry_for(optimizer)``.
        prefix: the logged keys' prefix.
        writer: optional, ``writer.write(metrics)`` per measured step.
        **state: other ``gk.MicroBatchGNS`` arguments (pool_beta, signal, ...).
    """

    def __init__(self, every: int = 10, geometry: Optional[str] = None, prefix: str = "gns/",
                 writer: Any = None, **state: Any):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: expected an int >= 1, got {every!r}")
        if writer is not None and not callable(getattr(writer, "write", None)):
            raise TypeError(f"writer: expected an object with write(dict) (gk.CSVWriter, WandbWriter), "
                            f"got {type(writer).__name__}")
        self.every, self.geometry, self.prefix, self.writer = every, geometry, prefix, writer
        self.state_kw = state
        self.gns = None
        self.history: list = []
        self._pending: Optional[dict] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from ..distributed import MicroBatchGNS
        from ..optim import geometry_for

        if args.world_size != 1:
            raise RuntimeError(f"GNSTrainerCallback: {args.world_size} processes; the Trainer's DDP "
                               "model is not handed to callbacks, so the GNS hook cannot be registered: "
                               "run one process, or use gk.AdaptiveBatching in your own loop")
        A = args.gradient_accumulation_steps
        if A < 2:
            raise ValueError("gradient_accumulation_steps: one process measures across the "
                             "micro-batches of a step, so it must be >= 2")
        if args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: {args.max_grad_norm}; the Trainer clips the gradient "
                             "before the last micro-batch is read, so the GNS would be measured on "
                             "a clipped gradient: set max_grad_norm=0.0")
        inner = getattr(optimizer, "optimizer", optimizer)   # accelerate's AcceleratedOptimizer
        geometry = self.geometry or (geometry_for(inner) if inner is not None else "l1")
        b = args.per_device_train_batch_size
        params = [p for p in model.parameters() if p.requires_grad]
        self.gns = MicroBatchGNS(params, geometry=geometry, every=self.every, batch_size=b * A,
                                 micro_batches=A, **self.state_kw)
        self.gns.step = state.global_step

    def on_substep_end(self, args, state, control, **kwargs):
        if self.gns is not None:
            self.gns.micro_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.gns is not None:
            self.gns.micro_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.gns is None:
            return
        k = state.global_step - 1
        est = self.gns.estimate
        if est is None or self.gns.estimate_step != k:
            return
        row = {"step": k, "batch_size": self.gns.batch_size,
               "accum_steps": args.gradient_accumulation_steps, "valid": bool(est.valid),
               "gns": est.gns, "noise": est.noise, "signal": est.signal,
               "noise_pooled": est.noise_pooled if est.noise_pooled is not None else math.nan}
        self.history.append(row)
        if self.writer is not None:
            self.writer.write(row)
        self._pending = scalars(row, self.prefix)
        control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending and logs is not None:
            logs.update(self._pending)   # seen by the callbacks after this one
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self._pending)  # the Trainer appended it before on_log
            self._pending = None
