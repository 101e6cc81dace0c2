"""The loops a coordinator drives: a step's micro-batches (``micro_batches``), the run's
steps as ``Batch`` objects whose step ends by itself at ``opt.step()`` (``batches``), the
explicit form's step numbers (``steps``), and the budget they stop at (``fits``).

Each function takes the coordinator and uses its rooms (stream, guard, watch, progress,
schedule) and its public calls (``begin_step``, ``check_micro_batch``, ``end_step``).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

from .._validation import warn_user
from .config import OWNER
from .reading import loss_scale
from .stream import loader_warnings, sync_contexts

__all__ = ["micro_batches", "batches", "steps", "fits", "finish_unended", "refuse_nested", "Batch"]


def micro_batches(coord, loader, model=None) -> Iterator[tuple[Any, Any]]:
    """The A_k micro-batches of the step in progress, as (batch, context) pairs
    (``AdaptiveBatching.micro_batches`` documents it)."""
    pr = coord.progress
    if pr.served:
        raise RuntimeError(
            f"micro_batches: step {coord.current_step}'s micro-batches were already handed out; end "
            "the step first: opt.step(), then coord.step() (in a coord.batches(...) loop the "
            "step ends by itself at opt.step(); iterate each batch once)")
    A = coord.accum_steps
    skip_sync, last = sync_contexts(model, A, coord.world_size)
    coord.guard.use_model(model)
    loader_warnings(loader, coord.stream.sampler, (coord.micro_batch_size, coord.world_size, coord.rank),
                    pr.warn_once)
    if coord.current_step == 0 and not pr.loaded and any(len(o.state) for o in coord.optimizers):
        pr.warn_once("resume", "the optimizers hold state (a checkpoint was loaded?) but "
                     "the coordinator starts at step 0 with B_0 and the data stream at "
                     "its start; to resume, call coord.load_state_dict(ckpt['coord']) "
                     "after loading the model and the optimizers. Going on without it, "
                     "the coordinator starts afresh: B_0, LR multiplier 1 on the loaded "
                     "scheduled rates")
        coord.lrs.restart(pr.samples)
    coord.begin_step()
    pr.served = pr.micro_batches_used = True
    # the scale this step's backward runs with (the noise pool stores statistics / scale^2)
    coord.schedule.write("grad_scale", loss_scale(coord.grad_scaler), by=OWNER)
    feeds = coord.stream.feeds(loader)
    measuring = coord.state.is_measurement_step(coord.current_step)
    for a in range(A):
        batch = coord.stream.next_item(loader)
        try:
            coord.check_micro_batch(batch, a)
        except ValueError:
            if a == 0:   # nothing of the step was handed out
                pr.served = False
                coord.watch.refused()
            raise
        if feeds:
            coord.stream.sampler.advance(1)
        pr.consumed += 1
        yield batch, (skip_sync() if a < A - 1 else last())
        if coord.kind == "micro":
            coord.state.micro_step()
        if measuring and a < A - 1:
            coord.watch.hold(coord.guard.params())
    if "coverage" not in pr.warned and coord.guard.check_coverage(warn_user):
        pr.warned.add("coverage")


def refuse_nested(coord, what: str) -> None:
    if coord.progress.in_batches:
        raise RuntimeError(
            f"coord.{what}(...): a coord.batches(...) loop of this coordinator is still running "
            "(a nested loop, or an earlier loop left with break whose iterator is still "
            "referenced: close() it); one loop draws the steps, each Batch once")


def fits(coord, max_samples: Optional[int], max_steps: Optional[int]) -> bool:
    """The next step's batch fits in ``max_samples`` (global examples, counting the samples
    seen) and k < ``max_steps`` (checked budgets; None: no limit)."""
    if max_steps is not None and coord.current_step >= max_steps:
        return False
    return max_samples is None or coord.samples_seen + coord.batch_size <= max_samples


def batches(coord, loader, max_samples: Optional[int], max_steps: Optional[int]) -> Iterator["Batch"]:
    """The steps as ``Batch`` objects; a step ends by itself when every optimizer stepped
    (``AdaptiveBatching.batches`` documents it)."""
    pr = coord.progress
    refuse_nested(coord, "batches")
    pr.in_batches = True
    try:
        while fits(coord, max_samples, max_steps):
            k = coord.current_step
            batch = Batch(coord, loader, k)
            pr.auto_end = True
            try:
                yield batch
            finally:
                pending = pr.auto_end and coord.current_step == k
                pr.auto_end = False
            if pending:
                finish_unended(coord, k)
    finally:
        pr.in_batches = False


def finish_unended(coord, k: int) -> None:
    """A batches() step whose optimizers did not all step: a GradScaler skipped it (inf
    gradient; the scale dropped), or the loop forgot opt.step() / left micro-batches."""
    pr = coord.progress
    if pr.consumed != coord.accum_steps:
        raise RuntimeError(
            f"step {k}: {pr.consumed} of its {coord.accum_steps} micro-batches were consumed; "
            "iterate each batch to the end, then call opt.step()")
    dropped = coord.grad_scaler is not None and loss_scale(coord.grad_scaler) < coord.grad_scale
    if any(pr.opt_steps) or dropped:
        coord.end_step()   # some optimizers stepped, or the scaler skipped an inf step
        return
    raise RuntimeError(f"step {k}: the batch ended without opt.step(); call opt.step() (with a "
                       "GradScaler: scaler.step(opt); scaler.update()) after its micro-batches")


def steps(coord, max_samples: Optional[int], max_steps: Optional[int]) -> Iterator[int]:
    """k = current_step while the budget allows; raises if a step ended without step()."""
    while fits(coord, max_samples, max_steps):
        k = coord.current_step
        yield k
        if coord.current_step == k:
            raise RuntimeError(f"AdaptiveBatching.steps: optimizer step {k} ended without "
                               "coord.step(); call coord.step() after optimizer.step()")


class Batch:
    """One optimizer step of ``AdaptiveBatching.batches``: ``len()`` is A_k, iterating
    yields this rank's A_k micro-batches, each inside its synchronization context;
    ``step`` is k."""

    def __init__(self, coord, loader, step: int):
        self._coord, self._loader, self.step = coord, loader, step
        self._iterated = False

    def __len__(self) -> int:
        return self._coord.accum_steps

    def __iter__(self) -> Iterator[Any]:
        coord = self._coord
        if coord.current_step != self.step:
            raise RuntimeError(f"the batch of step {self.step} iterated at step {coord.current_step}: "
                               "iterate each batch inside its own step of the coord.batches(...) loop")
        if self._iterated:
            raise RuntimeError(
                f"the batch of step {self.step} was already iterated: a Batch is iterated once (it "
                "draws its micro-batches from the loader as it goes); keep what you need from "
                "the first pass instead of iterating it again")
        self._iterated = True
        return self._micro_batches()

    def _micro_batches(self) -> Iterator[Any]:
        coord = self._coord
        for batch, ctx in coord.micro_batches(self._loader, coord.guard.model):
            with ctx:
                yield batch

    def __repr__(self) -> str:
        return f"Batch(step={self.step}, micro_batches={len(self)})"
