"""Lightning: ``GNSCallback``, the GNS measured, logged and turned into the batch size
inside a Lightning ``Trainer``. What the user adds::

    from gns_kernels.integrations.lightning import GNSCallback
    gns = GNSCallback(micro_batch_size=b, initial_batch_size=64, max_batch_size=1024)
    trainer = L.Trainer(strategy="ddp", callbacks=[gns])   # DataLoader(batch_size=b) as usual
    trainer.fit(model, loader)

Strategies: ``"ddp"`` (and ``"ddp_spawn"`` etc., any ``DDPStrategy``: the comm hook is
registered on Lightning's DDP model), ``ModelParallelStrategy`` with
``tensor_parallel_size=1`` (FSDP2: ``fully_shard`` the children and then the
LightningModule itself in ``configure_model``; the hook is attached with
``attach_fsdp_gns`` to the LightningModule, the FSDP2 root) and one device (the
micro-batches are the samples: ``MicroBatchGNS.micro_step()`` after each backward, in
``on_after_backward``). Refused with a RuntimeError naming the alternative:
Lightning's ``FSDPStrategy`` (FSDP1; its flat parameters hide the per-parameter gradients
the hook reads), tensor parallelism, a LightningModule that is not an FSDP2 module.

FSDP2 needs two more changes, both made by the callback: the first A_k - 1 micro-batches
run with ``set_requires_gradient_sync(False)`` (Lightning's ``block_backward_sync`` is
DDP's ``no_sync`` only), and ``training_step`` is routed through the LightningModule's
``__call__`` (Lightning's own forward redirection, which it uses for its DDP/FSDP1
wrappers). Without the second, ModelParallelStrategy calls ``training_step`` directly,
the FSDP2 root's forward never runs, every ``fully_shard``-ed child initializes as a root
of its own, and each one ends the backward on its own: the hook counted 2 synchronized
backward passes per step (with two units), which is why FSDP2 was refused before; the
no-sync itself worked.

What it changes in the Trainer, at ``on_train_start``: it builds ``gk.AdaptiveBatching``
on the strategy's model and the Trainer's optimizer, and takes over the accumulation:

- Lightning steps the optimizer when its per-epoch batch counter is a multiple of
  ``accumulate_grad_batches`` (and on an epoch's last batch), zeroes the gradients when
  the batch index is, and divides the loss by it. So a new A can only take effect at a
  multiple of itself; Algorithm 1 changes A after any step. The callback therefore
  replaces the epoch loop's accumulation decision (``_should_accumulate``) and the
  automatic optimization's zero-grad rule by its own count of A_k micro-batches per step
  (a step may span the end of an epoch; no short last step), sets
  ``trainer.accumulate_grad_batches = A_k`` at each step's first micro-batch (Lightning
  divides the loss by it: keep returning the micro-batch's mean loss); Lightning's DDP
  strategy then runs the first A_k - 1 under ``no_sync()`` by itself. These are Lightning
  internals of 2.x (tested on 2.6); another major version may need an update.
- After each optimizer step it calls ``coord.step()``, which sets the next A and every
  param group's lr (x sqrt(B / B_0)), and logs ``coord.metrics()`` through
  ``pl_module.log_dict`` (finite numbers under ``gns/``, on step).

What it does not change: the data. Keep your DataLoader with ``batch_size=b`` (the
micro-batch); Lightning's sampler decides the order (the coordinator's ``batch_sampler``
is not used). It refuses Lightning LR schedulers (the coordinator scales the lr; pass
``lr_schedule=`` instead), manual optimization and more than one optimizer.

Checkpoint: the callback's ``state_dict`` holds every rank's coordinator state (gathered
to rank 0, which Lightning writes) and each rank takes its own on resume (another world
size: as ``AdaptiveBatching.load_state_dict``, the pool restarts with a warning); also the
data position (Lightning's epoch and its micro-batches done) and the param groups'
scheduled lr (an optimizer restored through torch.distributed.checkpoint, FSDP2, gets
back only the keys a fresh optimizer has). Resume (``ckpt_path=``) from a checkpoint
written during fit (``ModelCheckpoint``) continues the uninterrupted run exactly when the
loader's order depends on the epoch alone (a ``DistributedSampler``, which
``strategy="ddp"`` puts in; tested bit-exact on DDP, FSDP2 and one device): Lightning
restarts a plain DataLoader's epoch at its first batch while counting the micro-batches
done as consumed, so the callback rebuilds the epoch's iterator and draws and drops them
(a stateful loader, with ``state_dict``, is left to Lightning's own restore). Where that
cannot be exact the resume warns, naming why: a ``RandomSampler`` (its order comes from
the global RNG, not restored by Lightning), another sampler or an ``IterableDataset``
(unchecked), a checkpoint written after ``fit()`` stopped mid-epoch (Lightning resumes it
at the next epoch's start: the rest of that epoch is never seen), a checkpoint written
inside an optimizer step, a loader without length.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ._common import missing, rank_world, scalars, warn_user

try:
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - the standalone package
    try:
        from pytorch_lightning.callbacks import Callback as _Callback  # type: ignore
    except ImportError as exc:
        raise missing("lightning", "lightning", "gns_kernels.integrations.lightning") from exc

__all__ = ["GNSCallback"]


def _data_parallel(trainer) -> tuple:
    """(R, rank): the data-parallel size and this rank among them, as the strategy shards
    the data (``distributed_sampler_kwargs``: under ModelParallelStrategy the data-parallel
    mesh dimension, the tp ranks of one data-parallel rank reading the same data)."""
    kw = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kw.get("num_replicas", trainer.world_size)), int(kw.get("rank", trainer.global_rank))


class GNSCallback(_Callback):
    """Adaptive batch size and GNS logging for a Lightning ``Trainer`` (the module
    docstring says what it changes).

    Args:
        micro_batch_size: b, the DataLoader's ``batch_size`` (examples per micro-batch per
            rank).
        initial_batch_size: B_0 (a multiple of ranks x b).
        adapt: False measures and logs only (A stays A_0 = B_0 / (ranks x b)).
        log: log ``coord.metrics()`` through ``pl_module.log_dict``.
        prefix: the logged keys' prefix.
        **coordinator: the other ``gk.AdaptiveBatching`` arguments (max_batch_size, every,
            theta, lr_schedule, geometry, ...).

    ``callback.coord`` is the coordinator once training started.
    """

    def __init__(self, micro_batch_size: int, initial_batch_size: int, adapt: bool = True,
                 log: bool = True, prefix: str = "gns/", **coordinator: Any):
        super().__init__()
        for bad in ("world_size", "rank", "schedulers"):
            if bad in coordinator:
                raise ValueError(f"{bad}: set by the callback from the Trainer; leave it out")
        if not adapt:
            coordinator["max_batch_size"] = initial_batch_size
        self.kw = dict(micro_batch_size=micro_batch_size, initial_batch_size=initial_batch_size,
                       **coordinator)
        self.log_metrics, self.prefix = log, prefix
        self.coord = None
        self._count = 0          # micro-batches of the current step seen so far
        self._epoch = 0          # Lightning's epoch and its micro-batches done (the data
        self._epoch_batches = 0  # position a checkpoint resumes from)
        self._pending: Optional[dict] = None

    # ------------------------------------------------------------------ setup
    def _measured_model(self, trainer, pl_module):
        strategy = trainer.strategy
        names = [c.__name__ for c in type(strategy).__mro__]
        if "FSDPStrategy" in names:
            raise RuntimeError(
                "GNSCallback: Lightning's FSDPStrategy (FSDP1) is not supported: its flat "
                "parameters hide the per-parameter gradients the GNS hook reads. Use "
                "ModelParallelStrategy with fully_shard(...) in configure_model (FSDP2), or "
                "strategy='ddp'")
        if "DDPStrategy" in names:
            return strategy.model       # Lightning's DistributedDataParallel
        if "ModelParallelStrategy" in names:
            # tensor_parallel_size > 1: configure_model's parallelize_module over
            # device_mesh["tensor_parallel"], then fully_shard over device_mesh["data_parallel"];
            # the GNS samples are the data-parallel ranks (_data_parallel below)
            if not callable(getattr(pl_module, "set_requires_gradient_sync", None)):
                raise RuntimeError(
                    "GNSCallback: ModelParallelStrategy but the LightningModule is not an FSDP2 "
                    "module: call fully_shard(self) last in configure_model (after its children)")
            return pl_module            # the FSDP2 root
        if trainer.world_size != 1:
            raise RuntimeError(f"GNSCallback: strategy {type(strategy).__name__} is not supported "
                               "(use 'ddp', ModelParallelStrategy with fully_shard, or one device)")
        return pl_module

    def on_train_start(self, trainer, pl_module) -> None:
        from ..adaptive import AdaptiveBatching

        if not pl_module.automatic_optimization:
            raise RuntimeError("GNSCallback: manual optimization is not supported (the callback "
                               "counts Lightning's accumulation); use gk.AdaptiveBatching directly")
        if len(trainer.optimizers) != 1:
            raise RuntimeError(f"GNSCallback: expected one optimizer, got {len(trainer.optimizers)}")
        if trainer.lr_scheduler_configs:
            raise RuntimeError(
                "GNSCallback: configure_optimizers returned an LR scheduler; the coordinator "
                "scales the lr as the batch grows and a scheduler stepped by Lightning would "
                "fight it. Return the optimizer only and pass "
                "GNSCallback(..., lr_schedule=lambda samples: ...)")
        model = self._measured_model(trainer, pl_module)
        resumed = self._pending
        if resumed is not None:
            _restore_lr_keys(trainer.optimizers, resumed.get("lr_keys"))
        world, rank = _data_parallel(trainer)
        self.coord = AdaptiveBatching(model, trainer.optimizers, world_size=world, rank=rank, **self.kw)
        self._pending = None
        if resumed is not None:
            self._load(resumed)
        self._count = 0
        self._take_over(trainer)
        if self.coord.kind == "fsdp":
            self._route_through_root(trainer)
        trainer.accumulate_grad_batches = self.coord.accum_steps
        self._check_loader(trainer)
        if resumed is not None:
            self._resume_data(trainer, resumed)

    def _check_loader(self, trainer) -> None:
        """At fit's start, not at the epoch's end: a train DataLoader whose micro-batches are
        not b examples (its batch_size), or whose pass ends in a shorter one (drop_last=False
        and a per-rank length that b does not divide). The coordinator counts B = R x A x b,
        and a short micro-batch would be measured as an equal GNS sample."""
        loader = getattr(trainer, "train_dataloader", None)
        if not isinstance(loader, torch.utils.data.DataLoader) or loader.batch_size is None:
            return   # a batch_sampler, an iterable, a CombinedLoader: checked per micro-batch
        b = self.coord.micro_batch_size
        fix = (f"build the train DataLoader with batch_size={b} (GNSCallback's micro_batch_size) "
               "and drop_last=True")
        if loader.batch_size != b:
            raise ValueError(f"GNSCallback: the train DataLoader's batch_size is {loader.batch_size}, "
                             f"micro_batch_size is {b}: {fix}")
        try:
            n = len(loader.sampler)
        except TypeError:   # a sampler without a length
            return
        if not loader.drop_last and n % b:
            raise ValueError(
                f"GNSCallback: the train DataLoader gives each rank {n} examples per epoch, not a "
                f"multiple of micro_batch_size {b}, and drop_last=False: every epoch would end "
                f"with a micro-batch of {n % b} examples, measured as an equal sample; {fix}")

    def _route_through_root(self, trainer) -> None:
        """ModelParallelStrategy calls ``training_step`` on the LightningModule directly, so
        the FSDP2 root's forward never runs: every ``fully_shard``-ed child then initializes
        as a root of its own and ends its backward on its own, and the GNS hook counted one
        synchronized backward per such root (2 per step with two units; this is why FSDP2
        was refused before). Lightning's own forward redirection (used for its DDP/FSDP1
        wrappers) routes ``training_step`` through ``module.__call__``, so the root's hooks
        run as in a plain ``model(x)`` loop."""
        strategy = trainer.strategy
        redirect = strategy._forward_redirection

        def training_step(*args, **kwargs):
            with strategy.precision_plugin.train_step_context():
                return redirect(strategy.model, strategy.lightning_module, "training_step",
                                *args, **kwargs)

        strategy.training_step = training_step

    def _take_over(self, trainer) -> None:
        cb = self
        loop = trainer.fit_loop.epoch_loop
        auto = loop.automatic_optimization
        make_zero_grad = type(auto)._make_zero_grad_fn

        def should_accumulate() -> bool:
            # inside a step (after on_train_batch_start counted its micro-batch): not its
            # last one; between steps (count 0: Lightning asks after on_train_batch_end, and
            # at a restart) the last micro-batch stepped, so loggers' step counter
            # (_batches_that_stepped) advances once per optimizer step
            return 0 < cb._count < cb.coord.accum_steps

        def zero_grad_fn(batch_idx, optimizer):
            # Lightning's rule is batch_idx % accumulate_grad_batches == 0; index 0 asks it
            # for the zero-grad of a step's first micro-batch
            return make_zero_grad(auto, 0, optimizer) if cb._count == 1 else None

        loop._should_accumulate = should_accumulate
        auto._make_zero_grad_fn = zero_grad_fn

    # ------------------------------------------------------------------ the loop
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.coord is None:
            return
        self._count += 1
        A = self.coord.accum_steps
        if self._count == 1:
            trainer.accumulate_grad_batches = A
            self.coord.begin_step()   # frozen / removed parameters; stale gradients at the backward
        self.coord.check_micro_batch(batch, self._count - 1)
        if self.coord.kind == "fsdp":   # Lightning's block_backward_sync is DDP's no_sync only
            pl_module.set_requires_gradient_sync(self._count >= A)

    def on_after_backward(self, trainer, pl_module) -> None:
        # one device: the micro-batches are the samples, read after each one's backward (the
        # optimizer step and any gradient clipping come after this hook); under DDP and
        # FSDP2 the hooks read the synchronized backward themselves
        if self.coord is not None and self.coord.kind == "micro":
            self.coord.state.micro_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.coord is None:
            return
        # the data position a checkpoint written now resumes from: micro-batches of the epoch
        self._epoch, self._epoch_batches = trainer.current_epoch, batch_idx + 1
        if self._count < self.coord.accum_steps:
            return
        self._count = 0
        self.coord.step()
        if self.log_metrics:
            values = scalars(self.coord.metrics(), self.prefix, keep_step=True)
            if values:
                pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        if self.coord is None:
            return dict(self._pending or {})
        import torch.distributed as dist

        mine = self.coord.state_dict()
        world = rank_world()[1]
        if world > 1:
            shares: list = [None] * world
            dist.all_gather_object(shares, mine)   # Lightning writes rank 0's dict
        else:
            shares = [mine]
        return {"version": 1, "ranks": shares, "count": self._count, "epoch": self._epoch,
                "epoch_batches": self._epoch_batches,
                "lr_keys": [{k: float(g[k]) for k in _LR_KEYS if k in g}
                            for opt in self.coord.optimizers for g in opt.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if not isinstance(state_dict, dict) or state_dict.get("version") != 1 \
                or not isinstance(state_dict.get("ranks"), list) or not state_dict["ranks"]:
            raise ValueError("GNSCallback.load_state_dict: not a GNSCallback state (version 1 with "
                             "'ranks')")
        if self.coord is None:
            self._pending = state_dict
        else:
            self._load(state_dict)

    def _load(self, state: dict) -> None:
        # one share per process (state_dict gathers them all; under tensor parallelism the
        # tp ranks of a data-parallel rank hold different noise pools)
        shares = state["ranks"]
        rank, world = rank_world()
        if len(shares) == world:
            mine = shares[rank]
        elif len(shares) == self.coord.world_size:
            mine = shares[self.coord.rank]
        else:  # another world size: the coordinator's load handles it as load_state_dict does
            mine = shares[0]
        self.coord.load_state_dict(mine)
        self._epoch, self._epoch_batches = state.get("epoch", 0), state.get("epoch_batches", 0)

    # ------------------------------------------------------------------ resume
    def _resume_data(self, trainer, state: dict) -> None:
        """Put the data where the checkpoint left it, or warn why that is impossible.

        Lightning restores the position of a stateful loader (``state_dict`` /
        ``load_state_dict``) only. A plain DataLoader restarted mid-epoch starts the
        epoch's iterator from its first batch while Lightning counts the epoch's
        micro-batches done as consumed: the run would see the epoch's first micro-batches
        again and stop the epoch before its last ones. Here the iterator is rebuilt for
        the resumed epoch (sampler epoch set first: a loader with workers has already
        drawn its indices) and the n micro-batches done are drawn and dropped, so
        Lightning's count and the data agree. That repeats the interrupted run only if
        the epoch's order depends on the epoch alone (a DistributedSampler, as
        ``strategy="ddp"`` puts in, or no shuffling); other cases are warned about."""
        fit = trainer.fit_loop
        combined, fetcher = getattr(fit, "_combined_loader", None), getattr(fit, "_data_fetcher", None)
        loaders = list(getattr(combined, "flattened", None) or [])
        epoch, n = state.get("epoch"), state.get("epoch_batches")
        now = fit.epoch_progress.current.processed      # the epoch Lightning runs next
        total = trainer.num_training_batches
        why = []
        if state.get("count"):
            why.append(f"it was written inside an optimizer step ({state['count']} of its "
                       "micro-batches done; their gradients are not in a checkpoint)")
        if epoch is None or n is None:
            why.append("its GNSCallback state has no data position (written by an older "
                       "gns_kernels)")
        elif now == epoch and 0 < n < total:      # Lightning restarts this epoch mid-way
            stateful = all(callable(getattr(dl, "state_dict", None))
                           and callable(getattr(dl, "load_state_dict", None)) for dl in loaders)
            if not stateful:                      # (a stateful loader was restored by Lightning)
                if total == float("inf"):
                    why.append("the training DataLoader has no length, so its position in the "
                               "epoch cannot be restored")
                elif not loaders or getattr(fetcher, "iterator", None) is None:
                    why.append("this Lightning version's fit loop has no _combined_loader / "
                               "_data_fetcher (Lightning 2.6's), so the epoch's position cannot "
                               "be restored")
                else:
                    self._skip_micro_batches(fetcher, loaders, now, n)
        elif now > epoch and n < total:
            why.append(f"it was written at micro-batch {n} of {total} of epoch {epoch} after "
                       f"fit() had stopped there (max_steps), and Lightning resumes such a "
                       f"checkpoint at the start of epoch {now}: the {total - n} micro-batches "
                       f"left of epoch {epoch} are never trained on (a checkpoint written during "
                       "fit, ModelCheckpoint(every_n_train_steps=...), resumes mid-epoch)")
        why += [w for w in map(_order_not_repeated, loaders) if w]
        if why:
            warn_user("GNSCallback: this resume cannot repeat the interrupted run (the "
                      "coordinator's batch, EMAs and lr are restored, but the data differs): "
                      + "; ".join(why) + ". See docs/integrations.md, Lightning, 'Resume'")

    @staticmethod
    def _skip_micro_batches(fetcher, loaders, epoch: int, n: int) -> None:
        for dl in loaders:
            for obj in {id(o): o for o in (getattr(dl, "sampler", None),
                                            getattr(getattr(dl, "batch_sampler", None), "sampler", None))
                        if o is not None}.values():
                if callable(getattr(obj, "set_epoch", None)):
                    obj.set_epoch(epoch)
        iter(fetcher)                 # this epoch's iterator (Lightning's counters are kept)
        for _ in range(n):
            next(fetcher.iterator)    # drawn and dropped: the micro-batches done before the checkpoint


# the coordinator's rates kept in each param group (gk.LRMultiplier's scheduled rate, the
# lr_schedule's base): an optimizer restored through torch.distributed.checkpoint (FSDP2,
# ModelParallelStrategy) gets back only the keys a fresh optimizer has, so the callback's
# state carries them too (without them the coordinator took the restored lr, already x
# omega, as the scheduled rate: lr x omega twice, 0.009 where 0.0052 was right)
_LR_KEYS = ("scheduled_lr", "base_lr")


def _restore_lr_keys(optimizers, saved) -> None:
    groups = [g for opt in optimizers for g in opt.param_groups]
    if not isinstance(saved, list) or len(saved) != len(groups):
        return    # an older state, or other param groups: the optimizer's own keys stay
    for g, keys in zip(groups, saved):
        if isinstance(keys, dict):
            g.update({k: float(v) for k, v in keys.items() if k in _LR_KEYS})


def _order_not_repeated(loader) -> Optional[str]:
    """Why a resumed epoch of ``loader`` may not repeat the interrupted run's order (None:
    it does: its sampler is a DistributedSampler, seeded by its seed and the epoch, or a
    SequentialSampler)."""
    from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset, SequentialSampler

    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return "the training data is an IterableDataset, whose order after a resume is its own"
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return (f"the training DataLoader's batch_sampler is a {type(batch_sampler).__name__}, "
                "whose order after a resume cannot be checked")
    sampler = getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)
    if type(sampler) in (DistributedSampler, SequentialSampler):
        return None
    name = type(sampler).__name__
    if name == "RandomSampler" and getattr(sampler, "generator", None) is None:
        return ("the training DataLoader shuffles with a RandomSampler, which draws each "
                "epoch's order from the global RNG, not restored by Lightning (pass "
                "sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=s) "
                "on one device; strategy='ddp' puts one in)")
    return (f"the training DataLoader's sampler is a {name}, whose order after a resume cannot "
            "be checked (a DistributedSampler's depends on its seed and the epoch alone)")
