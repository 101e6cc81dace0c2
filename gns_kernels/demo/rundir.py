"""The run folder (``--out``): created writable, refused when it already holds something
(unless ``--overwrite``), so that two runs never share one checkpoint.pt or metrics.csv."""
from __future__ import annotations

import os
import time

from .config import DemoError

# every file a demo run (or --compare) writes into its folder
RUN_FILES = ("checkpoint.pt", "checkpoint.pt.tmp", "config.json", "metrics.csv", "plot.png",
             "summary.json", "interrupted.json", "compare.txt", "compare.json", "compare.png")
COMPARE_RUNS = ("small", "large", "euclidean", "adaptive")


def check_out_dir(path: str) -> str:
    """Create `path` (and parents) if needed and check that a file can be written there;
    returns the absolute path. DemoError naming --out otherwise."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise DemoError(f"--out {path!r} is not a writable folder ({exc.strerror or exc})") from None
    return path


def _clear(path: str) -> None:
    for name in RUN_FILES:
        target = os.path.join(path, name)
        if os.path.isfile(target):
            os.remove(target)
    for sub in COMPARE_RUNS:
        if os.path.isdir(os.path.join(path, sub)):
            _clear(os.path.join(path, sub))


def prepare_out_dir(path: str, overwrite: bool = False) -> str:
    """A fresh run folder: `check_out_dir`, then DemoError when it holds anything (a
    previous run's checkpoint.pt would otherwise be resumable under this run's
    config.json); with `overwrite` the demo's own files there (RUN_FILES, also in the
    --compare sub-folders) are deleted first and anything else is left alone."""
    existed = os.path.isdir(path)
    path = check_out_dir(path)
    if overwrite:
        _clear(path)
        return path
    if existed:
        entries = sorted(e for e in os.listdir(path) if not e.startswith(".write_test."))
        if entries:
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise DemoError(f"--out {path!r} is not empty ({shown}); continue that run with "
                            "--resume, pick another folder, or pass --overwrite to replace it")
    return path


def default_out(prefix: str = "") -> str:
    return os.path.join(os.getcwd(), "runs", prefix + time.strftime("%Y%m%d-%H%M%S"))
