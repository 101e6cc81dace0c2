"""Argument checks shared by the gns_kernels optimizers."""
from __future__ import annotations

from typing import Any

from .._validation import check_real


def check_hyper(name: str, value: Any, lo: float, hi: float | None = None, hi_open: bool = True) -> float:
    """Return ``float(value)`` after checking lo <= value (< or <=) hi; clear error naming it.

    TypeError for a non-number (bool included), ValueError for NaN, inf or out of range.
    """
    return check_real(name, value, lo, hi, hi_open=hi_open)
