"""Rank-side code of the torchtitan tests, run by torchtitan's own Trainer machinery on CPU.

torchtitan 0.3.0's Trainer needs an accelerator as shipped; three things are patched here,
and only here (test code), before torchtitan's modules are imported:

- ``torchtitan.tools.utils.device_type`` / ``device_module``: it falls back to "cuda" when
  no accelerator is found, and ``Trainer.__init__`` calls ``torch.cuda.set_device``
  (AttributeError ``_cuda_setDevice`` on a CPU torch). Replaced by "cpu" and a small
  module with the calls the Trainer and its memory monitor make (no-ops, the machine's
  memory as capacity).
- ``torch.distributed.set_timeout``: ``Trainer.train`` calls it after the first step
  (torchtitan targets a newer torch; torch 2.13.0 has no such function). A no-op.
- FSDP2's reduce op: torchtitan sets ``gradient_divide_factor=1.0`` (it normalizes by the
  global token count itself), which FSDP2 turns into ``PREMUL_SUM(1.0)``, and gloo has no
  PREMUL_SUM ("Cannot use ReduceOp.PREMUL_SUM with Gloo", with or without gns_kernels).
  ``gloo_sum`` sets ``force_sum_reduction_for_comms`` on the FSDP modules after the
  Trainer is built: SUM then x 1, the same numbers. (On NCCL the hook meets PREMUL_SUM,
  its branch untested here: docs/fsdp.md.)
- ``parallelism.spmd_backend="partial_dtensor"``: the default "spmd_types" passes
  ``dp_mesh_dims`` to ``fully_shard``, which torch 2.13's refuses for plain parameters.
- attention: FlexAttention (the only language-model backend besides varlen) has no
  backward on CPU; the debug model's attention is switched to torchtitan's own
  ``ScaledDotProductAttention`` through the config tree (causal, RoPE from positions).

Everything else (FSDP2 through torchtitan's parallelize_fn, its optimizers, LR schedulers,
loss, checkpointer over DCP, MetricsProcessor, train loop) is torchtitan's. The data is a
synthetic stateful loader (no tokenizer or dataset download)."""
from __future__ import annotations

import os
import types

import torch


def patch_cpu() -> None:
    import torch.distributed as dist
    import torchtitan.tools.utils as tu

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tu.device_type = "cpu"
    tu.device_module = types.SimpleNamespace(
        set_device=lambda d: None, current_device=lambda: 0, device_count=lambda: 1,
        get_device_name=lambda d=None: "cpu", empty_cache=lambda: None,
        synchronize=lambda *a: None, is_available=lambda: True,
        get_device_properties=lambda d=None: types.SimpleNamespace(total_memory=mem),
        reset_peak_memory_stats=lambda *a: None, memory_stats=lambda *a: {})
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None


