"""The run's schedule: the measuring period F, the step k, the global batch B_k and the
loss scale, in one object that one owner writes and the others read.

A hook state (``GNSHookState``, ``MicroBatchGNS``) and the controller
(``AdaptiveBatchSize``) each make a ``Schedule`` of their own when used alone, and then own
it: its settable fields are theirs (``state.batch_size = B``, ``state.step = k`` on resume).
``gk.AdaptiveBatching`` makes one ``Schedule`` for the run and hands it to the hook state and
the controller, which then read F, k, B and the scale from it instead of keeping copies;
the coordinator (and the controller, whose decision B_{k+1} is) writes it. A write through
a reader (``state.batch_size = ...`` on a coordinated hook state) raises, naming the owner.

Fields (plain Python values):
    every: F >= 1, measure at optimizer steps k with k % F == 0.
    step: k >= 0, the optimizer step in progress.
    batch_size: B_k > 0, the global batch of step k (examples, all ranks and micro-batches).
    grad_scale: > 0, the loss scale the step's backward runs with (1 without a GradScaler).
    per_step: R x b, the examples of one micro-batch on every rank (None when unknown): a
        coordinated ``MicroBatchGNS`` reads its A_k = B_k / (R b) from it.
"""
from __future__ import annotations

import math
from typing import Optional

__all__ = ["Schedule"]


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_batch_size(value, name: str = "batch_size"):
    """A positive finite number (the global batch; an int under the coordinator)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive number (the global batch), got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive finite number (the global batch), got {value}")
    return value


def check_grad_scale(value, name: str = "grad_scale") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a positive finite loss scale, got {value!r}")
    return float(value)


class Schedule:
    """F, k, B_k and the loss scale of one run (see the module docstring).

    ``owner``: a short name of the object that writes it (``"AdaptiveBatching"``), or None
    while the object that made it owns it alone. ``write(field, value, by)`` is the owner's
    write; ``check_writer(field, by)`` raises RuntimeError for anyone else."""

    __slots__ = ("_every", "_step", "_batch_size", "_grad_scale", "per_step", "owner")

    def __init__(self, every: int = 100, batch_size=1, step: int = 0, grad_scale: float = 1.0,
                 per_step: Optional[int] = None, owner: Optional[str] = None):
        self._every = _check_count("every", every, 1)
        self._batch_size = check_batch_size(batch_size)
        self._step = _check_count("step", step, 0)
        self._grad_scale = check_grad_scale(grad_scale)
        self.per_step = per_step
        self.owner = owner

    # ---------------------------------------------------------------- reads
    @property
    def every(self) -> int:
        """F, the measuring period."""
        return self._every

    @property
    def step(self) -> int:
        """k, the optimizer step in progress."""
        return self._step

    @property
    def batch_size(self):
        """B_k, the global batch of the step in progress."""
        return self._batch_size

    @property
    def grad_scale(self) -> float:
        """The loss scale of the step's backward."""
        return self._grad_scale

    @property
    def accum_steps(self) -> Optional[int]:
        """A_k = B_k / (R b) when ``per_step`` is known, else None."""
        return None if self.per_step is None else int(self._batch_size) // self.per_step

    def measures(self, step: Optional[int] = None) -> bool:
        """Whether step k (default: the step in progress) is a measuring step, k % F == 0."""
        return (self._step if step is None else step) % self._every == 0

    # ---------------------------------------------------------------- writes
    def check_writer(self, field: str, by: str) -> None:
        """RuntimeError when ``by`` may not write ``field``: the schedule has another owner."""
        if self.owner is not None and by != self.owner:
            raise RuntimeError(
                f"{field}: this schedule is owned by {self.owner}, which sets it every step; "
                f"{by} only reads it (remove the line that sets {field}, or leave it to "
                f"{self.owner})")

    def write(self, field: str, value, by: str) -> None:
        """Set ``field`` ("every", "step", "batch_size" or "grad_scale") to a checked value."""
        self.check_writer(field, by)
        if field == "every":
            self._every = _check_count("every", value, 1)
        elif field == "step":
            self._step = _check_count("step", value, 0)
        elif field == "batch_size":
            self._batch_size = check_batch_size(value)
        elif field == "grad_scale":
            self._grad_scale = check_grad_scale(value)
        else:
            raise AttributeError(f"Schedule has no field {field!r}")

    def __repr__(self) -> str:
        own = f", owner={self.owner!r}" if self.owner else ""
        return (f"Schedule(every={self._every}, step={self._step}, batch_size={self._batch_size}, "
                f"grad_scale={self._grad_scale}{own})")
