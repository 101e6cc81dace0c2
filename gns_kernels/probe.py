"""A direct critical-batch probe: from a checkpoint, short branches at several batch sizes
measure the critical batch size, and the GNS measured at the same point (every geometry)
says which theta makes Algorithm 1 ask for it.

Not a top-level name of ``gns_kernels``: ``from gns_kernels import probe`` (or
``gns-kernels probe RUN_DIR`` for a demo run, docs/probe.md).

The criterion (stated once, used everywhere here)
--------------------------------------------------
For one data seed, every batch size B of the grid continues training from the same
checkpoint (model and optimizer state) with the LR rule of the controller: every param
group's lr = its base lr x schedule(samples seen) x sqrt(B / B_0) (``lr_scaling="sqrt"``;
the schedule continues from the checkpoint's samples). The branch of the smallest B,
B_min, runs ``samples`` examples; its validation loss there is the **target**. Every
branch records (samples, validation loss) at evaluation points; its samples to target
S(B) is the first crossing of the target, linearly interpolated between the last
evaluation above it and the first at or below it (``samples_to_target``). With
r(B) = S(B) / S(B_min):

- **B_crit (grid)** = the largest grid B such that every grid B' <= B reached the target
  with r(B') <= tolerance (1.25 by default: a batch that costs at most 25% more examples
  than the smallest one to reach the same loss, i.e. it still buys at least
  B / (1.25 B_min) times fewer steps);
- **B_crit** = the same boundary interpolated: between that B (ratio r1 <= tolerance) and
  the next grid B (ratio r2 > tolerance, reached), log B is linear in log r; when the next
  B never reached the target (within ``cap`` x samples) or B_crit (grid) is the largest B
  of the grid, B_crit = B_crit (grid) and is flagged as a bound (``censored``: "not
  reached" above it, or ">=" at the grid's top).

Its noise is measured by repeating every branch with other data seeds (each seed its own
target) and reporting the spread of B_crit over the seeds (`summarize`).

theta from a GNS: Algorithm 1 asks for B = N / (theta^2 M) = GNS / theta^2, so the theta at
which it asks for B_crit is sqrt(GNS / B_crit) (`theta_for`). Which GNS matters: the one
the controller sees (its own estimator, EMAs and samples); the probe also measures a
fresh one at the checkpoint in every geometry (`measure_gns`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .controller import LR_SCALINGS, lr_omega

__all__ = ["samples_to_target", "CriticalBatch", "critical_batch", "theta_for", "summarize",
           "run_branch", "run_probe", "measure_gns", "controller_lr_rule"]


def _check_curve(samples, losses, where: str) -> tuple[list[float], list[float]]:
    s = [float(x) for x in samples]
    v = [float(x) for x in losses]
    if len(s) != len(v) or not s:
        raise ValueError(f"{where}: samples and losses must be non-empty and of equal length "
                         f"(got {len(s)} and {len(v)})")
    if any(not math.isfinite(x) or x < 0 for x in s) or any(b <= a for a, b in zip(s, s[1:])):
        raise ValueError(f"{where}: samples must be finite, >= 0 and strictly increasing")
    return s, v


def samples_to_target(samples: Sequence[float], losses: Sequence[float],
                      target: float) -> Optional[float]:
    """Examples seen when the curve first reaches `target`: the first evaluation with
    loss <= target, linearly interpolated from the evaluation before it (none before the
    first: its samples). None when no evaluation reaches it; a non-finite loss never does."""
    s, v = _check_curve(samples, losses, "samples_to_target")
    if not math.isfinite(target):
        raise ValueError(f"samples_to_target: target must be finite, got {target!r}")
    for i, (si, vi) in enumerate(zip(s, v)):
        if math.isfinite(vi) and vi <= target:
            if i == 0 or not math.isfinite(v[i - 1]) or v[i - 1] == vi:
                return si
            frac = (v[i - 1] - target) / (v[i - 1] - vi)
            return s[i - 1] + frac * (si - s[i - 1])
    return None


@dataclass
class CriticalBatch:
    """The criterion's result for one seed (module docstring)."""
    target: float
    tolerance: float
    samples_to_target: dict          # B -> S(B) or None (not reached)
    ratios: dict                     # B -> S(B) / S(B_min) or None
    b_crit_grid: int
    b_crit: float
    censored: str                    # "" | "not reached above" | "grid top"


