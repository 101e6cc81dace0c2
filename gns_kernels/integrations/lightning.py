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
micro-batches are the samples). Refused with a RuntimeError naming the alternative:
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
micro-batch); Lightning's sampler decides the order and its resume position (the
coordinator's ``batch_sampler`` is not used). It refuses Lightning LR schedulers (the
coordinator scales the lr; pass ``lr_schedule=`` instead), manual optimization and more
than one optimizer.

Checkpoint: the callback's ``state_dict`` holds every rank's coordinator state (gathered
to rank 0, which Lightning writes) and each rank takes its own on resume (another world
size: as ``AdaptiveBatching.load_state_dict``, the pool restarts with a warning).
"""
from __future__ import annotations

from typing import Any, Optional

from ._common import missing, rank_world, scalars

try:
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - the standalone package
    try:
        from pytorch_lightning.callbacks import Callback as _Callback  # type: ignore
    except ImportError as exc:
        raise missing("lightning", "lightning", "gns_kernels.integrations.lightning") from exc

__all__ = ["GNSCallback"]


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
            tp = getattr(strategy, "_tensor_parallel_size", 1)
            if tp not in (1, "auto") or (tp == "auto" and trainer.world_size != getattr(
                    strategy, "_data_parallel_size", trainer.world_size)):
                raise RuntimeError(f"GNSCallback: ModelParallelStrategy with tensor_parallel_size={tp}; "
                                   "only data parallelism (FSDP2, tensor_parallel_size=1) is supported")
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
        self.coord = AdaptiveBatching(model, trainer.optimizers, world_size=trainer.world_size,
                                      rank=trainer.global_rank, **self.kw)
        if self._pending is not None:
            self._load(self._pending)
            self._pending = None
        self._count = 0
        self._take_over(trainer)
        if self.coord.kind == "fsdp":
            self._route_through_root(trainer)
        trainer.accumulate_grad_batches = self.coord.accum_steps

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
            return cb._count < cb.coord.accum_steps

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
        if self.coord.kind == "fsdp":   # Lightning's block_backward_sync is DDP's no_sync only
            pl_module.set_requires_gradient_sync(self._count >= A)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.coord is None or self._count < self.coord.accum_steps:
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
        return {"version": 1, "ranks": shares, "count": self._count}

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
        shares = state["ranks"]
        r = self.coord.rank
        self.coord.load_state_dict(shares[r] if len(shares) == self.coord.world_size else shares[0])
