"""``gns-kernels demo --compare``: four runs with the same sample budget (constant small
batch, constant large batch with the sqrt-scaled LR, adaptive with the Euclidean GNS,
adaptive in the optimizer's geometry) and a table in the layout of the paper's Table 2."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace

from .config import DemoConfig, DemoError, validate
from .launch import is_main_process, launch, torchrun_world
from .rundir import check_out_dir, default_out, prepare_out_dir


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


def run_compare(cfg: DemoConfig, large_factor: int, overwrite: bool = False) -> int:
    """The four runs one after another in sub-folders of cfg.out; prints the table."""
    from .plots import plot_runs, plots_available, read_metrics

    validate(cfg, torchrun_world())
    if large_factor < 2:
        raise DemoError(f"--large-factor must be >= 2, got {large_factor}")
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
    for rc in runs.values():  # every run's options are checked before the first starts
        validate(rc, torchrun_world())
    top = prepare_out_dir(cfg.out or default_out("compare-"), overwrite)
    results, metrics = {}, {}
    t0 = time.time()
    for key, rc in runs.items():
        rc = replace(rc, out=check_out_dir(os.path.join(top, key)))
        if is_main_process() and not cfg.quiet:
            print(f"== {rc.label}: {rc.optimizer}, geometry {rc.resolved_geometry()}, "
                  f"B0={rc.initial_batch_size}, {'adaptive' if rc.adaptive else 'constant'}", flush=True)
        summary = launch(rc)
        if summary is None:
            return 1
        results[key] = summary
        metrics[key] = read_metrics(os.path.join(rc.out, "metrics.csv"))
    if not is_main_process():
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
