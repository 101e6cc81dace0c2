"""Step-time and memory cost of the FSDP2 GNS hook (gk.attach_fsdp_gns): the paper's
Table 9 / Table 10 FSDP rows, on this machine.

    python bench/bench_fsdp_overhead.py [--ranks 2] [--every 100] [--rounds 10] ...

FSDP2 (fully_shard on every transformer block and the root) on R CPU ranks (gloo,
spawned here; one thread per rank), the Llama-style byte model of the DDP benchmark
(gns_kernels.demo.model.bench_config: 4 layers, width 256, 4 heads, MLP 1024, vocabulary
256, context 128), random byte tokens, AdamW. Identical models train side by side in one
process group:

    base      plain FSDP2 (default Shard(0))
    l1        + attach_fsdp_gns(GNSHookState("l1"))
    s1        + attach_fsdp_gns(GNSHookState("nuclear")): all 2-D weights; the square and
              wide ones (attn.out, mlp.down, embed, lm_head) carry their column blocks in
              the reduce-scatter (row Gram under dim-0 sharding)
    base_p    plain FSDP2 with shard_placement_fn=gk.fsdp_gns_shard_placement (Shard(1)
              for m <= n weights)
    s1_p      + nuclear on base_p (every measured matrix natural: no extra payload)

As in gns_kernels/demo/overhead.py (the DDP benchmark): interleaved blocks so that drifts
of the machine load hit every configuration alike; F=100 rows: blocks of F steps (the
first measures), --rounds rounds, the MEAN step time over rounds*F steps; F=1 rows:
blocks of --f1-block measuring steps. Memory: peak live CPU bytes during backward
(torch.profiler memory events, all threads), a measurement step minus a plain step.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import timedelta

import torch

CONFIGS = ("base", "l1", "s1", "base_p", "s1_p")
F100_CONFIGS = ("base", "l1", "s1")


def _rank_main(rank: int, world: int, folder: str, cfg: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gns_kernels as gk
    from gns_kernels.demo.model import ByteTransformer, bench_config
    from gns_kernels.demo.overhead import timed_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        B = cfg["local_batch"] * world
        models, opts, states = {}, {}, {}
        for name in CONFIGS:
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
        step = timed_step(models, opts, cfg, rank)

        for st in states.values():
            st.every = 1
        for name in CONFIGS:
            for _ in range(cfg["warmup"]):
                step(name)
        F = cfg["every"]
        times = {f"{n}_F{f}": [] for n in CONFIGS for f in (1, F)}
        est = {}
        order = list(F100_CONFIGS)
        for r in range(cfg["rounds"]):
            for name in order[r % len(order):] + order[:r % len(order)]:
                if name in states:
                    states[name].every = F
                    states[name].step = 0  # the block's first step measures
                for _ in range(F):
                    times[f"{name}_F{F}"].append(step(name))
        order = list(CONFIGS)
        for r in range(cfg["f1_rounds"]):
            for name in order[r % len(order):] + order[:r % len(order)]:
                if name in states:
                    states[name].every = 1
                for _ in range(cfg["f1_block"]):
                    times[f"{name}_F1"].append(step(name))
                if name in states:
                    e = states[name].estimate
                    est[name] = None if e is None else [e.gns, e.valid]
        out = {"times": times, "estimates": est,
               "params": sum(p.numel() for p in models["base"].parameters())}
        if cfg["memory"]:
            out["memory"] = _memory(step, states)
        if rank == 0:
            torch.save(out, os.path.join(folder, "result.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _memory(step, states):
    """Peak live CPU bytes allocated during backward, relative to its start (profiler
    memory events of the CPU allocator; min over 2 tries), per configuration."""
    from torch.profiler import ProfilerActivity, profile

    def peak(name):
        box = {}

        class Ctx:
            def __enter__(self):
                box["prof"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                box["prof"].__enter__()

            def __exit__(self, *exc):
                box["prof"].__exit__(*exc)

        step(name, Ctx)
        evs = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in box["prof"].events()
                     if e.self_cpu_memory_usage)
        live = top = 0
        for _, b in evs:
            live += b
            top = max(top, live)
        return top

    for st in states.values():
        st.every = 1
    return {name: min(peak(name) for _ in range(2)) for name in CONFIGS}


def _table(res: dict, F: int) -> str:
    t = res["times"]
    mean = {k: statistics.fmean(v) for k, v in t.items() if v}
    lines = ["| F | steps / config | baseline (s/step) | + l1 GNS (s/step) | overhead | + S1 GNS (s/step) | overhead |",
             "|---|---|---|---|---|---|---|"]
    for f in (1, F):
        b, l1, s1 = mean[f"base_F{f}"], mean[f"l1_F{f}"], mean[f"s1_F{f}"]
        lines.append(f"| {f} | {len(t[f'base_F{f}'])} | {b:.4f} | {l1:.4f} | {100 * (l1 / b - 1):+.1f}% | "
                     f"{s1:.4f} | {100 * (s1 / b - 1):+.1f}% |")
    bp, s1p = mean["base_p_F1"], mean["s1_p_F1"]
    lines.append(f"\nShard(1) placement (fsdp_gns_shard_placement), F=1: baseline {bp:.4f} s/step, "
                 f"+ S1 {s1p:.4f} s/step ({100 * (s1p / bp - 1):+.1f}%).")
    b1 = mean["base_F1"]
    for name, label, base in (("l1", "l1", "base"), ("s1", "S1", "base"), ("s1_p", "S1 (Shard(1) placement)", "base_p")):
        cost = mean[f"{name}_F1"] - mean[f"{base}_F1"]
        lines.append(f"One {label} measurement step costs {cost:+.4f} s over its F=1 baseline "
                     f"({100 * cost / mean[f'{base}_F1']:+.1f}%); / 100 = {cost / 100:+.6f} s/step "
                     f"({100 * cost / 100 / b1:+.2f}% at F=100, amortized).")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--local-batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--f1-block", type=int, default=5)
    p.add_argument("--f1-rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    if args.ranks < 2:
        print("--ranks: expected >= 2", file=sys.stderr)
        return 2
    cfg = dict(local_batch=args.local_batch, context=args.context, every=args.every, rounds=args.rounds,
               f1_block=args.f1_block, f1_rounds=args.f1_rounds, warmup=args.warmup, memory=args.memory)
    t0 = time.time()
    from gns_kernels.demo.overhead import launch_ranks

    res = launch_ranks(_rank_main, cfg, args.ranks, args.timeout, label="bench_fsdp_overhead")
    wall = time.time() - t0
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{args.ranks} gloo ranks x 1 thread; model {res['params'] / 1e6:.2f}M params, "
          f"local batch {args.local_batch} x {args.context} tokens; FSDP2 per block + root")
    print(_table(res, args.every))
    if "memory" in res:
        m = res["memory"]
        print("\npeak live CPU bytes during backward (measurement step; extra vs its baseline):")
        for name in CONFIGS:
            base = m["base_p"] if name.endswith("_p") else m["base"]
            print(f"  {name:7s} {m[name]:>12,}  extra {m[name] - base:>+12,}")
    print(f"\nlast estimates (gns, valid): {res['estimates']}; wall time {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
