"""``gns-kernels demo --compare --preset paper-cpu``: the paper's Table 2 protocol on a CPU.

Protocol (per optimizer of `Protocol.optimizers`, Signum and Muon by default):

1. **B_0 grid.** Constant-batch runs at every B of `Protocol.grid_for(optimizer)` and every
   peak LR of `Protocol.lrs_for(optimizer)` with every seed of `Protocol.select_seeds()`
   (all seeds by default), the same sample budget and the same LR schedule shape on
   samples (no LR scaling with B). (B_0, its LR) is the pair with the lowest final
   validation loss averaged over those seeds (ties: the smaller batch, then the smaller
   LR). One seed's grid is noise-dominated: its differences (0.001-0.005 here) are smaller
   than the seed-to-seed spread (up to 0.024), so a single-seed choice favours whichever
   setting drew a lucky seed.
2. **Runs.** With several LRs, Algorithm 1 from B_0 with the Euclidean (l2) GNS at theta
   0.3 and with the GNS in the optimizer's geometry (l1 for Signum, nuclear for Muon) at
   theta 0.6 first run at every LR on the same selection seeds; each keeps the LR of its
   lowest mean final loss (the paper tunes every method's LR). Then for every seed: the
   constant baseline at (B_0, its LR) and the two adaptive runs at their LRs (runs the
   grid or the search already made are reused). Every run sees the same sample budget
   and LR schedule shape; the adaptive runs multiply the LR by sqrt(B/B_0) (the paper's
   rule).
3. **Table** (`paper_table`), Table 2 layout: median final validation loss over the seeds
   (with the seeds' min and max), and the median over seeds of the steps reduction: for
   seed s, target_s = min validation loss of the baseline of seed s, n_base = the first
   step at which that baseline logged target_s, n_run = the first step at which the
   adaptive run of seed s logged a validation loss <= target_s; reduction =
   100 (n_base - n_run) / n_base (a run that never reaches target_s counts as "not
   reached", below every number, in the median).

A finished run (its folder holds summary.json and a config.json equal to the run's
configuration) is reused, so an interrupted protocol continues where it stopped.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace

from .config import OPTIMIZERS, DemoConfig, DemoError, check_theta, validate
from .plots import finish_figure

# options the preset fixes (every other DemoConfig field keeps its default). Why these:
# - ranks 1 x 2 micro-batches: R = 2 GNS samples as with 2 ranks, without a second process
#   (the cheapest set-up on a 2-core machine);
# - a 30k-parameter model (width 32, 1 layer, MLP 96) and 200000 sequences of 64 bytes
#   (12.8M bytes, about 400 per parameter): the constant baselines' validation loss
#   flattens long before the budget ends, as the protocol asks, and a step is cheap
#   enough for ~20 runs on 2 cores (at 20 and 5 bytes per parameter the adaptive runs
#   missed the baseline's loss too: docs/demo.md, "Results");
# - val_windows 512 every 100 steps: 32768 validation bytes, the same windows for every run;
# - lr_min_ratio 0: the cosine decays to zero (the paper's "learning rate min fraction 0.0");
# - bias_correction False: the paper's estimator (no c4(R) correction of the l1 / nuclear
#   noise), which theta 0.6 / 0.3 were chosen for; the corrected noise at R = 2 is
#   1/c4(2)^2 = pi/2 times larger, so the same theta would ask for batches about 1.57x the
#   paper's.
PRESETS: dict[str, dict] = {
    "paper-cpu": dict(ranks=1, micro_batches=2, dim=32, layers=1, heads=2, mlp=96, context=64,
                      samples=200000, eval_every=100, val_windows=512, every=5,
                      max_batch_size=512, max_local_batch=64, checkpoint_every=100000,
                      bias_correction=False, lr_min_ratio=0.0),
}
# the 20-bytes-per-parameter regime of issue 34 (docs/record/demo-experiments.md): the
# same protocol with an 84,720-parameter model and 26475 sequences (1.69M bytes), the
# constant baselines step-limited rather than flat at the end
PRESETS["paper-cpu-20"] = dict(PRESETS["paper-cpu"], dim=48, layers=2, heads=4, mlp=144,
                               samples=26475, eval_every=50)


@dataclass(frozen=True)
class Protocol:
    """What the preset runs besides the DemoConfig fields: optimizers, seeds, B_0 grids, the
    peak learning rates searched per optimizer, and the seeds the choices are made on.

    grid: the constant batch sizes of the B_0 grid; grids: ((optimizer, (B, ...)), ...)
    per-optimizer grids that replace it. The defaults were pruned from a first-seed search
    over B 16-128 x 3-4 LRs (docs/demo.md) so that three seeds of every setting fit: B = 128
    was 0.014-0.08 worse than the best at every LR for both optimizers, Signum at 1e-3 and
    2e-3 worse than 4e-3 at all but one B (2e-3 at B = 16 on three seeds: 1.6080 / 1.6232 /
    1.6135, against 1.6017 at 4e-3 on the first), Muon at 0.02 worse than 0.01 at all but
    one B; Muon's optimum sat at the lower edge (16) and B = 8 was better still on that
    seed, so its grid is 8/16/32.
    lrs: ((optimizer, (lr, ...)), ...); an optimizer not listed (or listed with ()) runs at
    its default LR only. With several LRs the constant grid runs every (B, lr) pair and
    each adaptive kind (l2, geometry-matched) runs every lr; each keeps the LR with the
    lowest final validation loss (the paper tunes the LR of every method from a grid, its
    Table "hyperparameter search space"). select: "all" (default) makes every choice on
    the mean final loss over all seeds (the grid and the search run on every seed);
    "first" on the first seed only (cheaper, but the choice then follows that seed's
    noise)."""
    optimizers: tuple = ("signum", "muon")
    seeds: tuple = (0, 1, 2)
    grid: tuple = (16, 32, 64)
    grids: tuple = (("muon", (8, 16, 32)),)
    lrs: tuple = (("signum", (4e-3, 8e-3)), ("muon", (0.005, 0.01)), ("signsgd", (4e-3, 8e-3)))
    select: str = "all"

    def lrs_for(self, optimizer: str) -> tuple:
        """The LRs searched for `optimizer`: (None,) (its default) when none are listed.
        DemoError for a non-positive LR or two LRs that would share a run folder."""
        for name, values in self.lrs:
            if name == optimizer and values:
                out = tuple(float(v) for v in values)
                if not all(math.isfinite(v) and v > 0 for v in out):
                    raise DemoError(f"Protocol.lrs[{optimizer!r}]: LRs must be finite and > 0, got {values!r}")
                tags = [_lr_tag(v) for v in out]
                if len(set(tags)) != len(tags):
                    raise DemoError(f"Protocol.lrs[{optimizer!r}]: {values!r} holds LRs that are equal "
                                    "to 6 significant figures (their runs would share a folder)")
                return out
        return (None,)

    def grid_for(self, optimizer: str) -> tuple:
        """The B_0 grid of `optimizer` (its `grids` entry, else `grid`). DemoError unless it
        is a non-empty list of distinct integers >= 1."""
        values, where = self.grid, "Protocol.grid"
        for name, vals in self.grids:
            if name == optimizer:
                values, where = vals, f"Protocol.grids[{optimizer!r}]"
        ok = (len(values) > 0 and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                      for b in values))
        if not ok or len(set(values)) != len(values):
            raise DemoError(f"{where}: expected distinct integer batch sizes >= 1, got {values!r}")
        return tuple(values)

    def select_seeds(self) -> tuple:
        """The seeds the B_0 grid and the LR search run on and are chosen by (their mean
        final loss): every seed for select='all', the first for 'first'."""
        if not self.seeds:
            raise DemoError("Protocol.seeds: expected at least one seed, got ()")
        if self.select == "all":
            return tuple(self.seeds)
        if self.select == "first":
            return tuple(self.seeds[:1])
        raise DemoError(f"Protocol.select: expected 'all' or 'first', got {self.select!r}")


PROTOCOLS = {"paper-cpu": Protocol(), "paper-cpu-20": Protocol()}


def apply_preset(cfg: DemoConfig, name: str, keep=()) -> DemoConfig:
    """cfg with the preset's options, except the DemoConfig fields named in keep (the ones
    the user set explicitly: an explicit flag wins over the preset); DemoError for an
    unknown name."""
    if name not in PRESETS:
        raise DemoError(f"unknown --preset {name!r}; expected one of {', '.join(sorted(PRESETS))}")
    keep = set(keep)
    return replace(cfg, **{k: v for k, v in PRESETS[name].items() if k not in keep})


def steps_to_reach(metrics: dict, target: float) -> int | None:
    """Optimizer steps taken (1-based) when the run first logged a validation loss <= target;
    None when it never did."""
    for s, v in zip(metrics["step"], metrics["val_loss"]):
        if not math.isnan(v) and v <= target:
            return int(s) + 1
    return None


def reduction(base_steps: int | None, run_steps: int | None) -> float | None:
    """100 (base - run) / base in percent; None when either is missing (not reached)."""
    if run_steps is None or not base_steps:
        return None
    return 100.0 * (base_steps - run_steps) / base_steps


def median_with_missing(values: list) -> float | None:
    """Median where None ("not reached") ranks below every number; None when the median
    falls on a None (or between a None and a number)."""
    if not values:
        return None
    order = sorted(values, key=lambda v: (v is not None, -math.inf if v is None else v))
    n = len(order)
    mid = order[(n - 1) // 2: n // 2 + 1]
    if any(v is None for v in mid):
        return None
    return sum(mid) / len(mid)


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of finite values."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return (math.nan, math.nan, math.nan)
    n = len(vals)
    med = (vals[(n - 1) // 2] + vals[n // 2]) / 2
    return (med, vals[0], vals[-1])


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def seed_rows(metrics: dict[str, dict], kinds: tuple = ("euclidean", "adaptive")) -> dict:
    """Per-seed arithmetic of one optimizer. `metrics` maps "baseline", and each of `kinds`
    to read_metrics(...) dicts of ONE seed. Returns {"target", "base_steps", kind:
    {"steps", "reduction"}}."""
    base = metrics["baseline"]
    vals = [v for v in base["val_loss"] if not math.isnan(v)]
    target = min(vals)
    base_steps = steps_to_reach(base, target)
    out = {"target": target, "base_steps": base_steps}
    for k in kinds:
        s = steps_to_reach(metrics[k], target)
        out[k] = {"steps": s, "reduction": reduction(base_steps, s)}
    return out


def _last_logged(m: dict) -> float:
    return [v for v in m["val_loss"] if not math.isnan(v)][-1]


def add_closeness(seeds: list[dict], seed_metrics: list[dict],
                  kinds: tuple = ("euclidean", "adaptive")) -> None:
    """How close the adaptive runs come when they miss the target, per seed (in place):

    - ``loose``: the steps reduction to reach the upper end of the baseline's seed spread
      (the largest final validation loss logged by the baselines of all seeds), n_base and
      n_run both counted to that loss;
    - ``at_final``: 100 (n_b - n_run) / n_b with n_run the run's total steps and n_b the
      steps the baseline of that seed needed to first log the run's final loss (None when
      the baseline never got that low: the run is better than the baseline).
    """
    loose = max(_last_logged(m["baseline"]) for m in seed_metrics)
    for row, mets in zip(seeds, seed_metrics):
        nb = steps_to_reach(mets["baseline"], loose)
        row["loose_target"], row["loose_base_steps"] = loose, nb
        for k in kinds:
            nr = steps_to_reach(mets[k], loose)
            nb_final = steps_to_reach(mets["baseline"], _last_logged(mets[k]))
            row[k]["loose_steps"] = nr
            row[k]["loose_reduction"] = reduction(nb, nr)
            row[k]["base_steps_to_final"] = nb_final
            row[k]["at_final"] = reduction(nb_final, len(mets[k]["step"]))


def paper_table(per_opt: dict[str, dict]) -> str:
    """Table 2 layout. per_opt[optimizer] = {"B0": int, "labels": {kind: label},
    "seeds": [{"final": {kind: loss}, "steps": {kind: total steps}, **seed_rows(...)}]}
    with kinds "baseline", "euclidean", "adaptive"."""
    kinds = ("baseline", "euclidean", "adaptive")
    lines = []
    head = (f"{'Optimizer':<10}{'B_0':>5}{'constant B_0':>26}{'Euclidean GNS (l2)':>26}"
            f"{'Non-Euclidean GNS':>26}{'Steps reduction(%) l2':>23}{'Steps reduction(%) non-Eucl.':>30}")
    lines.append(head)
    for opt, d in per_opt.items():
        cells = []
        for k in kinds:
            med, lo, hi = spread([s["final"][k] for s in d["seeds"]])
            cells.append(f"{med:.4f} [{lo:.4f}, {hi:.4f}]")
        red = {k: median_with_missing([s[k]["reduction"] for s in d["seeds"]])
               for k in ("euclidean", "adaptive")}
        lines.append(f"{opt:<10}{d['B0']:>5}" + "".join(f"{c:>26}" for c in cells)
                     + f"{_fmt_pct(red['euclidean']):>23}{_fmt_pct(red['adaptive']):>30}")
    lines.append("")
    lines.append("losses: median over seeds [min, max]; steps reduction: median over seeds")
    for opt, d in per_opt.items():
        if any(v is not None for v in (d.get("lr") or {}).values()):
            lr = d["lr"]
            lines.append(f"peak LR, {opt}: constant {_fmt_lr(lr.get('baseline'))}, l2 "
                         f"{_fmt_lr(lr.get('euclidean'))}, {d.get('geometry', 'geom')} "
                         f"{_fmt_lr(lr.get('adaptive'))}")
    lines.append("")
    lines.append(f"{'optimizer':<10}{'seed':>5}{'target':>9}{'base steps':>11}"
                 + "".join(f"{'  ' + n + ' steps/total/final/red%':>38}" for n in ("l2", "geom")))
    for opt, d in per_opt.items():
        for i, s in enumerate(d["seeds"]):
            row = f"{opt:<10}{d['seeds_used'][i]:>5}{s['target']:>9.4f}{str(s['base_steps']):>11}"
            for k in ("euclidean", "adaptive"):
                reach = "-" if s[k]["steps"] is None else str(s[k]["steps"])
                row += (f"{reach:>12}/{s['steps'][k]:>6}/{s['final'][k]:.4f}/"
                        f"{_fmt_pct(s[k]['reduction']):>7}")
            lines.append(row)
    if all("loose_target" in s for d in per_opt.values() for s in d["seeds"]):
        lines.append("")
        lines.append("how close (median over seeds): steps reduction to reach the upper end of the "
                     "baseline's seed spread (its worst seed's final loss); steps reduction at the "
                     "run's own final loss (baseline steps to that loss vs the run's steps)")
        lines.append(f"{'optimizer':<10}{'spread end':>11}{'l2 to spread':>14}{'l2 at final':>13}"
                     f"{'geom to spread':>16}{'geom at final':>15}")
        for opt, d in per_opt.items():
            cells = []
            for k in ("euclidean", "adaptive"):
                cells.append(median_with_missing([s[k]["loose_reduction"] for s in d["seeds"]]))
                cells.append(median_with_missing([s[k]["at_final"] for s in d["seeds"]]))
            lines.append(f"{opt:<10}{d['seeds'][0]['loose_target']:>11.4f}{_fmt_pct(cells[0]):>14}"
                         f"{_fmt_pct(cells[1]):>13}{_fmt_pct(cells[2]):>16}{_fmt_pct(cells[3]):>15}")
    lines.append("")
    lines.append("final-loss gap to the same seed's baseline (run final - baseline final): "
                 "mean [min, max] over seeds; a positive gap is a worse run")
    lines.append(f"{'optimizer':<10}{'l2 gap':>28}{'geom gap':>28}")
    for opt, d in per_opt.items():
        cells = [_fmt_gap(paired_gaps(d["seeds"], k)) for k in ("euclidean", "adaptive")]
        lines.append(f"{opt:<10}{cells[0]:>28}{cells[1]:>28}")
    return "\n".join(lines)


def paired_gaps(seeds: list[dict], kind: str) -> list[float]:
    """Per seed, the final validation loss of run `kind` minus that of the same seed's
    baseline. Same-seed pairs share the initial model and data order, so the seed-to-seed
    spread (0.007-0.024 of the final loss here) cancels from the difference: a gap that
    keeps its sign over the seeds is a systematic difference even when the run's median
    lies inside the baselines' spread."""
    return [s["final"][kind] - s["final"]["baseline"] for s in seeds]


