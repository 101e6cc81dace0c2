"""The host route's lag in a hook state (GNSHookState inherits it): the measurement that
awaits its join, the join at the next measurement, the one-time warning when a join had to
wait, and dropping a measurement that can no longer be joined. Reads and writes the
state's ``_lagged`` and ``_warned_wait`` and calls its ``record``.
"""
from __future__ import annotations

import math
from typing import Optional

from .._validation import warn_user as _warn_user
from ._measurement import LaggedMeasurement

__all__ = ["HostLag"]


class HostLag:
    """The lagged host-route measurement of a GNSHookState (module docstring)."""

    # ---------------------------------------------------------------- the host route's lag
    @property
    def lagged_step(self) -> Optional[int]:
        """The step of the host-route measurement awaiting its join (its estimate becomes
        readable at the next measurement), None when there is none."""
        return None if self._lagged is None else self._lagged.step

    def record_lagged(self, new: LaggedMeasurement, group, all_reduce) -> None:
        """A host-route measurement ``new`` was staged (the transports, where a measurement
        launches its collective: never in a collective's callback): join the one awaiting
        its join (wait for its host job, start its share all-reduce with ``group`` /
        ``all_reduce``, none with one rank) and record it, readable from ``new.step`` on;
        then submit ``new``'s host job and keep it until the next measurement."""
        prev, self._lagged = self._lagged, None
        if prev is not None:
            dev = new.share.device
            sums, waited, interval = prev.join(group, all_reduce, new.step, device=dev)
            self._note_wait(prev.step, new.step, waited, interval)
            self.record(sums)
        new.submit()
        self._lagged = new

    def _note_wait(self, step: int, available: int, waited: float, interval: Optional[float]) -> None:
        """Warn once when a join waited for its host job longer than 5% of the interval
        since the job's submit (and 10 ms): the host route does not keep up at this F."""
        if self._warned_wait or interval is None or waited <= max(0.05 * interval, 0.01):
            return
        self._warned_wait = True
        gap = max(1, available - step)
        job = interval + waited  # the job ended about when the wait did
        keep = max(gap, math.ceil(gap * job / interval)) if interval > 0 else None
        _warn_user(
            f"{type(self).__name__}: the host solve of the measurement of step {step} took about "
            f"{job:.3g} s; the join at step {available} waited {waited:.3g} s for it "
            f"({100 * waited / max(interval, 1e-12):.0f}% of the {interval:.3g} s since it was "
            "submitted), so training stalls there at every measurement. On this machine the "
            "host route keeps up from about every="
            + (f"{keep}" if keep is not None else "?")
            + f" (measuring every {gap} steps now), or with more CPU cores for the process "
            "(the values do not depend on it: the join waits). Said once")

    def _drop_lagged(self, why: str) -> None:
        lagged, self._lagged = self._lagged, None
        if lagged is None:
            return
        lagged.cancel()
        _warn_user(f"{type(self).__name__}: the host-route measurement of step {lagged.step} "
                   f"awaiting its join is dropped ({why}); it gives no estimate")
