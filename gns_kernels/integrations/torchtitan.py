"""torchtitan (0.3): ``GNSTrainer``, a torchtitan ``Trainer`` whose batch size adapts from
the GNS measured on its FSDP2 reduce-scatters, and ``GNS``, the component whose ``Config``
sits in torchtitan's config tree (``config.gns``). What the user adds::

    from gns_kernels.integrations.torchtitan import GNS, GNSTrainer
    config = GNSTrainer.from_config(your_trainer_config, GNS.Config(max_batch_size=1024))
    trainer = config.build()               # instead of your_trainer_config.build()
    trainer.train()

How: after torchtitan's ``Trainer.__init__`` has parallelized the model (``fully_shard``),
built the optimizers, the LR schedulers and the checkpointer, ``GNSTrainer`` builds
``gk.AdaptiveBatching`` on the FSDP2 model (``attach_fsdp_gns``: the data-parallel ranks
are the GNS samples; geometry from the optimizer, AdamW -> l1), hands it to the
checkpointer as ``states["gns"] = DCPState(coord)`` (every rank's share under its own key;
torchtitan's ``checkpointer.load`` in ``train()`` restores it with the model, optimizer,
LR schedulers and data loader), and replaces ``train_step``: step k draws A_k = B_k /
(dp x local_batch_size) micro-batches from torchtitan's data iterator, runs the first
A_k - 1 under ``set_requires_gradient_sync(False)`` (torchtitan 0.3 reduce-scatters every
micro-batch; the GNS hook must see one synchronized backward per step), clips, steps the
optimizers, then ``coord.step()`` (which steps torchtitan's LR schedulers on the
un-multiplied rates and sets lr = scheduled x omega; torchtitan's own
``lr_schedulers.step()`` is not called) and logs ``coord.metrics()`` under ``gns/``
through the ``MetricsProcessor`` (``extra_metrics``) on its logging steps.

Loss normalization (torchtitan's, kept): every micro-batch's token-summed loss is divided
by the global number of valid tokens of the step (all ranks, all A_k micro-batches), and
FSDP2 sums (``gradient_divide_factor=1``). Rank j's accumulated gradient is then
(n_j / N) x (its per-token mean gradient): with equal valid tokens per rank (packed
sequences, no padding) the GNS is exact (noise and signal are both 1 / R^2 of the
per-rank-mean convention; their ratio is not); with unequal n_j the ranks are samples of
unequal weight and the GNS is that of the weighted samples (tests/integrations/
test_torchtitan.py shows the effect with ``gk.estimate``).

Meshes: FSDP2 (``data_parallel_shard_degree``), HSDP (``data_parallel_replicate_degree``
> 1 with it) and either with tensor parallelism (``tensor_parallel_degree`` > 1): the GNS samples are all R = replicate x shard data-parallel ranks (the ``batch``
mesh; the tp ranks of one are one sample), B a multiple of R x ``local_batch_size``; HSDP
needs torchtitan's default float32 reduce dtype (``training.mixed_precision_reduce``),
where the statistics ride.

What it does not do: ``ChunkedLossWrapper`` (the llama3 configs' default loss) is refused:
it runs the lm_head outside the FSDP2 root's forward, and in a test every synchronized
backward was counted twice with accumulation micro-batches still reduce-scattering that
unit; use its plain ``loss_fn``. Pipeline, context or expert parallelism,
replicate-only data parallelism and one data-parallel rank are refused; CUDA graphs are refused (the step is not a fixed graph when A
changes); ``training.steps`` counts optimizer steps, not tokens (stop by tokens with
``gns.max_samples``); the data loader's checkpoint is torchtitan's (exact with
``num_workers=0``; with workers, its ``snapshot_every_n_steps`` was computed from the
initial accumulation). torchtitan's Trainer itself needs CUDA (or another accelerator)
as shipped: on CPU the tests patch its device module (docs/integrations.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ._common import missing, scalars

try:
    from torchtitan.config import Configurable
    from torchtitan.trainer import Trainer as _Trainer
except ImportError as exc:  # pragma: no cover
    raise missing("torchtitan", "torchtitan", "gns_kernels.integrations.torchtitan") from exc

__all__ = ["GNS", "GNSTrainer"]


class GNS(Configurable):
    """The adaptive-batching component: its ``Config`` is ``GNSTrainer.Config.gns``;
    ``build(model=..., optimizers=..., ...)`` makes ``gk.AdaptiveBatching`` (``self.coord``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enable: bool = True
        """False: torchtitan's loop unchanged (fixed accumulation), nothing measured."""
        initial_batch_size: int = -1
        """B_0 in sequences (global, all ranks); -1: training.global_batch_size (or
        local_batch_size x dp when that is -1)."""
        max_batch_size: Optional[int] = None
        """Cap on B in sequences (a multiple of dp x local_batch_size), or None."""
        max_samples: Optional[int] = None
        """Stop before a step would pass this many sequences (None: training.steps only)."""
        theta: float = 0.6
        every: int = 100
        """F, measure every F optimizer steps."""
        geometry: Optional[str] = None
        """'l1', 'l2' or 'nuclear'; None: from the optimizer (AdamW -> l1)."""
        warmup_steps: int = 0
        max_growth: Optional[float] = None
        signal: Optional[str] = None
        lr_scaling: str = "sqrt"
        prefix: str = "gns/"
        """The logged metrics' prefix."""

    def __init__(self, config: "GNS.Config", *, model, optimizers, schedulers, micro_batch_size: int,
                 trainer_batch_size: int, world_size: int, rank: int):
        from ..adaptive import AdaptiveBatching

        self.config = config
        B0 = config.initial_batch_size if config.initial_batch_size > 0 else trainer_batch_size
        self.coord = AdaptiveBatching(
            model, list(optimizers), micro_batch_size=micro_batch_size, initial_batch_size=B0,
            max_batch_size=config.max_batch_size, theta=config.theta, every=config.every,
            warmup_steps=config.warmup_steps, max_growth=config.max_growth, signal=config.signal,
            lr_scaling=config.lr_scaling, geometry=config.geometry, schedulers=list(schedulers),
            world_size=world_size, rank=rank)


def _refusals(trainer) -> None:
    pd, cfg = trainer.parallel_dims, trainer.config
    for name, on in (("pipeline_parallel_degree", pd.pp_enabled),
                     ("context_parallel_degree", pd.cp_enabled), ("expert_parallel_degree", pd.ep_enabled)):
        if on:
            raise ValueError(f"parallelism.{name}: GNSTrainer supports FSDP2, HSDP and tensor "
                             "parallelism (the GNS samples are the data-parallel ranks); set it to 1")
    if not pd.dp_shard_enabled:
        raise ValueError("parallelism.data_parallel_shard_degree: GNSTrainer needs FSDP2 (or HSDP) "
                         "sharding over >= 2 ranks, where the GNS is measured (in the reduce-scatter); "
                         "with replicate-only data parallelism use DDP and gk.AdaptiveBatching in your "
                         "own loop, on one rank gk.MicroBatchGNS")
    if not cfg.training.disable_cuda_graphs:
        raise ValueError("training.disable_cuda_graphs: must be True (a step's number of "
                         "micro-batches changes, so it is not one captured graph)")
    from torchtitan.components.loss import ChunkedLossWrapper

    if isinstance(trainer.loss_fn, ChunkedLossWrapper):
        raise ValueError(
            "loss: ChunkedLossWrapper runs the lm_head inside the loss, outside the FSDP2 "
            "root's forward, so its FSDP unit backs up on its own: tested (torch 2.13, 2 gloo "
            "ranks) each synchronized backward was counted twice and the accumulation "
            "micro-batches still reduce-scattered that unit. Use the plain loss "
            "(e.g. CrossEntropyLoss.Config, the wrapper's loss_fn)")
    if len(trainer.model_parts) != 1:
        raise ValueError(f"GNSTrainer: expected one model part, got {len(trainer.model_parts)}")


class GNSTrainer(_Trainer):
    """torchtitan ``Trainer`` with adaptive batching (the module docstring). ``trainer.coord``
    is the ``gk.AdaptiveBatching``; ``trainer.gns_history`` every step's ``coord.metrics()``."""

    @dataclass(kw_only=True, slots=True)
    class Config(_Trainer.Config):
        gns: GNS.Config = field(default_factory=GNS.Config)

    @classmethod
    def from_config(cls, config: "_Trainer.Config", gns: Optional[GNS.Config] = None) -> "GNSTrainer.Config":
        """A ``GNSTrainer.Config`` with every field of a torchtitan ``Trainer.Config``."""
        from dataclasses import fields

        kw = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
        return cls.Config(**kw, gns=gns if gns is not None else GNS.Config())

    def __init__(self, config: "GNSTrainer.Config"):
        super().__init__(config)
        self.coord = None
        self.gns_history: list = []
        if not config.gns.enable:
            return
        _refusals(self)
        from .dcp import DCPState

        mesh = self.parallel_dims.get_mesh("batch")
        R, r = mesh.size(), mesh.get_local_rank()
        b = config.training.local_batch_size
        B0 = config.training.global_batch_size
        B0 = B0 if B0 > 0 else b * R
        self.gns = config.gns.build(
            model=self.model_parts[0], optimizers=self.optimizers.optimizers,
            schedulers=self.lr_schedulers.schedulers, micro_batch_size=b, trainer_batch_size=B0,
            world_size=R, rank=r)
        self.coord = self.gns.coord
        if getattr(self.checkpointer, "enable", False):
            # one share per data-parallel rank; under tensor parallelism per process (the tp
            # ranks of a data-parallel rank hold different noise-pool parts and solves), so
            # keyed by the world's rank: DCP keeps one copy of a key several ranks write
            group = None if self.parallel_dims.tp_enabled else mesh.get_group()
            self.checkpointer.states["gns"] = DCPState(self.coord, group=group)

    def should_continue_training(self) -> bool:
        c, cap = self.coord, self.config.gns.max_samples
        if c is not None and not c.fits(cap):
            return False
        return super().should_continue_training()

    def train_step(self, data_iterator):
        if self.coord is None:
            return super().train_step(data_iterator)
        import torch

        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed import utils as dist_utils

        coord, pd = self.coord, self.parallel_dims
        model = self.model_parts[0]
        self.optimizers.zero_grad(set_to_none=True)
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)
        # the step's A_k micro-batches with their sync contexts, drawn before the first
        # backward (torchtitan counts the step's valid tokens first; the FSDP2 kind does
        # nothing between yields); the generator is finished after the backward passes, so
        # its end-of-step checks (parameter coverage) see the step's gradients
        batches = coord.micro_batches(data_iterator, model)
        pairs = [next(batches) for _ in range(coord.accum_steps)]
        local_valid = torch.tensor(0, dtype=torch.int64)
        for (_, labels), _ctx in pairs:
            local_valid += (labels != IGNORE_INDEX).sum()
        global_valid = dist_utils.dist_sum_tensor(local_valid.to(self.device), pd.get_mesh("batch"))
        accumulated = None
        for (input_dict, labels), ctx in pairs:
            for key, value in input_dict.items():
                if isinstance(value, torch.Tensor):
                    input_dict[key] = value.to(self.device)
            with ctx:
                loss = self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                                  global_valid_tokens=global_valid)
            loss = loss.detach()
            accumulated = loss.clone() if accumulated is None else accumulated.add_(loss)
        for _ in batches:  # the generator's end (no more batches: A_k were drawn)
            pass
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm,
            foreach=True, pp_mesh=pd.get_optional_mesh("pp"), ep_enabled=pd.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        coord.step()         # steps the LR schedulers (not self.lr_schedulers.step())
        metrics = coord.metrics()
        self.gns_history.append(metrics)
        if not should_log:
            return
        loss_mesh = pd.get_optional_mesh("loss")
        local_avg = accumulated * global_valid / local_valid.to(accumulated.device)
        global_avg = dist_utils.dist_sum(accumulated, loss_mesh)
        global_max = dist_utils.dist_max(local_avg, loss_mesh)
        if not math.isfinite(global_avg):
            raise RuntimeError(f"Loss is not finite (global_avg_loss={global_avg}) at step {self.step}")
        extra = {**lr_metrics, **scalars(metrics, self.config.gns.prefix, keep_step=True)}
        self.metrics_processor.log(self.step, global_avg, global_max, float(grad_norm.item()),
                                   extra_metrics=extra)
