"""`gns-kernels bench overhead`: step-time cost of the DDP GNS hook (the paper's Table 9).

DDP on R CPU ranks (gloo, started by this command; one thread per rank), the Llama-style
byte model (4 layers, width 256, 4 heads, MLP 1024, vocabulary 256, context
128; gns_kernels.demo.model.bench_config), random byte tokens, AdamW. Three identical
models train side by side in the same process group:

    baseline  plain DDP (no comm hook: DDP's built-in C++ all-reduce)
    + l1      DDP + gk.ddp_gns_hook, GNSHookState(geometry="l1")
    + S1      DDP + gk.ddp_gns_hook, GNSHookState(geometry="nuclear") (all 2-D weights)

Timing design (other processes may share the CPU): the configurations are interleaved
step by step (base, l1, S1, then the next step of each, rotating the order), so drifts in
machine load hit all of them alike. F = 100: ``--rounds`` x F steps per configuration
(steps 0, F, 2F, ... measure): the MEAN step time over them (a median would hide the
one-in-F measurement step; use --rounds >= 10 for >= 10 F steps). F = 1:
``--f1-rounds`` x ``--f1-block`` steps per configuration, all measuring.
Reported: mean s/step per configuration and F, the overhead in %, and the cost of one
measurement step (F=1 minus baseline) and that cost / F (amortized over F steps).

``--breakdown`` times the pieces of one measurement step in isolation (rank 0, same
buckets): packing (square_pack / Grams), the all-reduce of the larger payload vs the plain
one, and the statistics (variance_norms_multi / nuclear_stats).
``--memory`` measures the peak bytes of the hook's buffers alive at once in a measurement
step (weak references on the packs; see ``_memory``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch


QUICK = dict(every=10, rounds=1, f1_block=2, f1_rounds=1, warmup=1, breakdown=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
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
                        help="time the pieces of a measurement step")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the peak extra bytes of a measurement step")
    parser.add_argument("--configs", default="base,l1,s1",
                        help="comma-separated configurations: base (plain DDP), cpp (DDP + torch's "
                             "built-in C++ ALLREDUCE comm hook), py (DDP + torch's Python "
                             "allreduce_hook: the cost of any Python comm hook), l1, s1")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    parser.add_argument("--quick", action="store_true",
                        help="a short check that the bench runs, not a measurement: sets "
                             + " ".join(f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool)
                                        else f"--{'' if v else 'no-'}{k.replace('_', '-')}"
                                        for k, v in QUICK.items()))


def _validate(args) -> None:
    if args.ranks < 2:
        raise ValueError(f"--ranks: expected >= 2 (a variance needs 2 ranks), got {args.ranks}")
    for name in ("local_batch", "every", "rounds", "f1_block", "f1_rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not 1 <= args.context <= 128:
        raise ValueError(f"--context: expected 1..128 (the model's context), got {args.context}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: expected >= 0, got {args.warmup}")
    if args.bucket_cap_mb <= 0:
        raise ValueError(f"--bucket-cap-mb: expected > 0, got {args.bucket_cap_mb}")


# ----------------------------------------------------------------------------- rank side
def _rank_main(rank: int, world: int, folder: str, cfg: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gns_kernels as gk
    from gns_kernels.demo.model import ByteTransformer, bench_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        B = cfg["local_batch"] * world
        models, ddps, opts, states = {}, {}, {}, {}
        names = cfg["configs"]
        for name in names:
            torch.manual_seed(0)
            m = ByteTransformer(**bench_config())
            d = DDP(m, bucket_cap_mb=cfg["bucket_cap_mb"],
                    gradient_as_bucket_view=cfg.get("gradient_as_bucket_view", False))
            if name == "cpp":  # torch's built-in C++ ALLREDUCE comm hook: a hook without Python
                d._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
            elif name == "py":  # torch's own Python default hook: the cost of any Python hook
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                d.register_comm_hook(None, allreduce_hook)
            elif name != "base":
                st = gk.GNSHookState("l1" if name == "l1" else "nuclear", every=cfg["every"], batch_size=B)
                d.register_comm_hook(st, gk.ddp_gns_hook)
                states[name] = st
            models[name], ddps[name] = m, d
            opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-4)
        step = timed_step(ddps, opts, cfg, rank)

        for name in names:
            for st in states.values():
                st.every = 1
            for _ in range(cfg["warmup"]):
                step(name)
        times = {f"{n}_F{F}": [] for n in names for F in (1, cfg["every"])}
        est = {}
        F = cfg["every"]
        order = list(names)
        n_cfg = len(order)
        # step-by-step interleaving: configuration c's i-th step runs next to the others'
        # i-th steps (rotating the order), so load drifts hit all configurations alike
        for every, n_steps in ((F, cfg["rounds"] * F), (1, cfg["f1_rounds"] * cfg["f1_block"])):
            for st in states.values():
                st.every = every
                st.step = 0  # steps 0, F, 2F, ... measure
            for i in range(n_steps):
                for name in order[i % n_cfg:] + order[:i % n_cfg]:
                    times[f"{name}_F{every}"].append(step(name))
        for name, st in states.items():
            e = st.estimate
            est[name] = None if e is None else [e.gns, e.valid]
        out = {"times": times, "estimates": est, "params": sum(p.numel() for p in models[names[0]].parameters())}
        if cfg["breakdown"]:
            out["breakdown"] = _breakdown(ddps[names[0]], models[names[0]], B, world)
        if cfg["memory"] and states:
            out["memory"] = _memory(step, states)
        if rank == 0:
            torch.save(out, os.path.join(folder, "result.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def timed_step(models: dict, opts: dict, cfg: dict, rank: int):
    """step(name, around_backward=None) -> seconds of one training step of configuration
    ``name`` (zero_grad, forward, backward, optimizer step) on random byte tokens from a
    pool of 8 batches of cfg["local_batch"] x cfg["context"] (seeded per rank, cycled
    across all configurations). ``around_backward``: a zero-argument callable returning a
    context manager entered around the backward (profiling). Shared by the DDP and FSDP2
    overhead benches."""
    gen = torch.Generator().manual_seed(1000 + rank)
    pool = [torch.randint(0, 256, (cfg["local_batch"], cfg["context"] + 1), generator=gen) for _ in range(8)]
    counter = [0]

    def step(name, around_backward=None):
        tok = pool[counter[0] % len(pool)]
        counter[0] += 1
        t0 = time.perf_counter()
        opts[name].zero_grad(set_to_none=True)
        loss = models[name](tok[:, :-1], tok[:, 1:])
        if around_backward is None:
            loss.backward()
        else:
            with around_backward():
                loss.backward()
        opts[name].step()
        return time.perf_counter() - t0

    return step


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


def _breakdown(ddp, model, B, world):
    import torch.distributed as dist

    from gns_kernels import ops, spectral

    res = {"pack_l1": 0.0, "allreduce_plain": 0.0, "allreduce_l1": 0.0, "stats_l1": 0.0,
           "pack_s1": 0.0, "allreduce_s1": 0.0, "stats_s1": 0.0}
    scale = float(B) / (world - 1)
    torch.manual_seed(5)
    for ps in _buckets(model, 25.0):
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


def _memory(step, states):
    """Peak bytes of the hook's own buffers alive at once in a measurement step.

    Per bucket the hook allocates a float32 pack (for nuclear also the bucket's Grams, for
    the moment they are copied into it). The probe wraps the pack builders and tracks each
    pack by a weak reference, so a pack counts until it is really freed (after its
    all-reduce and statistics, on a gloo thread). Profiler memory events cannot measure
    this: frees on gloo's worker threads are not recorded, which makes packs look alive
    for the rest of the step.
    """
    import weakref

    from gns_kernels.distributed import ddp as hook

    live: list = []
    peak = [0]

    def wrap(fn, nuclear):
        def probe(buf, segs, state, micro):
            before = sum(4 * t.numel() for t in (r() for r in live) if t is not None)
            pack, plan = fn(buf, segs, state, micro)
            grams = sum(4 * e[-1].numel() for e in plan) if nuclear else 0
            peak[0] = max(peak[0], before + 4 * pack.numel() + grams)
            live.append(weakref.ref(pack))
            return pack, plan
        return probe

    orig = hook._pack_l, hook._pack_nuclear
    hook._pack_l, hook._pack_nuclear = wrap(orig[0], False), wrap(orig[1], True)
    out = {}
    try:
        for st in states.values():
            st.every = 1
        for name in states:
            peak[0] = 0
            for _ in range(2):
                live.clear()
                step(name)
            out[name] = peak[0]
    finally:
        hook._pack_l, hook._pack_nuclear = orig
    return out


# ----------------------------------------------------------------------------- parent side
def launch_ranks(rank_main, cfg: dict, world: int, timeout: float, label: str = "bench overhead") -> dict:
    """Spawn ``world`` processes running ``rank_main(rank, world, folder, cfg)`` (a picklable
    module-level function that writes ``folder/result.pt`` on rank 0); wait at most
    ``timeout`` seconds, terminate stragglers, return the loaded result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gns_overhead_") as folder:
        ctx = mp.start_processes(rank_main, args=(world, folder, cfg), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=2.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: ranks did not finish in {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(10)
        return torch.load(os.path.join(folder, "result.pt"), weights_only=True)


def _fmt_table(res: dict, F: int) -> str:
    t = res["times"]
    mean = {k: statistics.fmean(v) for k, v in t.items()}
    if not all(f"{n}_F1" in t for n in ("base", "l1", "s1")):
        return _fmt_partial(t, mean, F)
    lines = ["| F | steps / config | baseline (s/step) | + l1 GNS (s/step) | overhead | + S1 GNS (s/step) | overhead |",
             "|---|---|---|---|---|---|---|"]
    for f in (1, F):
        b, l1, s1 = mean[f"base_F{f}"], mean[f"l1_F{f}"], mean[f"s1_F{f}"]
        lines.append(f"| {f} | {len(t[f'base_F{f}'])} | {b:.4f} | {l1:.4f} | {100 * (l1 / b - 1):+.1f}% | "
                     f"{s1:.4f} | {100 * (s1 / b - 1):+.1f}% |")
    b1 = mean["base_F1"]
    for name, label in (("l1", "l1"), ("s1", "S1")):
        cost = mean[f"{name}_F1"] - b1
        lines.append(f"\nOne {label} measurement step costs {cost:+.4f} s over the F=1 baseline "
                     f"({100 * cost / b1:+.1f}%); / {F} = {cost / F:+.6f} s/step "
                     f"({100 * cost / F / b1:+.2f}% at F={F}, amortized).")
    if "py_F1" in t:
        lines.append(_fmt_partial(t, mean, F))
    return "\n".join(lines)


_LABELS = {"base": "DDP (built-in C++ all-reduce)", "cpp": "DDP + torch's built-in C++ ALLREDUCE hook",
           "py": "DDP + torch's Python allreduce_hook",
           "l1": "DDP + ddp_gns_hook l1", "s1": "DDP + ddp_gns_hook S1"}


def _fmt_partial(t: dict, mean: dict, F: int) -> str:
    """Per-configuration means (any subset of configurations), relative to 'base'."""
    names = [n for n in ("base", "cpp", "py", "l1", "s1") if f"{n}_F1" in t]
    lines = ["\n| configuration | F=1 s/step | vs base | F=%d s/step | vs base | steps (F=1 / F=%d) |" % (F, F),
             "|---|---|---|---|---|---|"]
    for n in names:
        rel = [f"{100 * (mean[f'{n}_F{f}'] / mean[f'base_F{f}'] - 1):+.1f}%" if "base_F1" in t else "" for f in (1, F)]
        lines.append(f"| {_LABELS[n]} | {mean[f'{n}_F1']:.4f} | {rel[0]} | {mean[f'{n}_F{F}']:.4f} | {rel[1]} | "
                     f"{len(t[f'{n}_F1'])} / {len(t[f'{n}_F{F}'])} |")
    return "\n".join(lines)


def run(args) -> int:
    if getattr(args, "quick", False):
        args = argparse.Namespace(**{**vars(args), **QUICK})
    try:
        _validate(args)
    except ValueError as exc:
        print(f"gns-kernels bench overhead: {exc}", file=sys.stderr)
        return 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in _LABELS]
    if bad or not configs or len(set(configs)) != len(configs):
        print(f"gns-kernels bench overhead: --configs: expected distinct names from "
              f"{','.join(_LABELS)}, got {args.configs!r}", file=sys.stderr)
        return 2
    cfg = dict(configs=configs, local_batch=args.local_batch, context=args.context, every=args.every, rounds=args.rounds,
               f1_block=args.f1_block, f1_rounds=args.f1_rounds, warmup=args.warmup,
               bucket_cap_mb=args.bucket_cap_mb, breakdown=args.breakdown, memory=args.memory,
               gradient_as_bucket_view=args.gradient_as_bucket_view)
    t0 = time.time()
    res = launch_ranks(_rank_main, cfg, args.ranks, args.timeout)
    wall = time.time() - t0
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {args.ranks} gloo ranks x 1 thread; model "
          f"{res['params'] / 1e6:.2f}M params, local batch {args.local_batch} x {args.context} tokens"
          + (", gradient_as_bucket_view" if args.gradient_as_bucket_view else ""))
    print(_fmt_table(res, args.every))
    if "breakdown" in res:
        print("\nmeasurement-step pieces (rank 0, median of 5, seconds, summed over buckets):")
        for k, v in res["breakdown"].items():
            print(f"  {k:16s} {v:.5f}")
    if res.get("memory"):
        m = res["memory"]
        print("\npeak bytes of the hook's buffers alive at once in a measurement step "
              "(float32 packs [+ Grams]): " + "; ".join(f"{_LABELS[k]}: {v:,}" for k, v in m.items())
              + f" (model gradients: {4 * res['params']:,} bytes in float32)")
    print(f"\nlast estimates (gns, valid): {res['estimates']}; wall time {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in res.items()}, f, indent=1, default=str)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gns-kernels bench overhead", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
