"""ScheduleReader: a hook state's face on the run's schedule (F, k, B and the loss scale).

The schedule (gns_kernels.schedule.Schedule) holds F (``every``), the optimizer step k
(``step``), the global batch B (``batch_size``) and the loss scale (``grad_scale``). A hook
state makes its own and owns it when used alone: its setters write it (``state.batch_size
= B``; ``state.step = k`` on resume) and each synchronized backward advances k. Under a
coordinator (``use_schedule``) it reads the run's schedule, which the coordinator writes:
the setters then raise, naming the owner, and k is the coordinator's to advance.
``synced_backwards`` counts the synchronized backward passes either way.
"""
from __future__ import annotations

from typing import Optional

from ..schedule import Schedule, check_batch_size
from .config import check_count

__all__ = ["ScheduleReader"]


def _schedule_field(name: str, check, doc: str) -> property:
    """A property reading ``schedule.<name>`` and writing ``check(value)`` there as the
    reader (refused, naming the owner, when a coordinator owns the schedule)."""
    def get(self):
        return getattr(self.schedule, name)

    def put(self, value) -> None:
        self.schedule.write(name, check(value), by=type(self).__name__)

    return property(get, put, doc=doc)


class ScheduleReader:
    """F, k, B and the loss scale of a hook state, read from (and, when it owns it, written
    to) ``self.schedule`` (see the module docstring)."""

    schedule: Schedule
    synced_backwards: int

    def _own_schedule(self, every: int, batch_size: Optional[float]) -> None:
        """Make this state's own schedule (F = ``every``, B = ``batch_size``, k = 0)."""
        if batch_size is None:
            raise ValueError("batch_size: expected the global batch size (a positive number), got None")
        self.schedule = Schedule(every=check_count("every", every),
                                 batch_size=check_batch_size(batch_size))
        self.synced_backwards = 0   # synchronized backward passes seen (each ends a step)

    def use_schedule(self, schedule: Schedule) -> None:
        """Read F, k, B and the loss scale from ``schedule`` from now on (a coordinator's,
        which writes them; this state's setters then raise, naming the owner)."""
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule: expected a gns_kernels.schedule.Schedule, got {type(schedule).__name__}")
        self.schedule = schedule

    every = _schedule_field(
        "every", lambda v: check_count("every", v),
        "F: measure at optimizer steps k with k % F == 0 (settable unless a coordinator owns "
        "the schedule).")
    step = _schedule_field(
        "step", lambda v: check_count("step", v, minimum=0),
        "k: the optimizer step in progress; on its own the state counts the synchronized "
        "backward passes (settable on resume), under a coordinator it reads the run's k.")
    batch_size = _schedule_field(
        "batch_size", check_batch_size,
        "Global batch size B of the current step (settable; the trainer keeps it current).")
    grad_scale = _schedule_field(
        "grad_scale", lambda v: v,
        "The loss scale of the measured backward (settable; 1 without a GradScaler).")

    def is_measurement_step(self, step: Optional[int] = None) -> bool:
        """True when optimizer step k (default: the next one, ``self.step``) measures."""
        return self.schedule.measures(step)

    def advance_step(self) -> None:
        """One optimizer step (a synchronized backward) is done: ``synced_backwards`` += 1,
        and k += 1 when this state owns its schedule (a coordinator advances the run's k)."""
        self.synced_backwards += 1
        if self.schedule.owner is None:
            self.schedule.write("step", self.schedule.step + 1, by=type(self).__name__)
