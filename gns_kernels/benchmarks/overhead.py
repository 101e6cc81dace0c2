"""`gns-kernels bench overhead`: step-time and memory cost of the GNS hooks (the paper's
Tables 9 and 10) under DDP or FSDP2, on this machine.

R CPU ranks (gloo, started by this command; one thread per rank), the Llama-style byte
model (4 layers, width 256, 4 heads, MLP 1024, vocabulary 256, context 128;
gns_kernels.demo.model.bench_config), random byte tokens, AdamW. Identical models train
side by side in the same process group, one per configuration (``--configs``):

``--parallel ddp`` (default):
    base      plain DDP (no comm hook: DDP's built-in C++ all-reduce)
    cpp       DDP + torch's built-in C++ ALLREDUCE comm hook (a hook without Python)
    py        DDP + torch's Python ``allreduce_hook`` (what any Python comm hook costs)
    l1        DDP + gk.ddp_gns_hook, GNSHookState(geometry="l1")
    s1        DDP + gk.ddp_gns_hook, GNSHookState(geometry="nuclear") (all 2-D weights)
    l1_np     l1 without the noise pool (pool_beta=None): l1 - l1_np is the pool's cost
    s1_np     s1 without the noise pool
``--parallel fsdp2`` (``fully_shard`` on every transformer block and the root):
    base      plain FSDP2 (default Shard(0))
    l1        + gk.attach_fsdp_gns(model, GNSHookState("l1"))
    s1        + gk.attach_fsdp_gns(model, GNSHookState("nuclear"))
    base_p    plain FSDP2 with shard_placement_fn=gk.fsdp_gns_shard_placement
    s1_p      s1 on base_p (every measured matrix sharded on its Gram's summation index)
              (base_p and s1_p run only the F = 1 rows)

Timing (gns_kernels.benchmarks.harness.interleaved_times; other processes may share the
CPU): configurations alternate step by step in a rotating order, so drifts in machine
load hit all of them alike. F rows: ``--rounds`` x F steps per configuration, steps 0,
F, 2F, ... measure; the MEAN step time over them (a median would hide the one-in-F
measurement step). F = 1 rows: ``--f1-rounds`` x ``--f1-block`` steps, all measuring.
Reported: mean s/step per configuration and F, the overhead in %, and the cost of one
measurement step (its F = 1 mean minus its baseline's) and that cost / F (amortized).

``--breakdown`` (DDP only) times the pieces of one measurement step in isolation (rank 0,
same buckets): packing (square_pack / Grams), the all-reduce of the larger payload vs the
plain one, and the statistics (variance_norms_multi / nuclear_stats).
``--memory``: peak bytes allocated during the backward of a measurement step and alive at
once (harness.LiveBytes: a dispatch mode and weak references to the storages, min of 2
steps), per configuration and extra over its baseline.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
from torch.multiprocessing.spawn import ProcessException

from . import harness
from .harness import launch_ranks

QUICK = dict(every=10, rounds=1, f1_block=2, f1_rounds=1, warmup=1, breakdown=False)

LABELS = {
    "ddp": {"base": "DDP (built-in C++ all-reduce)", "cpp": "DDP + torch's built-in C++ ALLREDUCE hook",
            "py": "DDP + torch's Python allreduce_hook",
            "l1": "DDP + ddp_gns_hook l1", "s1": "DDP + ddp_gns_hook S1",
            "l1_np": "DDP + ddp_gns_hook l1, no noise pool", "s1_np": "DDP + ddp_gns_hook S1, no noise pool"},
    "fsdp2": {"base": "FSDP2 (Shard(0))", "l1": "FSDP2 + attach_fsdp_gns l1", "s1": "FSDP2 + attach_fsdp_gns S1",
              "base_p": "FSDP2 (fsdp_gns_shard_placement)",
              "s1_p": "FSDP2 (fsdp_gns_shard_placement) + attach_fsdp_gns S1"},
}
BASELINE_OF = {"base": "base", "cpp": "base", "py": "base", "l1": "base", "s1": "base",
               "l1_np": "base", "s1_np": "base", "base_p": "base_p", "s1_p": "base_p"}
COST_LABELS = {"l1": "l1", "s1": "S1", "s1_p": "S1 (Shard(1) placement)",
               "l1_np": "l1, no pool", "s1_np": "S1, no pool"}
DEFAULT_CONFIGS = {"ddp": "base,l1,s1", "fsdp2": "base,l1,s1,base_p,s1_p"}
NO_F_ROWS = ("base_p", "s1_p")  # FSDP2 placement configurations: F = 1 rows only


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp",
                        help="DDP comm hook (ddp_gns_hook) or FSDP2 reduce-scatter (attach_fsdp_gns)")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (gloo processes), >= 2")
    parser.add_argument("--local-batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--context", type=int, default=128, help="tokens per sequence (<= 128)")
    parser.add_argument("--every", type=int, default=100, help="F of the amortized rows")
    parser.add_argument("--rounds", type=int, default=10,
                        help="rounds of F steps per configuration (mean over rounds*F steps)")
    parser.add_argument("--f1-block", type=int, default=5, help="F=1 steps per round")
    parser.add_argument("--f1-rounds", type=int, default=4, help="rounds of F=1 steps (f1-rounds x f1-block steps)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration first")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="DDP gradient_as_bucket_view=True for every configuration (DDP then "
                             "divides by R in a separate pass with or without a comm hook)")
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                        help="time the pieces of a measurement step (DDP only)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the peak bytes of a measurement step's backward")
    parser.add_argument("--configs", default=None,
                        help="comma-separated configurations (see the module docstring); default "
                             + "; ".join(f"{k}: {v}" for k, v in DEFAULT_CONFIGS.items()))
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    parser.add_argument("--quick", action="store_true",
                        help="a short check that the bench runs, not a measurement: sets "
                             + " ".join(f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool)
                                        else f"--{'' if v else 'no-'}{k.replace('_', '-')}"
                                        for k, v in QUICK.items()))


def _validate(args) -> list:
    """Checked arguments -> the configuration names; ValueError naming the argument."""
    if args.ranks < 2:
        raise ValueError(f"--ranks: expected >= 2 (a variance needs 2 ranks), got {args.ranks}")
    for name in ("local_batch", "every", "rounds", "f1_block", "f1_rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not 1 <= args.context <= 128:
        raise ValueError(f"--context: expected 1..128 (the model's context), got {args.context}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: expected >= 0, got {args.warmup}")
    if not args.bucket_cap_mb > 0:
        raise ValueError(f"--bucket-cap-mb: expected > 0, got {args.bucket_cap_mb}")
    timeout = getattr(args, "timeout", 1800.0)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"--timeout: expected a finite number of seconds > 0, got {timeout}")
    parallel = getattr(args, "parallel", "ddp")
    text = args.configs if args.configs is not None else DEFAULT_CONFIGS[parallel]
    configs = [c.strip() for c in text.split(",") if c.strip()]
    labels = LABELS[parallel]
    if not configs or len(set(configs)) != len(configs) or any(c not in labels for c in configs):
        raise ValueError(f"--configs: expected distinct names from {','.join(labels)} "
                         f"(--parallel {parallel}), got {text!r}")
    return configs


# ----------------------------------------------------------------------------- rank side
def _build_ddp(names, cfg, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gns_kernels as gk
    from gns_kernels.demo.model import ByteTransformer, bench_config

    B = cfg["local_batch"] * world
    models, opts, states, plain = {}, {}, {}, {}
    for name in names:
        torch.manual_seed(0)
        m = ByteTransformer(**bench_config())
        d = DDP(m, bucket_cap_mb=cfg["bucket_cap_mb"],
                gradient_as_bucket_view=cfg.get("gradient_as_bucket_view", False))
        if name == "cpp":
            d._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        elif name == "py":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            d.register_comm_hook(None, allreduce_hook)
        elif name != "base":
            st = gk.GNSHookState("l1" if name.startswith("l1") else "nuclear", every=cfg["every"],
                                 batch_size=B, pool_beta=None if name.endswith("_np") else 0.9)
            d.register_comm_hook(st, gk.ddp_gns_hook)
            states[name] = st
        models[name], plain[name] = d, m
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-4)
    return models, opts, states, plain


def _build_fsdp2(names, cfg, world):
    from torch.distributed.fsdp import fully_shard

    import gns_kernels as gk
    from gns_kernels.demo.model import ByteTransformer, bench_config

    B = cfg["local_batch"] * world
    models, opts, states = {}, {}, {}
    for name in names:
        torch.manual_seed(0)
        m = ByteTransformer(**bench_config())
        kw = {}
        if name.endswith("_p"):
            kw["shard_placement_fn"] = lambda p: gk.fsdp_gns_shard_placement(p, world)
        for blk in m.blocks:
            fully_shard(blk, **kw)
        fully_shard(m, **kw)
        if name in ("l1", "s1", "s1_p"):
            st = gk.GNSHookState("l1" if name == "l1" else "nuclear", every=cfg["every"], batch_size=B)
            gk.attach_fsdp_gns(m, st)
            states[name] = st
        models[name] = m
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-4)
    return models, opts, states, models


def _rank_main(rank: int, world: int, folder: str, cfg: dict) -> None:
    with harness.process_group(rank, world, folder):
        names = cfg["configs"]
        build = _build_fsdp2 if cfg["parallel"] == "fsdp2" else _build_ddp
        models, opts, states, plain = build(names, cfg, world)
        step = harness.timed_step(models, opts, cfg, rank)
        times, est = harness.interleaved_times(
            step, states, names, every=cfg["every"], rounds=cfg["rounds"], f1_rounds=cfg["f1_rounds"],
            f1_block=cfg["f1_block"], warmup=cfg["warmup"], f_names=[n for n in names if n not in NO_F_ROWS])
        first = plain[names[0]]
        out = {"times": times, "estimates": est, "params": sum(p.numel() for p in first.parameters())}
        if cfg["breakdown"] and cfg["parallel"] == "ddp":
            out["breakdown"] = _breakdown(first, cfg["local_batch"] * world, world, cfg["bucket_cap_mb"])
        if cfg["memory"]:
            out["memory"] = harness.peak_memory(step, states, names)
        harness.save_result(rank, folder, out)


def _buckets(model, cap_mb):
    """Parameter groups as DDP buckets them after the rebuild (reverse order, size cap);
    the first bucket of DDP is capped at 1 MB. An approximation of DDP's own bucketing,
    used only to size the pieces timed by the breakdown."""
    import torch.distributed as dist

    params = list(model.parameters())[::-1]
    caps = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(cap_mb * 1024 * 1024)]
    out, cur, size = [], [], 0
    for p in params:
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= caps[min(len(out), 1)]:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def _time(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _breakdown(model, B, world, cap_mb):
    """Seconds (median of 5, summed over the buckets) of the pieces of a DDP measurement
    step on random gradients of the model's bucket shapes."""
    import torch.distributed as dist

    from gns_kernels import ops, spectral

    res = {"pack_l1": 0.0, "allreduce_plain": 0.0, "allreduce_l1": 0.0, "stats_l1": 0.0,
           "pack_s1": 0.0, "allreduce_s1": 0.0, "stats_s1": 0.0}
    scale = float(B) / (world - 1)
    torch.manual_seed(5)
    for ps in _buckets(model, cap_mb):
        n = sum(p.numel() for p in ps)
        buf = torch.randn(n) * 1e-3
        pack = torch.empty(2 * n)
        res["pack_l1"] += _time(lambda: ops.square_pack(buf, pack))
        res["allreduce_plain"] += _time(lambda: dist.all_reduce(buf.div_(world)))
        res["allreduce_l1"] += _time(lambda: dist.all_reduce(pack.div_(world)))
        ds, qs, off = [], [], 0
        for p in ps:
            ds.append(pack[off:off + p.numel()])
            qs.append(pack[n + off:n + off + p.numel()].abs())
            off += p.numel()
        res["stats_l1"] += _time(lambda: ops.variance_norms_multi(ds, qs, scale))
        mats = [torch.randn(p.shape) * 1e-3 for p in ps if p.dim() == 2]
        if not mats:
            continue
        grams = spectral.gram(mats)
        packs = torch.empty(n + sum(G.numel() for G in grams))
        res["pack_s1"] += _time(lambda: (spectral.gram(mats), packs[:n].copy_(buf)))
        res["allreduce_s1"] += _time(lambda: dist.all_reduce(packs.div_(world)))
        meang = [G + 1e-3 * torch.eye(G.shape[0]) for G in grams]
        res["stats_s1"] += _time(lambda: spectral.nuclear_stats(meang, mats, scale=scale, bias_correction=True,
                                                                num_samples=world, batch_size=float(B)))
    return res


