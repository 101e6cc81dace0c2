"""The training loop of one demo rank: `Trainer` builds the model, DDP with the GNS hook,
the optimizers and one `gk.AdaptiveBatching` coordinator (batch size, LR multiplier and
schedule, data stream), optionally resumes from a checkpoint, then runs optimizer steps
until the sample budget (or --steps / --stop-at-step) is reached, writing metrics.csv,
checkpoint.pt and (at the end) summary.json on rank 0.

The loop is the package's public one (README, "Adaptive batching in your own loop"):
``coord.micro_batches(loader, ddp)`` yields the step's A micro-batches of the fixed size b
(all but the last under ``ddp.no_sync()``), each loss divided by ``coord.accum_steps``;
then every optimizer steps and ``coord.step()`` ends the step. The GNS is measured by a
``gk.GNSHookState`` registered as DDP's comm hook (ranks are the samples) or, on one rank,
a ``gk.MicroBatchGNS`` (the micro-batches are the samples).

Requires an initialised torch.distributed process group (see launch.py).
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from .checkpoint import CHECKPOINT, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import COMPOSITES, METRIC_COLUMNS, DemoConfig
from .progress import Progress, fmt


def build_model(cfg: DemoConfig):
    """The run's ByteTransformer (vocab 256, cfg's shape), on the CPU, freshly initialised
    from the global torch RNG (seed it first for a reproducible start)."""
    from .model import ByteTransformer

    return ByteTransformer(vocab=256, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
                           mlp_hidden=cfg.mlp, context=cfg.context)


def lr_schedule(cfg: DemoConfig):
    """The run's LR schedule factor as a function of SAMPLES seen: warm-up (cfg.lr_warmup of
    the budget cfg.samples) + cosine down to cfg.lr_min_ratio, times cfg.lr_scale (x the
    base lr; `gk.AdaptiveBatching` multiplies in the batch's sqrt(B / B_0))."""
    import gns_kernels as gk

    budget = cfg.samples
    warmup = cfg.lr_warmup * budget

    def schedule(samples: int) -> float:
        """Warm-up + cosine over SAMPLES seen, times cfg.lr_scale (x the base lr)."""
        return cfg.lr_scale * gk.warmup_cosine(samples, budget, warmup, cfg.lr_min_ratio)
    return schedule


def build_optimizers(cfg: DemoConfig, model):
    """(optimizers, measured): the optimizer(s) of cfg.optimizer and the parameters the GNS
    is measured on (the 2-D hidden weights for the composites muon/specsgd, None = all)."""
    import gns_kernels as gk

    lr = cfg.resolved_lr()
    name = cfg.optimizer
    if name in COMPOSITES:
        hidden, other = model.hidden_matrices(), model.other_parameters()
        if name == "muon":
            main = torch.optim.Muon(hidden, lr=lr, momentum=0.95, weight_decay=0.0)
        else:
            main = gk.SpecSGD(hidden, lr=lr, momentum=0.95)
        aux = torch.optim.AdamW(other, lr=cfg.adam_lr, betas=(0.9, 0.95), weight_decay=0.0)
        return [main, aux], hidden
    params = list(model.parameters())
    if name == "signum":
        opt = gk.Signum(params, lr=lr, momentum=0.9)
    elif name == "signsgd":
        opt = gk.SignSGD(params, lr=lr)
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    elif name == "sgd":
        opt = torch.optim.SGD(params, lr=lr)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    return [opt], None


def _number(x: float) -> float | None:
    """None for the nan that coord.metrics() reports for a value it does not have yet."""
    return None if math.isnan(x) else x


class Trainer:
    """One rank of a demo run. `run()` trains; rank 0 writes the run folder."""

    def __init__(self, cfg: DemoConfig, corpus, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader

        import gns_kernels as gk
        from .data import TokenWindows

        self.cfg, self.corpus, self.device = cfg, corpus, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.geometry = cfg.resolved_geometry()
        self.theta = cfg.resolved_theta()
        B0, b = cfg.initial_batch_size, cfg.micro_batch_size()

        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg).to(device)
        self.optimizers, measured = build_optimizers(cfg, self.model)
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

        self.train_set = TokenWindows(corpus.train, cfg.context)
        self.val_set = TokenWindows(corpus.val, cfg.context)
        self.my_val = self.val_set.evenly_spaced(cfg.val_windows)[self.rank::self.world]

        if self.world == 1:   # one rank: the micro-batches are the samples
            self.gns = gk.MicroBatchGNS(
                measured if measured is not None else list(self.model.parameters()),
                geometry=self.geometry, every=cfg.every, batch_size=B0, micro_batches=B0 // b,
                bias_correction=cfg.bias_correction)
        else:
            self.gns = gk.GNSHookState(geometry=self.geometry, every=cfg.every, batch_size=B0,
                                       params=measured, bias_correction=cfg.bias_correction)
        self.ddp.register_comm_hook(self.gns, gk.ddp_gns_hook)

        self.budget = cfg.samples
        self.coord = gk.AdaptiveBatching(
            self.gns, self.optimizers, micro_batch_size=b, initial_batch_size=B0,
            max_batch_size=(cfg.max_batch_size if cfg.adaptive else B0), theta=self.theta,
            warmup_steps=cfg.resolved_warmup(), lr_scaling="sqrt", lr_schedule=lr_schedule(cfg),
            world_size=self.world, rank=self.rank)
        sampler = self.coord.batch_sampler(len(self.train_set), shuffle=True, seed=cfg.seed)
        # one micro-batch of b windows per item; its own generator, so that starting a pass
        # leaves the global torch RNG (checkpointed) alone
        self.loader = DataLoader(self.train_set, batch_sampler=sampler,
                                 generator=torch.Generator())

        self.elapsed_before = 0.0
        self.best_val = math.inf
        self.last_val = None
        self.last_B = self.coord.batch_size
        self.metrics_path = os.path.join(cfg.out, "metrics.csv")
        self.ckpt_path = os.path.join(cfg.out, CHECKPOINT)
        self.resumed = False
        self.t0 = time.time()

    # -- checkpoints ---------------------------------------------------------------------
    def resume(self, path: str) -> None:
        """Load every state of checkpoint `path`; rank 0 keeps the metrics rows it covers."""
        ck = load_checkpoint(path, map_location=self.device)  # checked by check_belongs first
        self.model.load_state_dict(ck["model"])
        for o, sd in zip(self.optimizers, ck["optimizers"]):
            o.load_state_dict(sd)
        # one per rank: each holds its hook state's share of the noise pool
        self.coord.load_state_dict(ck["coord"][self.rank])
        set_rng_state(ck["rng"][self.rank])
        self.elapsed_before = ck["elapsed"]
        self.best_val = ck["best_val"]
        self.last_B = self.coord.batch_size
        self.resumed = True
        if self.is_main:
            with open(self.metrics_path, newline="") as fh:
                rows = [r for r in csv.DictReader(fh) if int(r["step"]) < self.coord.current_step]
            self._write_rows(rows)

    def _write_rows(self, rows: list[dict]) -> None:
        with open(self.metrics_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=METRIC_COLUMNS, restval="")
            w.writeheader()
            w.writerows(rows)

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t0

    def save(self) -> None:
        """Collective: gathers every rank's RNG state and coordinator state (its hook
        state's share of the noise pool differs per rank); rank 0 writes checkpoint.pt."""
        rngs = [None] * self.world
        dist.all_gather_object(rngs, rng_state())
        coords = [None] * self.world
        dist.all_gather_object(coords, self.coord.state_dict())
        if self.is_main:
            ck = {"model": self.model.state_dict(),
                  "optimizers": [o.state_dict() for o in self.optimizers],
                  "coord": coords, "rng": rngs, "step": self.coord.current_step,
                  "elapsed": self.elapsed(), "best_val": self.best_val, "config": asdict(self.cfg)}
            save_checkpoint(ck, self.ckpt_path)

    # -- one step ------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Mean validation loss (nats per byte) over every rank's share of the windows."""
        with torch.no_grad():
            x, y = self.val_set.batch(self.my_val)
            logits = self.model(x.to(self.device))
            loss_sum = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.to(self.device).reshape(-1), reduction="sum")
            t = torch.stack([loss_sum.double().cpu(),
                             torch.tensor(float(y.numel()), dtype=torch.float64)]).to(self.device)
        dist.all_reduce(t)
        return (t[0] / t[1]).item()

    def train_step(self) -> tuple[dict, bool]:
        """One optimizer step; returns (its metrics.csv row {column: value}, whether it is
        the last step)."""
        cfg, coord = self.cfg, self.coord
        self.last_B = coord.batch_size
        lr_used = self.optimizers[0].param_groups[0]["lr"]
        loss_local = 0.0
        for (x, y), sync in coord.micro_batches(self.loader, self.ddp):
            with sync:   # ddp.no_sync() on all but the last micro-batch
                loss = self.ddp(x.to(self.device), y.to(self.device)) / coord.accum_steps
                loss.backward()
            loss_local += loss.item()
        for o in self.optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        coord.step()
        m = coord.metrics()

        tl = torch.tensor([loss_local], dtype=torch.float64, device=self.device)
        dist.all_reduce(tl)
        train_loss = tl.item() / self.world
        val_loss = None
        step = m["step"]
        last_step = (coord.samples_seen + coord.batch_size > self.budget or
                     (cfg.steps is not None and step + 1 >= cfg.steps))
        if step % cfg.eval_every == 0 or last_step:
            val_loss = self.last_val = self.evaluate()
            self.best_val = min(self.best_val, val_loss)
        measured = m["measured"]   # the estimate of this step reached the controller
        row = dict(step=step, samples=m["samples_seen"], lr=lr_used, batch_size=m["batch_size"],
                   gns_raw=m["gns"] if m["valid"] else None, gns_ema=_number(m["gns_ema"]),
                   train_loss=train_loss, val_loss=val_loss, lr_multiplier=m["lr_multiplier"],
                   accum_steps=m["accum_steps"], micro_batch=m["micro_batch_size"],
                   elapsed_s=self.elapsed(), noise=m["noise"] if measured else None,
                   noise_pooled=m["noise_pooled"] if measured else None,
                   signal=m["signal"] if measured else None)
        return row, last_step

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        """Train until the budget, --steps or --stop-at-step; rank 0 writes metrics.csv,
        checkpoints and summary.json (or interrupted.json). Collective."""
        cfg, coord = self.cfg, self.coord
        if not self.resumed and self.is_main:
            self._write_rows([])
        bar = Progress(self.budget, enabled=self.is_main and not cfg.quiet,
                       start_samples=coord.samples_seen)
        self.t0 = time.time()
        csv_fh = open(self.metrics_path, "a", newline="") if self.is_main else None
        stopped_early = False
        try:
            writer = csv.writer(csv_fh) if self.is_main else None
            for _ in coord.steps(max_samples=self.budget, max_steps=cfg.steps):
                row, last_step = self.train_step()
                if self.is_main:
                    writer.writerow([fmt(row[c]) for c in METRIC_COLUMNS])
                    bar.update(row["step"], row["samples"], row["samples"] * cfg.context,
                               row["train_loss"], row["batch_size"], row["gns_ema"], row["lr"])
                done = coord.current_step
                if done % cfg.checkpoint_every == 0 or last_step:
                    self._checkpoint(csv_fh)
                if cfg.stop_at_step is not None and done >= cfg.stop_at_step and not last_step:
                    stopped_early = True
                    if done % cfg.checkpoint_every:
                        self._checkpoint(csv_fh)
                    break
        finally:
            if self.is_main:
                csv_fh.close()
                bar.close()
        if stopped_early:
            if self.is_main:
                with open(os.path.join(cfg.out, "interrupted.json"), "w") as fh:
                    json.dump({"stopped_after_steps": coord.current_step,
                               "samples": coord.samples_seen}, fh)
                if not cfg.quiet:
                    print(f"stopped after step {coord.current_step} (--stop-at-step); resume "
                          f"with --resume {cfg.out}")
        elif self.is_main:
            from .summary import finish
            finish(cfg, coord.current_step, coord.samples_seen, self.last_val, self.best_val,
                   coord.controller, self.last_B, self.geometry, self.theta, self.elapsed(),
                   self.corpus)
        dist.barrier()  # summary.json exists before any rank returns (torchrun --compare)

    def _checkpoint(self, csv_fh) -> None:
        if self.is_main:
            csv_fh.flush()
        self.save()


def train(cfg: DemoConfig, corpus, device, resume_from: str | None) -> None:
    """One rank's whole run (the process group must exist)."""
    trainer = Trainer(cfg, corpus, device)
    if resume_from is not None:
        trainer.resume(resume_from)
    trainer.run()
