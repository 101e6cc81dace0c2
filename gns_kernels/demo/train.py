"""`gns-kernels demo`: data-parallel training of a byte-level transformer whose global batch
grows by Algorithm 1, driven by the GNS measured in the optimizer's geometry.

What one run does (see docs/demo.md):

- Processes: by default the command starts ``--ranks`` (2) CPU processes itself
  (torch.multiprocessing.spawn, gloo, a free local port). Under ``torchrun`` (RANK and
  WORLD_SIZE set) it joins the launcher's process group instead: NCCL and one GPU per
  process (LOCAL_RANK) when CUDA is available, gloo on CPUs otherwise.
- Model: `ByteTransformer` (demo/model.py) wrapped in DDP; data: windows of the Python
  standard library's sources (demo/data.py), served by `AdaptiveBatchSampler`
  (sampler.py) as R ranks x A micro-batches of b sequences (B = R*A*b; gradient
  accumulation under ``no_sync()`` with the loss divided by A once b would exceed
  ``--max-local-batch``).
- Optimizer (``--optimizer``): muon (default; torch.optim.Muon on the 2-D hidden weights +
  AdamW on embedding, head and norm gains), specsgd (SpecSGD + AdamW, same split), signum,
  signsgd, adamw, sgd, msgd (SGD with momentum 0.9). Geometry: gk.geometry_for(optimizer),
  or ``--geometry``. For the composites the GNS is measured on the 2-D hidden weights only
  (paper section 4.2); for the others on all parameters.
- GNS: the DDP comm hook gk.ddp_gns_hook with a gk.GNSHookState measures at optimizer
  steps k % F == 0 (``--every`` F), the controller gk.AdaptiveBatchSize (Algorithm 1:
  theta, warm-up I, EMAs) turns it into B_{k+1} and the LR multiplier omega_{k+1}
  (sqrt(B/B_0)) applied by gns_kernels.lr.LRMultiplier on top of the warm-up + cosine
  schedule. The schedule runs on SAMPLES seen (15% warm-up by default, as the paper's
  Appendix D), since the number of steps of an adaptive run is not known in advance.
- Output (``--out``, default runs/<timestamp>): metrics.csv (one row per optimizer step),
  plot.png (Figure 1 layout: validation loss, batch size, GNS vs steps), summary.json,
  config.json and checkpoint.pt (``--resume DIR`` continues the run in DIR exactly:
  model, optimizers, schedule, controller, sampler, hook step and RNG states).
- ``--compare``: constant small batch, constant large batch (``--large-factor`` x, LR x
  sqrt of that), adaptive with the Euclidean (l2) GNS, adaptive with the optimizer's
  geometry; same sample budget; a Table-2-style table and one plot with the four.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, replace

OPTIMIZERS = ("muon", "specsgd", "signum", "signsgd", "adamw", "sgd", "msgd")
GEOMETRIES = ("l2", "l1", "nuclear")
COMPOSITES = ("muon", "specsgd")
# main learning rate per optimizer (the AdamW part of the composites uses --adam-lr)
DEFAULT_LR = {"muon": 0.02, "specsgd": 0.02, "signum": 1e-3, "signsgd": 3e-4,
              "adamw": 3e-3, "sgd": 0.3, "msgd": 0.05}
COMPARE_SAMPLES = 6000   # default budget of each --compare run (four runs in < 15 min here)
METRIC_COLUMNS = ["step", "samples", "lr", "batch_size", "gns_raw", "gns_ema", "train_loss",
                  "val_loss", "lr_multiplier", "accum_steps", "micro_batch", "elapsed_s"]


class DemoError(Exception):
    """A bad command-line input: printed as one line, exit status 2."""


@dataclass
class DemoConfig:
    ranks: int = 2
    optimizer: str = "muon"
    geometry: str | None = None          # None: geometry_for(optimizer)
    theta: float | None = None           # None: 0.6 (l1/nuclear) or 0.3 (l2)
    every: int = 5
    warmup: int | None = None            # steps; None: the LR warm-up length at B_0
    initial_batch_size: int = 16
    max_batch_size: int | None = 512
    max_local_batch: int = 32
    micro_batches: int = 1               # minimum micro-batches per rank (>= 2 for 1 rank)
    multiple_of: int | None = None       # None: R*micro_batches*p, p the largest of 8, 4, 2, 1 dividing B_0/(R*micro)
    adaptive: bool = True
    samples: int = 8000                  # sample (sequence) budget
    steps: int | None = None             # optional cap on optimizer steps
    lr: float | None = None
    adam_lr: float = 3e-3
    lr_warmup: float = 0.15              # fraction of the sample budget
    lr_min_ratio: float = 0.1
    lr_scale: float = 1.0                # extra constant LR factor (large-batch baseline)
    seed: int = 0
    dim: int = 128
    layers: int = 2
    heads: int = 4
    mlp: int = 384
    context: int = 64
    corpus: str | None = None
    eval_every: int = 25
    val_windows: int = 192
    checkpoint_every: int = 200
    out: str = ""
    label: str = "adaptive"
    quiet: bool = False
    stop_at_step: int | None = None      # testing: stop after this step as if interrupted
    bias_correction: bool = True
    extra: dict = field(default_factory=dict)

    # -- derived ---------------------------------------------------------------------------
    def resolved_geometry(self) -> str:
        if self.geometry is not None:
            return self.geometry
        return {"muon": "nuclear", "specsgd": "nuclear", "signum": "l1", "signsgd": "l1",
                "adamw": "l1", "sgd": "l2", "msgd": "l2"}[self.optimizer]

    def resolved_theta(self) -> float:
        if self.theta is not None:
            return self.theta
        return 0.3 if self.resolved_geometry() == "l2" else 0.6

    def resolved_lr(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

    def resolved_multiple_of(self) -> int:
        if self.multiple_of is not None:
            return self.multiple_of
        base = self.ranks * self.micro_batches
        for p in (8, 4, 2):
            if self.initial_batch_size % (base * p) == 0:
                return base * p
        return base

    def resolved_warmup(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return int(math.ceil(self.lr_warmup * self.samples / self.initial_batch_size))


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    g = parser.add_argument_group("run")
    g.add_argument("--ranks", type=int, default=d.ranks,
                   help="data-parallel CPU processes started by the command (ignored under torchrun)")
    g.add_argument("--optimizer", default=d.optimizer,
                   help=f"one of {', '.join(OPTIMIZERS)} (default muon: Muon on 2-D hidden weights + AdamW)")
    g.add_argument("--geometry", default=None,
                   help="GNS geometry l2 | l1 | nuclear (default: the optimizer's)")
    g.add_argument("--samples", type=int, default=None,
                   help=f"sample budget in sequences of --context bytes (default {d.samples}; "
                        f"{COMPARE_SAMPLES} per run with --compare)")
    g.add_argument("--steps", type=int, default=None, help="also stop after this many optimizer steps")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--out", default=None, help="run folder (default runs/<timestamp> here)")
    g.add_argument("--corpus", default=None,
                   help="folder of .py files (default: this Python's standard library)")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run saved in DIR (its checkpoint.pt; every other option "
                        "comes from DIR/config.json)")
    g.add_argument("--compare", action="store_true",
                   help="constant small, constant large, adaptive l2, adaptive in the optimizer's geometry")
    g.add_argument("--large-factor", type=int, default=4,
                   help="--compare: the large constant batch is this times the initial (default 4)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    a = parser.add_argument_group("adaptive batch size (Algorithm 1)")
    a.add_argument("--theta", type=float, default=None, help="default 0.6 for l1/nuclear, 0.3 for l2")
    a.add_argument("--every", type=int, default=d.every, help="F: measure and update every F steps")
    a.add_argument("--warmup", type=int, default=None,
                   help="I: steps before the batch may grow (default: the LR warm-up at B_0)")
    a.add_argument("--initial-batch-size", type=int, default=d.initial_batch_size,
                   help="B_0, global sequences per step")
    a.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    a.add_argument("--max-local-batch", type=int, default=d.max_local_batch,
                   help="micro-batch cap per rank; gradient accumulation beyond it")
    a.add_argument("--micro-batches", type=int, default=None,
                   help="minimum micro-batches per rank (default 1; 2 with one rank)")
    a.add_argument("--multiple-of", type=int, default=None,
                   help="batch sizes are multiples of this (a multiple of ranks x micro-batches)")
    a.add_argument("--constant", action="store_true", help="keep the batch at B_0 (still measure the GNS)")
    a.add_argument("--raw-gns", action="store_true", help="the paper's raw estimator (no bias correction)")
    o = parser.add_argument_group("optimizer and model")
    o.add_argument("--lr", type=float, default=None, help="main learning rate (default per optimizer)")
    o.add_argument("--adam-lr", type=float, default=d.adam_lr, help="AdamW part of muon/specsgd")
    o.add_argument("--lr-warmup", type=float, default=d.lr_warmup, help="warm-up fraction of the budget")
    o.add_argument("--dim", type=int, default=d.dim)
    o.add_argument("--layers", type=int, default=d.layers)
    o.add_argument("--heads", type=int, default=d.heads)
    o.add_argument("--mlp", type=int, default=d.mlp)
    o.add_argument("--context", type=int, default=d.context)
    e = parser.add_argument_group("evaluation and checkpoints")
    e.add_argument("--eval-every", type=int, default=d.eval_every, help="validation every N steps")
    e.add_argument("--val-windows", type=int, default=d.val_windows)
    e.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    e.add_argument("--stop-at-step", type=int, default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    micro = args.micro_batches
    if micro is None:
        micro = 2 if args.ranks == 1 else 1
    return DemoConfig(
        ranks=args.ranks, optimizer=str(args.optimizer).lower(),
        geometry=None if args.geometry is None else str(args.geometry).lower(),
        theta=args.theta, every=args.every, warmup=args.warmup,
        initial_batch_size=args.initial_batch_size, max_batch_size=args.max_batch_size,
        max_local_batch=args.max_local_batch, micro_batches=micro, multiple_of=args.multiple_of,
        adaptive=not args.constant,
        samples=(args.samples if args.samples is not None
                 else COMPARE_SAMPLES if getattr(args, "compare", False) else DemoConfig.samples),
        steps=args.steps, lr=args.lr,
        adam_lr=args.adam_lr, lr_warmup=args.lr_warmup, seed=args.seed, dim=args.dim,
        layers=args.layers, heads=args.heads, mlp=args.mlp, context=args.context,
        corpus=args.corpus, eval_every=args.eval_every, val_windows=args.val_windows,
        checkpoint_every=args.checkpoint_every, out=args.out or "", quiet=args.quiet,
        stop_at_step=args.stop_at_step, bias_correction=not args.raw_gns,
    )


def validate(cfg: DemoConfig, world: int | None = None) -> None:
    """Raise DemoError (one line, naming the option) on bad input."""
    from ..sampler import plan_split

    if cfg.optimizer not in OPTIMIZERS:
        raise DemoError(f"unknown --optimizer {cfg.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    if cfg.geometry is not None and cfg.geometry not in GEOMETRIES:
        raise DemoError(f"unknown --geometry {cfg.geometry!r}; expected one of {', '.join(GEOMETRIES)}")
    if cfg.ranks < 1:
        raise DemoError(f"--ranks must be >= 1, got {cfg.ranks}")
    if cfg.theta is not None and not (math.isfinite(cfg.theta) and cfg.theta > 0):
        raise DemoError(f"--theta must be > 0, got {cfg.theta}")
    for name, value, lo in (("--every", cfg.every, 1), ("--samples", cfg.samples, 1),
                            ("--initial-batch-size", cfg.initial_batch_size, 1),
                            ("--max-local-batch", cfg.max_local_batch, 1),
                            ("--micro-batches", cfg.micro_batches, 1),
                            ("--eval-every", cfg.eval_every, 1), ("--val-windows", cfg.val_windows, 1),
                            ("--checkpoint-every", cfg.checkpoint_every, 1),
                            ("--dim", cfg.dim, 2), ("--layers", cfg.layers, 1),
                            ("--heads", cfg.heads, 1), ("--mlp", cfg.mlp, 1),
                            ("--context", cfg.context, 1)):
        if value < lo:
            raise DemoError(f"{name} must be >= {lo}, got {value}")
    for name, value in (("--steps", cfg.steps), ("--warmup", cfg.warmup)):
        if value is not None and value < (1 if name == "--steps" else 0):
            raise DemoError(f"{name} must be >= {1 if name == '--steps' else 0}, got {value}")
    if not 0.0 <= cfg.lr_warmup < 1.0:
        raise DemoError(f"--lr-warmup must be in [0, 1), got {cfg.lr_warmup}")
    if cfg.lr is not None and not cfg.lr > 0:
        raise DemoError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
        raise DemoError(f"--dim {cfg.dim} must split into --heads {cfg.heads} heads of even size")
    ranks = cfg.ranks if world is None else world
    if ranks * cfg.micro_batches < 2:
        raise DemoError("one rank needs --micro-batches >= 2 (the micro-batches are the GNS samples)")
    try:
        plan_split(cfg.initial_batch_size, ranks, cfg.max_local_batch, cfg.micro_batches)
    except ValueError as exc:
        raise DemoError(f"--initial-batch-size {cfg.initial_batch_size} does not split across "
                        f"{ranks} ranks x micro-batches: {exc}") from None
    mult = cfg.resolved_multiple_of()
    if mult % (ranks * cfg.micro_batches):
        raise DemoError(f"--multiple-of {mult} must be a multiple of ranks x micro-batches "
                        f"({ranks} x {cfg.micro_batches})")
    if cfg.initial_batch_size % mult:
        raise DemoError(f"--initial-batch-size {cfg.initial_batch_size} must be a multiple of "
                        f"--multiple-of {mult}")
    if cfg.samples < cfg.initial_batch_size:
        raise DemoError(f"--samples {cfg.samples} is less than one batch "
                        f"(--initial-batch-size {cfg.initial_batch_size})")
    if cfg.max_batch_size is not None and cfg.max_batch_size < cfg.initial_batch_size:
        raise DemoError(f"--max-batch-size {cfg.max_batch_size} is below --initial-batch-size "
                        f"{cfg.initial_batch_size}")


def _check_out_dir(path: str) -> str:
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise DemoError(f"--out {path!r} is not a writable folder ({exc.strerror or exc})") from None
    return path


def _default_out(prefix: str = "") -> str:
    return os.path.join(os.getcwd(), "runs", prefix + time.strftime("%Y%m%d-%H%M%S"))


# ---------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "resume", None):
            return _resume(args)
        cfg = config_from_args(args)
        world = _torchrun_world()
        if world is not None:  # under torchrun the launcher decides the ranks
            if not args.out:
                raise DemoError("--out is required under torchrun (every rank must agree on it)")
            cfg = replace(cfg, ranks=world,
                          micro_batches=args.micro_batches or (2 if world == 1 else 1))
        if getattr(args, "compare", False):
            return _compare(cfg, args.large_factor)
        validate(cfg, _torchrun_world())
        cfg.out = _check_out_dir(cfg.out or _default_out())
        summary = launch(cfg)
        return 0 if summary is not None else 1
    except DemoError as exc:
        print(f"gns-kernels demo: error: {exc}", file=sys.stderr)
        return 2


def _torchrun_world() -> int | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _load_corpus_checked(cfg: DemoConfig):
    from .data import CorpusNotFoundError, load_corpus
    try:
        return load_corpus(cfg.corpus)
    except CorpusNotFoundError as exc:
        raise DemoError(str(exc)) from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: DemoConfig, resume_from: str | None = None) -> dict | None:
    """Run one training run (spawning cfg.ranks CPU processes, or in this process under
    torchrun); returns its summary dict (None on failure)."""
    corpus = _load_corpus_checked(cfg)
    if _is_main_process():
        for name in ("summary.json", "interrupted.json"):   # stale results of this folder
            if os.path.exists(os.path.join(cfg.out, name)):
                os.remove(os.path.join(cfg.out, name))
        with open(os.path.join(cfg.out, "config.json"), "w") as fh:
            json.dump(asdict(cfg), fh, indent=1)
    world = _torchrun_world()
    if world is not None:
        _torchrun_worker(cfg, corpus, resume_from)
    else:
        import torch.multiprocessing as mp
        port = _free_port()
        try:
            mp.spawn(_spawn_worker, args=(cfg.ranks, port, cfg, corpus, resume_from),
                     nprocs=cfg.ranks, join=True)
        except Exception as exc:  # a worker failed: its traceback was printed by spawn
            last = str(exc).strip().splitlines()
            print(f"gns-kernels demo: error: a training process failed: {last[-1] if last else exc}",
                  file=sys.stderr)
            return None
    for name in ("summary.json", "interrupted.json"):
        path = os.path.join(cfg.out, name)
        if os.path.exists(path):
            with open(path) as fh:
                return json.load(fh)
    return None


def _spawn_worker(rank: int, world: int, port: int, cfg: DemoConfig, corpus, resume_from):
    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _train(cfg, corpus, torch.device("cpu"), resume_from)
    finally:
        dist.destroy_process_group()


def _torchrun_worker(cfg: DemoConfig, corpus, resume_from):
    import torch
    import torch.distributed as dist
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend)
    try:
        _train(cfg, corpus, device, resume_from)
    finally:
        if created:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# the training loop (one process per rank)
# ---------------------------------------------------------------------------------------
def _build_optimizers(cfg: DemoConfig, model):
    import torch
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


def _rng_state():
    import numpy as np
    import torch
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state):
    import numpy as np
    import torch
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class _Progress:
    """One text line updated in place on a terminal; a line every ~5% otherwise."""

    def __init__(self, total_samples: int, enabled: bool):
        self.total = total_samples
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()
        self.next_print = 0.0
        self.t0 = time.time()

    def update(self, step, samples, tokens, loss, batch, gns, lr):
        if not self.enabled:
            return
        frac = min(1.0, samples / self.total)
        elapsed = time.time() - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        width = 20
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        gns_text = "  -  " if gns is None else f"{gns:7.1f}"
        line = (f"[{bar}] {100 * frac:5.1f}% step {step:5d} tokens {tokens / 1e6:6.2f}M "
                f"loss {loss:6.3f} batch {batch:4d} GNS {gns_text} lr {lr:.2e} "
                f"{elapsed:5.0f}s eta {eta:4.0f}s")
        if self.tty:
            sys.stdout.write("\r" + line)
            sys.stdout.flush()
        elif frac >= self.next_print:
            print(line, flush=True)
            self.next_print = frac + 0.05

    def close(self):
        if self.tty:
            sys.stdout.write("\n")
            sys.stdout.flush()


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.8g}"
    return str(x)


def _train(cfg: DemoConfig, corpus, device, resume_from: str | None) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gns_kernels as gk
    from ..distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook
    from ..lr import LRMultiplier, warmup_cosine
    from ..sampler import AdaptiveBatchSampler
    from .data import TokenWindows
    from .model import ByteTransformer

    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    geometry = cfg.resolved_geometry()
    theta = cfg.resolved_theta()
    B0 = cfg.initial_batch_size

    torch.manual_seed(cfg.seed)
    model = ByteTransformer(vocab=256, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
                            mlp_hidden=cfg.mlp, context=cfg.context).to(device)
    optimizers, measured = _build_optimizers(cfg, model)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    train_set = TokenWindows(corpus.train, cfg.context)
    val_set = TokenWindows(corpus.val, cfg.context)
    val_idx = val_set.evenly_spaced(cfg.val_windows)
    my_val = val_idx[rank::world]

    sampler = AdaptiveBatchSampler(len(train_set), B0, num_replicas=world, rank=rank,
                                   max_local_batch=cfg.max_local_batch,
                                   min_accum_steps=cfg.micro_batches, seed=cfg.seed)
    ctrl = gk.AdaptiveBatchSize(
        initial_batch_size=B0, theta=theta, every=cfg.every, warmup_steps=cfg.resolved_warmup(),
        max_batch_size=(cfg.max_batch_size if cfg.adaptive else B0),
        multiple_of=cfg.resolved_multiple_of(), lr_scaling="sqrt")
    micro_gns = world == 1   # one rank: the micro-batches are the samples (MicroBatchGNS)
    if micro_gns:
        hook_state = MicroBatchGNS(measured if measured is not None else list(model.parameters()),
                                      geometry=geometry, every=cfg.every, batch_size=B0,
                                      micro_batches=sampler.accum_steps,
                                      bias_correction=cfg.bias_correction)
    else:
        hook_state = GNSHookState(geometry=geometry, every=cfg.every, batch_size=B0,
                                     params=measured, bias_correction=cfg.bias_correction)
    ddp.register_comm_hook(hook_state, ddp_gns_hook)

    budget = cfg.samples
    warm_samples = cfg.lr_warmup * budget
    progress = {"samples": 0}

    def schedule(_):
        return cfg.lr_scale * warmup_cosine(progress["samples"], budget, warm_samples, cfg.lr_min_ratio)

    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
    lrm = LRMultiplier(optimizers, schedulers)

    step = 0
    elapsed_before = 0.0
    best_val = math.inf
    metrics_path = os.path.join(cfg.out, "metrics.csv")
    ckpt_path = os.path.join(cfg.out, "checkpoint.pt")
    if resume_from is not None:
        ck = torch.load(resume_from, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        for o, sd in zip(optimizers, ck["optimizers"]):
            o.load_state_dict(sd)
        for s, sd in zip(schedulers, ck["schedulers"]):
            s.load_state_dict(sd)
        lrm.load_state_dict(ck["lr_multiplier"])
        ctrl.load_state_dict(ck["controller"])
        sampler.load_state_dict(ck["sampler"])
        hook_state.load_state_dict(ck["hook"])
        _set_rng_state(ck["rng"][rank])
        step = ck["step"]
        elapsed_before = ck["elapsed"]
        best_val = ck["best_val"]
        progress["samples"] = sampler.samples_seen
        if is_main:  # keep the rows of the steps the checkpoint covers
            with open(metrics_path, newline="") as fh:
                rows = [r for r in csv.DictReader(fh) if int(r["step"]) < step]
            with open(metrics_path, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=METRIC_COLUMNS)
                w.writeheader()
                w.writerows(rows)
    elif is_main:
        with open(metrics_path, "w", newline="") as fh:
            csv.writer(fh).writerow(METRIC_COLUMNS)

    def evaluate() -> float:
        with torch.no_grad():
            x, y = val_set.batch(my_val)
            logits = model(x.to(device))
            loss_sum = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1), reduction="sum")
            t = torch.stack([loss_sum.double().cpu(), torch.tensor(float(y.numel()), dtype=torch.float64)]).to(device)
        dist.all_reduce(t)
        return (t[0] / t[1]).item()

    def save_checkpoint():
        rngs = [None] * world
        dist.all_gather_object(rngs, _rng_state())
        if is_main:
            ck = {"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                  "schedulers": [s.state_dict() for s in schedulers],
                  "lr_multiplier": lrm.state_dict(), "controller": ctrl.state_dict(),
                  "sampler": sampler.state_dict(), "hook": hook_state.state_dict(),
                  "rng": rngs, "step": step, "elapsed": elapsed_before + time.time() - t0,
                  "best_val": best_val, "config": asdict(cfg)}
            tmp = ckpt_path + ".tmp"
            torch.save(ck, tmp)
            os.replace(tmp, ckpt_path)

    bar = _Progress(budget, enabled=is_main and not cfg.quiet)
    t0 = time.time()
    csv_fh = open(metrics_path, "a", newline="") if is_main else None
    writer = csv.writer(csv_fh) if is_main else None
    last_val = None
    last_B = ctrl.batch_size
    stopped_early = False
    try:
        while (sampler.samples_seen + ctrl.batch_size <= budget
               and (cfg.steps is None or step < cfg.steps)):
            B = last_B = ctrl.batch_size
            sampler.set_batch_size(B)
            hook_state.batch_size = B
            if micro_gns:
                hook_state.micro_batches = sampler.accum_steps
            lr_used = optimizers[0].param_groups[0]["lr"]
            micro = sampler.next_step()
            A = len(micro)
            loss_local = 0.0
            for i, idx in enumerate(micro):
                x, y = train_set.batch(idx)
                x, y = x.to(device), y.to(device)
                if i < A - 1:
                    with ddp.no_sync():
                        loss = ddp(x, y) / A
                        loss.backward()
                else:
                    loss = ddp(x, y) / A
                    loss.backward()
                loss_local += loss.item()
                if micro_gns:
                    hook_state.micro_step()
            estimate = hook_state.estimate if hook_state.estimate_step == step else None
            for o in optimizers:
                o.step()
                o.zero_grad(set_to_none=True)
            ctrl.update(step, estimate)
            progress["samples"] = sampler.samples_seen
            lrm.step(ctrl.lr_multiplier)

            tl = torch.tensor([loss_local], dtype=torch.float64, device=device)
            dist.all_reduce(tl)
            train_loss = tl.item() / world
            val_loss = None
            last_step = (sampler.samples_seen + ctrl.batch_size > budget or
                         (cfg.steps is not None and step + 1 >= cfg.steps))
            if step % cfg.eval_every == 0 or last_step:
                val_loss = evaluate()
                last_val = val_loss
                best_val = min(best_val, val_loss)
            gns_raw = estimate.gns if (estimate is not None and estimate.valid) else None
            if is_main:
                writer.writerow([_fmt(v) for v in (
                    step, sampler.samples_seen, lr_used, B, gns_raw, ctrl.gns_ema, train_loss,
                    val_loss, lrm.multiplier, A, sampler.micro_batch_size,
                    elapsed_before + time.time() - t0)])
                bar.update(step, sampler.samples_seen, sampler.samples_seen * cfg.context,
                           train_loss, B, ctrl.gns_ema, lr_used)
            step += 1
            if step % cfg.checkpoint_every == 0 or last_step:
                if is_main:
                    csv_fh.flush()
                save_checkpoint()
            if cfg.stop_at_step is not None and step >= cfg.stop_at_step and not last_step:
                stopped_early = True
                if step % cfg.checkpoint_every:
                    if is_main:
                        csv_fh.flush()
                    save_checkpoint()
                break
    finally:
        if is_main:
            csv_fh.close()
            bar.close()

    if stopped_early:
        if is_main:
            with open(os.path.join(cfg.out, "interrupted.json"), "w") as fh:
                json.dump({"stopped_after_steps": step, "samples": sampler.samples_seen}, fh)
            if not cfg.quiet:
                print(f"stopped after step {step} (--stop-at-step); resume with --resume {cfg.out}")
        dist.barrier()
        return
    if is_main:
        _finish(cfg, step, sampler.samples_seen, last_val, best_val, ctrl, last_B, geometry,
                theta, elapsed_before + time.time() - t0, corpus)
    dist.barrier()  # summary.json exists before any rank returns (torchrun --compare)


def _finish(cfg, steps, samples, last_val, best_val, ctrl, last_B, geometry, theta, elapsed, corpus):
    from .plots import plot_run, plots_available

    metrics_path = os.path.join(cfg.out, "metrics.csv")
    plot_path = None
    if plots_available():
        plot_path = plot_run(metrics_path, os.path.join(cfg.out, "plot.png"),
                             title=f"{cfg.optimizer}, {geometry} GNS, theta={theta:g}, "
                                   f"{cfg.ranks} ranks", label=cfg.label)
    summary = dict(label=cfg.label, optimizer=cfg.optimizer, geometry=geometry, theta=theta,
                   adaptive=cfg.adaptive, steps=steps, samples=samples,
                   tokens=samples * cfg.context, final_val_loss=last_val, best_val_loss=best_val,
                   initial_batch_size=cfg.initial_batch_size, final_batch_size=last_B,
                   next_batch_size=ctrl.batch_size,
                   final_gns_ema=ctrl.gns_ema, lr_multiplier=ctrl.lr_multiplier,
                   measurements=ctrl.num_measurements, skipped_measurements=ctrl.num_skipped,
                   elapsed_s=elapsed, corpus=corpus.root, corpus_train_bytes=int(corpus.train.numel()),
                   corpus_val_bytes=int(corpus.val.numel()), out=cfg.out, plot=plot_path)
    with open(os.path.join(cfg.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    if not cfg.quiet:
        gns = "-" if ctrl.gns_ema is None else f"{ctrl.gns_ema:.1f}"
        print(f"done: {steps} steps, {samples} sequences ({samples * cfg.context / 1e6:.2f}M tokens) "
              f"in {elapsed:.0f}s | val loss {last_val:.4f} (best {best_val:.4f}) | batch "
              f"{cfg.initial_batch_size} -> {last_B} | {geometry} GNS (EMA) {gns} | "
              f"lr x{ctrl.lr_multiplier:.2f}")
        print(f"run folder: {cfg.out} (metrics.csv, {'plot.png, ' if plot_path else ''}summary.json, "
              "checkpoint.pt)")


def _resume(args) -> int:
    folder = os.path.abspath(args.resume)
    ckpt = os.path.join(folder, "checkpoint.pt")
    conf = os.path.join(folder, "config.json")
    if not (os.path.exists(ckpt) and os.path.exists(conf)):
        raise DemoError(f"--resume {folder!r}: no checkpoint.pt and config.json there")
    with open(conf) as fh:
        cfg = DemoConfig(**json.load(fh))
    cfg = replace(cfg, out=_check_out_dir(folder), stop_at_step=args.stop_at_step,
                  quiet=args.quiet or cfg.quiet)
    world = _torchrun_world()
    if world is not None and world != cfg.ranks:
        raise DemoError(f"--resume {folder!r}: the run used {cfg.ranks} ranks, torchrun started "
                        f"{world}; resume with the same number to continue the same trajectory")
    validate(cfg, world)
    summary = launch(cfg, resume_from=ckpt)
    return 0 if summary is not None else 1


# ---------------------------------------------------------------------------------------
# --compare
# ---------------------------------------------------------------------------------------
def _steps_to_reach(metrics: dict, target: float) -> int | None:
    """First step (1-based count of optimizer steps taken) whose val loss <= target."""
    for s, v in zip(metrics["step"], metrics["val_loss"]):
        if not math.isnan(v) and v <= target:
            return int(s) + 1
    return None


def compare_table(results: dict[str, dict], metrics: dict[str, dict], optimizer: str,
                  small_key: str = "small") -> str:
    """Table 2 layout: validation losses of the runs (columns, in order; the last one is the
    adaptive run in the optimizer's geometry), its steps reduction (%), then one row per run:
    final and best validation loss, steps, samples, final batch, steps to reach the small
    constant baseline's best validation loss (as logged in its metrics) and the reduction
    relative to the steps the baseline itself needed to reach it; the last column reads the
    comparison the other way: the steps the baseline needed to reach each run's final loss
    (useful in short runs where the adaptive runs end above the baseline's best)."""
    base_vals = [v for v in metrics[small_key]["val_loss"] if not math.isnan(v)]
    target = min(base_vals)
    base_steps = _steps_to_reach(metrics[small_key], target)
    reach = {k: _steps_to_reach(metrics[k], target) for k in results}

    def reduction(k):
        s = reach[k]
        return "-" if (s is None or not base_steps) else f"{100.0 * (base_steps - s) / base_steps:.2f}"

    keys = list(results)
    heads = ["Optimizer"] + [results[k]["label"] for k in keys] + ["Steps reduction(%)"]
    cells = [optimizer] + [f"{results[k]['final_val_loss']:.4f}" for k in keys] + [reduction(keys[-1])]
    widths = [max(len(h), len(c)) + 2 for h, c in zip(heads, cells)]
    lines = ["".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(heads, widths))),
             "".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))),
             "",
             f"target = best validation loss of {results[small_key]['label']}: {target:.4f} "
             f"(reached after {base_steps} steps)"]
    name_w = max(len(results[k]["label"]) for k in keys) + 2
    lines.append("run".ljust(name_w) + "final val".rjust(10) + "best val".rjust(10) + "steps".rjust(8)
                 + "samples".rjust(9) + "final B".rjust(9) + "steps to target".rjust(17)
                 + "reduction %".rjust(13) + "baseline steps to its final loss".rjust(34))
    for k in keys:
        r = results[k]
        s = reach[k]
        logged = [v for v in metrics[k]["val_loss"] if not math.isnan(v)]
        back = _steps_to_reach(metrics[small_key], logged[-1]) if logged else None
        lines.append(r["label"].ljust(name_w) + f"{r['final_val_loss']:.4f}".rjust(10)
                     + f"{r['best_val_loss']:.4f}".rjust(10) + str(r["steps"]).rjust(8)
                     + str(r["samples"]).rjust(9) + str(r["final_batch_size"]).rjust(9)
                     + ("not reached" if s is None else str(s)).rjust(17) + reduction(k).rjust(13)
                     + ("not reached" if back is None else str(back)).rjust(34))
    return "\n".join(lines)


