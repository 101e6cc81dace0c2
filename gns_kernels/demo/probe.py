"""`gns-kernels probe RUN_DIR`: the critical-batch probe (gns_kernels/probe.py) on a demo
run's checkpoint.pt.

From the checkpoint (model, optimizers with their momentum / Adam state and base LRs, the
coordinator's samples seen, batch and controller EMAs), short branches at every batch of
``--batch-sizes`` continue training with the demo's LR rule (base lr x warm-up + cosine
on samples x sqrt(B / B_0), as `AdaptiveBatching` sets it) on fresh random windows of
the training text, one process, no DDP; every branch is evaluated on the run's own
validation windows. Beside the probed critical batch it puts the GNS at the same point:
the controller's own EMA from the checkpoint (what Algorithm 1 compares with B) and a
fresh measurement in every geometry (l1, nuclear, l2) on the run's measured parameters,
with the run's estimator (raw or bias-corrected), at each batch of the grid split into
the run's micro-batches (``gns_by_batch``); and, per geometry, the theta at which
Algorithm 1's fixed point is the probed B_crit (``fixed_point_thetas``). Writes probe.json
and probe.txt (``--out``, default RUN_DIR); ``--gns-only`` runs no branch and writes
gns.json (the GNS per grid batch, and the thetas for a given ``--b-crit``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from .config import DemoError

DEFAULT_BATCHES = "16,32,64,128,256"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", default=None,
                        help="a demo run folder holding checkpoint.pt and config.json")
    parser.add_argument("--batch-sizes", default=DEFAULT_BATCHES,
                        help="comma-separated batch sizes of the branches (the smallest sets the target)")
    parser.add_argument("--samples", type=int, default=3200,
                        help="examples the smallest batch's branch runs; its final validation loss is the target")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated data seeds (the spread is the criterion's noise)")
    parser.add_argument("--tolerance", type=float, default=1.25,
                        help="B_crit: the largest B whose examples to the target stay within this factor of the smallest B's")
    parser.add_argument("--cap", type=float, default=2.0,
                        help="a larger B's branch stops at this many times --samples (not reached beyond)")
    parser.add_argument("--evals", type=int, default=16, help="evaluations over --samples examples")
    parser.add_argument("--repeats", type=int, default=8, help="fresh GNS measurements averaged at the checkpoint")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default=None, help="folder for probe.json / probe.txt (default: RUN_DIR)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--gns-only", action="store_true",
                        help="no branches: only the GNS measured at each of --batch-sizes (gns.json), and "
                             "with --b-crit the theta at which that batch is Algorithm 1's fixed point")
    parser.add_argument("--b-crit", type=float, default=None,
                        help="--gns-only: a critical batch (e.g. from an earlier probe.json)")


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise DemoError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise DemoError(f"{name}: expected at least one integer, got {text!r}")
    return vals


def load_run(run_dir: str):
    """(cfg, checkpoint dict) of a demo run folder; DemoError naming what is missing."""
    from .checkpoint import CHECKPOINT, load_checkpoint
    from .config import config_from_dict

    ckpt = os.path.join(run_dir, CHECKPOINT)
    conf = os.path.join(run_dir, "config.json")
    for p in (ckpt, conf):
        if not os.path.exists(p):
            raise DemoError(f"probe: {run_dir!r} has no {os.path.basename(p)} (a demo run folder "
                            "with a checkpoint: e.g. a run stopped with --stop-at-step)")
    with open(conf) as fh:
        cfg = config_from_dict(json.load(fh), conf)
    ck = load_checkpoint(ckpt)
    coords = ck.get("coord")
    if not isinstance(coords, (list, tuple)) or not coords or not isinstance(coords[0], dict):
        raise DemoError(f"probe: {ckpt} holds no coordinator state (written before the demo ran on "
                        "gk.AdaptiveBatching?)")
    return cfg, ck


class DemoRun:
    """The probe's callbacks for a demo run: start(), draw(B, gen), loss_fn, evaluate, the
    LR rule, and the run's point (samples seen, batch, micro-batch, controller EMAs)."""

    def __init__(self, cfg, ck, corpus=None):
        from ..probe import controller_lr_rule
        from .data import TokenWindows, load_corpus
        from .loop import lr_schedule

        self.cfg, self.ck = cfg, ck
        corpus = corpus if corpus is not None else load_corpus(cfg.corpus)
        self.train = TokenWindows(corpus.train, cfg.context)
        val = TokenWindows(corpus.val, cfg.context)
        self.val_x, self.val_y = val.batch(val.evenly_spaced(cfg.val_windows))
        coord = ck["coord"][0]
        sched = coord.get("schedule", coord)   # version 2 keeps k and B there, version 1 at the top
        self.step = int(sched["step"])
        self.samples_seen = int(coord["samples_seen"])
        self.batch_size = int(sched["batch_size"])
        self.micro_batch = int(coord["micro_batch_size"])
        self.world = int(coord["world_size"])
        ctrl = coord["controller"]
        n, m = ctrl.get("noise_ema"), ctrl.get("signal_ema")
        self.gns_ema = (n / m) if (n is not None and m and m > 0) else math.nan
        self.geometry = cfg.resolved_geometry()
        self.theta = cfg.resolved_theta()
        self.lr_rule = controller_lr_rule(lr_schedule(cfg), self.samples_seen,
                                          cfg.initial_batch_size, "sqrt")

    def start(self):
        from .loop import build_model, build_optimizers

        model = build_model(self.cfg)
        model.load_state_dict(self.ck["model"])
        optimizers, measured = build_optimizers(self.cfg, model)
        for o, sd in zip(optimizers, self.ck["optimizers"]):
            o.load_state_dict(sd)
        self.measured = measured if measured is not None else list(model.parameters())
        return model, optimizers

    def draw(self, n: int, gen: torch.Generator):
        idx = torch.randint(len(self.train), (n,), generator=gen)
        return self.train.batch(idx)

    @staticmethod
    def loss_fn(model, batch):
        x, y = batch
        return model(x, y)

    def evaluate(self, model) -> float:
        with torch.no_grad():
            logits = model(self.val_x)
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), self.val_y.reshape(-1)).item()


