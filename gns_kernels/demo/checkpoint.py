"""checkpoint.pt of a demo run: RNG states in a form ``torch.load(weights_only=True)``
accepts, an atomic write that reports a full disk, a load that never runs code, and the
check that a checkpoint belongs to the config.json beside it.

Layout (a dict): model, optimizers (state_dicts), coord (one ``AdaptiveBatching.state_dict()``
per rank: step, samples seen, controller, LR multiplier, sampler position and that rank's
hook state with its share of the noise pool), rng (one `rng_state()` per rank), step,
elapsed, best_val, config (asdict(DemoConfig) of the run that wrote it). A checkpoint
written before the demo ran on ``AdaptiveBatching`` (controller, sampler, hook ... instead
of coord) is refused by `check_belongs` with one line.
"""
from __future__ import annotations

import errno
import io
import os
import pickle
import random
import re

import numpy as np
import torch

from .config import DemoError, trajectory_diff

CHECKPOINT = "checkpoint.pt"


def rng_state() -> dict:
    """This process's torch, numpy and Python RNG states, made of tensors, ints, floats,
    strings and tuples only (numpy's keys as an int64 tensor), so the checkpoint loads
    under weights_only=True."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(state["python"])


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def save_checkpoint(ck: dict, path: str) -> None:
    """Write `ck` to `path` atomically (serialised in memory, written to ``path.tmp``,
    fsync'ed, renamed). On any error ``path.tmp`` is removed and `path` keeps the previous
    checkpoint; a full disk (ENOSPC, EDQUOT) becomes DemoError("disk full while writing
    <path>")."""
    buf = io.BytesIO()
    torch.save(ck, buf)
    tmp = path + ".tmp"
    try:
        _write_bytes(tmp, buf.getbuffer())
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DemoError(f"disk full while writing {path} (the previous checkpoint, if any, "
                            "is kept; free space and --resume)") from None
        raise
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path: str, map_location=None) -> dict:
    """torch.load(weights_only=True): tensors and plain containers only, never code.
    DemoError naming the file when it holds anything else or is not a checkpoint."""
    try:
        ck = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _refusal_reason(exc)
        if "GLOBAL" in reason:  # a class or function the allow-list refuses: code or objects
            raise DemoError(f"--resume: {path} holds objects other than tensors and plain "
                            f"containers and is not loaded ({reason})") from None
        raise DemoError(f"--resume: {path} is not a readable checkpoint ({reason})") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise DemoError(f"--resume: {path} is not a readable checkpoint ({exc})") from None
    if not isinstance(ck, dict) or "config" not in ck or "rng" not in ck or "step" not in ck:
        raise DemoError(f"--resume: {path} is not a demo checkpoint (no config, rng or step)")
    return ck


def _refusal_reason(exc: Exception) -> str:
    """What torch's weights_only refusal refused: "GLOBAL <name>" when the file names a
    class or function, else the specific line of the message (its other lines are
    generic advice)."""
    text = str(exc)
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"GLOBAL {m.group(1)} is not allowed"
    m = re.search(r"WeightsUnpickler error:[ \t]*(\S[^\n]*)", text)
    if m:
        return m.group(1).strip()
    generic = ("Weights only load failed", "Please file an issue", "Check the documentation", "(")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    specific = [ln for ln in lines if not ln.startswith(generic)]
    return specific[0] if specific else (lines[-1] if lines else type(exc).__name__)


def check_belongs(ck: dict, config: dict, folder: str, ranks: int) -> None:
    """DemoError unless checkpoint `ck` was written by the run described by `config`
    (asdict(DemoConfig) from config.json): every key that changes the trajectory must be
    equal, and it must hold one RNG state and one coordinator state per rank."""
    saved = ck["config"]
    if not isinstance(saved, dict):
        raise DemoError(f"--resume {folder!r}: the checkpoint's config is not a dict")
    diff = trajectory_diff(saved, config)
    if diff:
        shown = "; ".join(f"{k}: checkpoint {saved.get(k, '<missing>')!r} vs config.json "
                          f"{config.get(k, '<missing>')!r}" for k in diff[:5])
        raise DemoError(f"--resume {folder!r}: checkpoint.pt and config.json belong to different "
                        f"runs ({shown}{'; ...' if len(diff) > 5 else ''})")
    if not isinstance(ck["rng"], (list, tuple)) or len(ck["rng"]) != ranks:
        raise DemoError(f"--resume {folder!r}: the checkpoint holds RNG states of "
                        f"{len(ck['rng']) if isinstance(ck['rng'], (list, tuple)) else '?'} "
                        f"ranks, the run has {ranks}")
    coords = ck.get("coord")
    if coords is None and "controller" in ck:
        raise DemoError(f"--resume {folder!r}: checkpoint.pt was written by an earlier version of "
                        "the demo (before it ran on gk.AdaptiveBatching) and cannot be continued; "
                        "start a new run")
    if (not isinstance(coords, (list, tuple)) or len(coords) != ranks
            or not all(isinstance(c, dict) for c in coords)):
        raise DemoError(f"--resume {folder!r}: the checkpoint holds no coordinator state "
                        f"(coord) for each of the run's {ranks} ranks")
