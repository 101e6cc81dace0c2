"""Command-line options of `gns-kernels demo` and their mapping onto a `DemoConfig`."""
from __future__ import annotations

import argparse

from .config import COMPARE_SAMPLES, DEFAULT_TIMEOUT, OPTIMIZERS, DemoConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to `parser` (help shows every default)."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    d = DemoConfig()
    g = parser.add_argument_group("run")
    g.add_argument("--ranks", type=int, default=d.ranks,
                   help="data-parallel CPU processes started by the command (ignored under torchrun)")
    g.add_argument("--optimizer", default=d.optimizer,
                   help=f"one of {', '.join(OPTIMIZERS)} (muon: Muon on 2-D hidden weights + AdamW)")
    g.add_argument("--geometry", default=None,
                   help="GNS geometry l2 | l1 | nuclear (None: the optimizer's)")
    g.add_argument("--samples", type=int, default=None,
                   help=f"sample budget in sequences of --context bytes (None: {d.samples}; "
                        f"{COMPARE_SAMPLES} per run with --compare)")
    g.add_argument("--steps", type=int, default=None, help="also stop after this many optimizer steps")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the model, data order and RNGs")
    g.add_argument("--out", default=None,
                   help="run folder (None: runs/<timestamp> in the current folder); must be empty "
                        "unless --overwrite")
    g.add_argument("--overwrite", action="store_true",
                   help="reuse a non-empty --out: delete the demo files already there "
                        "(checkpoint.pt, metrics.csv, ...) before the run starts")
    g.add_argument("--corpus", default=None,
                   help="folder of .py files (None: this Python's standard library)")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run saved in DIR (its checkpoint.pt; every other option "
                        "comes from DIR/config.json, except --quiet, --stop-at-step and --timeout)")
    g.add_argument("--compare", action="store_true",
                   help="constant small, constant large, adaptive l2, adaptive in the optimizer's geometry")
    g.add_argument("--preset", default=None, choices=["paper-cpu", "paper-cpu-20"],
                   help="fixed options of a named experiment (see docs/demo.md; an option given "
                        "on the command line wins over the preset's); with --compare, paper-cpu "
                        "runs the paper's Table 2 protocol (B_0 grid, Signum and Muon, 3 seeds; "
                        "with --optimizer, that optimizer alone; with --theta, the "
                        "geometry-matched runs at that theta); paper-cpu-20: the same at 20 "
                        "bytes per parameter (84,720 parameters, 26475 sequences)")
    g.add_argument("--jobs", type=int, default=1,
                   help="--compare --preset: runs at a time (each run's process gets "
                        "OMP_NUM_THREADS threads, else cpu_count // jobs)")
    g.add_argument("--large-factor", type=int, default=4,
                   help="--compare: the large constant batch is this times the initial")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--timeout", type=float, default=None,
                   help=f"seconds a rank waits for the others (process-group start and every "
                        f"collective) before the run ends with an error (None: {DEFAULT_TIMEOUT:g}, "
                        "or the resumed run's value); raise it for large models or slow file systems")
    a = parser.add_argument_group("adaptive batch size (Algorithm 1)")
    a.add_argument("--theta", type=float, default=None, help="None: 0.6 for l1/nuclear, 0.3 for l2")
    a.add_argument("--every", type=int, default=d.every, help="F: measure and update every F steps")
    a.add_argument("--warmup", type=int, default=None,
                   help="I: steps before the batch may grow (None: the LR warm-up at B_0)")
    a.add_argument("--initial-batch-size", type=int, default=d.initial_batch_size,
                   help="B_0, global sequences per step")
    a.add_argument("--max-batch-size", type=int, default=d.max_batch_size,
                   help="cap on the global batch (a multiple of --multiple-of)")
    a.add_argument("--max-local-batch", type=int, default=d.max_local_batch,
                   help="cap on the micro-batch size b per rank, fixed for the run; a larger "
                        "batch accumulates more micro-batches of b")
    a.add_argument("--micro-batches", type=int, default=None,
                   help="minimum micro-batches per rank (None: 1; 2 with one rank)")
    a.add_argument("--multiple-of", type=int, default=None,
                   help="batch sizes are multiples of this = ranks x the micro-batch size b, so "
                        "it sets b (None: b the largest micro-batch <= --max-local-batch that "
                        "splits B_0 into at least --micro-batches per rank)")
    a.add_argument("--constant", action="store_true", help="keep the batch at B_0 (still measure the GNS)")
    a.add_argument("--raw-gns", action="store_true", help="the paper's raw estimator (no bias correction)")
    o = parser.add_argument_group("optimizer and model")
    o.add_argument("--lr", type=float, default=None, help="main learning rate (None: per optimizer)")
    o.add_argument("--adam-lr", type=float, default=d.adam_lr, help="AdamW part of muon/specsgd")
    o.add_argument("--lr-warmup", type=float, default=d.lr_warmup, help="warm-up fraction of the budget")
    o.add_argument("--lr-min", type=float, default=d.lr_min_ratio,
                   help="the cosine's final LR as a fraction of the peak (0: decay to zero)")
    o.add_argument("--dim", type=int, default=d.dim, help="model width")
    o.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    o.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    o.add_argument("--mlp", type=int, default=d.mlp, help="hidden width of the SwiGLU MLP")
    o.add_argument("--context", type=int, default=d.context, help="sequence length in bytes")
    e = parser.add_argument_group("evaluation and checkpoints")
    e.add_argument("--eval-every", type=int, default=d.eval_every, help="validation every N steps")
    e.add_argument("--val-windows", type=int, default=d.val_windows,
                   help="validation sequences (fixed, evenly spaced over the validation text)")
    e.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="write checkpoint.pt every N steps (and at the end)")
    e.add_argument("--stop-at-step", type=int, default=None,
                   help="stop after this many steps as if interrupted: writes checkpoint.pt and "
                        "interrupted.json; continue with --resume")


# command-line destinations whose DemoConfig field has another name
_FIELD_OF_DEST = {"raw_gns": "bias_correction", "lr_min": "lr_min_ratio", "constant": "adaptive"}


def explicit_fields(args: argparse.Namespace) -> set:
    """The DemoConfig fields the user set on the command line (args._explicit: the option
    destinations given, recorded by the CLI); empty when unknown."""
    return {_FIELD_OF_DEST.get(d, d) for d in getattr(args, "_explicit", ())}


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    micro = args.micro_batches
    if micro is None:
        micro = 2 if args.ranks == 1 else 1
    timeout = getattr(args, "timeout", None)
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
        adam_lr=args.adam_lr, lr_warmup=args.lr_warmup, lr_min_ratio=args.lr_min, seed=args.seed, dim=args.dim,
        layers=args.layers, heads=args.heads, mlp=args.mlp, context=args.context,
        corpus=args.corpus, eval_every=args.eval_every, val_windows=args.val_windows,
        checkpoint_every=args.checkpoint_every, out=args.out or "", quiet=args.quiet,
        stop_at_step=args.stop_at_step, bias_correction=not args.raw_gns,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
    )
