"""What a coordinated step measured, as the controller and the metrics see it.

``controller_estimate`` takes the hook state's estimate of step k (never another step's;
on the hooks' host route the one that became readable at step k, measured at k - F),
in the loss scale's units divided out; ``step_row`` is the flat row ``metrics()`` reports
for the step.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Optional

from ..stats.gns import GNSEstimate

__all__ = ["controller_estimate", "step_row", "loss_scale"]


def loss_scale(grad_scaler) -> float:
    """The loss scale a GradScaler applies now (1 without one, or for a scale that is not a
    positive finite number)."""
    s = 1.0 if grad_scaler is None else float(grad_scaler.get_scale())
    return s if s > 0 and math.isfinite(s) else 1.0


def controller_estimate(state, k: int, scale: float, samples_per_step: int, one_rank: bool,
                        warn_once: Callable[[str, str], None]) -> Optional[GNSEstimate]:
    """The hook state's estimate readable at step k as the controller sees it: noise,
    signal and the pooled noise divided by the loss scale squared (a GradScaler's:
    ``scale``, step k's, or for a lagged estimate the measured step's,
    ``state.estimate_grad_scale``); None when step k has no estimate (warned once, unless
    the step had fewer than 2 samples: ``samples_per_step`` = R x A for micro-batch
    samples, else 2, or the state's host route has just staged step k's measurement and
    has no earlier one to join: ``state.lagged_step``) or it says it was measured at
    another step. The estimate of step k is the one measured at k, or on the hooks' host
    route the one that became available at k (``state.estimate_available_step``; its
    ``step`` is the measured one, k - F). ``one_rank``: the samples are one rank's
    micro-batches (for the zero-noise message)."""
    est = state.estimate
    avail = getattr(state, "estimate_available_step", None)
    if avail is None:
        avail = state.estimate_step
    if est is None or avail != k:
        if getattr(state, "lagged_step", None) == k:
            return None   # the host route's first measurement: readable at the next one
        if samples_per_step >= 2:
            warn_once("missing", f"step {k} is a measuring step but the hook state has no "
                      f"estimate of it (estimate_step = {state.estimate_step}); the batch "
                      "cannot adapt. Is the hook attached to the model that ran backward?")
        return None
    if not isinstance(est, GNSEstimate):
        raise TypeError(f"the hook state's estimate must be a GNSEstimate, got {type(est).__name__}")
    lag = getattr(est, "available_step", None)
    if est.step is not None and (est.step != k if lag is None else (lag != k or est.step > k)):
        warn_once("stale", f"the estimate of step {k} says it was measured at step "
                  f"{est.step}" + ("" if lag is None else f" and available at step {lag}")
                  + "; it is not used")
        return None
    if lag is not None:  # lagged: the measured step's loss scale
        ms = getattr(state, "estimate_grad_scale", None)
        if ms is not None:
            scale = float(ms)
    step = k if est.step is None else est.step
    if est.valid and est.noise == 0 and est.signal > 0:
        who, whom = ("micro-batch", "micro-batches") if one_rank else ("rank", "ranks")
        warn_once("zero-noise", (
            f"the noise measured at step {k} is exactly 0: every {who} computed the same "
            f"gradient, so the GNS is 0 and the batch cannot grow. Do the {whom} read the same "
            "examples (a loader that repeats one batch, or is not sharded by rank)? Use "
            "DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)))"))
    s2 = scale * scale
    if s2 == 1.0:
        return replace(est, step=step)
    div = (lambda v: None if v is None else float(v) / s2)
    return replace(est, noise=est.noise / s2, signal=est.signal / s2, step=step,
                   noise_pooled=div(est.noise_pooled), noise_raw=div(est.noise_raw),
                   signal_raw=div(est.signal_raw), signal_unbiased=div(est.signal_unbiased))


def step_row(k: int, samples_seen: int, B: int, A: int, b: int, next_batch: int,
             multiplier: float, measure: bool, est: Optional[GNSEstimate], controller,
             scale: float, optimizers: list, state) -> dict:
    """The flat metrics row of step k (``AdaptiveBatching.metrics()`` documents its keys)."""
    ctrl = controller
    nan = float("nan")
    row: dict[str, Any] = {
        "step": k, "samples_seen": samples_seen, "batch_size": B, "accum_steps": A,
        "micro_batch_size": b, "next_batch_size": next_batch,
        "lr_multiplier": multiplier, "measuring_step": measure,
        "measured": est is not None,
        "valid": bool(est.valid) if est is not None else None,  # None: nothing measured
        "gns": est.gns if est is not None else nan,
        "noise": est.noise if est is not None else nan,
        "noise_pooled": (est.noise_pooled if est is not None and est.noise_pooled is not None
                         else nan),
        "signal": est.signal if est is not None else nan,
        "noise_ema": nan if ctrl.noise_ema is None else ctrl.noise_ema,
        "signal_ema": nan if ctrl.signal_ema is None else ctrl.signal_ema,
        "gns_ema": nan if ctrl.gns_ema is None else ctrl.gns_ema,
        "target_batch_size": nan if ctrl.target_batch_size is None else ctrl.target_batch_size,
        "grad_scale": scale,
    }
    i = 0
    for opt in optimizers:
        for group in opt.param_groups:
            row[f"lr_{i}"] = float(group["lr"])
            i += 1
    # per-layer terms, when the measuring object exposes them as {name: (noise, signal)}
    layers = getattr(state, "layer_stats", None) if est is not None else None
    if isinstance(layers, dict):
        s2 = scale * scale
        for name, (n, s) in layers.items():
            row[f"noise/{name}"] = float(n) / s2
            row[f"signal/{name}"] = float(s) / s2
    return row