def _fmt_gap(gaps: list[float]) -> str:
    vals = [g for g in gaps if math.isfinite(g)]
    if not vals:
        return "-"
    return f"{sum(vals) / len(vals):+.4f} [{min(vals):+.4f}, {max(vals):+.4f}]"


def _lr_tag(lr: float | None) -> str:
    """Run-folder suffix of a searched LR ('' for the optimizer's default)."""
    return "" if lr is None else f"_lr{lr:g}"


def _fmt_lr(lr: float | None) -> str:
    return "default" if lr is None else f"{lr:g}"


def _finals(summaries: list) -> str:
    return "/".join(f"{r['final_val_loss']:.4f}" for r in summaries)


def _mean_final(summaries: list) -> float:
    return sum(r["final_val_loss"] for r in summaries) / len(summaries)


def grid_table(grid: dict[str, list]) -> str:
    """The B_0 grid: mean final validation loss over the selection seeds, each seed's final
    loss, steps and mean seconds per optimizer, B and peak LR. grid[optimizer] = [(B, lr
    or None, [summary per selection seed]), ...]."""
    lines = [f"{'optimizer':<10}{'B':>6}{'lr':>9}{'mean final':>11}  {'final val per seed':<26}"
             f"{'steps':>7}{'seconds':>9}"]
    for opt, runs in grid.items():
        for B, lr, rs in sorted(runs, key=lambda t: (t[0], t[1] or 0.0)):
            secs = sum(r["elapsed_s"] for r in rs) / len(rs)
            lines.append(f"{opt:<10}{B:>6}{_fmt_lr(lr):>9}{_mean_final(rs):>11.4f}  {_finals(rs):<26}"
                         f"{rs[0]['steps']:>7}{secs:>9.0f}")
    return "\n".join(lines)


