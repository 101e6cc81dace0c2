"""`gns-kernels demo`: data-parallel training of a byte-level transformer whose global batch
grows by Algorithm 1, driven by the GNS measured in the optimizer's geometry.

What one run does (see docs/demo.md):

- Processes: by default the command starts ``--ranks`` (2) CPU processes itself
  (torch.multiprocessing, gloo, a store on a port the system picks; launch.py). Under
  ``torchrun`` (RANK and WORLD_SIZE set) it joins the launcher's process group instead:
  NCCL and one GPU per process (LOCAL_RANK) when CUDA is available, gloo on CPUs
  otherwise. Either way a rank waits at most ``--timeout`` seconds for the others.
- Model: `ByteTransformer` (demo/model.py) wrapped in DDP; data: windows of the Python
  standard library's sources (demo/data.py) in a DataLoader over the coordinator's
  `MicroBatchSampler`: micro-batches of a fixed b sequences (the largest b <=
  ``--max-local-batch`` that splits B_0), R ranks x A of them per step (B = R*A*b; the
  first A-1 under ``no_sync()``, each loss divided by A).
- Optimizer (``--optimizer``): muon (default; torch.optim.Muon on the 2-D hidden weights +
  AdamW on embedding, head and norm gains), specsgd (SpecSGD + AdamW, same split), signum,
  signsgd, adamw, sgd, msgd (SGD with momentum 0.9). Geometry: gk.geometry_for(optimizer),
  or ``--geometry``. For the composites the GNS is measured on the 2-D hidden weights only
  (paper section 4.2); for the others on all parameters.
- GNS: the DDP comm hook gk.ddp_gns_hook with a gk.GNSHookState (one rank: a
  gk.MicroBatchGNS) measures at optimizer steps k % F == 0 (``--every`` F); the loop is
  gk.AdaptiveBatching's (loop.py): Algorithm 1 (theta, warm-up I, EMAs) turns the
  measurement into B_{k+1} and the LR multiplier omega_{k+1} (sqrt(B/B_0)), applied to
  every param group of all optimizers on top of the warm-up + cosine schedule
  (``lr_schedule=``). The schedule runs on SAMPLES seen (15% warm-up by default, as the
  paper's Appendix D), since the number of steps of an adaptive run is not known in advance.
- Output (``--out``, default runs/<timestamp>): metrics.csv (one row per optimizer step),
  plot.png (Figure 1 layout: validation loss, batch size, GNS vs steps), summary.json,
  config.json and checkpoint.pt (``--resume DIR`` continues the run in DIR exactly:
  model, optimizers, every rank's coordinator state and RNG states; the folder
  of a new run must be empty unless ``--overwrite``).
- ``--compare``: constant small batch, constant large batch (``--large-factor`` x, LR x
  sqrt of that), adaptive with the Euclidean (l2) GNS, adaptive with the optimizer's
  geometry; same sample budget; a Table-2-style table and one plot with the four.

The parts: config.py (options, validation), args.py (command line), rundir.py (the
run folder), launch.py (processes, failures), loop.py (one rank's training), checkpoint.py,
summary.py, progress.py, compare.py. This module is the command's entry point.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from .args import add_arguments, config_from_args, explicit_fields
from .compare import compare_table, run_compare
from .config import (COMPARE_SAMPLES, COMPOSITES, DEFAULT_LR, GEOMETRIES, METRIC_COLUMNS,
                     OPTIMIZERS, DemoConfig, DemoError, config_from_dict, validate)
from .launch import is_main_process, launch, torchrun_world
from .rundir import check_out_dir, default_out, prepare_out_dir

__all__ = ["add_arguments", "run", "config_from_args", "validate", "launch", "compare_table",
           "DemoConfig", "DemoError", "OPTIMIZERS", "GEOMETRIES", "COMPOSITES", "DEFAULT_LR",
           "COMPARE_SAMPLES", "METRIC_COLUMNS"]


def run(args: argparse.Namespace) -> int:
    """`gns-kernels demo`: 0 on success, 1 when a rank failed, 2 on bad input (one line)."""
    try:
        if getattr(args, "resume", None):
            return _resume(args)
        overwrite = bool(getattr(args, "overwrite", False))
        cfg = config_from_args(args)
        world = torchrun_world()
        if world is not None:  # under torchrun the launcher decides the ranks
            if not args.out:
                raise DemoError("--out is required under torchrun (every rank must agree on it)")
            cfg = replace(cfg, ranks=world,
                          micro_batches=args.micro_batches or (2 if world == 1 else 1))
        if getattr(args, "preset", None):
            from .presets import PROTOCOLS, apply_preset, run_paper
            explicit = explicit_fields(args)
            cfg = apply_preset(cfg, args.preset, keep=explicit)
            if getattr(args, "compare", False):
                if world is not None:
                    raise DemoError("--preset with --compare starts its own processes; "
                                    "run it without torchrun")
                top = cfg.out or default_out("paper-")
                if not overwrite and os.path.isdir(top) and os.listdir(top):
                    print(f"{top} is not empty: finished runs with the same options are reused")
                protocol = PROTOCOLS[args.preset]
                if "optimizer" in explicit:  # the protocol for that optimizer alone
                    protocol = replace(protocol, optimizers=(cfg.optimizer,))
                run_paper(cfg, protocol, top, log=lambda m: print(m, flush=True),
                          jobs=getattr(args, "jobs", 1))
                return 0
        if getattr(args, "compare", False):
            return run_compare(cfg, args.large_factor, overwrite)
        validate(cfg, world)
        cfg.out = prepare_out_dir(cfg.out or default_out(), overwrite)
        summary = launch(cfg)
        return 0 if summary is not None else 1
    except DemoError as exc:
        print(f"gns-kernels demo: error: {exc}", file=sys.stderr)
        return 2


# the options that apply to a resumed run (every other one comes from its config.json)
RESUME_OPTIONS = frozenset({"resume", "quiet", "stop_at_step", "timeout"})


def given_options(args: argparse.Namespace) -> set:
    """The option destinations the user gave: ``args._explicit`` (recorded by the CLI from
    argv), else, for a namespace built in code, those whose value differs from the
    parser's default."""
    explicit = getattr(args, "_explicit", None)
    if explicit is not None:
        return set(explicit)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    return {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}