# ----------------------------------------------------------------------------- parent side
def format_results(res: dict, F: int, parallel: str = "ddp") -> str:
    """The tables of a result (``times`` from harness.interleaved_times; optional
    ``memory``: name -> peak bytes)."""
    labels = LABELS[parallel]
    text = harness.format_tables(res["times"], F, labels, BASELINE_OF, COST_LABELS)
    if res.get("memory"):
        m = res["memory"]
        rows = ["", "peak bytes allocated during the backward of a measurement step, alive at once "
                    "(extra: over its baseline):"]
        for name, v in m.items():
            b = BASELINE_OF[name]
            extra = f"  extra {v - m[b]:>+13,}" if b in m and b != name else ""
            rows.append(f"  {labels[name]:56s} {v:>13,}{extra}")
        if "params" in res:
            rows.append(f"  (model gradients: {4 * res['params']:,} bytes in float32)")
        text += "\n" + "\n".join(rows)
    return text


def run(args) -> int:
    if getattr(args, "quick", False):
        args = argparse.Namespace(**{**vars(args), **QUICK})
    try:
        configs = _validate(args)
    except ValueError as exc:
        print(f"gns-kernels bench overhead: {exc}", file=sys.stderr)
        return 2
    parallel = getattr(args, "parallel", "ddp")
    cfg = dict(parallel=parallel, configs=configs, local_batch=args.local_batch, context=args.context,
               every=args.every, rounds=args.rounds, f1_block=args.f1_block, f1_rounds=args.f1_rounds,
               warmup=args.warmup, bucket_cap_mb=args.bucket_cap_mb, breakdown=args.breakdown,
               memory=args.memory, gradient_as_bucket_view=args.gradient_as_bucket_view)
    t0 = time.time()
    try:
        res = launch_ranks(_rank_main, cfg, args.ranks, args.timeout)
    except TimeoutError as exc:  # the ranks did not finish in --timeout: one line, exit 1
        print(f"gns-kernels bench overhead: error: {exc}", file=sys.stderr)
        return 1
    except ProcessException as exc:  # a rank failed: its traceback, then one line, exit 1
        print(str(exc).rstrip(), file=sys.stderr)
        print(f"gns-kernels bench overhead: error: rank {exc.error_index} failed (above)",
              file=sys.stderr)
        return 1
    wall = time.time() - t0
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {args.ranks} gloo ranks x 1 thread; "
          + ("FSDP2 per block + root; " if parallel == "fsdp2" else "DDP; ")
          + f"model {res['params'] / 1e6:.2f}M params, local batch {args.local_batch} x {args.context} tokens"
          + (", gradient_as_bucket_view" if args.gradient_as_bucket_view and parallel == "ddp" else ""))
    print(format_results(res, args.every, parallel))
    if "breakdown" in res:
        print("\nmeasurement-step pieces (rank 0, median of 5, seconds, summed over buckets):")
        for k, v in res["breakdown"].items():
            print(f"  {k:16s} {v:.5f}")
    print(f"\nlast estimates (gns, valid): {res['estimates']}; wall time {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gns-kernels bench overhead", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
