"""The coordinator's checkpoint format: what ``AdaptiveBatching.state_dict()`` holds, the
versions it loads, and how a saved batch is brought into a run on another R x b.

Version 2 (now): ``schedule`` {every, step, batch_size} (F, k and B_k, saved once),
``samples_seen``, ``world_size``, ``micro_batch_size``, ``controller`` (without F and B),
``lr_multiplier``, ``schedulers``, ``sampler`` (the stream's position), ``hook`` (the hook
state's eigensolver hints and this rank's noise pool). Version 1 kept ``step``,
``batch_size`` and ``every`` at the top level and copies in the controller's and the
hook's entries; ``check_state_dict`` turns it into version 2.
"""
from __future__ import annotations

import warnings
from typing import Optional

from .._dcp_guard import refuse_unwrapped_dcp
from .._validation import check_int, warn_user
from .config import OWNER
from .reading import loss_scale

__all__ = ["STATE_VERSION", "STATE_KEYS", "check_state_dict", "check_schedule", "resumed_batch",
           "save", "load"]

STATE_VERSION = 2
STATE_KEYS = ("schedule", "samples_seen", "world_size", "micro_batch_size", "controller",
              "lr_multiplier", "schedulers", "sampler", "hook")
_STATE_KEYS_V1 = ("step", "samples_seen", "world_size", "micro_batch_size", "controller",
                  "lr_multiplier", "schedulers", "sampler", "hook")


def check_state_dict(sd) -> dict:
    """``sd`` as a state_dict of the current version, or ValueError / KeyError when it is not
    one ``AdaptiveBatching`` wrote (any version; nothing is loaded)."""
    if not isinstance(sd, dict) or sd.get("version") not in (1, STATE_VERSION):
        got = sd.get("version") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"AdaptiveBatching.load_state_dict: version {got!r}, expected a "
                         f"state_dict of version 1 or {STATE_VERSION}")
    keys = _STATE_KEYS_V1 if sd["version"] == 1 else STATE_KEYS
    missing = [k for k in keys if k not in sd]
    if missing:
        raise KeyError(f"AdaptiveBatching.load_state_dict: a dict without keys {missing}")
    if not isinstance(sd["controller"], dict) or not isinstance(sd["controller"].get("config"), dict):
        raise ValueError("AdaptiveBatching.load_state_dict: 'controller' is not a controller state_dict")
    if sd["version"] == 1:
        ctrl = sd["controller"]
        schedule = {"every": sd.get("every", ctrl["config"].get("every")), "step": sd["step"],
                    "batch_size": ctrl.get("batch_size")}
        sd = {k: v for k, v in sd.items() if k not in ("step", "batch_size", "every")}
        sd.update(version=STATE_VERSION, schedule=schedule)
    if not isinstance(sd["schedulers"], (list, tuple)) or not isinstance(sd["hook"], dict):
        raise ValueError("AdaptiveBatching.load_state_dict: 'schedulers' must be a list and 'hook' a dict")
    if not isinstance(sd["schedule"], dict):
        raise ValueError("AdaptiveBatching.load_state_dict: 'schedule' must be a dict")
    return sd


def check_schedule(schedule: dict) -> tuple[int, int, int]:
    """(F, k, B) of a saved schedule, each checked."""
    return (check_int("state_dict['schedule']['every']", schedule.get("every"), 1),
            check_int("state_dict['schedule']['step']", schedule.get("step"), 0),
            check_int("state_dict['schedule']['batch_size']", schedule.get("batch_size"), 1))


def resumed_batch(batch: int, multiple: int, initial: int, cap: Optional[int]) -> tuple[int, Optional[str]]:
    """(the batch a run on ``multiple`` = R x b continues with, why it differs from the saved
    ``batch`` or None): rounded up to a multiple of R x b, within [B_0, max_batch_size]."""
    new = -(-batch // multiple) * multiple
    if cap is not None:
        new = min(new, cap)
    new = max(new, initial)
    if new == batch:
        return new, None
    why = (f"not a multiple of {multiple}" if batch % multiple else
           f"below this run's initial_batch_size {initial}" if batch < initial else
           f"above this run's max_batch_size {cap}")
    return new, why


def save(coord) -> dict:
    """``coord.state_dict()``: the current version's dict (module docstring)."""
    refuse_unwrapped_dcp("AdaptiveBatching")
    s = coord.schedule
    lr_multiplier, schedulers = coord.lrs.state_dicts()
    return {
        "version": STATE_VERSION,
        "schedule": {"every": s.every, "step": s.step, "batch_size": s.batch_size},
        "samples_seen": coord.progress.samples, "world_size": coord.world_size,
        "micro_batch_size": coord.micro_batch_size, "controller": coord.controller.state_dict(),
        "lr_multiplier": lr_multiplier, "schedulers": schedulers,
        "sampler": coord.stream.state_dict(), "hook": coord.state.state_dict(),
    }


def load(coord, sd, strict: bool) -> None:
    """``coord.load_state_dict(sd, strict)``: all or nothing (a refused state_dict leaves the
    coordinator, its schedule, controller, sampler, schedulers and hook state as they were:
    what changed is reloaded from the state the coordinator had)."""
    sd = check_state_dict(sd)
    saved = save(coord)
    kept = [(obj, dict(vars(obj))) for obj in (coord.progress, coord.stream)]
    try:
        _load(coord, sd, strict)
    except BaseException:
        for obj, fields in kept:
            vars(obj).update(fields)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _load(coord, saved, strict=False)
        raise


def _load(coord, sd: dict, strict: bool) -> None:
    ctrl = coord.controller
    csd = dict(sd["controller"])
    csd["config"] = dict(csd["config"])
    every, step, batch = check_schedule(sd["schedule"])
    if strict:
        diff = ctrl.config_differences(csd["config"], ignore=("multiple_of",))
        if every != coord.every:
            diff["every"] = (every, coord.every)
        if diff:
            details = ", ".join(f"{k}: saved {a!r} vs {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(f"AdaptiveBatching.load_state_dict: the controller's settings differ "
                             f"({details}); construct it with the saved settings or pass strict=False")
    new, why = resumed_batch(batch, ctrl.multiple_of, ctrl.initial_batch_size, ctrl.max_batch_size)
    if why is not None:
        warn_user(
            f"AdaptiveBatching: resumed with world_size x micro_batch_size = {coord.world_size} x "
            f"{coord.micro_batch_size} = {ctrl.multiple_of} (saved: {sd['world_size']} x "
            f"{sd['micro_batch_size']}); the saved batch {batch} is {why}, continuing with {new} "
            "(the LR multiplier follows)")
    samples = check_int("state_dict['samples_seen']", sd["samples_seen"], 0)
    coord.schedule.write("batch_size", new, by=OWNER)
    coord.schedule.write("step", step, by=OWNER)
    ctrl.load_state_dict(csd, strict=False)     # B is the schedule's: not read from csd
    coord.lrs.load(sd["schedulers"], ctrl.lr_multiplier)
    coord.stream.load_state_dict(sd["sampler"])
    coord.state.load_state_dict(dict(sd["hook"]))   # F, k, B there (version 1) are not read
    coord.stream.restart()
    pr = coord.progress
    pr.new_step(coord.state.synced_backwards, len(coord.optimizers))
    pr.samples, pr.loaded = samples, True
    coord.schedule.write("grad_scale", loss_scale(coord.grad_scaler), by=OWNER)