def lr_table(tuning: dict[str, list]) -> str:
    """The adaptive runs' LR search on the selection seeds. tuning[optimizer] = [(kind label,
    lr, [summary per selection seed]), ...]."""
    lines = [f"{'optimizer':<10}{'run':<28}{'lr':>9}{'mean final':>11}  {'final val per seed':<26}"
             f"{'steps':>7}{'final B':>9}{'seconds':>9}"]
    for opt, runs in tuning.items():
        for label, lr, rs in runs:
            secs = sum(r["elapsed_s"] for r in rs) / len(rs)
            lines.append(f"{opt:<10}{label:<28}{_fmt_lr(lr):>9}{_mean_final(rs):>11.4f}  "
                         f"{_finals(rs):<26}{rs[0]['steps']:>7}{rs[0]['final_batch_size']:>9}"
                         f"{secs:>9.0f}")
    return "\n".join(lines)


def _finished(rc: DemoConfig) -> dict | None:
    """The summary of a finished run with exactly rc's configuration in rc.out, else None."""
    from .config import RUN_ONLY_KEYS
    sj, cj = os.path.join(rc.out, "summary.json"), os.path.join(rc.out, "config.json")
    if not (os.path.exists(sj) and os.path.exists(cj)):
        return None
    with open(cj) as fh:
        saved = json.load(fh)
    mine = asdict(rc)
    if any(saved.get(k) != v for k, v in mine.items() if k not in RUN_ONLY_KEYS):
        return None
    with open(sj) as fh:
        return json.load(fh)


