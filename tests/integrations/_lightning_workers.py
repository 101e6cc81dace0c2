"""Rank-side code of the Lightning tests (in the spawned gloo processes; the process group
exists, so Lightning's DDP strategy joins it instead of launching processes)."""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def _env(rank, world):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")


def _data(n=1024):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 12, generator=g)
    y = (x @ torch.randn(12, 4, generator=g) + 2.0 * torch.randn(n, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _module(fsdp=False, sched=False, tp=False):
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
            self.losses, self.sizes, self.seen = [], [], []

        def configure_model(self):
            if tp:  # tensor parallelism over the strategy's tp mesh, then FSDP2 over dp
                from torch.distributed.fsdp import fully_shard
                from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                               parallelize_module)
                mesh = self.device_mesh
                parallelize_module(self.net, mesh["tensor_parallel"],
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
                dp = mesh["data_parallel"]
                fully_shard(self.net[0], mesh=dp); fully_shard(self.net[2], mesh=dp); fully_shard(self, mesh=dp)
            elif fsdp:
                from torch.distributed.fsdp import fully_shard
                fully_shard(self.net[0]); fully_shard(self.net[2]); fully_shard(self)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.sizes.append(x.shape[0])
            self.seen.append(float(x.double().sum()))   # which micro-batch this was
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            if sched:
                return [opt], [torch.optim.lr_scheduler.StepLR(opt, 10)]
            return opt

    return Net()


def _trainer(strategy, callbacks, folder, max_steps, world, checkpointing=False):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy,
                     callbacks=callbacks, max_steps=max_steps, logger=False,
                     enable_checkpointing=checkpointing, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=folder, log_every_n_steps=1,
                     use_distributed_sampler=True)


def _params(model):
    """This rank's weights (its shards under FSDP2)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in model.state_dict().items()}


_PACKAGE = ("GNSCallback", "AdaptiveBatching", "MicroBatchGNS", "GNSHookState", "FSDPGNS",
            "gns_kernels", "coord.")


def _ours(caught):
    """The package's warnings among those caught (Lightning's own are left out)."""
    return [str(w.message) for w in caught if any(k in str(w.message) for k in _PACKAGE)]


def fit(rank, world, folder, strategy="ddp", steps=8, resume=False, stop=5):
    """`steps` optimizer steps (with resume: a ModelCheckpoint at step `stop`, then a new
    Trainer resumed from it through ckpt_path to `steps`): what the module saw, the
    logged metrics, the coordinator's state and weights of both runs."""
    from gns_kernels.integrations.lightning import GNSCallback

    _env(rank, world)

    dp = world // 2 if strategy == "tp" else world   # the data-parallel ranks (tp: 2 per dp rank)

    def strat():
        if strategy in ("fsdp", "tp"):
            from lightning.pytorch.strategies import ModelParallelStrategy
            return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=world // dp)
        return strategy

    def callback():
        return GNSCallback(micro_batch_size=4, initial_batch_size=8 * dp,
                           max_batch_size=64 * dp, every=2, geometry="l1")

    logged, before = [], []

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Spy(L.Callback):  # what the callback logged this step
        def on_train_batch_end(self, trainer, pl_module, *a):
            k = trainer.callback_metrics.get("gns/step")
            if k is not None and (not logged or logged[-1]["gns/step"] != float(k)):
                logged.append({k: float(v) for k, v in trainer.callback_metrics.items()
                               if k.startswith("gns/")})
            if trainer.global_step == stop and not before:
                before.append(len(pl_module.seen))   # micro-batches before the checkpoint

    gns = callback()
    model = _module(fsdp=(strategy == "fsdp"), tp=(strategy == "tp"))
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    extra = [ModelCheckpoint(dirpath=folder, every_n_train_steps=stop, save_top_k=-1,
                             filename="gns-{step}")] if resume else []
    trainer = _trainer(strat(), [gns, Spy()] + extra, folder, steps, world, checkpointing=resume)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    coord = gns.coord
    out = {"sizes": model.sizes, "logged": logged, "global_step": trainer.global_step,
           "coord_step": coord.current_step, "batch": coord.batch_size,
           "accum": coord.accum_steps, "state": coord.state_dict(), "seen": model.seen,
           "params": _params(model),
           "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
           "warnings": _ours(caught)}
    if resume:  # a new Trainer from the step-`stop` checkpoint: the callback restores every rank's state
        _env(rank, world)   # Lightning's teardown removed them
        gns2 = callback()
        model2 = _module(fsdp=(strategy == "fsdp"), tp=(strategy == "tp"))
        trainer2 = _trainer(strat(), [gns2], folder, steps, world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer2.fit(model2, loader, ckpt_path=os.path.join(folder, f"gns-step={stop}.ckpt"))
        out.update(before=before[0], resumed_seen=model2.seen, resumed_params=_params(model2),
                   resumed_state=gns2.coord.state_dict(), resumed_warnings=_ours(caught),
                   resumed_pool_keys=sorted(map(str, gns2.coord.state.pool.keys())))
    return out


def refused(rank, world, folder, what):
    from gns_kernels.integrations.lightning import GNSCallback

    _env(rank, world)
    gns = GNSCallback(micro_batch_size=4, initial_batch_size=8 * world, geometry="l1")
    strat = "ddp"
    if what == "fsdp1":
        from lightning.pytorch.strategies import FSDPStrategy
        strat = FSDPStrategy()
    trainer = _trainer(strat, [gns], folder, 2, world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_module(sched=(what == "sched")), DataLoader(_data(64), batch_size=4))
    except Exception as exc:
        return str(exc)
    return None
