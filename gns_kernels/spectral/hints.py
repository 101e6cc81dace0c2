"""EigHints: which parameter shapes' eigenproblems are solved in float64 directly.

A cost hint for the eigenvalue path of ``nuclear_stats`` on CPU. The Grams of gradients
of few tokens per sample are rank-deficient, so their float32 error bound always fails
and they always take the float64 fallback: the float32 attempt is wasted work. A hints
object remembers, per parameter shape ('768x256'), whether some matrix of that shape
needed float64 at the last measurement that saw it, and the next measurement solves that
shape in float64 directly. The result is the one the fallback would give; only where
float32 would have been accepted does the hinted result differ (by float32's error,
within the 1e-3 budget), which is why the hints are part of a checkpoint.

Use: ``lookup(shapes)`` before a measurement, ``record(shapes, used64)`` with what each
matrix needed (collected, not yet used), ``apply()`` when the measurement finishes (so a
measurement's hints do not depend on the order in which its parts were solved).
``state_dict()`` / ``load_state_dict()``: a dict shape string -> bool.
"""
from __future__ import annotations

from typing import Iterable, Sequence


def shape_key(shape: Sequence[int]) -> str:
    """The hint key of a parameter shape: (768, 256) -> '768x256'."""
    return "x".join(str(int(d)) for d in shape)


class EigHints:
    """Per parameter shape: solve its eigenproblems in float64 directly (module docstring)."""

    def __init__(self, float64: dict[str, bool] | None = None):
        self._float64: dict[str, bool] = {}
        self._seen: dict[str, bool] = {}
        if float64 is not None:
            self.load_state_dict(float64)

    def lookup(self, shapes: Iterable[Sequence[int]]) -> list[bool]:
        """One bool per shape: True solves that layer in float64 directly."""
        return [self._float64.get(shape_key(s), False) for s in shapes]

    def record(self, shapes: Sequence[Sequence[int]], used64: Sequence[bool]) -> None:
        """Collect one measurement part's report: used64[i] = layer i needed float64. A shape
        counts as float64 if any of its matrices did. Takes effect at apply()."""
        if len(shapes) != len(used64):
            raise ValueError(f"used64: expected {len(shapes)} bools (one per shape), got {len(used64)}")
        for s, f in zip(shapes, used64):
            k = shape_key(s)
            self._seen[k] = self._seen.get(k, False) or bool(f)

    def apply(self) -> None:
        """End of a measurement: the collected reports become the hints (shapes not seen keep theirs)."""
        self._float64.update(self._seen)
        self._seen = {}

    def discard(self) -> None:
        """Drop the reports collected since the last apply() (a measurement that did not finish)."""
        self._seen = {}

    def state_dict(self) -> dict[str, bool]:
        """The applied hints, shape string -> bool (reports not yet applied are not kept)."""
        return dict(self._float64)

    def load_state_dict(self, sd: dict, name: str = "eig_float64") -> None:
        """Replace the hints with ``sd`` (shape string -> bool); ValueError naming ``name``."""
        if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, bool)
                                               for k, v in sd.items()):
            raise ValueError(f"{name}: expected a dict of shape string -> bool, got {sd!r}")
        for k in sd:
            parts = k.split("x")
            if not all(p.isdigit() for p in parts):
                raise ValueError(f"{name}: expected shape strings like '768x256', got key {k!r}")
        self._float64 = dict(sd)
        self._seen = {}

    def __len__(self) -> int:
        return len(self._float64)

    def __repr__(self) -> str:
        return f"EigHints({self._float64!r})"