def _run(rc: DemoConfig, log) -> tuple[dict, dict]:
    from .launch import launch
    from .plots import read_metrics
    from .rundir import check_out_dir, prepare_out_dir

    done = _finished(rc)
    if done is None:
        check_out_dir(rc.out)
        prepare_out_dir(rc.out, overwrite=True)
        t = time.time()
        done = launch(rc)
        if done is None:
            raise DemoError(f"run {rc.out} failed")
        log(f"  {rc.label:<32} {rc.optimizer:<7} seed {rc.seed}: final val {done['final_val_loss']:.4f}, "
            f"{done['steps']} steps, B {rc.initial_batch_size} -> {done['final_batch_size']} "
            f"({time.time() - t:.0f}s)")
    else:
        log(f"  {rc.label:<32} {rc.optimizer:<7} seed {rc.seed}: reused ({done['final_val_loss']:.4f})")
    return done, read_metrics(os.path.join(rc.out, "metrics.csv"))


def _const_folder(B: int, lr: float | None, seed: int, first_seed: int) -> str:
    """Run folder of a constant-batch run (the first seed's is the grid's historical name)."""
    return (f"grid_B{B}{_lr_tag(lr)}" if seed == first_seed
            else f"const_B{B}{_lr_tag(lr)}_seed{seed}")


