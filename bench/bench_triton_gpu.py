"""GPU benchmark of the Triton fused-op kernels against eager, torch.compile and the floor.

Run on a machine with a CUDA GPU (from the repository root, package installed):

    python bench/bench_triton_gpu.py                    # float32, 2^25 elements
    python bench/bench_triton_gpu.py --dtype bfloat16 --n 67108864
    python bench/bench_triton_gpu.py --paper            # bytes and times at 3 TB/s, no GPU needed

For each op it times (triton.testing.do_bench, median over repetitions, after warm-up):
  eager    the composite torch formula (gns_kernels.ops backend="eager"),
  compile  the same float32 formula under torch.compile (after warm-up),
  triton   gns_kernels.triton.fused,
  floor    variance_norms: summing its inputs once each (one .sum() per input);
           square_pack / accumulate_sq: Tensor.copy_ moving the same bytes (read + write),
and prints median ms, effective GB/s (bytes the op must move / time) and the ratio to
the floor, in the layout of the CPU benchmark table. Ratios, not absolute times, are the
result: they are measured in one process on one device.

``--device cpu`` runs the same code on CPU tensors through Triton's interpreter with a
wall-clock median (a smoke test of this script, not a benchmark).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The paper's models (parameters) for the "on paper" table.
PAPER_MODELS = {"160M": 160e6, "1B": 1e9}
BANDWIDTH = 3e12  # bytes/s (H100 SXM is about 3.35 TB/s)


def op_bytes(op: str, n: int, itemsize: int, shift: bool) -> int:
    """Bytes an op must move for n elements of an input dtype of ``itemsize`` bytes."""
    if op == "variance_norms":  # read mean_grad, mean_sq (+ shift)
        return n * itemsize * (3 if shift else 2)
    if op == "square_pack":  # read grad (+ shift), write 2n float32
        return n * itemsize * (2 if shift else 1) + 8 * n
    if op == "accumulate_sq":  # read grad, prev, sq(f32); write sq(f32), prev
        return n * (3 * itemsize + 8)
    raise ValueError(f"op: unknown {op!r}")


def paper_table() -> str:
    rows = ["| op | dtype | shift | bytes/param | 160M at 3 TB/s | 1B at 3 TB/s |", "|---|---|---|---|---|---|"]
    for op in ("variance_norms", "square_pack", "accumulate_sq"):
        for dt, size in (("float32", 4), ("bfloat16", 2)):
            for shift in ((False, True) if op != "accumulate_sq" else (False,)):
                b = op_bytes(op, 1, size, shift)
                t = [op_bytes(op, int(p), size, shift) / BANDWIDTH * 1e3 for p in PAPER_MODELS.values()]
                rows.append(f"| {op} | {dt} | {'yes' if shift else 'no'} | {b} | {t[0]:.3f} ms | {t[1]:.3f} ms |")
    return "\n".join(rows)


def _timer(device: str, reps: int):
    if device == "cuda":
        import triton.testing

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=max(100, reps), return_mode="median")
    else:
        def bench(fn):
            fn()
            ts = []
            for _ in range(max(3, reps // 50)):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts)
    return bench


def _vn_formula(d, q, scale: float):
    d = d.float()
    q = q.float()
    s2 = scale * (q - d * d)
    s2 = torch.where(s2 < 0, torch.zeros_like(s2), s2)
    return torch.stack([s2.sqrt().sum(), d.abs().sum(), s2.sum(), (d * d).sum()])


def _vn_multi_formula(ds, qs, scale: float):
    return sum(_vn_formula(d, q, scale) for d, q in zip(ds, qs))


# The paper's 160M Llama without embeddings (issue 6): 12 layers x (q, k, v, o: 768x768;
# gate, up: 2048x768; down: 768x2048) = 84.9M parameters in 84 tensors.
LLAMA_160M_SHAPES = [(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]
LLAMA_160M_SHAPES = LLAMA_160M_SHAPES * 12


def _sp_formula(g, out):
    n = g.numel()
    x = g.float()
    out[:n].copy_(x)
    out[n:].copy_(x * x)
    return out


def _acc_formula(g, prev, sq):
    d = g.float() - prev.float()
    sq.add_(d * d)
    prev.copy_(g)


def run(args) -> str:
    from gns_kernels import ops
    from gns_kernels.triton import fused

    dev, dt, n = args.device, DTYPES[args.dtype], args.n
    bench = _timer(dev, args.reps)
    gen = torch.Generator(device="cpu").manual_seed(0)
    d = torch.randn(n, generator=gen).to(dev, dt)
    q = (d.float() ** 2 + 1).to(dt)
    g = torch.randn(n, generator=gen).to(dev, dt)
    prev = torch.randn(n, generator=gen).to(dev, dt)
    sq = torch.zeros(n, device=dev)
    out = torch.empty(2 * n, device=dev)
    isz = d.element_size()
    rows = []

    def copy_floor(nbytes):
        m = max(1, nbytes // 8)  # float32 copy: 4 bytes read + 4 written per element
        src = torch.empty(m, device=dev)
        dst = torch.empty(m, device=dev)
        return lambda: dst.copy_(src)

    cases = {
        "variance_norms": dict(
            eager=lambda: ops.variance_norms(d, q, 2.0, backend="eager"),
            compile=torch.compile(_vn_formula) if args.compile else None,
            compile_args=(d, q, 2.0),
            triton=lambda: fused.variance_norms(d, q, 2.0),
            floor=lambda: (d.sum(), q.sum()),
            bytes=op_bytes("variance_norms", n, isz, False)),
        "square_pack": dict(
            eager=lambda: ops.square_pack(g, out, backend="eager"),
            compile=torch.compile(_sp_formula) if args.compile else None,
            compile_args=(g, out),
            triton=lambda: fused.square_pack(g, out),
            floor=copy_floor(op_bytes("square_pack", n, isz, False)),
            bytes=op_bytes("square_pack", n, isz, False)),
        "accumulate_sq": dict(
            eager=lambda: ops.accumulate_sq(g, prev, sq, backend="eager"),
            compile=torch.compile(_acc_formula) if args.compile else None,
            compile_args=(g, prev, sq),
            triton=lambda: fused.accumulate_sq(g, prev, sq),
            floor=copy_floor(op_bytes("accumulate_sq", n, isz, False)),
            bytes=op_bytes("accumulate_sq", n, isz, False)),
    }
    if args.multi:
        shapes = LLAMA_160M_SHAPES if dev == "cuda" else [(7, 5), (33, 64), (0, 3)]
        ds = [torch.randn(*sh, generator=gen).to(dev, dt) for sh in shapes]
        qs = [(x.float() ** 2 + 1).to(dt) for x in ds]
        nm = sum(x.numel() for x in ds)
        cases["variance_norms_multi"] = dict(
            eager=lambda: ops.variance_norms_multi(ds, qs, 2.0, backend="eager"),
            compile=torch.compile(_vn_multi_formula) if args.compile else None,
            compile_args=(ds, qs, 2.0),
            triton=lambda: fused.variance_norms_multi(ds, qs, 2.0),
            floor=lambda: [(x.sum(), y.sum()) for x, y in zip(ds, qs)],
            bytes=op_bytes("variance_norms", nm, isz, False), n=nm)
    header = "| op | impl | n | dtype | median ms | GB/s | x floor |"
    rows = [header, "|---|---|---|---|---|---|---|"]
    for op, c in cases.items():
        timings = {"floor": bench(c["floor"]), "eager": bench(c["eager"])}
        if c["compile"] is not None:
            fn, a = c["compile"], c["compile_args"]
            for _ in range(3):
                fn(*a)  # warm-up: compile outside the timing
            timings["compile"] = bench(lambda: fn(*a))
        timings["triton"] = bench(c["triton"])
        for impl in ("eager", "compile", "triton", "floor"):
            if impl not in timings:
                continue
            ms = timings[impl]
            gbs = c["bytes"] / (ms * 1e-3) / 1e9
            rows.append(f"| {op} | {impl} | {c.get('n', n)} | {args.dtype} | {ms:.4f} | {gbs:.0f} | "
                        f"{ms / timings['floor']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Triton fused-op kernels vs eager, torch.compile and the floor")
    p.add_argument("--n", type=int, default=2**25, help="elements per tensor (default 2^25)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--reps", type=int, default=500, help="do_bench rep time in ms (CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: Triton interpreter smoke run (not a benchmark)")
    p.add_argument("--no-multi", dest="multi", action="store_false",
                   help="skip variance_norms_multi over the 160M Llama shapes (84 tensors, 84.9M)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    p.add_argument("--paper", action="store_true", help="print bytes and 3 TB/s times only (no GPU)")
    a = p.parse_args(argv)
    if a.paper:
        print(paper_table())
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --paper / --device cpu")
    print(f"device: {torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu (interpreter)'}; "
          f"torch {torch.__version__}")
    print(run(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
