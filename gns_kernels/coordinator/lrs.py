"""The learning rates of a coordinated run: each param group's scheduled rate (a schedule
on samples seen, or the user's schedulers) times the multiplier omega of the batch.

``LRControl`` owns the rates: it sets step 0's at construction, steps the schedulers once
per coordinator step on the un-multiplied rates, applies omega (``gns_kernels.lr.
LRMultiplier``), takes an lr changed outside as a new scheduled rate (warned once), and
names a scheduler that was stepped by hand.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Optional

from ..lr import LRMultiplier

__all__ = ["LRControl", "lr_moved"]


def lr_moved(group: dict, multiplier: float) -> bool:
    """A param group's lr is not its scheduled lr x the multiplier: set outside the
    coordinator."""
    if "scheduled_lr" not in group:  # a group added after the coordinator (add_param_group)
        return False
    return not math.isclose(float(group["lr"]), group["scheduled_lr"] * multiplier,
                            rel_tol=1e-12, abs_tol=0.0)


class LRControl:
    """The scheduled rates and omega of ``optimizers``.

    ``schedulers``: LR schedulers of the optimizers (stepped by ``step``), or an empty list;
    ``lr_schedule``: a function of the global examples seen to a factor of each group's base
    lr (its lr when the coordinator was built, kept as ``group["base_lr"]``), or None
    (exclusive with schedulers). ``check_schedule(lr_schedule)`` runs the checks that may
    refuse, before anything changes; the constructor then writes step 0's rates."""

    @staticmethod
    def check(schedulers: list, lr_schedule) -> None:
        """TypeError / ValueError for schedulers or an lr_schedule the coordinator cannot use
        (nothing is changed)."""
        for i, s in enumerate(schedulers):
            if not (callable(getattr(s, "step", None)) and callable(getattr(s, "state_dict", None))):
                raise TypeError(f"schedulers[{i}]: expected an LR scheduler (step(), state_dict()), "
                                f"got {type(s).__name__}")
        if lr_schedule is not None:
            if not callable(lr_schedule):
                raise TypeError(f"lr_schedule: expected a function of the samples seen, got "
                                f"{type(lr_schedule).__name__}")
            if schedulers:
                raise ValueError("lr_schedule and schedulers: pass one of them (both would own "
                                 "the scheduled learning rate)")
            schedule_factor(lr_schedule, 0)   # a schedule that refuses 0 refuses here

    def __init__(self, optimizers: list, schedulers: list, lr_schedule: Optional[Callable]):
        self.optimizers, self.schedulers, self.lr_schedule = optimizers, schedulers, lr_schedule
        if lr_schedule is not None:
            f0 = schedule_factor(lr_schedule, 0)
            for group in self._groups():
                group.setdefault("base_lr", float(group["lr"]))
                group["lr"] = group["base_lr"] * f0
                group.pop("scheduled_lr", None)
        self.lrm = LRMultiplier(optimizers, schedulers)   # captures the scheduled rates
        self.epochs = self.scheduler_epochs()

    def _groups(self):
        for opt in self.optimizers:
            yield from opt.param_groups

    @property
    def multiplier(self) -> float:
        return self.lrm.multiplier

    def scheduler_epochs(self) -> list:
        return [getattr(s, "last_epoch", None) for s in self.schedulers]

    def factor(self, samples: int) -> Optional[float]:
        """lr_schedule(samples), checked; None without an lr_schedule."""
        return None if self.lr_schedule is None else schedule_factor(self.lr_schedule, samples)

    def step(self, multiplier: float, factor: Optional[float],
             warn_once: Callable[[str, str], None]) -> None:
        """End of a coordinator step: an lr changed outside is taken as the new scheduled rate
        (warned once), the lr_schedule's ``factor`` of the next step applied, the schedulers
        stepped on the scheduled rates, omega = ``multiplier`` applied."""
        m = self.lrm.multiplier
        for group in self._groups():
            if "scheduled_lr" not in group:  # added by add_param_group: its lr is scheduled
                group["scheduled_lr"] = float(group["lr"])
                if self.lr_schedule is not None:
                    group.setdefault("base_lr", float(group["lr"]))
                continue
            if lr_moved(group, m):
                warn_once(
                    "lr", "a param group's lr was changed outside the coordinator (a scheduler "
                    "stepped by hand?); it is taken as the new scheduled rate. Pass "
                    "schedulers=[...] to AdaptiveBatching and do not step them yourself, so "
                    "they never see the multiplier")
                group["scheduled_lr"] = float(group["lr"])
        if factor is not None:
            for group in self._groups():
                group["scheduled_lr"] = group["base_lr"] * factor
        self.lrm.step(multiplier)
        self.epochs = self.scheduler_epochs()

    def restart(self, samples: int) -> None:
        """The optimizers were loaded from a checkpoint without the coordinator: their param
        groups carry the checkpoint's lr (scheduled x the saved multiplier). Going on, the
        coordinator starts afresh, so lr = the loaded scheduled rate x this coordinator's
        multiplier (with lr_schedule: base lr x lr_schedule(samples seen)); taking the loaded
        lr as a new scheduled rate multiplied it a second time at every step."""
        f = self.factor(samples)
        for group in self._groups():
            if f is not None and "base_lr" in group:
                group["scheduled_lr"] = group["base_lr"] * f
            else:
                group.setdefault("scheduled_lr", float(group["lr"]))
        self.lrm.set_multiplier(self.lrm.multiplier)

    def check_hand_steps(self, k: int) -> None:
        """RuntimeError for a scheduler stepped outside the coordinator: one built on a
        passed optimizer but not passed (it changed an lr; stepped by hand it sees the
        multiplied lr), or a passed one whose last_epoch moved."""
        m = self.lrm.multiplier
        for i, opt in enumerate(self.optimizers):
            changed = any(lr_moved(g, m) for g in opt.param_groups)
            if (changed and getattr(opt.step, "_wrapped_by_lr_sched", False)
                    and not any(getattr(s, "optimizer", None) is opt for s in self.schedulers)):
                raise RuntimeError(
                    f"step {k}: an LR scheduler built on optimizer {i} (position in the list given "
                    "to the coordinator) changed its lr outside the coordinator; stepped by hand "
                    "it sees the multiplied lr (a chainable one compounds the multiplier every "
                    "step). Pass it as AdaptiveBatching(..., schedulers=[sched]) and do not step "
                    "it yourself")
        now = self.scheduler_epochs()
        moved = [i for i, (a, b) in enumerate(zip(self.epochs, now)) if a != b]
        if moved:
            raise RuntimeError(
                f"step {k}: schedulers {moved} (positions in schedulers=[...]) were stepped "
                f"outside the coordinator (last_epoch {self.epochs[moved[0]]} -> "
                f"{now[moved[0]]}); the coordinator steps the schedulers it was given, once per "
                "coord.step(): remove your scheduler.step() call")

    def state_dicts(self) -> tuple[dict, list]:
        return self.lrm.state_dict(), [s.state_dict() for s in self.schedulers]

    def load(self, schedulers_sd: list, multiplier: float) -> None:
        if len(schedulers_sd) != len(self.schedulers):
            raise ValueError(f"AdaptiveBatching.load_state_dict: {len(schedulers_sd)} schedulers "
                             f"saved, {len(self.schedulers)} given")
        for s, ssd in zip(self.schedulers, schedulers_sd):
            s.load_state_dict(ssd)
        self.lrm.set_multiplier(multiplier)
        self.epochs = self.scheduler_epochs()


def schedule_factor(lr_schedule: Callable, samples: int) -> float:
    f = lr_schedule(samples)
    if isinstance(f, bool) or not isinstance(f, Real) or not (math.isfinite(f) and f >= 0):
        raise ValueError(f"lr_schedule({samples}) returned {f!r}; expected a finite number >= 0")
    return float(f)