def _theta_tag(theta: float | None) -> str:
    return "" if theta is None else f"_th{theta:.6g}"


def seed_configs(base_cfg: DemoConfig, B0: int, seed: int, grid_seed: int, folder: str,
                 lrs: dict | None = None, theta: float | None = None) -> dict:
    """The three runs of one seed: {"baseline", "euclidean", "adaptive"} -> DemoConfig with
    its run folder under `folder` (the baseline of grid_seed is the grid's run at B0).
    lrs: kind -> peak LR (None or missing: the optimizer's default). theta: Algorithm 1's
    theta of the geometry-matched run (None: 0.6; its folder and label then name no
    theta), e.g. from ``--theta`` or the critical-batch probe; the l2 run keeps 0.3."""
    lrs = lrs or {}
    geom = base_cfg.resolved_geometry()
    lb, le, la = (lrs.get(k) for k in ("baseline", "euclidean", "adaptive"))
    base_out = _const_folder(B0, lb, seed, grid_seed)
    geom_label = f"Non-Euclidean GNS ({geom})" + ("" if theta is None else f" theta {theta:g}")
    return {
        "baseline": replace(base_cfg, adaptive=False, initial_batch_size=B0, seed=seed, lr=lb,
                            label=f"B={B0}", multiple_of=None, out=os.path.join(folder, base_out)),
        "euclidean": replace(base_cfg, adaptive=True, initial_batch_size=B0, seed=seed, lr=le,
                             geometry="l2", label="Euclidean GNS (l2)",
                             out=os.path.join(folder, f"l2{_lr_tag(le)}_seed{seed}")),
        "adaptive": replace(base_cfg, adaptive=True, initial_batch_size=B0, seed=seed, lr=la,
                            theta=theta, label=geom_label,
                            out=os.path.join(folder, f"{geom}{_lr_tag(la)}{_theta_tag(theta)}_seed{seed}")),
    }


