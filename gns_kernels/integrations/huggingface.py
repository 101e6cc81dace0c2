"""Hugging Face ``Trainer``: ``AdaptiveTrainer`` (a ``Trainer`` subclass) adapts the batch
size from the GNS; ``GNSTrainerCallback`` only measures and logs the GNS of a run's
gradient-accumulation micro-batches. ``AdaptiveTrainer`` is documented on the class; the
callback, what the user adds::

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
The measuring schedule is the Trainer's step counter (``state.global_step``, read at
every step's start).

Steps other than planned: the Trainer ends each epoch with a shorter step when the
epoch's micro-batches are not a multiple of A, and a dataset of N examples ends the epoch
with a micro-batch of N mod b examples (unless ``dataloader_drop_last``). A step of
n >= 2 full micro-batches is measured from them (B = b x n, ``accum_steps`` = n in its
row); a step of one micro-batch, or holding the epoch's partial micro-batch (samples of
unequal size), is not measured: a RuntimeWarning names the first such step (one per
kind) and the schedule goes on. (The partial micro-batch is found from the train
dataloader's length; a loader without one, an ``IterableDataset``, is trusted to give
full micro-batches.)

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
import os
from typing import Any, Optional

from ._common import missing, scalars, warn_user

try:
    from transformers import Trainer as _Trainer
    from transformers import TrainerCallback as _TrainerCallback
except ImportError as exc:  # pragma: no cover
    raise missing("transformers", "hf", "gns_kernels.integrations.huggingface") from exc

__all__ = ["GNSTrainerCallback", "AdaptiveTrainer"]


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

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       train_dataloader=None, **kwargs):
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
        self._b, self._A, self._n = b, A, 0
        self._epoch = _epoch_shape(train_dataloader, b, A)
        self._warned: set = set()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.gns is None:
            return
        # the Trainer's step counter is the schedule (every, the logged step): follow it
        self.gns.step = state.global_step
        self.gns.micro_batches, self.gns.batch_size = self._A, self._b * self._A
        self._n = 0

    def on_substep_end(self, args, state, control, **kwargs):
        if self.gns is not None:
            self._n += 1
            self.gns.micro_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.gns is None:
            return
        n, k = self._n + 1, state.global_step   # the step's micro-batches, this one included
        short = None
        if n < 2:
            short = ("it has 1 micro-batch (an epoch's last step when the epoch's micro-batches "
                     "are not a multiple of gradient_accumulation_steps), and one process needs "
                     ">= 2 micro-batches to measure")
        elif self._epoch is not None and self._epoch.partial(k):
            short = (f"its last micro-batch is the epoch's partial batch ({self._epoch.last} of "
                     f"{self._b} examples), and micro-batches of unequal size are not equal "
                     "samples (dataloader_drop_last=True avoids it)")
        if short is not None:
            kind = "one" if n < 2 else "partial"
            if self.gns.is_measurement_step() and kind not in self._warned:
                self._warned.add(kind)
                warn_user(f"GNSTrainerCallback: step {k} is not measured: {short}. Such steps "
                          "are skipped (this warning is not repeated for them); the other "
                          "measured steps are not affected")
            self.gns.skip_step()
            return
        if n != self.gns.micro_batches:   # fewer micro-batches than planned, all full: measure them
            self.gns.micro_batches, self.gns.batch_size = n, self._b * n
        self.gns.micro_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.gns is None:
            return
        k = state.global_step - 1
        est = self.gns.estimate
        # the estimate readable at step k: measured at k, or on the hooks' host route at
        # k - F (available at k; its step says which)
        avail = getattr(self.gns, "estimate_available_step", None)
        if est is None or (self.gns.estimate_step if avail is None else avail) != k:
            return
        row = {"step": k, "batch_size": self.gns.batch_size,
               "accum_steps": self.gns.micro_batches, "valid": bool(est.valid),
               "gns": est.gns, "noise": est.noise, "signal": est.signal,
               "noise_pooled": est.noise_pooled if est.noise_pooled is not None else math.nan}
        if getattr(est, "available_step", None) is not None:   # lagged: what it measured
            row.update(measured_step=est.step, batch_size=est.batch_size)
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


class _EpochShape:
    """Where the Trainer's epoch puts its partial last micro-batch: L micro-batches per
    epoch, U = ceil(L / A) optimizer steps per epoch (the Trainer's count), so the step k
    with k % U == U - 1 holds micro-batch L - 1, which has ``last`` < b examples."""

    def __init__(self, L: int, A: int, last: int):
        self.steps, self.last = -(-L // A), last

    def partial(self, k: int) -> bool:
        return k % self.steps == self.steps - 1


def _epoch_shape(loader, b: int, A: int) -> Optional[_EpochShape]:
    """The epoch's shape when its last micro-batch is partial (N examples, L = ceil(N / b)
    micro-batches, the last with N - (L - 1) b < b examples); None when it is full
    (``dataloader_drop_last``, N a multiple of b) or the loader has no length (an
    IterableDataset: a short last micro-batch cannot be told apart there)."""
    try:
        L, N = len(loader), len(loader.dataset)
    except (TypeError, AttributeError):
        return None
    last = N - (L - 1) * b
    return _EpochShape(L, A, last) if L >= 1 and 0 < last < b else None


# ---------------------------------------------------------------------------- the trainer
_STATE_FILE = "gns_kernels_rank{}.pt"


class _StepTick(dict):
    """What the Trainer's own loop iterates: one item per optimizer step (empty: the
    step's micro-batches come from the coordinator's loader inside ``training_step``)."""


class _Ticks:
    """The Trainer's "train dataloader": endless ticks, no length (the Trainer then runs
    ``max_steps`` optimizer steps in one "epoch")."""

    def __iter__(self):
        while True:
            yield _StepTick()


class _CoordinatedScheduler:
    """The Trainer's ``lr_scheduler`` while the coordinator owns the lr: the Trainer's own
    ``step()`` after each optimizer step does nothing (``coord.step()`` steps the real
    scheduler on the un-multiplied rates and sets lr = scheduled x omega); the rest is
    the real scheduler's (state_dict, load_state_dict, ...); ``get_last_lr`` reads the
    rates the optimizer runs with."""

    def __init__(self, scheduler, optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def step(self, *args, **kwargs):
        return None

    def get_last_lr(self):
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class _AdaptiveSteps(_TrainerCallback):
    """AdaptiveTrainer's own callback: ends the coordinator's step after the optimizer
    step (``on_step_end``, before logging and saving) and writes the coordinator's state
    into each checkpoint (``on_save``, every rank its own file)."""

    def __init__(self, trainer: "AdaptiveTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if t.coord is not None:
            t.coord.step()
            t.gns_history.append(t.coord.metrics())
            # the Trainer's epoch counts its one endless "epoch" of max_steps ticks (and restarts
            # it on resume); here: passes over train_dataset, from the examples the
            # coordinator served (a resumed run continues the uninterrupted one's count)
            state.epoch = t.coord.samples_seen / len(t.train_dataset)

    def on_save(self, args, state, control, **kwargs):
        import torch
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        t = self.trainer
        if t.coord is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(t.coord.state_dict(), os.path.join(folder, _STATE_FILE.format(t.coord.rank)))


class AdaptiveTrainer(_Trainer):
    """A Hugging Face ``Trainer`` whose batch size adapts from the GNS: step k accumulates
    A_k micro-batches of ``per_device_train_batch_size`` = b per process, A_k from
    ``gk.AdaptiveBatching`` (Algorithm 1; the lr multiplied by omega_k)::

        from gns_kernels.integrations.huggingface import AdaptiveTrainer
        args = TrainingArguments(..., per_device_train_batch_size=b, max_steps=N)
        trainer = AdaptiveTrainer(model, args, train_dataset=ds,
                                  initial_batch_size=64, max_batch_size=1024)
        trainer.train()                    # resume: trainer.train(resume_from_checkpoint=...)

    How (transformers 5.x): a callback cannot change the loop, and the Trainer decides the
    accumulation inside ``_run_epoch`` from ``args.gradient_accumulation_steps`` (which
    micro-batch steps, ``(step + 1) % A == 0``, so A cannot change mid-run). This class
    keeps the Trainer's loop with ``gradient_accumulation_steps=1`` (one loop iteration =
    one optimizer step) and overrides, among others, three public methods: ``get_train_dataloader``
    returns endless step ticks, ``get_batch_samples`` hands one tick per step (and stops
    at ``max_samples``), and ``training_step`` runs the step's A_k micro-batches from
    ``coord.micro_batches`` (the coordinator's sampler over ``train_dataset``, the first
    A_k - 1 under DDP's ``no_sync()``), each micro-batch's mean loss divided by A_k. The
    Trainer then clips (the GNS was read before: clipping is allowed), steps the
    optimizer, and a callback calls ``coord.step()``. The Trainer's LR scheduler is
    stepped by the coordinator (the Trainer's own ``lr_scheduler.step()`` becomes a
    no-op), so the lr is scheduled x omega. Logs: ``coord.metrics()`` under ``gns/`` in
    every training log (``logging_steps``); every step's metrics in
    ``trainer.gns_history``. Checkpoints: each rank's ``coord.state_dict()`` in the
    checkpoint folder (``gns_kernels_rank{r}.pt``), read back by
    ``train(resume_from_checkpoint=...)``: the data position, batch, EMAs and noise pool
    continue (the Trainer restores model, optimizer, scheduler and RNG). The file is read
    with torch's safe loader (``weights_only=True``: nothing in it runs) before the Trainer
    starts; a file that is not a coordinator state is refused with a ValueError naming it
    (one whose settings do not fit the run, at the first step).

    What it changes or replaces: the data (``train_dataset`` must be map-style; it is read
    through the coordinator's ``batch_sampler``, so a custom ``get_train_dataloader``,
    ``group_by_length`` or a train sampler is not used; ``dataloader_num_workers``,
    ``dataloader_pin_memory`` and the collator are), the accumulation, the lr multiplier,
    ``ignore_data_skip`` (set True: the coordinator keeps the data position),
    ``ddp_find_unused_parameters`` (on several processes its None, which the Trainer reads
    as True for a PreTrainedModel, is set False; an explicit True is kept and supported,
    for a model with parameters unused in some forward passes). The loss:
    each micro-batch's mean loss / A_k (the Trainer's token-count normalization,
    ``num_items_in_batch``, is not used: the GNS treats each micro-batch, and each rank,
    as a sample of equal weight). ``state.epoch`` (the logged ``epoch``) is the passes over
    ``train_dataset``: ``gns/samples_seen`` (global examples) / ``len(train_dataset)``, so a
    resumed run continues the uninterrupted one's value; ``train()``'s
    ``train_samples_per_second`` is the examples of that call (sum of B_k) per second of
    ``train_runtime`` (the Trainer's own figures count its one-tick-per-step loop). Refused: ``gradient_accumulation_steps`` != 1,
    ``max_steps`` <= 0 (epochs have no fixed number of steps when the batch grows; give
    ``max_samples`` to stop by examples), fp16 (its GradScaler is not handed to the
    coordinator; use bf16), DeepSpeed, FSDP, several GPUs in one process (DataParallel),
    an ``IterableDataset``. Hyperparameter search (``trial``) checkpoints are not handled.

    Args (besides the ``Trainer``'s):
        initial_batch_size: B_0, global examples of step 0 (a multiple of processes x b;
            one process: >= 2 b, the micro-batches are the GNS samples).
        max_batch_size: cap on B (a multiple of processes x b), or None.
        max_samples: stop before a step would pass this many global examples (None:
            ``max_steps`` only).
        coordinator: other ``gk.AdaptiveBatching`` arguments (theta, every, geometry,
            warmup_steps, max_growth, signal, lr_scaling, ...).
        gns_prefix: the logged keys' prefix.
    """

    def __init__(self, *args: Any, initial_batch_size: int, max_batch_size: Optional[int] = None,
                 max_samples: Optional[int] = None, coordinator: Optional[dict] = None,
                 gns_prefix: str = "gns/", **kwargs: Any):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None and targs.world_size > 1:
            if targs.ddp_find_unused_parameters is None:
                # read when the Trainer builds its accelerator; its None means True for a
                # PreTrainedModel (an extra autograd traversal per backward): False here
                # unless asked for (True is supported: docs/distributed.md, "Unused parameters")
                targs.ddp_find_unused_parameters = False
        super().__init__(*args, **kwargs)
        coordinator = dict(coordinator or {})
        for bad in ("micro_batch_size", "world_size", "rank", "schedulers", "grad_scaler",
                    "initial_batch_size", "max_batch_size"):
            if bad in coordinator:
                raise ValueError(f"coordinator: {bad!r} is set by AdaptiveTrainer (from the "
                                 "TrainingArguments or its own arguments); leave it out")
        a = self.args
        if a.gradient_accumulation_steps != 1:
            raise ValueError(f"gradient_accumulation_steps: {a.gradient_accumulation_steps}; "
                             "AdaptiveTrainer sets the accumulation per step (A_k = B_k / "
                             "(processes x per_device_train_batch_size)): leave it 1")
        if a.max_steps is None or a.max_steps <= 0:
            raise ValueError("max_steps: AdaptiveTrainer needs max_steps > 0 (optimizer steps): "
                             "as the batch grows an epoch has no fixed number of steps "
                             "(num_train_epochs is not used; max_samples= stops by examples)")
        if a.fp16:
            raise ValueError("fp16: its GradScaler is not handed to the coordinator (noise and "
                             "signal would read scale^2 too large); use bf16")
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False) \
                or getattr(a, "fsdp", None):
            raise ValueError("AdaptiveTrainer: DeepSpeed and FSDP through the Trainer are not "
                             "supported (DDP and one process are); for FSDP2 use "
                             "gk.AdaptiveBatching in your own loop (docs/fsdp.md)")
        if a.n_gpu > 1:
            raise ValueError(f"n_gpu: {a.n_gpu} GPUs in one process (DataParallel) are not "
                             "supported; run one process per GPU (torchrun, DDP)")
        import torch

        ds = self.train_dataset
        if ds is None or isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__"):
            raise ValueError("train_dataset: AdaptiveTrainer reads a map-style dataset (len and "
                             "indexing) through the coordinator's sampler; got "
                             f"{type(ds).__name__}")
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                        or max_samples < initial_batch_size):
            raise ValueError(f"max_samples: expected an int >= initial_batch_size "
                             f"({initial_batch_size}), got {max_samples!r}")
        a.ignore_data_skip = True   # the coordinator keeps the data position
        self.gns_options = dict(micro_batch_size=a.per_device_train_batch_size,
                                initial_batch_size=initial_batch_size,
                                max_batch_size=max_batch_size, **coordinator)
        self.gns_prefix, self.max_samples = gns_prefix, max_samples
        self.coord = None
        self.gns_history: list = []
        self._gns_loader = None
        self._gns_state: Optional[dict] = None      # read by train(), loaded at the first step
        self._gns_state_path: Optional[str] = None
        self._gns_samples0 = 0                      # samples_seen when this train() began
        self._gns_flops = 0.0
        self.add_callback(_AdaptiveSteps(self))

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        path = resume_from_checkpoint
        if isinstance(path, bool):
            if path:
                from transformers.trainer_utils import get_last_checkpoint
                path = get_last_checkpoint(self.args.output_dir)
            else:
                path = None
        # read (and check) the coordinator's state before the Trainer or this object changes:
        # a missing or foreign file is refused here, with nothing loaded or attached
        state = None if path is None else self._load_gns_state(path, self.args.process_index)
        self._gns_state = state
        self.coord, self._gns_loader = None, None   # built at the first training_step
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def get_train_dataloader(self):
        return _Ticks()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        c = self.coord
        if c is not None and not c.fits(self.max_samples):
            self.control.should_training_stop = True
            return [], None
        return [next(epoch_iterator)], None

    def _gns_setup(self, model):
        import torch

        from ..adaptive import AdaptiveBatching

        opt = getattr(self.optimizer, "optimizer", self.optimizer)   # accelerate's wrapper
        sched = self.lr_scheduler
        if isinstance(sched, _CoordinatedScheduler):
            sched = sched.scheduler
        schedulers = [] if sched is None else [sched]
        coord = AdaptiveBatching(model, [opt], schedulers=schedulers, **self.gns_options)
        if self._gns_state is not None:
            try:
                coord.load_state_dict(self._gns_state)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"resume_from_checkpoint: {self._gns_state_path} is not a usable "
                                 f"gns_kernels coordinator state for this run: {exc}") from exc
            self._gns_state = None
        self._gns_samples0 = coord.samples_seen   # this train() call's first example
        ds = self.train_dataset
        try:
            import datasets
            is_hf = isinstance(ds, datasets.Dataset)
        except ImportError:
            is_hf = False
        if is_hf:
            ds, collate = self._remove_unused_columns(ds, description="training"), self.data_collator
        else:
            collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        a = self.args
        seed = a.data_seed if a.data_seed is not None else a.seed
        # a generator of its own: iter(DataLoader) draws its base seed from it, not from the
        # global RNG (which the Trainer restores on resume: dropout continues bit-exactly)
        kw = dict(collate_fn=collate, num_workers=a.dataloader_num_workers,
                  pin_memory=a.dataloader_pin_memory,
                  generator=torch.Generator().manual_seed(seed))
        if a.dataloader_num_workers > 0:
            kw.update(persistent_workers=a.dataloader_persistent_workers,
                      prefetch_factor=a.dataloader_prefetch_factor)
        self._gns_loader = torch.utils.data.DataLoader(
            ds, batch_sampler=coord.batch_sampler(len(ds), shuffle=True, seed=seed), **kw)
        if sched is not None:
            self.lr_scheduler = _CoordinatedScheduler(sched, opt)
        self.coord = coord
        return coord

    def _load_gns_state(self, folder: str, rank: int) -> dict:
        """This rank's ``gns_kernels_rank{r}.pt`` in checkpoint ``folder`` (rank 0's, with a
        warning, when the checkpoint was saved on fewer processes), read with torch's safe
        loader (``weights_only=True``: plain values and tensors, no code is run). Raises
        FileNotFoundError when the checkpoint has none, ValueError naming the file when it
        is not a coordinator state."""
        import torch

        path = os.path.join(str(folder), _STATE_FILE.format(rank))
        if not os.path.exists(path):
            first = os.path.join(str(folder), _STATE_FILE.format(0))
            if not os.path.exists(first):
                raise FileNotFoundError(
                    f"resume_from_checkpoint: {folder} has no {_STATE_FILE.format(rank)} (the "
                    "coordinator's state, written by AdaptiveTrainer at each save); was the "
                    "checkpoint written by a plain Trainer?")
            warn_user(f"AdaptiveTrainer: {folder} has no state of rank {rank} (saved on "
                      "fewer processes); resuming from rank 0's")
            path = first
        foreign = (f"resume_from_checkpoint: {path} is not a gns_kernels coordinator state (the "
                   "dict of plain values AdaptiveTrainer writes at each save)")
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as exc:
            # torch's message would suggest unpickling the file with weights_only=False, which
            # runs whatever code it holds: not repeated (nor chained) here
            raise ValueError(f"{foreign}: torch's safe loader refused it ({type(exc).__name__}; "
                             "nothing in it was run). Resume from a checkpoint folder written by "
                             "AdaptiveTrainer, or put that run's file back") from None
        from ..adaptive import AdaptiveBatching

        if not isinstance(sd, dict):
            raise ValueError(f"{foreign}: it holds a {type(sd).__name__}")
        try:   # checked here, before the Trainer loads anything (the coordinator checks the rest)
            AdaptiveBatching.check_state_dict(sd)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{foreign}: {str(exc).strip(chr(39) + chr(34))}") from None
        self._gns_state_path = path
        return sd

    def training_step(self, model, inputs, num_items_in_batch=None):
        import torch

        if not isinstance(inputs, _StepTick):
            raise RuntimeError("AdaptiveTrainer.training_step runs a whole optimizer step (the "
                               "coordinator's A_k micro-batches); it is called by the Trainer's "
                               "loop with a step tick, not with a batch")
        coord = self.coord if self.coord is not None else self._gns_setup(model)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        A = coord.accum_steps
        total = torch.zeros((), device=self.args.device)
        self._gns_flops = 0.0
        for batch, ctx in coord.micro_batches(self._gns_loader, model):
            self._gns_flops += float(super().floating_point_ops(batch))
            self._track_num_input_tokens(batch)
            with ctx:
                micro = self._prepare_inputs(batch)
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, micro)
                self.accelerator.backward(loss / A)
            total += loss.detach() / A
        return total

    def floating_point_ops(self, inputs):
        if isinstance(inputs, _StepTick):
            return self._gns_flops       # the step's micro-batches, counted in training_step
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs):
        if isinstance(inputs, _StepTick):
            return                       # counted per micro-batch in training_step
        return super()._track_num_input_tokens(inputs)

    def log(self, logs, start_time=None):
        c = self.coord
        if c is not None and "train_samples_per_second" in logs and logs.get("train_runtime"):
            # the Trainer's figure is max_steps x per_device_train_batch_size x processes
            # (its ticks), scaled to the steps run: the examples of this train() call are
            # the coordinator's (B_k per step). In place: train()'s returned metrics are this dict
            logs["train_samples_per_second"] = round(
                (c.samples_seen - self._gns_samples0) / logs["train_runtime"], 3)
        if c is not None and "loss" in logs:
            logs = {**logs, **scalars(c.metrics(), self.gns_prefix, keep_step=True)}
        return super().log(logs, start_time)
