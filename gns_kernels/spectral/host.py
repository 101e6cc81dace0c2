"""The host route's solves: float64 eigenvalues on the CPU, and the sums the statistics read.

For each symmetric k x k matrix A (the lower triangle is read; float64 on the CPU: a
copy of any other dtype or device), lambda = torch.linalg.eigvalsh(A) (LAPACK, float64,
MKL's default thread count of the thread that runs it), s_i = sqrt(max(lambda_i, 0)):

    row 0   tr A_+^{1/2} = sum_i s_i                       (units of sqrt(A))
    row 1   pair sum sum_{i,j} s_i s_j / (s_i + s_j)       (0/0 := 0; units of sqrt(A);
            stats.bias.pair_sum, only where asked: 0 elsewhere)
    row 2   tr A = sum_i lambda_i                          (units of A)
    row 3   ||A||_F^2 = sum_i lambda_i^2                   (units of A^2)

``host_eigen_sums`` runs them on the calling thread; ``HostJob`` runs them (or any callable
over a list of items) on one background thread, optionally after a CUDA event, so the
caller can go on and collect the result later. Results are placed by index and each
eigvalsh runs with the same settings whichever thread runs it (measured: float64 eigvalsh
in a plain worker thread gives the main thread's bits at its default thread count, also
with two workers at once), so they do not depend on timing. No worker sets the torch
thread count: torch.set_num_threads is process-global and would change the training
thread's too.
"""
from __future__ import annotations

import itertools
import math
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..stats.bias import pair_sum

Tensor = torch.Tensor

__all__ = ["host_eigen_sums", "HostJob", "HostJobCancelled"]

# Test hook: None, or a callable i -> seconds that a HostJob's worker sleeps before item i
# (injected delays and reorderings of concurrent jobs; read before each item)
_DELAY: Optional[Callable[[int], float]] = None

_JOB_IDS = itertools.count()


def _eigen_sums_one(A: Tensor, pair: bool) -> Tensor:
    """float64 Tensor[4] (module docstring's rows) of one k x k matrix, on the CPU. k = 0:
    zeros; a non-finite matrix, or one float64 LAPACK fails on: NaN."""
    k = A.shape[-1]
    if k == 0:
        return torch.zeros(4, dtype=torch.float64)
    x = A.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(x).all()):
        return torch.full((4,), math.nan, dtype=torch.float64)
    try:
        lam = torch.linalg.eigvalsh(x)
    except torch.linalg.LinAlgError:  # float64 LAPACK non-convergence: no value
        return torch.full((4,), math.nan, dtype=torch.float64)
    s = lam.clamp_min(0).sqrt()
    zero = torch.zeros((), dtype=torch.float64)
    return torch.stack([s.sum(), pair_sum(s) if pair else zero, lam.sum(), (lam * lam).sum()])


def _check_pair(pair: Optional[Sequence[bool]], n: int) -> list:
    if pair is None:
        return [False] * n
    pair = list(pair)
    if len(pair) != n or not all(isinstance(p, bool) for p in pair):
        raise ValueError(f"pair: expected {n} bools (one per matrix), got {pair!r}")
    return pair


def host_eigen_sums(mats: Sequence[Tensor], pair: Optional[Sequence[bool]] = None) -> Tensor:
    """float64 Tensor[4, n] on the CPU, column i the sums of mats[i] (module docstring):
    [tr A_+^{1/2}, pair sum (0 where pair[i] is False), tr A, ||A||_F^2], from float64
    eigvalsh of mats[i] (k x k symmetric, any float dtype and device: copied to the CPU
    in float64, the lower triangle read). A non-finite matrix gives a NaN column, k = 0
    a zero column. pair: n bools, or None (no pair sums). Runs on the calling thread."""
    mats = list(mats)
    pair = _check_pair(pair, len(mats))
    if not mats:
        return torch.zeros((4, 0), dtype=torch.float64)
    return torch.stack([_eigen_sums_one(A, p) for A, p in zip(mats, pair)], dim=1)


class HostJobCancelled(RuntimeError):
    """HostJob.result() of a job whose cancel() stopped it before its last item."""


class HostJob:
    """One solve job on one background thread (named ``gns_host-<id>``), started at
    construction and ended with the job: no idle thread outlives it.

    HostJob(items, fn=None, *, pair=None, event=None)
      fn None: items are k x k matrices; result() is host_eigen_sums(items, pair), float64
        Tensor[4, n] on the CPU (the same bits: each column is computed by the same
        function, placed by index).
      fn given: result() is [fn(x) for x in items] (pair must be None).
      event: None, or a CUDA event (anything with .synchronize()) the worker waits on
        before the first item (the device's copy of the items is then complete); the
        waiting happens on the worker thread, never on the caller's.
      device: None, or the CUDA device of the event: the worker makes it its current
        device first (thread-local), so it touches no other GPU.

    done(): the worker has ended (result or error in place; the thread is gone).
    result(timeout=None): waits for the worker (TimeoutError after ``timeout`` seconds) and
      returns its result; re-raises the worker's exception; raises HostJobCancelled when
      cancel() stopped the job before its last item.
    cancel(): asks the worker to stop; checked before each item (an item being solved is
      finished first, so the job ends within one item's time). A cancel that arrives
      after the last item started has no effect: result() then returns the full result.
      Whether a cancel takes effect therefore depends on timing; the values never do.
    """

    def __init__(self, items: Sequence[Any], fn: Optional[Callable[[Any], Any]] = None, *,
                 pair: Optional[Sequence[bool]] = None, event=None, device=None):
        self._items = list(items)
        if fn is None:
            self._pair = _check_pair(pair, len(self._items))
        elif pair is not None:
            raise ValueError("pair: only without fn (the default solve takes the pair flags)")
        else:
            self._pair = None
        if fn is not None and not callable(fn):
            raise ValueError(f"fn: expected None or a callable item -> value, got {fn!r}")
        self._fn = fn
        self._event = event
        self._device = None if device is None else torch.device(device)
        self._cancel = threading.Event()
        self._out: list = [None] * len(self._items)
        self._error: Optional[BaseException] = None
        self._stopped = False
        self.id = next(_JOB_IDS)
        self._thread = threading.Thread(target=self._run, name=f"gns_host-{self.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._device is not None and self._device.type == "cuda":
                # this thread's current device (thread-local): the event's, not device 0
                # (a first CUDA call on another device would create a context there)
                torch.cuda.set_device(self._device)
            if self._event is not None:
                self._event.synchronize()
            for i, x in enumerate(self._items):
                if self._cancel.is_set():
                    self._stopped = True
                    return
                delay = _DELAY
                if delay is not None:
                    time.sleep(float(delay(i)))
                self._out[i] = self._fn(x) if self._fn is not None else _eigen_sums_one(x, self._pair[i])
        except BaseException as exc:  # handed to result()
            self._error = exc
        finally:
            self._items = []  # the job holds no input past its end

    def done(self) -> bool:
        """True once the worker has ended (its result or error is in place)."""
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Ask the worker to stop before its next item (class docstring)."""
        self._cancel.set()

    def cancelled(self) -> bool:
        """True when cancel() stopped the worker before its last item (once done())."""
        return self._stopped

    def result(self, timeout: Optional[float] = None):
        """The job's result (class docstring); waits for the worker first."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"gns_host-{self.id}: not done after {timeout} s")
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise HostJobCancelled(f"gns_host-{self.id}: cancelled before its last item; no result")
        if self._fn is not None:
            return list(self._out)
        if not self._out:
            return torch.zeros((4, 0), dtype=torch.float64)
        return torch.stack(self._out, dim=1)
