"""The training loop of one demo rank: `Trainer` builds the model, DDP with the GNS hook,
the sampler, controller, optimizers and schedules, optionally resumes from a checkpoint,
then runs optimizer steps until the sample budget (or --steps / --stop-at-step) is
reached, writing metrics.csv, checkpoint.pt and (at the end) summary.json on rank 0.

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


class Trainer:
    """One rank of a demo run. `run()` trains; rank 0 writes the run folder."""

    def __init__(self, cfg: DemoConfig, corpus, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel as DDP

        import gns_kernels as gk
        from ..distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook
        from ..lr import LRMultiplier
        from ..sampler import AdaptiveBatchSampler
        from .data import TokenWindows
        from .model import ByteTransformer

        self.cfg, self.corpus, self.device = cfg, corpus, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.geometry = cfg.resolved_geometry()
        self.theta = cfg.resolved_theta()
        B0 = cfg.initial_batch_size

        torch.manual_seed(cfg.seed)
        self.model = ByteTransformer(vocab=256, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
                                     mlp_hidden=cfg.mlp, context=cfg.context).to(device)
        self.optimizers, measured = build_optimizers(cfg, self.model)
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

        self.train_set = TokenWindows(corpus.train, cfg.context)
        self.val_set = TokenWindows(corpus.val, cfg.context)
        self.my_val = self.val_set.evenly_spaced(cfg.val_windows)[self.rank::self.world]

        self.sampler = AdaptiveBatchSampler(len(self.train_set), B0, num_replicas=self.world,
                                            rank=self.rank, max_local_batch=cfg.max_local_batch,
                                            min_accum_steps=cfg.micro_batches, seed=cfg.seed)
        self.ctrl = gk.AdaptiveBatchSize(
            initial_batch_size=B0, theta=self.theta, every=cfg.every,
            warmup_steps=cfg.resolved_warmup(),
            max_batch_size=(cfg.max_batch_size if cfg.adaptive else B0),
            multiple_of=cfg.resolved_multiple_of(), lr_scaling="sqrt")
        self.micro_gns = self.world == 1   # one rank: the micro-batches are the samples
        if self.micro_gns:
            self.hook_state = MicroBatchGNS(
                measured if measured is not None else list(self.model.parameters()),
                geometry=self.geometry, every=cfg.every, batch_size=B0,
                micro_batches=self.sampler.accum_steps, bias_correction=cfg.bias_correction)
        else:
            self.hook_state = GNSHookState(geometry=self.geometry, every=cfg.every, batch_size=B0,
                                           params=measured, bias_correction=cfg.bias_correction)
            if measured is None:  # the noise pool is checkpointed keyed by this order
                self.hook_state.bind_params(self.model.parameters())
        self.ddp.register_comm_hook(self.hook_state, ddp_gns_hook)

        self.budget = cfg.samples
        self.samples = 0   # samples seen, read by the LR schedule
        # a lambda (not a bound method), so LambdaLR's state_dict leaves it out
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda _: self._schedule())
                           for o in self.optimizers]
        self.lrm = LRMultiplier(self.optimizers, self.schedulers)

        self.step = 0
        self.elapsed_before = 0.0
        self.best_val = math.inf
        self.last_val = None
        self.last_B = self.ctrl.batch_size
        self.metrics_path = os.path.join(cfg.out, "metrics.csv")
        self.ckpt_path = os.path.join(cfg.out, CHECKPOINT)
        self.resumed = False
        self.t0 = time.time()

    def _schedule(self) -> float:
        """LambdaLR factor: warm-up + cosine over SAMPLES seen, times cfg.lr_scale."""
        from ..lr import warmup_cosine

        cfg = self.cfg
        return cfg.lr_scale * warmup_cosine(self.samples, self.budget, cfg.lr_warmup * self.budget,
                                            cfg.lr_min_ratio)

    # -- checkpoints ---------------------------------------------------------------------
    def resume(self, path: str) -> None:
        """Load every state of checkpoint `path`; rank 0 keeps the metrics rows it covers."""
        ck = load_checkpoint(path, map_location=self.device)
        self.model.load_state_dict(ck["model"])
        for o, sd in zip(self.optimizers, ck["optimizers"]):
            o.load_state_dict(sd)
        for s, sd in zip(self.schedulers, ck["schedulers"]):
            s.load_state_dict(sd)
        self.lrm.load_state_dict(ck["lr_multiplier"])
        self.ctrl.load_state_dict(ck["controller"])
        self.sampler.load_state_dict(ck["sampler"])
        hook = ck["hook"]  # one per rank (each holds its share of the noise pool)
        self.hook_state.load_state_dict(hook[self.rank] if isinstance(hook, list) else hook)
        set_rng_state(ck["rng"][self.rank])
        self.step = ck["step"]
        self.elapsed_before = ck["elapsed"]
        self.best_val = ck["best_val"]
        self.samples = self.sampler.samples_seen
        self.last_B = self.ctrl.batch_size
        self.resumed = True
        if self.is_main:
            with open(self.metrics_path, newline="") as fh:
                rows = [r for r in csv.DictReader(fh) if int(r["step"]) < self.step]
            self._write_rows(rows)

    def _write_rows(self, rows: list[dict]) -> None:
        with open(self.metrics_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=METRIC_COLUMNS, restval="")
            w.writeheader()
            w.writerows(rows)

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t0

    def save(self) -> None:
        """Collective: gathers every rank's RNG state and hook state (its share of the noise
        pool); rank 0 writes checkpoint.pt."""
        rngs = [None] * self.world
        dist.all_gather_object(rngs, rng_state())
        hooks = [None] * self.world
        dist.all_gather_object(hooks, self.hook_state.state_dict())
        if self.is_main:
            ck = {"model": self.model.state_dict(),
                  "optimizers": [o.state_dict() for o in self.optimizers],
                  "schedulers": [s.state_dict() for s in self.schedulers],
                  "lr_multiplier": self.lrm.state_dict(), "controller": self.ctrl.state_dict(),
                  "sampler": self.sampler.state_dict(), "hook": hooks,
                  "rng": rngs, "step": self.step, "elapsed": self.elapsed(),
                  "best_val": self.best_val, "config": asdict(self.cfg)}
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

    def _forward_backward(self, micro: list[list[int]]) -> float:
        """Gradient accumulation over this rank's A micro-batches (all but the last under
        no_sync); returns the sum of the A scaled losses."""
        A = len(micro)
        loss_local = 0.0
        for i, idx in enumerate(micro):
            x, y = self.train_set.batch(idx)
            x, y = x.to(self.device), y.to(self.device)
            if i < A - 1:
                with self.ddp.no_sync():
                    loss = self.ddp(x, y) / A
                    loss.backward()
            else:
                loss = self.ddp(x, y) / A
                loss.backward()
            loss_local += loss.item()
            if self.micro_gns:
                self.hook_state.micro_step()
        return loss_local

    def train_step(self) -> tuple[dict, bool]:
        """One optimizer step; returns (its metrics.csv row {column: value}, whether it is
        the last step)."""
        cfg, sampler, ctrl = self.cfg, self.sampler, self.ctrl
        B = self.last_B = ctrl.batch_size
        sampler.set_batch_size(B)
        self.hook_state.batch_size = B
        if self.micro_gns:
            self.hook_state.micro_batches = sampler.accum_steps
        lr_used = self.optimizers[0].param_groups[0]["lr"]
        micro = sampler.next_step()
        loss_local = self._forward_backward(micro)
        step = self.step
        estimate = self.hook_state.estimate if self.hook_state.estimate_step == step else None
        for o in self.optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        ctrl.update(step, estimate)
        self.samples = sampler.samples_seen
        self.lrm.step(ctrl.lr_multiplier)

        tl = torch.tensor([loss_local], dtype=torch.float64, device=self.device)
        dist.all_reduce(tl)
        train_loss = tl.item() / self.world
        val_loss = None
        last_step = (sampler.samples_seen + ctrl.batch_size > self.budget or
                     (cfg.steps is not None and step + 1 >= cfg.steps))
        if step % cfg.eval_every == 0 or last_step:
            val_loss = self.last_val = self.evaluate()
            self.best_val = min(self.best_val, val_loss)
        gns_raw = estimate.gns if (estimate is not None and estimate.valid) else None
        noise = None if estimate is None else estimate.noise
        noise_pooled = None if estimate is None else estimate.noise_pooled
        signal = None if estimate is None else estimate.signal
        row = dict(step=step, samples=sampler.samples_seen, lr=lr_used, batch_size=B,
                   gns_raw=gns_raw, gns_ema=ctrl.gns_ema, train_loss=train_loss, val_loss=val_loss,
                   lr_multiplier=self.lrm.multiplier, accum_steps=len(micro),
                   micro_batch=sampler.micro_batch_size, elapsed_s=self.elapsed(),
                   noise=noise, noise_pooled=noise_pooled, signal=signal)
        return row, last_step

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        """Train until the budget, --steps or --stop-at-step; rank 0 writes metrics.csv,
        checkpoints and summary.json (or interrupted.json). Collective."""
        cfg = self.cfg
        if not self.resumed and self.is_main:
            self._write_rows([])
        bar = Progress(self.budget, enabled=self.is_main and not cfg.quiet,
                       start_samples=self.sampler.samples_seen)
        self.t0 = time.time()
        csv_fh = open(self.metrics_path, "a", newline="") if self.is_main else None
        stopped_early = False
        try:
            writer = csv.writer(csv_fh) if self.is_main else None
            while (self.sampler.samples_seen + self.ctrl.batch_size <= self.budget
                   and (cfg.steps is None or self.step < cfg.steps)):
                row, last_step = self.train_step()
                if self.is_main:
                    writer.writerow([fmt(row[c]) for c in METRIC_COLUMNS])
                    bar.update(row["step"], row["samples"], row["samples"] * cfg.context,
                               row["train_loss"], row["batch_size"], row["gns_ema"], row["lr"])
                self.step += 1
                if self.step % cfg.checkpoint_every == 0 or last_step:
                    self._checkpoint(csv_fh)
                if cfg.stop_at_step is not None and self.step >= cfg.stop_at_step and not last_step:
                    stopped_early = True
                    if self.step % cfg.checkpoint_every:
                        self._checkpoint(csv_fh)
                    break
        finally:
            if self.is_main:
                csv_fh.close()
                bar.close()
        if stopped_early:
            if self.is_main:
                with open(os.path.join(cfg.out, "interrupted.json"), "w") as fh:
                    json.dump({"stopped_after_steps": self.step,
                               "samples": self.sampler.samples_seen}, fh)
                if not cfg.quiet:
                    print(f"stopped after step {self.step} (--stop-at-step); resume with "
                          f"--resume {cfg.out}")
        elif self.is_main:
            from .summary import finish
            finish(cfg, self.step, self.sampler.samples_seen, self.last_val, self.best_val,
                   self.ctrl, self.last_B, self.geometry, self.theta, self.elapsed(), self.corpus)
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