def _compare(cfg: DemoConfig, large_factor: int) -> int:
    from .plots import plot_runs, plots_available, read_metrics

    validate(cfg, _torchrun_world())
    if large_factor < 2:
        raise DemoError(f"--large-factor must be >= 2, got {large_factor}")
    top = _check_out_dir(cfg.out or _default_out("compare-"))
    geometry = cfg.resolved_geometry()
    B0 = cfg.initial_batch_size
    BL = B0 * large_factor
    warm = cfg.resolved_warmup()
    runs = {
        "small": replace(cfg, adaptive=False, label=f"B={B0}"),
        "large": replace(cfg, adaptive=False, initial_batch_size=BL, lr_scale=math.sqrt(large_factor),
                         warmup=warm, label=f"B={BL}"),
        "euclidean": replace(cfg, adaptive=True, geometry="l2", theta=None,
                             label="Euclidean GNS (l2)"),
        "adaptive": replace(cfg, adaptive=True, label=f"Non-Euclidean GNS ({geometry})"),
    }
    if geometry == "l2":  # the optimizer's own geometry is Euclidean: compare with l1 instead
        runs["euclidean"] = replace(runs["euclidean"], geometry="l1", label="l1 GNS")
        runs["adaptive"] = replace(runs["adaptive"], label="Euclidean GNS (l2, optimizer's)")
    results, metrics = {}, {}
    t0 = time.time()
    for key, rc in runs.items():
        rc = replace(rc, out=_check_out_dir(os.path.join(top, key)))
        validate(rc, _torchrun_world())
        if _is_main_process() and not cfg.quiet:
            print(f"== {rc.label}: {rc.optimizer}, geometry {rc.resolved_geometry()}, "
                  f"B0={rc.initial_batch_size}, {'adaptive' if rc.adaptive else 'constant'}", flush=True)
        summary = launch(rc)
        if summary is None:
            return 1
        results[key] = summary
        metrics[key] = read_metrics(os.path.join(rc.out, "metrics.csv"))
    if not _is_main_process():
        return 0
    table = compare_table(results, metrics, cfg.optimizer)
    plot_path = None
    if plots_available():
        plot_path = plot_runs({results[k]["label"]: metrics[k] for k in results},
                              os.path.join(top, "compare.png"),
                              title=f"{cfg.optimizer}: constant vs adaptive batch, "
                                    f"{cfg.samples} sequences each")
    with open(os.path.join(top, "compare.txt"), "w") as fh:
        fh.write(table + "\n")
    with open(os.path.join(top, "compare.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    print(table)
    print(f"compare folder: {top} (compare.txt, compare.json{', compare.png' if plot_path else ''}; "
          f"one run folder each) in {time.time() - t0:.0f}s")
    return 0


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"