def critical_batch(curves: dict, target: float, tolerance: float = 1.25) -> CriticalBatch:
    """The criterion on curves {B: (samples, losses)} at `target` (module docstring).
    ValueError when the smallest B never reaches the target (the target must be one the
    smallest batch reaches: it defines the reference cost) or on bad input."""
    if not isinstance(curves, dict) or len(curves) < 1:
        raise ValueError("critical_batch: curves must be a non-empty dict {batch size: (samples, losses)}")
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 1):
        raise ValueError(f"critical_batch: tolerance must be a finite number >= 1, got {tolerance!r}")
    Bs = sorted(curves)
    if any(not isinstance(B, int) or isinstance(B, bool) or B < 1 for B in Bs):
        raise ValueError(f"critical_batch: batch sizes must be integers >= 1, got {Bs!r}")
    S = {B: samples_to_target(*curves[B], target) for B in Bs}
    s0 = S[Bs[0]]
    if s0 is None or s0 <= 0:
        raise ValueError(f"critical_batch: the smallest batch ({Bs[0]}) never reaches the target "
                         f"{target!r} (or reaches it at 0 examples); choose a target it reaches")
    ratios = {B: (None if S[B] is None else S[B] / s0) for B in Bs}
    last = 0
    for i, B in enumerate(Bs):
        r = ratios[B]
        if r is None or r > tolerance:
            break
        last = i
    b_grid = Bs[last]
    censored, b_crit = "", float(b_grid)
    if last == len(Bs) - 1:
        censored = "grid top"
    else:
        nxt = Bs[last + 1]
        r1, r2 = ratios[b_grid], ratios[nxt]
        if r2 is None:
            censored = "not reached above"
        elif r2 > r1:
            t = (math.log(tolerance) - math.log(r1)) / (math.log(r2) - math.log(r1))
            t = min(max(t, 0.0), 1.0)
            b_crit = math.exp(math.log(b_grid) + t * (math.log(nxt) - math.log(b_grid)))
    return CriticalBatch(target=float(target), tolerance=float(tolerance), samples_to_target=S,
                         ratios=ratios, b_crit_grid=b_grid, b_crit=b_crit, censored=censored)


def theta_for(gns: float, batch_size: float) -> float:
    """The theta at which Algorithm 1 asks for `batch_size`: B = GNS / theta^2, so
    theta = sqrt(GNS / B) (before the rounding up to a multiple). ValueError unless both
    are finite and > 0."""
    for name, v in (("gns", gns), ("batch_size", batch_size)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"theta_for: {name} must be a finite number > 0, got {v!r}")
    return math.sqrt(gns / batch_size)