def _run_all(rcs: list[DemoConfig], log, jobs: int) -> list[tuple[dict, dict]]:
    """_run of every config, `jobs` at a time (threads, each waiting on its own spawned
    run), results in the order of `rcs`."""
    for rc in rcs:
        validate(rc)
    if jobs <= 1 or len(rcs) <= 1:
        return [_run(rc, log) for rc in rcs]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda rc: _run(rc, log), rcs))


def run_paper(cfg: DemoConfig, protocol: Protocol, top: str, log=print, jobs: int = 1) -> dict:
    """The whole protocol into folder `top` (one sub-folder per run); writes paper.txt,
    paper.json and paper_<optimizer>.png there and returns {"table", "grid_table", ...}.

    `jobs` runs at a time (first every grid run, then every seed's runs); with jobs > 1 and
    OMP_NUM_THREADS unset, each run's process gets cpu_count // jobs threads."""
    from .plots import plots_available
    from .rundir import check_out_dir

    if not isinstance(jobs, int) or jobs < 1:
        raise DemoError(f"--jobs must be an integer >= 1, got {jobs!r}")
    if jobs > 1 and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    t0 = time.time()
    per_opt, grid_res, curves = {}, {}, {}
    theta = cfg.theta   # --theta: the geometry-matched runs' (the l2 runs keep 0.3)
    check_theta(theta)
    base_cfgs = {opt: replace(cfg, optimizer=opt, geometry=None, theta=None, lr=None)
                 for opt in protocol.optimizers}
    for opt, bc in base_cfgs.items():
        validate(bc)
        if bc.resolved_geometry() == "l2":
            usable = [o for o in OPTIMIZERS if replace(bc, optimizer=o).resolved_geometry() != "l2"]
            raise DemoError(f"--optimizer {opt}: its GNS geometry is l2, so the protocol's "
                            "geometry-matched run would be a second l2 run; use an optimizer "
                            f"with an l1 or nuclear geometry ({', '.join(usable)})")
    top = check_out_dir(top)
    lrs = {opt: protocol.lrs_for(opt) for opt in protocol.optimizers}
    first = protocol.seeds[0]
    sel = protocol.select_seeds()
    grids = {opt: protocol.grid_for(opt) for opt in protocol.optimizers}
    # 1. grid of constant batches x peak LRs, on every selection seed
    grid_keys = [(opt, B, lr) for opt in protocol.optimizers for B in grids[opt] for lr in lrs[opt]]
    grid_rcs = [replace(base_cfgs[opt], adaptive=False, initial_batch_size=B, lr=lr, seed=seed,
                        label=f"B={B}", multiple_of=None,
                        out=os.path.join(top, opt, _const_folder(B, lr, seed, first)))
                for opt, B, lr in grid_keys for seed in sel]
    done = _run_all(grid_rcs, log, jobs)
    for i, (opt, B, lr) in enumerate(grid_keys):
        summaries = [summary for summary, _ in done[i * len(sel):(i + 1) * len(sel)]]
        grid_res.setdefault(opt, []).append((B, lr, summaries))
    B0s, tuned = {}, {}
    for opt in protocol.optimizers:
        B0, lr0, _ = min(grid_res[opt], key=lambda t: (_mean_final(t[2]), t[0], t[1] or 0.0))
        B0s[opt] = B0
        tuned[opt] = {"baseline": lr0, "euclidean": lr0, "adaptive": lr0}
        log(f"{opt}: B_0 = {B0}, lr {_fmt_lr(lr0)} (lowest mean final validation loss of the "
            f"grid over seeds {', '.join(str(x) for x in sel)})")
    # 2. the adaptive runs' LR search on the selection seeds (only where several LRs are listed)
    tune_keys = [(opt, lr, k) for opt in protocol.optimizers if len(lrs[opt]) >= 2
                 for lr in lrs[opt] for k in ("euclidean", "adaptive")]
    tune_rcs = [seed_configs(base_cfgs[opt], B0s[opt], seed, first, os.path.join(top, opt),
                             {"baseline": tuned[opt]["baseline"], "euclidean": lr,
                              "adaptive": lr}, theta)[k]
                for opt, lr, k in tune_keys for seed in sel]
    done = _run_all(tune_rcs, log, jobs)
    tuning, searched = {}, {}
    for i, (opt, lr, k) in enumerate(tune_keys):
        summaries = [summary for summary, _ in done[i * len(sel):(i + 1) * len(sel)]]
        tuning.setdefault(opt, []).append((tune_rcs[i * len(sel)].label, lr, summaries))
        searched.setdefault((opt, k), []).append((lr, summaries))
    for opt in tuning:
        for k in ("euclidean", "adaptive"):
            tuned[opt][k] = min(searched[(opt, k)], key=lambda t: (_mean_final(t[1]), t[0]))[0]
        log(f"{opt}: lr l2 {_fmt_lr(tuned[opt]['euclidean'])}, "
            f"{base_cfgs[opt].resolved_geometry()} {_fmt_lr(tuned[opt]['adaptive'])} "
            f"(lowest mean final validation loss over seeds {', '.join(str(x) for x in sel)})")
    # 3. baseline, l2 and geometry-matched adaptive runs per seed
    seed_runs = {(opt, seed): seed_configs(base_cfgs[opt], B0s[opt], seed, first,
                                           os.path.join(top, opt), tuned[opt], theta)
                 for opt in protocol.optimizers for seed in protocol.seeds}
    order = [(key, k) for key, runs in seed_runs.items() for k in runs]
    order.sort(key=lambda item: item[1] != "baseline")  # the longest runs (constant B_0) first
    done = dict(zip(order, _run_all([seed_runs[key][k] for key, k in order], log, jobs)))
    for opt in protocol.optimizers:
        geom, B0 = base_cfgs[opt].resolved_geometry(), B0s[opt]
        seeds, curves[opt], seed_mets = [], {}, []
        for seed in protocol.seeds:
            runs = seed_runs[(opt, seed)]
            summ = {k: done[((opt, seed), k)][0] for k in runs}
            mets = {k: done[((opt, seed), k)][1] for k in runs}
            row = seed_rows(mets)
            row["final"] = {k: summ[k]["final_val_loss"] for k in runs}
            row["steps"] = {k: summ[k]["steps"] for k in runs}
            seeds.append(row)
            curves[opt][seed] = {runs[k].label: mets[k] for k in runs}
            seed_mets.append(mets)
        add_closeness(seeds, seed_mets)
        per_opt[opt] = {"B0": B0, "seeds": seeds, "seeds_used": list(protocol.seeds),
                        "geometry": geom, "lr": dict(tuned[opt])}
    table = paper_table(per_opt)
    gtable = grid_table(grid_res)
    ltable = lr_table(tuning) if tuning else ""
    with open(os.path.join(top, "paper.txt"), "w") as fh:
        seeds_txt = "seeds " + ", ".join(str(x) for x in sel)
        fh.write(table + f"\n\nB_0 grid ({seeds_txt}):\n" + gtable + "\n")
        if ltable:
            fh.write(f"\nadaptive runs' LR search ({seeds_txt}):\n" + ltable + "\n")
    with open(os.path.join(top, "paper.json"), "w") as fh:
        json.dump({"per_optimizer": per_opt,
                   "selection_seeds": list(sel),
                   "grid": {o: [{"B": b, "lr": lr, "mean_final_val_loss": _mean_final(rs),
                                 "runs": rs} for b, lr, rs in g]
                            for o, g in grid_res.items()},
                   "lr_search": {o: [{"run": lab, "lr": lr, "mean_final_val_loss": _mean_final(rs),
                                      "runs": rs} for lab, lr, rs in g]
                                 for o, g in tuning.items()},
                   "config": asdict(cfg), "protocol": asdict(protocol)}, fh, indent=1)
    plots = []
    if plots_available():
        for opt in protocol.optimizers:
            path = os.path.join(top, f"paper_{opt}.png")
            plot_paper(curves[opt], path, title=f"{opt}: constant B_0={per_opt[opt]['B0']} vs "
                       f"adaptive (Algorithm 1), {cfg.samples} sequences each, "
                       f"{len(protocol.seeds)} seeds")
            plots.append(path)
    log(table)
    log("\nB_0 grid:\n" + gtable)
    if ltable:
        log("\nadaptive runs' LR search:\n" + ltable)
    log(f"protocol folder: {top} (paper.txt, paper.json, {', '.join(os.path.basename(p) for p in plots)}) "
        f"in {time.time() - t0:.0f}s")
    return {"table": table, "grid_table": gtable, "per_optimizer": per_opt, "plots": plots}


