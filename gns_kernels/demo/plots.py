"""Plots of the demo runs in the layout of the paper's Figure 1 / Figure 3 panels.

One row of three panels against optimizer steps: validation loss, global batch size, GNS
(raw measurements as dots, the controller's EMA N/M as a line). `plot_run` draws one run
(metrics.csv of `gns-kernels demo`), `plot_runs` overlays several (``--compare``).
matplotlib is imported lazily with the non-interactive Agg backend; it is an optional
dependency (extras "demo"/"test"): without it `plots_available()` is False and the demo
skips the picture.
"""
from __future__ import annotations

import csv
import math

__all__ = ["plots_available", "read_metrics", "plot_run", "plot_runs"]


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _num(text: str) -> float:
    return float(text) if text not in ("", None) else math.nan


def read_metrics(path: str) -> dict[str, list[float]]:
    """Columns of a metrics.csv as lists of floats (empty cells -> nan)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return {}
    return {key: [_num(r[key]) for r in rows] for key in rows[0]}


def _series(m, key):
    xs, ys = [], []
    for x, y in zip(m["step"], m[key]):
        if not math.isnan(y):
            xs.append(x)
            ys.append(y)
    return xs, ys


def plot_runs(runs: dict[str, dict[str, list[float]]], path: str, title: str | None = None) -> str:
    """Overlay runs {label: read_metrics(...)} in three panels; writes a PNG to `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (label, m) in enumerate(runs.items()):
        color = f"C{i}"
        axes[0].plot(*_series(m, "val_loss"), color=color, marker=".", label=label)
        axes[1].plot(m["step"], m["batch_size"], color=color, label=label, drawstyle="steps-post")
        xs, ys = _series(m, "gns_raw")
        axes[2].plot(xs, ys, ".", color=color, alpha=0.35, markersize=3)
        axes[2].plot(*_series(m, "gns_ema"), color=color, label=f"{label} (EMA)")
    axes[0].set_ylabel("validation loss (nats/byte)")
    axes[1].set_ylabel("global batch size (sequences)")
    axes[2].set_ylabel("GNS (sequences): dots raw, line EMA")
    for ax in axes:
        ax.set_xlabel("steps")
    return finish_figure(fig, axes, path, title, dpi=100)


def finish_figure(fig, axes, path: str, title: str | None, dpi: int) -> str:
    """Grid and legend on every panel, the title, then write the PNG to ``path`` and close."""
    import matplotlib.pyplot as plt

    for ax in getattr(axes, "flat", axes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_run(metrics_csv: str, path: str, title: str | None = None, label: str = "adaptive") -> str:
    """Figure-1-style plot of one run's metrics.csv."""
    return plot_runs({label: read_metrics(metrics_csv)}, path, title)
