"""End of a demo run (rank 0): plot.png, summary.json and the closing lines."""
from __future__ import annotations

import json
import os

from .config import DemoConfig


def finish(cfg: DemoConfig, steps, samples, last_val, best_val, ctrl, last_B, geometry, theta,
           elapsed, corpus) -> dict:
    """Write plot.png (when matplotlib is installed; one line says so otherwise) and
    summary.json into cfg.out; print the result line unless cfg.quiet. Returns the summary."""
    from .plots import plot_run, plots_available

    metrics_path = os.path.join(cfg.out, "metrics.csv")
    plot_path = None
    if plots_available():
        plot_path = plot_run(metrics_path, os.path.join(cfg.out, "plot.png"),
                             title=f"{cfg.optimizer}, {geometry} GNS, theta={theta:g}, "
                                   f"{cfg.ranks} ranks", label=cfg.label)
    else:
        print("plot.png skipped: matplotlib is not installed (pip install matplotlib, or the "
              "package's 'demo' extra)", flush=True)
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
    return summary