def plot_paper(curves: dict[int, dict[str, dict]], path: str, title: str | None = None) -> str:
    """Four panels: validation loss vs steps, validation loss vs samples, batch size vs
    steps, batch size vs samples; curves[seed][label] = read_metrics(...); one colour per
    label, one line per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    labels = []
    for runs in curves.values():
        for lab in runs:
            if lab not in labels:
                labels.append(lab)
    for j, (seed, runs) in enumerate(curves.items()):
        for lab, m in runs.items():
            c = f"C{labels.index(lab)}"
            pts = [(s, n, v) for s, n, v in zip(m["step"], m["samples"], m["val_loss"])
                   if not math.isnan(v)]
            kw = dict(color=c, alpha=0.85 if j == 0 else 0.45, lw=1.2,
                      label=lab if j == 0 else None)
            axes[0, 0].plot([p[0] + 1 for p in pts], [p[2] for p in pts], **kw)
            axes[0, 1].plot([p[1] for p in pts], [p[2] for p in pts], **kw)
            axes[1, 0].plot([s + 1 for s in m["step"]], m["batch_size"], drawstyle="steps-post", **kw)
            axes[1, 1].plot(m["samples"], m["batch_size"], drawstyle="steps-post", **kw)
    for ax in axes[0]:
        ax.set_ylabel("validation loss (nats/byte)")
        lo = min(min(v for v in m["val_loss"] if not math.isnan(v))
                 for runs in curves.values() for m in runs.values())
        ax.set_ylim(lo - 0.05, lo + 0.8)
    for ax in axes[1]:
        ax.set_ylabel("global batch size (sequences)")
        ax.set_yscale("log", base=2)
    for ax in axes[:, 0]:
        ax.set_xlabel("optimizer steps")
    for ax in axes[:, 1]:
        ax.set_xlabel("samples (sequences)")
    return finish_figure(fig, axes, path, title, dpi=90)
