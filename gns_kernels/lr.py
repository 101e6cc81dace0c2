"""Learning-rate multiplier of the adaptive batch controller, on top of any LR schedule.

Algorithm 1 updates x_{k+1} = x_k - omega_k eta_k p_k: eta_k is the user's schedule (e.g.
linear warm-up then cosine, as in the paper's Appendix D) and omega_k the controller's
cumulative multiplier (``ctrl.lr_multiplier``, sqrt(B_k / B_0) by default).

`LRMultiplier` applies omega to every param group of one or more optimizers WITHOUT the
schedulers ever seeing it: each group keeps its scheduled rate in ``group["scheduled_lr"]``
and its effective rate ``group["lr"] = scheduled_lr * omega``. Before a scheduler steps,
``group["lr"]`` is put back to the scheduled value, so recursive (chainable) schedulers
such as CosineAnnealingLR, whose next value is computed from the current ``lr``, compose
correctly, and closed-form ones (LambdaLR) are unaffected. Both keys live in the param
groups, so they are saved and restored with ``optimizer.state_dict()``.

Per step::

    loss.backward(); optimizer.step()
    ctrl.update(k, estimate)
    lrm.step(ctrl.lr_multiplier)      # scheduler.step() inside, then lr = scheduled * omega

`warmup_cosine(t, total, warmup, min_ratio)` is the paper's schedule factor as a function of
progress t in any unit (the demo uses samples seen, since with a growing batch the number
of steps is not known in advance).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ._validation import check_real

__all__ = ["LRMultiplier", "warmup_cosine"]


def warmup_cosine(t: float, total: float, warmup: float = 0.0, min_ratio: float = 0.0) -> float:
    """Schedule factor in [min_ratio, 1]: linear warm-up from 0 over [0, warmup], then a
    cosine from 1 down to min_ratio at t = total (held there after).

        t < warmup:  (t + 1) / (warmup + 1)        (never exactly 0 at t = 0)
        else:        min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2,
                     p = min((t - warmup) / (total - warmup), 1)
    """
    t = check_real("warmup_cosine: t", t)
    total = check_real("warmup_cosine: total", total)
    warmup = check_real("warmup_cosine: warmup", warmup)
    min_ratio = check_real("warmup_cosine: min_ratio", min_ratio)
    if total <= 0:
        raise ValueError(f"warmup_cosine: total must be > 0, got {total}")
    if not 0 <= warmup < total:
        raise ValueError(f"warmup_cosine: warmup must be in [0, total), got {warmup} (total {total})")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"warmup_cosine: min_ratio must be in [0, 1], got {min_ratio}")
    if t < warmup:
        return (t + 1.0) / (warmup + 1.0)
    p = min((t - warmup) / (total - warmup), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def _as_list(x):
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


class LRMultiplier:
    """Multiply every param group's scheduled LR by the controller's omega.

    Args:
        optimizers: one optimizer or a list (e.g. [Muon, AdamW] of a composite).
        schedulers: None, one LR scheduler or a list (stepped inside `step`, in order).
        multiplier: initial omega (1.0 = omega_0 of Algorithm 1).
    """

    def __init__(self, optimizers, schedulers=None, multiplier: float = 1.0):
        self.optimizers = _as_list(optimizers)
        if not self.optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in self.optimizers):
            raise TypeError("LRMultiplier: optimizers must be a torch.optim.Optimizer or a list of them")
        self.schedulers = _as_list(schedulers)
        self.multiplier = 1.0
        for group in self._groups():
            group.setdefault("scheduled_lr", float(group["lr"]))
        self.set_multiplier(multiplier)

    def _groups(self) -> Iterable[dict]:
        for opt in self.optimizers:
            yield from opt.param_groups

    def set_multiplier(self, multiplier: float) -> None:
        """lr = scheduled_lr * multiplier in every group (no scheduler step)."""
        multiplier = check_real("LRMultiplier: multiplier", multiplier, 0.0, lo_open=True)
        self.multiplier = multiplier
        for group in self._groups():
            group["lr"] = group["scheduled_lr"] * multiplier

    def step(self, multiplier: float | None = None) -> None:
        """Step the schedulers on the scheduled (un-multiplied) rates, then apply
        `multiplier` (None: keep the current one)."""
        if multiplier is not None:
            multiplier = check_real("LRMultiplier: multiplier", multiplier, 0.0, lo_open=True)
        else:
            multiplier = self.multiplier
        for group in self._groups():
            group["lr"] = group["scheduled_lr"]
        for sched in self.schedulers:
            sched.step()
        for group in self._groups():
            group["scheduled_lr"] = float(group["lr"])
        self.set_multiplier(multiplier)

    @property
    def lrs(self) -> list[float]:
        """Effective learning rates of all groups (optimizer order)."""
        return [g["lr"] for g in self._groups()]

    def state_dict(self) -> dict:
        return {"multiplier": self.multiplier}

    def load_state_dict(self, state: dict) -> None:
        """Restore omega. Load the optimizers' state first (it holds scheduled_lr)."""
        if not isinstance(state, dict) or "multiplier" not in state:
            raise ValueError(
                f"state: expected a dict with key 'multiplier' from state_dict(), got {state!r}"
            )
        self.set_multiplier(state["multiplier"])
