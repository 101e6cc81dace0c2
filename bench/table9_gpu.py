"""The paper's Table 9 on one GPU: step-time overhead of l1 and S1 (nuclear) GNS
measurement on a Llama with the 160M shapes, through MicroBatchGNS with 8 micro-batches.

    python bench/table9_gpu.py                          # a GPU (bf16 autocast)
    python bench/table9_gpu.py --device cpu --tiny      # toy sizes: a check of the script

Model: 12 layers of q, k, v, o (768x768), gate, up (2048x768), down (768x2048), RMSNorm,
RoPE, causal attention (12 heads), SwiGLU, untied embedding and head (vocabulary
--vocab, default 50304: 162M parameters; the paper does not state its vocabulary). The
embedding, the head and the final norm are outside the measurement: the hooks measure
the transformer blocks (l1: every block parameter; S1: the 84 matrices). float32
parameters and gradients, bf16 autocast (CPU: bf16 autocast on CPU), AdamW.

One step = A = 8 micro-batches of --micro-batch sequences of --seq tokens (loss / A,
gradients accumulated in float32), then the optimizer step: the samples of one GPU's
MicroBatchGNS are its 8 micro-batches, as 8 ranks x 1 would give (R = 8). Configurations:

    base     no GNS object
    l1 F=1   MicroBatchGNS("l1", every=1): every step measures (estimate read each step)
    l1 hook  MicroBatchGNS("l1", every=huge): micro_step() called, nothing measured
    S1 F=1   MicroBatchGNS("nuclear", every=1), noise pool on (the default)
    S1 hook  the same, never measuring

The hooks' own time is also measured directly: CUDA events around each
``micro_step()`` and the estimate read (their span on the stream: the hooks' kernels and
any gap their host work leaves; a wall clock on the CPU), so the amortized overhead
(own time of a measuring step + (F - 1) x that of a hooked one) / F / base step resolves
far below the +-0.5% that differences of whole steps give over a few dozen steps.

Configurations are timed in interleaved blocks (--block steps of one configuration, the
configurations in a rotating order per round) after --warmup untimed steps each; per-step means with 95%
intervals (t distribution). The amortized overhead at F is
(t_F1 + (F - 1) t_hook) / F / t_base - 1, its 95% interval from 2000 bootstrap
resamples of the steps. Peak memory: torch.cuda.max_memory_allocated over the
configuration's steps.

On one GPU, MicroBatchGNS solves every one of the 84 matrices (the one-rank path); under
DDP with 8 ranks each rank solves about 1/8 of them (its share). --rank-share-ms (the
S1 phase of bench/gpu_window.sh: the busiest rank's extra time per measuring step through
the DDP hook) gives a PREDICTION of the 8-rank overhead: that extra over F steps of one
rank, whose step is taken as 1/8 of this step (no communication counted).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

PAPER = {"l1": "+0.2%", "S1": "+13.9%"}  # Table 9, 160M, 8xH100, F = 100
TARGET = {"l1": "<= +0.1%", "S1": "<= +0.5%"}  # the targets at F = 100


# ----------------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, mlp, bias=False), nn.Linear(dim, mlp, bias=False)
        self.down = nn.Linear(mlp, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab, dim, layers, heads, mlp, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


# ----------------------------------------------------------------------------- statistics
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042]


def mean_ci(xs):
    """(mean, half-width of the 95% interval: t distribution) of a list."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    t = _T975[len(xs) - 2] if len(xs) - 1 <= len(_T975) else 1.96
    return m, t * statistics.stdev(xs) / math.sqrt(len(xs))


def amortized(base, f1, hook, F_):
    return (statistics.fmean(f1) + (F_ - 1) * statistics.fmean(hook)) / F_ / statistics.fmean(base) - 1


