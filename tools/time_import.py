"""Wall time of `import torch`, `import gns_kernels` and `gns-kernels --help`, each in
fresh processes (median and min over --runs runs, interleaved so load drifts hit all alike).

    python tools/time_import.py --runs 9

Run it where gns_kernels is importable (installed, or PYTHONPATH=<repo>). The times include
the interpreter's start-up; the CPU time (user + sys of the child) is printed beside them.
Last line: what `import gns_kernels` adds once torch is imported, timed inside fresh
processes (the least sensitive to other load on the machine).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "python -c 'import gns_kernels'": [sys.executable, "-c", "import gns_kernels"],
    "gns-kernels --help": [sys.executable, "-c", "import sys; from gns_kernels.cli import main; sys.exit(main(['--help']))"],
}


DELTA = ("import time, torch\n"
         "t0 = time.perf_counter()\n"
         "import gns_kernels\n"
         "print(time.perf_counter() - t0)\n")


def _delta() -> float:
    """Seconds `import gns_kernels` takes in a fresh process that has imported torch."""
    out = subprocess.run([sys.executable, "-c", DELTA], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def _once(cmd: list[str]) -> tuple[float, float]:
    before = os.times()
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9, help="fresh processes per case")
    args = ap.parse_args()
    for cmd in CASES.values():  # warm the file cache
        _once(cmd)
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in CASES}
    deltas = []
    for _ in range(args.runs):
        for name, cmd in CASES.items():
            res[name].append(_once(cmd))
        deltas.append(_delta())
    print(f"{'command':34s} {'wall median':>12s} {'wall min':>9s} {'cpu median':>11s}")
    for name, rows in res.items():
        walls, cpus = [w for w, _ in rows], [c for _, c in rows]
        print(f"{name:34s} {statistics.median(walls):11.3f}s {min(walls):8.3f}s {statistics.median(cpus):10.3f}s")
    print(f"import gns_kernels after import torch, in one process: median {statistics.median(deltas):.3f}s, "
          f"min {min(deltas):.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