def summarize(results: Sequence[CriticalBatch]) -> dict:
    """Spread of the criterion over seeds: B_crit median / min / max (interpolated and
    grid), and per B the ratio S(B)/S(B_min) as mean [min, max] over the seeds that
    reached the target (with how many did)."""
    if not results:
        raise ValueError("summarize: no results")
    vals = sorted(r.b_crit for r in results)
    grid = sorted(r.b_crit_grid for r in results)

    def median(x):
        n = len(x)
        return x[n // 2] if n % 2 else 0.5 * (x[n // 2 - 1] + x[n // 2])

    per_b = {}
    for B in sorted(results[0].ratios):
        rs = [r.ratios.get(B) for r in results]
        got = [x for x in rs if x is not None]
        per_b[B] = dict(reached=len(got), of=len(rs),
                        mean=(sum(got) / len(got) if got else None),
                        min=(min(got) if got else None), max=(max(got) if got else None))
    return dict(b_crit_median=median(vals), b_crit_min=vals[0], b_crit_max=vals[-1],
                b_crit_grid_median=median(grid), b_crit_grid_min=grid[0], b_crit_grid_max=grid[-1],
                censored=[r.censored for r in results], ratios=per_b)


# ----------------------------------------------------------------------------- branches
def controller_lr_rule(schedule: Optional[Callable[[int], float]], samples_at_start: int,
                       initial_batch_size: int, lr_scaling: str = "sqrt") -> Callable[[int, int], float]:
    """The LR rule of `AdaptiveBatching` as a factor on each param group's base lr:
    factor(n, B) = schedule(samples_at_start + n) x omega(B), with omega = sqrt(B / B_0)
    ("sqrt"), B / B_0 ("linear") or 1 ("none"); schedule None counts as 1. n is the examples
    the branch has seen before the step."""
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(f"controller_lr_rule: lr_scaling must be 'sqrt', 'linear' or 'none', got {lr_scaling!r}")

    def rule(n: int, B: int) -> float:
        f = 1.0 if schedule is None else float(schedule(samples_at_start + n))
        return f * lr_omega(B / initial_batch_size, lr_scaling)
    return rule


def _evaluate_in_eval_mode(evaluate: Callable[[torch.nn.Module], float], model: torch.nn.Module) -> float:
    """float(evaluate(model)) with the model in eval mode under torch.no_grad(); the
    model's train / eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(evaluate(model))
    finally:
        model.train(was_training)


def run_branch(start: Callable[[], tuple], draw: Callable[[int, torch.Generator], object],
               loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
               evaluate: Callable[[torch.nn.Module], float], batch_size: int, seed: int,
               max_samples: int, eval_every: int, lr_rule: Callable[[int, int], float],
               stop_at: Optional[float] = None) -> tuple[list[int], list[float]]:
    """One branch: ``model, optimizers = start()`` (fresh objects restored from the
    checkpoint), then optimizer steps of `batch_size` examples drawn by
    ``draw(batch_size, generator)`` (generator seeded with `seed`, so every B of one seed
    reads the same stream) until `max_samples` examples; before each step every param
    group's lr = base lr x ``lr_rule(samples, batch_size)`` (base lr: the group's
    "base_lr" when it has one, as `AdaptiveBatching(lr_schedule=...)` stores it, else its
    lr at start). Evaluates at 0 and whenever another `eval_every` examples have been
    seen, and at the end; stops early after the first evaluation <= `stop_at`. Every
    ``evaluate(model)`` call runs with the model in eval mode (dropout off) under
    ``torch.no_grad()``; the model's mode is restored after it and every training step
    runs in train mode. Returns (samples, losses) of the evaluations."""
    model, optimizers = start()
    optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    bases = [[float(g.get("base_lr", g["lr"])) for g in o.param_groups] for o in optimizers]
    gen = torch.Generator().manual_seed(int(seed))
    samples, losses = [0], [_evaluate_in_eval_mode(evaluate, model)]
    n, next_eval = 0, eval_every
    while n + batch_size <= max_samples:
        factor = lr_rule(n, batch_size)
        for o, bs in zip(optimizers, bases):
            for g, base in zip(o.param_groups, bs):
                g["lr"] = base * factor
        batch = draw(batch_size, gen)
        model.train()
        loss = loss_fn(model, batch)
        loss.backward()
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        n += batch_size
        if n >= next_eval or n + batch_size > max_samples:
            while next_eval <= n:
                next_eval += eval_every
            losses.append(_evaluate_in_eval_mode(evaluate, model))
            samples.append(n)
            if stop_at is not None and losses[-1] <= stop_at:
                break
    return samples, losses


def run_probe(start, draw, loss_fn, evaluate, batch_sizes: Sequence[int], seeds: Sequence[int],
              samples: int, lr_rule, tolerance: float = 1.25, cap: float = 2.0,
              evals: int = 16, log: Callable[[str], None] = lambda s: None) -> dict:
    """The probe (module docstring) for every seed: the smallest B runs `samples` examples
    and sets the seed's target (its last evaluation); every larger B runs until it
    reaches the target or `cap` x `samples` examples. Evaluations every
    samples / `evals` examples (rounded up to a multiple of every B is not needed: each
    branch evaluates at the first step at or past each point). Returns
    {"seeds": {seed: {"curves": {B: (samples, losses)}, "result": CriticalBatch}},
     "summary": summarize(...)}."""
    Bs = sorted(int(b) for b in batch_sizes)
    if len(Bs) < 2 or len(set(Bs)) != len(Bs) or Bs[0] < 1:
        raise ValueError(f"run_probe: batch_sizes must be >= 2 distinct integers >= 1, got {batch_sizes!r}")
    if samples < Bs[0]:
        raise ValueError(f"run_probe: samples ({samples}) must be at least the smallest batch ({Bs[0]})")
    if not seeds:
        raise ValueError("run_probe: at least one seed")
    if not (cap >= tolerance >= 1):
        raise ValueError(f"run_probe: need cap >= tolerance >= 1, got cap {cap!r}, tolerance {tolerance!r}")
    every = max(1, int(math.ceil(samples / evals)))
    out = {}
    for seed in seeds:
        curves = {}
        curves[Bs[0]] = run_branch(start, draw, loss_fn, evaluate, Bs[0], seed, samples, every, lr_rule)
        target = curves[Bs[0]][1][-1]
        log(f"seed {seed}: B={Bs[0]} target {target:.4f} at {curves[Bs[0]][0][-1]} examples")
        limit = int(cap * curves[Bs[0]][0][-1])
        for B in Bs[1:]:
            curves[B] = run_branch(start, draw, loss_fn, evaluate, B, seed, limit, every, lr_rule,
                                   stop_at=target)
            s = samples_to_target(*curves[B], target)
            log(f"seed {seed}: B={B} " + ("not reached" if s is None else f"reached at {s:.0f} examples"))
        out[seed] = dict(curves=curves, result=critical_batch(curves, target, tolerance))
    return dict(seeds=out, summary=summarize([v["result"] for v in out.values()]))


# ----------------------------------------------------------------------------- GNS
def measure_gns(model: torch.nn.Module, params: Sequence[torch.nn.Parameter], draw, loss_fn,
                micro_batch: int, micro_batches: int, repeats: int = 8, seed: int = 0,
                geometries: Sequence[str] = ("l1", "nuclear", "l2"),
                bias_correction: bool = False) -> dict:
    """The GNS at the model's current point in every geometry, measured like a one-rank run
    (``MicroBatchGNS``): `micro_batches` micro-batches of `micro_batch` examples are the
    samples of one measurement (B = their product), `repeats` measurements on fresh data
    (``draw``, a generator seeded with `seed`); noise and signal are averaged over the
    repeats (as the controller's EMAs average measurements) and their ratio is the GNS.
    `bias_correction` as in ``gk.estimate`` (False: the paper's raw estimator). Returns
    {geometry: {"gns", "noise", "signal", "gns_each": [...]}}; the model is left as it was
    (its .grad untouched)."""
    from .stats.offline import estimate

    params = list(params)
    if micro_batches < 2:
        raise ValueError(f"measure_gns: micro_batches must be >= 2 (the samples), got {micro_batches}")
    if repeats < 1 or micro_batch < 1:
        raise ValueError("measure_gns: repeats and micro_batch must be >= 1")
    gen = torch.Generator().manual_seed(int(seed))
    acc = {g: dict(noise=[], signal=[], gns=[]) for g in geometries}
    was_training = model.training
    model.train()
    try:
        for _ in range(repeats):
            samples = []
            for _ in range(micro_batches):
                loss = loss_fn(model, draw(micro_batch, gen))
                samples.append([t.detach().float() for t in torch.autograd.grad(loss, params)])
            for g in geometries:
                est = estimate(samples, batch_size=micro_batch * micro_batches, geometry=g,
                               bias_correction=bias_correction)
                if est.valid:
                    acc[g]["noise"].append(est.noise)
                    acc[g]["signal"].append(est.signal)
                    acc[g]["gns"].append(est.gns)
    finally:
        model.train(was_training)
    out = {}
    for g, a in acc.items():
        if a["noise"]:
            n, s = sum(a["noise"]) / len(a["noise"]), sum(a["signal"]) / len(a["signal"])
            out[g] = dict(gns=n / s, noise=n, signal=s, gns_each=a["gns"])
        else:
            out[g] = dict(gns=math.nan, noise=math.nan, signal=math.nan, gns_each=[])
    return out
