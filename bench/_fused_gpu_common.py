"""Pieces shared by bench/bench_cuda_gpu.py and bench/bench_triton_gpu.py.

Pure functions (plus the constants they use): the bytes each fused op moves, the on-paper
table at 3 TB/s, the benchmark inputs, the floor (``copy_``) and eager composite peers, and
the rendering of the candidate / ratio / bandwidth tables. The timers stay in the scripts
(CUDA events there, triton.testing.do_bench or a wall clock here).

Units: element counts ``n`` in elements, ``itemsize`` in bytes per element, byte counts in
bytes, times in seconds (tables print milliseconds), bandwidth in bytes/s (tables GB/s).
"""
from __future__ import annotations

import statistics
from types import SimpleNamespace

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAPER_MODELS = {"160M": 160e6, "1B": 1e9}  # parameters
BANDWIDTH = 3e12  # bytes/s (H100 SXM: about 3.35 TB/s)

# The paper's 160M Llama without embeddings: 12 layers x (q, k, v, o: 768x768;
# gate, up: 2048x768; down: 768x2048).
LLAMA_160M_SHAPES = ([(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]) * 12


def op_bytes(op: str, n: int, itemsize: int, shift: bool = False, prev_itemsize: int | None = None) -> int:
    """Bytes an op must move for n elements of a gradient dtype of ``itemsize`` bytes.

    ``prev_itemsize`` (bytes) is the element size of accumulate_sq's ``prev`` buffer when it
    differs from the gradient's (default: the gradient's ``itemsize``).
    """
    if op == "variance_norms":  # read mean_grad, mean_sq (+ shift)
        return n * itemsize * (3 if shift else 2)
    if op == "square_pack":  # read grad (+ shift), write 2n float32
        return n * itemsize * (2 if shift else 1) + 8 * n
    if op == "accumulate_sq":  # read grad, prev, sq (float32); write sq, prev
        p = itemsize if prev_itemsize is None else prev_itemsize
        return n * (itemsize + 2 * p + 8)
    raise ValueError(f"op: unknown {op!r}")


def paper_table() -> str:
    """Markdown table: bytes per parameter and the time (ms) to move them at BANDWIDTH for
    the PAPER_MODELS parameter counts, per op and gradient dtype."""
    rows = ["| op | gradient dtype | bytes / param | 160M @ 3 TB/s | 1B @ 3 TB/s |",
            "|---|---|---:|---:|---:|"]
    for name, op, shift in [("variance_norms", "variance_norms", False),
                            ("variance_norms + shift", "variance_norms", True),
                            ("square_pack", "square_pack", False),
                            ("square_pack + shift", "square_pack", True),
                            ("accumulate_sq", "accumulate_sq", False)]:
        for dt, size in (("float32", 4), ("bfloat16", 2)):
            b = op_bytes(op, 1, size, shift)
            t = [op_bytes(op, int(p), size, shift) / BANDWIDTH * 1e3 for p in PAPER_MODELS.values()]
            rows.append(f"| {name} | {dt} | {b} | {t[0]:.3f} ms | {t[1]:.3f} ms |")
    return "\n".join(rows)


def make_inputs(n: int, device: str, dtype: torch.dtype, shapes) -> SimpleNamespace:
    """Seeded benchmark inputs: d, q, s, prev (n elements of ``dtype``), sq (n float32),
    out (2n float32), ds / qs (one tensor per shape in ``shapes``), isz (bytes per gradient
    element), nm (elements over ds) and scale."""
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(n, generator=gen).to(device, dtype)
    q = (d.float() ** 2 + 1).to(dtype)
    s = torch.randn(n, generator=gen).to(device, dtype)
    prev = torch.randn(n, generator=gen).to(device, dtype)
    sq = torch.zeros(n, device=device)
    out = torch.empty(2 * n, device=device)
    ds = [torch.randn(*sh, generator=gen).to(device, dtype) for sh in shapes]
    qs = [(x.float() ** 2 + 1).to(dtype) for x in ds]
    return SimpleNamespace(d=d, q=q, s=s, prev=prev, sq=sq, out=out, ds=ds, qs=qs,
                           isz=d.element_size(), nm=sum(x.numel() for x in ds), scale=3.0)


def copy_of(nbytes: int, device: str):
    """A float32 ``Tensor.copy_`` moving about ``nbytes`` bytes (4 read + 4 written per element)."""
    m = max(1, nbytes // 8)
    src, dst = torch.empty(m, device=device), torch.empty(m, device=device)
    return lambda: dst.copy_(src)


def copy_labels(isz: int) -> tuple[str, str, str]:
    """Names of the copy_ floors of square_pack, square_pack (shift) and accumulate_sq for a
    gradient of ``isz`` bytes per element (bytes per element in the name)."""
    return (f"copy_ ({op_bytes('square_pack', 1, isz)}n bytes)",
            f"copy_ ({op_bytes('square_pack', 1, isz, True)}n bytes)",
            f"copy_ ({op_bytes('accumulate_sq', 1, isz)}n bytes)")


def eager_formula(d, q, scale: float):
    """The composite torch formula of variance_norms (float32, NaN-preserving clamp)."""
    d = d.float()
    q = q.float()
    s2 = scale * (q - d * d)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)
    return torch.stack([s2.sqrt().sum(), d.abs().sum(), s2.sum(), (d * d).sum()])


def eager_multi(ds, qs, scale: float):
    """eager_formula per (d, q) pair, summed: the composite peer of variance_norms_multi."""
    return sum(eager_formula(d, q, scale) for d, q in zip(ds, qs))


def add_compiled(cands: dict, x: SimpleNamespace) -> None:
    """Adds torch.compile(eager_formula / eager_multi) to ``cands``, compiled and warmed up
    (3 calls) outside the timing."""
    comp = torch.compile(eager_formula)
    comp_multi = torch.compile(eager_multi)
    for _ in range(3):  # compile + warm-up outside the timing
        comp(x.d, x.q, x.scale)
        comp_multi(x.ds, x.qs, x.scale)
    cands["torch.compile(formula)"] = lambda: comp(x.d, x.q, x.scale)
    cands["multi torch.compile(formula)"] = lambda: comp_multi(x.ds, x.qs, x.scale)


class Results:
    """Times per candidate (lists of seconds) with their medians and minima (seconds)."""

    def __init__(self, times: dict):
        self.times = times
        self.med = {k: statistics.median(v) for k, v in times.items()}
        self.mn = {k: min(v) for k, v in times.items()}

    def candidate_rows(self) -> list[str]:
        """Markdown table (after a blank line): median and minimum in ms, rounds timed."""
        lines = ["", "| candidate | median ms | min ms | rounds |", "|---|---:|---:|---:|"]
        for k, v in self.times.items():
            lines.append(f"| {k} | {self.med[k] * 1e3:.3f} | {self.mn[k] * 1e3:.3f} | {len(v)} |")
        return lines

    def ratio(self, a: str, b: str) -> str:
        """Time of a over time of b: ratio of medians, ratio of minima in brackets."""
        return f"{self.med[a] / self.med[b]:.2f} (min: {self.mn[a] / self.mn[b]:.2f})"

    def ratio_rows(self, k: str, isz: int, *, compiled: bool, multi_note: str, extra=()) -> list[str]:
        """Markdown ratio table (after a blank line) for the kernels named ``k + op``;
        ``extra`` rows go after the variance_norms ones (and the torch.compile one)."""
        ratio = self.ratio
        c_sp, c_sp2, c_acc = copy_labels(isz)
        vn, vm = f"{k}variance_norms", f"{k}variance_norms_multi"
        lines = ["", "| ratio (medians; minima in brackets) | value | target |", "|---|---:|---|",
                 f"| variance_norms / floor | {ratio(vn, 'floor: d.sum() + q.sum()')} | <= 1.25 |",
                 f"| variance_norms (shift) / 3-input floor | "
                 f"{ratio(vn + ' (shift)', 'floor (3 inputs): d,q,s .sum()')} | <= 1.25 |",
                 f"| eager formula / variance_norms | {ratio('eager formula', vn)} | >= 20 (CPU target) |"]
        if compiled:
            lines += [f"| torch.compile(formula) / variance_norms | "
                      f"{ratio('torch.compile(formula)', vn)} | >= 1 |"]
        lines += list(extra)
        lines += [f"| square_pack / copy_ same bytes | {ratio(k + 'square_pack', c_sp)} | <= 1.5 |",
                  f"| square_pack (shift) / copy_ same bytes | {ratio(k + 'square_pack (shift)', c_sp2)} | <= 1.5 |",
                  f"| accumulate_sq / copy_ same bytes | {ratio(k + 'accumulate_sq', c_acc)} | <= 1.5 |",
                  f"| variance_norms_multi / multi floor | "
                  f"{ratio(vm, 'multi floor: .sum() per input')} | {multi_note} |",
                  f"| multi eager / variance_norms_multi | {ratio('multi eager formula', vm)} | |"]
        if compiled:
            lines.append(f"| multi torch.compile / variance_norms_multi | "
                         f"{ratio('multi torch.compile(formula)', vm)} | >= 1 |")
        return lines

    def bandwidth_rows(self, k: str, n: int, nm: int, isz: int) -> list[str]:
        """Markdown table (after a blank line): bytes moved / median time, in GB/s."""
        lines = ["", "| effective bandwidth (median) | GB/s |", "|---|---:|"]
        for name, b in [(f"{k}variance_norms", op_bytes("variance_norms", n, isz)),
                        (f"{k}square_pack", op_bytes("square_pack", n, isz)),
                        (f"{k}accumulate_sq", op_bytes("accumulate_sq", n, isz)),
                        ("floor: d.sum() + q.sum()", op_bytes("variance_norms", n, isz)),
                        (f"{k}variance_norms_multi", op_bytes("variance_norms", nm, isz))]:
            lines.append(f"| {name} | {b / self.med[name] / 1e9:.1f} |")
        return lines


def candidates(k: str, kernels: dict, x: SimpleNamespace, n: int, device: str) -> dict:
    """The candidate table in its order: floors, the kernels named ``k + op`` (``kernels``
    maps op name, e.g. "square_pack (shift)", to a no-argument call) and the eager peers."""
    d, q, s, ds, qs, isz, scale = x.d, x.q, x.s, x.ds, x.qs, x.isz, x.scale
    c_sp, c_sp2, c_acc = copy_labels(isz)
    return {
        "floor: d.sum() + q.sum()": lambda: (d.sum(), q.sum()),
        f"{k}variance_norms": kernels["variance_norms"],
        "floor (3 inputs): d,q,s .sum()": lambda: (d.sum(), q.sum(), s.sum()),
        f"{k}variance_norms (shift)": kernels["variance_norms (shift)"],
        "eager formula": lambda: eager_formula(d, q, scale),
        c_sp: copy_of(op_bytes("square_pack", n, isz), device),
        f"{k}square_pack": kernels["square_pack"],
        c_sp2: copy_of(op_bytes("square_pack", n, isz, True), device),
        f"{k}square_pack (shift)": kernels["square_pack (shift)"],
        c_acc: copy_of(op_bytes("accumulate_sq", n, isz), device),
        f"{k}accumulate_sq": kernels["accumulate_sq"],
        "multi floor: .sum() per input": lambda: [(a.sum(), b.sum()) for a, b in zip(ds, qs)],
        f"{k}variance_norms_multi": kernels["variance_norms_multi"],
        "multi eager formula": lambda: eager_multi(ds, qs, scale),
    }