def gloo_sum(trainer) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in trainer.model_parts[0].modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _components():
    from dataclasses import dataclass

    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class Tok(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab: int = 2048

        def __init__(self, config, **kw):
            super().__init__()
            self.vocab = config.vocab

        def encode(self, *a, **k):
            return []

        def decode(self, *a, **k):
            return ""

        def get_vocab_size(self):
            return self.vocab

    class Data(BaseDataLoader):
        """Micro-batch i of rank r: fixed random tokens from seed (r, i); the state is i,
        under a per-rank key (as torchtitan's own loader keys dp_rank_{r})."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab: int = 2048
            pad_rank1: int = 0     # label positions of rank 1 set to IGNORE_INDEX

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **kw):
            self.r, self.n, self.cfg = dp_rank, 0, config
            self.b, self.T, self.V = local_batch_size, seq_len, config.vocab

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(1000 * self.r + self.n)
                x = torch.randint(0, self.V, (self.b, self.T + 1), generator=g)
                self.n += 1
                labels = x[:, 1:].clone()
                if self.r == 1 and self.cfg.pad_rank1:
                    labels[:, -self.cfg.pad_rank1:] = -100
                pos = torch.arange(self.T).expand(self.b, self.T).contiguous()
                yield {"input": x[:, :-1], "positions": pos}, labels

        def state_dict(self):
            return {f"dp_rank_{self.r}": self.n}

        def load_state_dict(self, sd):
            self.n = sd.get(f"dp_rank_{self.r}", self.n)

    return Tok, Data


def config(folder, steps=4, load_step=-1, gns=True, **gns_kw):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from gns_kernels.integrations.torchtitan import GNS, GNSTrainer

    Tok, Data = _components()
    base = llama3_debugmodel()
    base.model_spec = model_registry("debugmodel")
    for _fqn, _c, parent, attr in base.model_spec.model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    base.loss = base.loss.loss_fn   # the plain CrossEntropyLoss: GNSTrainer refuses ChunkedLossWrapper
    base.tokenizer = Tok.Config()
    base.dataloader = Data.Config()
    base.training.seq_len, base.training.local_batch_size = 16, 2
    base.training.global_batch_size, base.training.steps = 8, steps
    base.training.disable_cuda_graphs = True
    base.parallelism.spmd_backend = "partial_dtensor"   # "spmd_types" (default) needs a newer fully_shard
    base.validator.enable = False
    base.compile.enable = False
    base.activation_checkpoint = None
    base.debug.seed = 0
    base.dump_folder = folder
    base.checkpoint.enable, base.checkpoint.interval = True, 2
    base.checkpoint.load_step = load_step
    base.metrics.log_freq = 1
    kw = dict(every=1, theta=0.05, max_batch_size=16)
    kw.update(gns_kw)
    return GNSTrainer.from_config(base, GNS.Config(enable=gns, **kw))


def _local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def fit(rank, world, folder):
    """4 steps with checkpoints at 2 and 4; then a fresh trainer loads step 2 and runs to 4."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    patch_cpu()
    logged = []

    def run(load_step):
        t = config(folder, load_step=load_step).build()
        gloo_sum(t)
        inner = t.metrics_processor.log

        def spy(step, avg, mx, gn, extra_metrics=None):
            logged.append((step, dict(extra_metrics or {})))
            return inner(step, avg, mx, gn, extra_metrics=extra_metrics)

        t.metrics_processor.log = spy
        t.train()
        out = {"history": t.gns_history, "step": t.step, "model": type(t.model_parts[0]).__name__,
               "params": {n: _local(p) for n, p in t.model_parts[0].named_parameters()},
               "lr": [g["lr"] for g in t.optimizers.optimizers[0].param_groups],
               "data_n": t.dataloader.n}
        t.close()
        return out

    chunked = config(folder)
    chunked.loss = __import__("torchtitan.components.loss", fromlist=["x"]).ChunkedLossWrapper.Config(
        loss_fn=chunked.loss)
    try:
        chunked.build()
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    first = run(-1)
    first["logged"] = list(logged)
    first["refusal"] = refusal
    second = run(2)
    return {"first": first, "second": second}


def fit_hsdp(rank, world, folder):
    """HSDP: data_parallel_replicate_degree 2 x data_parallel_shard_degree world / 2, three
    steps (no checkpoint): the GNS over all world ranks, the batch growing."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    patch_cpu()
    cfg = config(folder, steps=3)
    cfg.checkpoint.enable = False
    cfg.parallelism.data_parallel_replicate_degree = 2
    cfg.parallelism.data_parallel_shard_degree = world // 2
    cfg.training.global_batch_size = 2 * world   # local_batch_size 2 on every rank
    cfg.gns.max_batch_size = 4 * world
    t = cfg.build()
    gloo_sum(t)
    t.train()
    h = t.coord.fsdp_handle
    out = {"history": t.gns_history, "hsdp": h.mesh.hsdp, "dp": (h.dp_size, h.dp_rank),
           "replicate": h.mesh.replicate_size, "data_n": t.dataloader.n}
    t.close()
    return out


def _same_weights(model) -> None:
    """Weights that do not depend on the parallelism (torchtitan's initialization draws
    them differently under tensor parallelism): each parameter from a generator seeded by
    its name, loaded as a full state dict into however the model is sharded."""
    import zlib

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = {}
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full[name] = (torch.ones(p.shape) if name.endswith("norm.weight")
                      else 0.02 * torch.randn(p.shape, generator=g)).to(p.dtype)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def fit_tp(rank, world, folder, tp=2, resume=False, replicate=1):
    """FSDP2 x tensor parallelism: data_parallel_shard_degree world / tp x
    tensor_parallel_degree tp, three steps: the GNS over the world / tp data-parallel ranks,
    the batch growing. tp=1: the same run without tensor parallelism (the data depends on
    the data-parallel rank only). resume: a checkpoint at step 2, and a second trainer that
    loads it and runs step 3 (its history and coordinator state returned)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    patch_cpu()
    out = _fit_tp(rank, world, folder, tp, load_step=-1, checkpoint=resume, replicate=replicate)
    if resume:
        again = _fit_tp(rank, world, folder, tp, load_step=2, checkpoint=True, replicate=replicate)
        out.update(resumed_history=again["history"], resumed_state=again["state"])
    return out


def _fit_tp(rank, world, folder, tp, load_step, checkpoint, replicate=1):
    cfg = config(folder, steps=3, load_step=load_step)
    cfg.checkpoint.enable = checkpoint
    cfg.parallelism.data_parallel_replicate_degree = replicate   # > 1: HSDP x TP
    cfg.parallelism.data_parallel_shard_degree = world // (tp * replicate)
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.training.global_batch_size = 2 * (world // tp)   # local_batch_size 2 on every dp rank
    cfg.gns.max_batch_size = 4 * (world // tp)
    # float32 compute: under bf16 the tp and the plain run round differently (measured: the
    # l1 noise 4e-4 apart), which would hide what the comparison checks
    cfg.training.mixed_precision_param = "float32"
    t = cfg.build()
    gloo_sum(t)
    _same_weights(t.model_parts[0])
    t.train()
    h = t.coord.fsdp_handle
    out = {"history": t.gns_history, "tp": (h.mesh.tp_size, h.mesh.tp_rank), "dp": (h.dp_size, h.dp_rank),
           "state": t.coord.state_dict(),
           "tp_mesh": h.mesh.tp, "hsdp": h.mesh.hsdp,
           "data_n": t.dataloader.n}
    t.close()
    return out


def refused(rank, world, folder, what):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    patch_cpu()
    cfg = config(folder)
    if what == "cudagraphs":
        cfg.training.disable_cuda_graphs = False
    try:
        cfg.build()
    except ValueError as exc:
        return str(exc)
    return None