def amortized_ci(base, f1, hook, F_, draws=2000, seed=0):
    """(estimate, lo, hi) of the amortized overhead, percentile bootstrap over the steps."""
    rng = random.Random(seed)
    est = amortized(base, f1, hook, F_)
    vals = sorted(amortized(rng.choices(base, k=len(base)), rng.choices(f1, k=len(f1)),
                            rng.choices(hook, k=len(hook)), F_) for _ in range(draws))
    return est, vals[int(0.025 * draws)], vals[int(0.975 * draws) - 1]


def direct(base, own_f1, own_hook, F_):
    """The amortized overhead from the hooks' own time: (mean own time of a measuring step
    + (F - 1) x that of a hooked step that does not measure) / F / the mean base step."""
    return (statistics.fmean(own_f1) + (F_ - 1) * statistics.fmean(own_hook)) / F_ / statistics.fmean(base)


def direct_ci(base, own_f1, own_hook, F_, draws=2000, seed=0):
    """(estimate, lo, hi) of ``direct``, percentile bootstrap over the steps."""
    rng = random.Random(seed)
    est = direct(base, own_f1, own_hook, F_)
    vals = sorted(direct(rng.choices(base, k=len(base)), rng.choices(own_f1, k=len(own_f1)),
                         rng.choices(own_hook, k=len(own_hook)), F_) for _ in range(draws))
    return est, vals[int(0.025 * draws)], vals[int(0.975 * draws) - 1]


class HookTimer:
    """The hooks' own time within one step: CUDA events around each call on the GPU
    (their span on the stream: the hook's kernels, and any gap its host work leaves), a
    wall clock on the CPU. ``total_ms()`` after the step's synchronize."""

    def __init__(self, cuda: bool):
        self.cuda, self.spans = cuda, []

    @contextlib.contextmanager
    def time(self):
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            yield
            e1.record()
            self.spans.append((e0, e1))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.append((t0, time.perf_counter()))

    def total_ms(self) -> float:
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.spans)
        return sum(b - a for a, b in self.spans) * 1e3


# ----------------------------------------------------------------------------- run
def _left() -> float:
    ends = [float(os.environ[k]) for k in ("GPU_WINDOW_END", "GPU_WINDOW_PHASE_END") if os.environ.get(k)]
    return (min(ends) - time.time()) if ends else math.inf