def _resume(args) -> int:
    """--resume DIR: config.json and checkpoint.pt of DIR, checked to belong together."""
    from .checkpoint import CHECKPOINT, check_belongs, load_checkpoint

    if getattr(args, "overwrite", False):
        raise DemoError("--resume and --overwrite exclude each other (--overwrite starts a new run)")
    ignored = sorted(given_options(args) - RESUME_OPTIONS - {"overwrite"})
    if ignored:
        names = ", ".join("--" + d.replace("_", "-") for d in ignored)
        raise DemoError(f"--resume continues the saved run with the options in its config.json; "
                        f"{names} cannot be changed on resume (only --quiet, --stop-at-step and "
                        "--timeout apply): drop them, or start a new run to change them")
    folder = os.path.abspath(args.resume)
    ckpt = os.path.join(folder, CHECKPOINT)
    conf = os.path.join(folder, "config.json")
    if not (os.path.exists(ckpt) and os.path.exists(conf)):
        missing = [n for n, p in ((CHECKPOINT, ckpt), ("config.json", conf)) if not os.path.exists(p)]
        raise DemoError(f"--resume {folder!r}: no {' and no '.join(missing)} there (nothing to "
                        "continue: a run writes checkpoint.pt every --checkpoint-every steps)")
    try:
        with open(conf) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise DemoError(f"--resume {folder!r}: config.json is not readable JSON ({exc})") from None
    cfg = config_from_dict(data, f"--resume {folder!r}: config.json")
    if not os.path.exists(os.path.join(folder, "metrics.csv")):
        raise DemoError(f"--resume {folder!r}: no metrics.csv there (the rows of the steps "
                        "before the checkpoint would be lost)")
    cfg = replace(cfg, out=check_out_dir(folder), stop_at_step=args.stop_at_step,
                  quiet=args.quiet or cfg.quiet)
    if getattr(args, "timeout", None) is not None:
        cfg = replace(cfg, timeout=args.timeout)
    world = torchrun_world()
    if world is not None and world != cfg.ranks:
        raise DemoError(f"--resume {folder!r}: the run used {cfg.ranks} ranks, torchrun started "
                        f"{world}; resume with the same number to continue the same trajectory")
    validate(cfg, world)
    ck = load_checkpoint(ckpt, map_location="cpu")
    check_belongs(ck, asdict(cfg), folder, cfg.ranks)
    del ck
    summary = launch(cfg, resume_from=ckpt)
    return 0 if summary is not None else 1


# names this module had before it was split: resolved lazily to their new homes
_MOVED = {"_is_main_process": ("launch", "is_main_process"),
          "_torchrun_world": ("launch", "torchrun_world"),
          "_load_corpus_checked": ("launch", "load_corpus_checked"),
          "_spawn_worker": ("launch", "_spawn_worker"),
          "_torchrun_worker": ("launch", "_torchrun_worker"),
          "_check_out_dir": ("rundir", "check_out_dir"),
          "_default_out": ("rundir", "default_out"),
          "_build_optimizers": ("loop", "build_optimizers"),
          "_train": ("loop", "train"),
          "_rng_state": ("checkpoint", "rng_state"),
          "_set_rng_state": ("checkpoint", "set_rng_state"),
          "_finish": ("summary", "finish"),
          "_Progress": ("progress", "Progress"),
          "_fmt": ("progress", "fmt"),
          "_compare": ("compare", "run_compare"),
          "_steps_to_reach": ("compare", "_steps_to_reach")}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib
        module, attr = _MOVED[name]
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