def gns_by_batch(run: "DemoRun", batch_sizes, repeats: int, bias_correction: bool) -> dict:
    """{batch: {geometry: measure_gns entry}}: the fresh GNS at the checkpoint measured as a
    run at batch B would measure it, for each B of ``batch_sizes``: A = max(2, B // b)
    micro-batches of the run's b, keyed by the batch measured, A b (B itself when it is a
    multiple of b of at least 2 b; grid batches that round to one measured batch give one
    entry). With the raw signal the measured GNS grows with the batch it is measured at (the
    noise leaks into the signal, docs/estimators.md), so the batch Algorithm 1 settles at
    depends on it."""
    from ..probe import measure_gns

    model, _ = run.start()
    b = run.micro_batch
    measured = sorted({b * max(2, int(B) // b) for B in batch_sizes})
    return {M: measure_gns(model, run.measured, run.draw, run.loss_fn, b, M // b, repeats=repeats,
                           seed=20_000 + M, bias_correction=bias_correction)
            for M in measured}


def fixed_point_thetas(by_b: dict, bc: float) -> dict:
    """{geometry: sqrt(GNS(B_crit) / B_crit) or None}: Algorithm 1's fixed point at B_crit, the
    GNS measured at each grid batch (by_b: {B: {geometry: {"gns": ...}}}) interpolated
    log-log at bc (None outside the grid)."""
    from ..probe import theta_for

    out = {}
    for g in next(iter(by_b.values())):
        x = interp_loglog({B: d[g]["gns"] for B, d in by_b.items()}, bc)
        out[g] = None if x is None else theta_for(x, bc)
    return out


def interp_loglog(points: dict, x: float) -> float | None:
    """y at x from {x_i: y_i}, linear in log x / log y between the neighbours; None outside
    the points' range or where a neighbour is not finite and > 0."""
    xs = sorted(points)
    for a, b in zip(xs, xs[1:]):
        if a <= x <= b:
            ya, yb = points[a], points[b]
            if not all(math.isfinite(v) and v > 0 for v in (ya, yb)):
                return None
            t = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a))
            return math.exp(math.log(ya) + t * (math.log(yb) - math.log(ya)))
    if xs and x == xs[-1]:
        return points[x]
    return None


def probe_run(run_dir: str, batch_sizes, samples: int, seeds, tolerance: float = 1.25,
              cap: float = 2.0, evals: int = 16, repeats: int = 8, log=lambda s: None,
              corpus=None) -> dict:
    """The probe on a demo run folder; returns the report dict written to probe.json."""
    from ..probe import measure_gns, run_probe, theta_for

    cfg, ck = load_run(run_dir)
    run = DemoRun(cfg, ck, corpus)
    t0 = time.time()
    model, _ = run.start()
    A = max(2, run.batch_size // run.micro_batch)
    gns = measure_gns(model, run.measured, run.draw, run.loss_fn, run.micro_batch, A,
                      repeats=repeats, seed=10_000, bias_correction=cfg.bias_correction)
    log(f"GNS at step {run.step}: " + ", ".join(f"{g} {v['gns']:.1f}" for g, v in gns.items())
        + f"; controller EMA ({run.geometry}) {run.gns_ema:.1f}")
    res = run_probe(run.start, run.draw, run.loss_fn, run.evaluate, batch_sizes, seeds, samples,
                    run.lr_rule, tolerance=tolerance, cap=cap, evals=evals, log=log)
    summ = res["summary"]
    bc = summ["b_crit_median"]
    by_b = gns_by_batch(run, batch_sizes, repeats, cfg.bias_correction)

    def th(g, b=None):
        return theta_for(g, bc if b is None else b) if math.isfinite(g) and g > 0 else None

    def th_range(g):   # the seeds' spread of B_crit as a spread of theta (larger B, smaller theta)
        lo, hi = th(g, summ["b_crit_max"]), th(g, summ["b_crit_min"])
        return None if lo is None else [lo, hi]
    report = dict(
        run_dir=os.path.abspath(run_dir), step=run.step, samples_seen=run.samples_seen,
        batch_size=run.batch_size, micro_batch=run.micro_batch, optimizer=cfg.optimizer,
        run_geometry=run.geometry, run_theta=run.theta, bias_correction=cfg.bias_correction,
        criterion=dict(tolerance=tolerance, samples=samples, cap=cap, evals=evals,
                       batch_sizes=sorted(batch_sizes), seeds=list(seeds)),
        per_seed={str(s): dict(target=v["result"].target, b_crit=v["result"].b_crit,
                               b_crit_grid=v["result"].b_crit_grid, censored=v["result"].censored,
                               samples_to_target={str(B): x for B, x in v["result"].samples_to_target.items()},
                               ratios={str(B): x for B, x in v["result"].ratios.items()},
                               curves={str(B): [list(c[0]), list(c[1])] for B, c in v["curves"].items()})
                  for s, v in res["seeds"].items()},
        summary={k: v for k, v in summ.items() if k != "ratios"},
        ratios={str(B): v for B, v in summ["ratios"].items()},
        gns=dict(controller_ema=dict(geometry=run.geometry, gns=run.gns_ema,
                                     batch_asked_at_run_theta=(run.gns_ema / run.theta ** 2
                                                               if math.isfinite(run.gns_ema) else None),
                                     theta_for_b_crit=th(run.gns_ema),
                                     theta_range=th_range(run.gns_ema)),
                 fresh={g: dict(gns=v["gns"], noise=v["noise"], signal=v["signal"],
                                gns_each=v["gns_each"], theta_for_b_crit=th(v["gns"]),
                                theta_range=th_range(v["gns"]),
                                micro_batches=A, micro_batch=run.micro_batch, repeats=repeats)
                        for g, v in gns.items()},
                 # Algorithm 1's fixed point: GNS measured AT B_crit (log-log between the
                 # grid's measurements) / theta^2 = B_crit
                 at_batch={str(B): {g: v["gns"] for g, v in d.items()} for B, d in by_b.items()},
                 fixed_point_theta=fixed_point_thetas(by_b, bc)),
        seconds=time.time() - t0)
    return report


def format_report(r: dict) -> str:
    c, s = r["criterion"], r["summary"]
    lines = [f"probe of {r['run_dir']} at step {r['step']} ({r['samples_seen']} samples seen, batch "
             f"{r['batch_size']}, {r['optimizer']}, run geometry {r['run_geometry']} theta {r['run_theta']})",
             f"criterion: target = the B={min(c['batch_sizes'])} branch's validation loss after "
             f"{c['samples']} examples; B_crit = largest B with examples-to-target <= {c['tolerance']} x "
             f"B={min(c['batch_sizes'])}'s (interpolated in log B / log ratio); branches capped at "
             f"{c['cap']} x {c['samples']} examples; seeds {c['seeds']}",
             "", "examples to target / smallest B's: mean [min, max] over seeds (reached/of)"]
    for B, v in r["ratios"].items():
        cell = ("not reached" if v["mean"] is None else
                f"{v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}]")
        lines.append(f"  B={B:>5}  {cell}  ({v['reached']}/{v['of']})")
    lines.append("")
    for seed, v in r["per_seed"].items():
        flag = f" ({v['censored']})" if v["censored"] else ""
        lines.append(f"  seed {seed}: target {v['target']:.4f}  B_crit {v['b_crit']:.1f} "
                     f"(grid {v['b_crit_grid']}){flag}")
    lines.append(f"B_crit: median {s['b_crit_median']:.1f} [min {s['b_crit_min']:.1f}, max "
                 f"{s['b_crit_max']:.1f}] over seeds; grid median {s['b_crit_grid_median']}")
    lines.append("")
    e = r["gns"]["controller_ema"]
    est = "bias-corrected" if r["bias_correction"] else "raw (paper's)"
    lines.append(f"GNS at this point ({est} estimator) and theta at which Algorithm 1 asks for "
                 f"B_crit = {s['b_crit_median']:.1f} (theta = sqrt(GNS / B_crit)):")
    def fmt_th(v):
        x, rng = v["theta_for_b_crit"], v.get("theta_range")
        if x is None:
            return "-"
        return f"{x:.3f}" + ("" if rng is None else f" [{rng[0]:.3f}, {rng[1]:.3f} over the seeds' B_crit]")
    lines.append(f"  controller EMA ({e['geometry']}): GNS {e['gns']:.2f}, asks B = "
                 f"{e['batch_asked_at_run_theta'] or float('nan'):.1f} at the run's theta; "
                 f"theta for B_crit {fmt_th(e)}")
    for g, v in r["gns"]["fresh"].items():
        lines.append(f"  fresh {g:>7}: GNS {v['gns']:.2f} ({v['repeats']} measurements of "
                     f"{v['micro_batches']} x {v['micro_batch']}); theta for B_crit {fmt_th(v)}")
    lines.append("fresh GNS measured at each batch (B / b micro-batches of the run's b), and the "
                 "theta at which B_crit is Algorithm 1's fixed point (GNS at B_crit / theta^2 = B_crit; "
                 "the recommended theta: the one above holds only while the batch stays where it is, "
                 "because the measured GNS grows with the batch it is measured at):")
    geoms = list(r["gns"]["fixed_point_theta"])
    lines.append("  " + f"{'B':>6}" + "".join(f"{g:>10}" for g in geoms))
    for B, d in r["gns"]["at_batch"].items():
        lines.append("  " + f"{B:>6}" + "".join(f"{d[g]:>10.2f}" for g in geoms))
    lines.append("  " + f"{'theta':>6}" + "".join(
        f"{'-' if x is None else format(x, '.3f'):>10}" for x in r["gns"]["fixed_point_theta"].values()))
    lines.append(f"({r['seconds']:.0f} s)")
    return "\n".join(lines)


def _gns_only(args, Bs, out) -> int:
    bc = args.b_crit
    if bc is not None and not (math.isfinite(bc) and bc > 0):
        raise DemoError(f"--b-crit must be a finite number > 0, got {bc!r}")
    cfg, ck = load_run(args.run_dir)
    run = DemoRun(cfg, ck)
    by_b = gns_by_batch(run, Bs, args.repeats, cfg.bias_correction)
    geoms = list(next(iter(by_b.values())))
    fixed = fixed_point_thetas(by_b, bc) if bc is not None else {}
    lines = [f"GNS of {os.path.abspath(args.run_dir)} at step {run.step} measured at each batch "
             f"({'bias-corrected' if cfg.bias_correction else 'raw'} estimator, {args.repeats} measurements, "
             f"B / {run.micro_batch} micro-batches); controller EMA ({run.geometry}) {run.gns_ema:.2f}",
             "  " + f"{'B':>6}" + "".join(f"{g:>10}" for g in geoms)]
    for B, d in by_b.items():
        lines.append("  " + f"{B:>6}" + "".join(f"{d[g]['gns']:>10.2f}" for g in geoms))
    if bc is not None:
        lines.append(f"  theta at which B = {bc:g} is Algorithm 1's fixed point: " + ", ".join(
            f"{g} {'-' if x is None else format(x, '.3f')}" for g, x in fixed.items()))
    text = "\n".join(lines)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gns.json"), "w") as fh:
        json.dump(dict(step=run.step, controller_ema=run.gns_ema, b_crit=bc, fixed_point_theta=fixed,
                       at_batch={str(B): {g: v for g, v in d.items()} for B, d in by_b.items()}), fh, indent=1)
    print(text)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if not args.run_dir:
            raise DemoError("RUN_DIR: give a demo run folder holding checkpoint.pt and config.json")
        Bs = _ints(args.batch_sizes, "--batch-sizes")
        seeds = _ints(args.seeds, "--seeds")
        if len(Bs) < 2 or len(set(Bs)) != len(Bs) or min(Bs) < 1:
            raise DemoError(f"--batch-sizes: expected at least two distinct integers >= 1, got {args.batch_sizes!r}")
        if args.samples < min(Bs):
            raise DemoError(f"--samples ({args.samples}) must be at least the smallest batch ({min(Bs)})")
        if not (math.isfinite(args.tolerance) and args.tolerance >= 1):
            raise DemoError(f"--tolerance must be a finite number >= 1, got {args.tolerance!r}")
        if not (math.isfinite(args.cap) and args.cap >= args.tolerance):
            raise DemoError(f"--cap must be a finite number >= --tolerance, got {args.cap!r}")
        for name in ("evals", "repeats", "threads"):
            if getattr(args, name) < 1:
                raise DemoError(f"--{name} must be >= 1, got {getattr(args, name)!r}")
        out = args.out or args.run_dir
        torch.set_num_threads(args.threads)
        log = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
        if args.gns_only:
            return _gns_only(args, Bs, out)
        report = probe_run(args.run_dir, Bs, args.samples, seeds, args.tolerance, args.cap,
                           args.evals, args.repeats, log=log)
        text = format_report(report)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "probe.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        with open(os.path.join(out, "probe.txt"), "w") as fh:
            fh.write(text + "\n")
        print(text)
        return 0
    except DemoError as exc:
        print(f"gns-kernels probe: error: {exc}", file=sys.stderr)
        return 2
