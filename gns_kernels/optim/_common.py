"""Argument checks shared by the gns_kernels optimizers."""
from __future__ import annotations

import math
from numbers import Real
from typing import Any


def check_hyper(name: str, value: Any, lo: float, hi: float | None = None, hi_open: bool = True) -> float:
    """Return ``float(value)`` after checking lo <= value (< or <=) hi; clear error naming it."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or v < lo or (hi is not None and (v >= hi if hi_open else v > hi)):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return v