def row(what, value, target=""):
    print(f"@@ | Table 9 | {what} | {value} | {target} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a check of the script)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=8, help="A (R = 8 as 8 ranks give)")
    p.add_argument("--steps", type=int, default=40,
                   help="timed steps per configuration (fewer where the window's deadline comes first)")
    p.add_argument("--block", type=int, default=2, help="steps per interleaved block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    p.add_argument("--rank-share-ms", type=float, default=None,
                   help="the S1 phase's busiest-rank extra per measuring step (ms), for the 8-rank prediction")
    a = p.parse_args(argv)
    if a.tiny:
        a.layers, a.dim, a.heads, a.mlp, a.vocab, a.seq, a.micro_batch = 2, 64, 4, 128, 256, 32, 2
        a.steps = min(a.steps, 6)
    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    import gns_kernels as gk

    warnings.filterwarnings("ignore", message="MicroBatchGNS: a second backward pass")
    torch.manual_seed(0)
    model = Llama(a.vocab, a.dim, a.layers, a.heads, a.mlp, a.seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
    A = a.micro_batches
    B = A * a.micro_batch
    blocks = list(model.blocks.parameters())
    n_all = sum(x.numel() for x in model.parameters())
    n_blk = sum(x.numel() for x in blocks)
    n_mat = sum(x.numel() for x in blocks if x.dim() == 2)
    n_mats = sum(1 for x in blocks if x.dim() == 2)
    g = torch.Generator(device=dev).manual_seed(1)
    data = torch.randint(0, a.vocab, (A, a.micro_batch, a.seq + 1), device=dev, generator=g)
    xs, ys = data[..., :-1].contiguous(), data[..., 1:].contiguous()

    mbs = {
        "l1 F=1": gk.MicroBatchGNS(blocks, geometry="l1", every=1, batch_size=B, micro_batches=A),
        "l1 hook": gk.MicroBatchGNS(blocks, geometry="l1", every=10**9, batch_size=B, micro_batches=A),
        "S1 F=1": gk.MicroBatchGNS(blocks, geometry="nuclear", every=1, batch_size=B, micro_batches=A),
        "S1 hook": gk.MicroBatchGNS(blocks, geometry="nuclear", every=10**9, batch_size=B, micro_batches=A),
    }
    for k in ("l1 hook", "S1 hook"):
        mbs[k].step = 1  # k % F != 0 from here on: never measures
    names = ["base"] + list(mbs)
    cuda = dev == "cuda"
    ac = dict(device_type=dev, dtype=torch.bfloat16)
    estimates = {}

    def step(name):
        mb = mbs.get(name)
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        own = HookTimer(cuda)
        t0 = time.perf_counter()
        for i in range(A):
            with torch.autocast(**ac):
                loss = model(xs[i], ys[i]) / A
            loss.backward()
            if mb is not None:
                with own.time():
                    mb.micro_step()
        if mb is not None and mb.estimate_step is not None and name.endswith("F=1"):
            with own.time():
                estimates[name] = mb.estimate  # the one read per measurement (the controller's)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return dt, (torch.cuda.max_memory_allocated() if cuda else None), own.total_ms()

    print(f"# Table 9 on one {torch.cuda.get_device_name() if cuda else 'CPU'}: Llama {a.layers} layers, "
          f"dim {a.dim}, {a.heads} heads, MLP {a.mlp}, vocab {a.vocab}: {n_all / 1e6:.1f}M parameters "
          f"({n_blk / 1e6:.1f}M in the blocks, {n_mat / 1e6:.1f}M in the {n_mats} "
          f"matrices); A = {A} micro-batches x {a.micro_batch} sequences x {a.seq} tokens "
          f"({A * a.micro_batch * a.seq} tokens per step), bf16 autocast, AdamW", flush=True)
    row("setup", f"{n_all / 1e6:.1f}M params ({n_mat / 1e6:.1f}M in {n_mats} measured matrices"
        f"{' (toy)' if a.tiny else ''}); "
        f"A = {A} x {a.micro_batch} seq x {a.seq} tokens; vocab {a.vocab}; bf16 autocast", "")
    broken = {}  # configuration -> the error that took it out (the others go on)

    def run(name):
        try:
            return step(name)
        except Exception as exc:  # noqa: BLE001  (the window reports and goes on)
            import traceback

            traceback.print_exc()
            broken[name] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
            names.remove(name)
            if mbs.get(name) is not None:
                mbs.pop(name)
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()
            return None

    t0 = time.time()
    for name in list(names):  # warm-up
        for _ in range(a.warmup):
            if name in names:
                run(name)
    warm = time.time() - t0
    print(f"warm-up: {warm:.1f} s for {a.warmup} steps of each configuration", flush=True)
    times = {n: [] for n in names}
    owns = {n: [] for n in names}  # the hooks' own ms per step (HookTimer)
    mem = {n: 0 for n in names}
    per_round = warm / max(a.warmup, 1) * a.block
    rounds = -(-a.steps // a.block)
    for rnd in range(rounds):
        if rnd >= 1 and _left() < per_round * 1.3:
            print(f"deadline: stopped after {rnd} rounds ({rnd * a.block} steps per configuration)", flush=True)
            break
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            for _ in range(a.block):
                res = run(name) if name in names else None
                if res is None:
                    break
                dt, m, own_ms = res
                times[name].append(dt)
                owns[name].append(own_ms / 1e3)  # seconds, as the step times
                if m is not None:
                    mem[name] = max(mem[name], m)
    for name, why in broken.items():
        print(f"FAILED: {name}: {why}", flush=True)
        row(f"configuration {name}", f"FAILED: {why}")
    if "base" not in names:
        return 1
    n = len(times["base"])
    print("\n| configuration | steps | mean ms per step | 95% interval | peak memory GB |\n|---|---:|---:|---:|---:|")
    for name in names:
        if not times[name]:
            continue
        m, h = mean_ci(times[name])
        print(f"| {name} | {len(times[name])} | {m * 1e3:.1f} | +/- {h * 1e3:.1f} | "
              f"{mem[name] / 2**30:.2f} |" if cuda else f"| {name} | {len(times[name])} | {m * 1e3:.1f} | "
              f"+/- {h * 1e3:.1f} | not measured (CPU) |")
    for k, v in estimates.items():
        print(f"last estimate {k}: gns {v.gns:.4g}, valid {v.valid}", flush=True)
    mb_, hb = mean_ci(times["base"])
    memtxt = (lambda k: f"{mem[k] / 2**30:.2f} GB") if cuda else (lambda k: "n/a (CPU)")
    row("baseline step (mean, 95% interval, peak memory)",
        f"{mb_ * 1e3:.1f} +/- {hb * 1e3:.1f} ms ({n} steps), {memtxt('base')}")
    for geo in ("l1", "S1"):
        f1, hook = times[f"{geo} F=1"], times[f"{geo} hook"]
        if not f1 or not hook:
            continue
        m1, h1 = mean_ci(f1)
        mh, hh = mean_ci(hook)
        row(f"+{geo}: measuring step / hooked step (mean, 95%)",
            f"{m1 * 1e3:.1f} +/- {h1 * 1e3:.1f} / {mh * 1e3:.1f} +/- {hh * 1e3:.1f} ms; peak {memtxt(geo + ' F=1')}")
        cells = []
        for F_ in (100, 10):
            est, lo, hi = amortized_ci(times["base"], f1, hook, F_)
            cells.append(f"F={F_}: {100 * est:+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]")
            print(f"{geo} amortized at F = {F_}: {100 * est:+.3f}% (95% bootstrap interval "
                  f"[{100 * lo:+.3f}, {100 * hi:+.3f}])", flush=True)
        one_rank = " (one rank solves all 84 matrices: 8x a rank's share)" if geo == "S1" else ""
        row(f"+{geo} amortized, whole steps{one_rank}", "; ".join(cells),
            f"paper {PAPER[geo]} (8xH100, F=100); target {TARGET[geo]}")
        o1, oh = owns[f"{geo} F=1"], owns[f"{geo} hook"]
        m1, h1 = mean_ci(o1)
        mh, hh = mean_ci(oh)
        cells = []
        for F_ in (100, 10):
            est, lo, hi = direct_ci(times["base"], o1, oh, F_)
            cells.append(f"F={F_}: {100 * est:+.3f}% [{100 * lo:+.3f}, {100 * hi:+.3f}]")
            print(f"{geo} amortized at F = {F_} from the hooks' own time: {100 * est:+.4f}% "
                  f"(95% bootstrap interval [{100 * lo:+.4f}, {100 * hi:+.4f}])", flush=True)
        timer = "CUDA events" if cuda else "wall clock"
        row(f"+{geo} amortized, the hooks' own time ({timer}){one_rank}",
            f"{'; '.join(cells)} (own ms per step: measuring {m1 * 1e3:.2f} +/- {h1 * 1e3:.2f}, "
            f"not measuring {mh * 1e3:.3f} +/- {hh * 1e3:.3f})",
            f"paper {PAPER[geo]} (8xH100, F=100); target {TARGET[geo]}")
    if a.rank_share_ms is not None and times["S1 F=1"]:
        pred = a.rank_share_ms * 1e-3 / 100 / (mb_ / 8)
        row("+S1 at 8 ranks, F=100 (PREDICTION: the S1 phase's busiest-rank extra over a rank step = 1/8 of this one)",
            f"{100 * pred:+.2f}% (rank extra {a.rank_share_ms:.1f} ms per measurement)",
            f"paper {PAPER['S1']}; target {TARGET['S1']}")
    else:
        print("no --rank-share-ms: the 8-rank prediction is left out", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
