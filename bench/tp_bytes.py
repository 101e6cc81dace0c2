"""Bytes of the nuclear GNS's tensor-parallel collectives per measurement (a count, not a
timing): FSDP2 x TP with the Llama TP plan torchtitan uses (q, k, v, gate, up colwise:
rows sliced; o, down rowwise: columns sliced), for the 160M and 1B shapes of
bench/model_gpu.py.

Per weight (m x n, out x in) the Gram side is the smaller one (row when m <= n). A slice
along the Gram's summation index adds up: the Gram partials ride in the per-group Gram
all-reduce the 1-D path issues anyway (now over dp x tp ranks, 2 k^2 float32 per matrix,
unchanged in size). A slice along the Gram's own dimension (q, k, v: row Gram, rows
sliced) is assembled: each rank all-gathers, over tp, its local gradient slice (m n / t
floats) before the reduce-scatter and its mean-gradient blocks (m n / (t R)) after; per
rank it receives (t - 1) / t of the whole. Printed: those all-gather bytes per rank per
measurement, and the Gram all-reduce bytes for comparison.

Run: ``python bench/tp_bytes.py`` (Markdown table).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_gpu import MODELS  # noqa: E402

# the TP plan's slicing of each per-layer weight, in model_gpu's order:
# q, k, v, o, gate, up, down -> 0: rows (colwise), 1: columns (rowwise)
TP_DIMS = [0, 0, 0, 1, 0, 0, 1]


def tp_bytes(shapes, tp_dims, t: int, R: int):
    """(all-gather bytes received per rank, Gram all-reduce bytes per rank, matrices
    assembled) per measurement, float32."""
    gather = gram = 0.0
    assembled = 0
    for (m, n), d in zip(shapes, tp_dims):
        side_dim = 0 if m <= n else 1  # row Gram: the rows are its dimension
        k = min(m, n)
        gram += 2 * k * k * 4
        if d == side_dim:  # sliced along the Gram's own dimension: assembled over tp
            assembled += 1
            gather += (t - 1) / t * (m * n + m * n / R) * 4
    return gather, gram, assembled


def main() -> None:
    print("| model | tp | R (dp) | matrices assembled | tp all-gathers, received per rank | Gram all-reduce payload (the 1-D path's too) |")
    print("|---|---|---|---|---|---|")
    for name, (layers, per_layer) in MODELS.items():
        shapes, dims = per_layer * layers, TP_DIMS * layers
        for t in (2, 4, 8):
            R = 8
            g, a, n = tp_bytes(shapes, dims, t, R)
            print(f"| {name} | {t} | {R} | {n} of {len(shapes)} | {g / 2**20:.0f} MiB | {a / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
