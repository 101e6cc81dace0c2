"""AdaptiveBatching: one object that owns the optimizer-step counter, the measuring period,
the batch size and the learning-rate multiplier of an adaptive-batch run (the code is in
``gns_kernels.coordinator``, one room per job; this module is its public face).

It ties together the lower-level pieces, which stay public: the GNS measurement
(``GNSHookState`` + ``ddp_gns_hook`` under DDP, ``MicroBatchGNS`` on one rank or under
DDP, the handle of ``attach_fsdp_gns`` under FSDP2), Algorithm 1 (``AdaptiveBatchSize``),
the LR multiplier (``gns_kernels.lr.LRMultiplier``) and the data stream
(``gns_kernels.data.MicroBatchSampler``).

Batch arithmetic: the micro-batch size b is fixed; the global batch of step k is
B_k = R x A_k x b (R data-parallel ranks, A_k micro-batches accumulated per rank), so B
moves in multiples of R x b (the controller's ``multiple_of``). On one rank the samples of
the GNS are the micro-batches, so A >= 2 there (B_0 >= 2 b).

A loop (DDP shown; the loss of a micro-batch is its mean loss divided by A, so that the
accumulated gradient is the mean over the global batch, as DDP's averaging expects)::

    coord = AdaptiveBatching(state, optimizers=[opt], micro_batch_size=8,
                             initial_batch_size=32, max_batch_size=512)
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=2)
    for k in coord.steps(max_samples=total):
        for (x, y), ctx in coord.micro_batches(loader, ddp):
            with ctx:                                   # no_sync() on the first A-1
                (loss_fn(ddp(x), y) / coord.accum_steps).backward()
        opt.step(); opt.zero_grad()
        coord.step()

``coord.step()`` after the optimizer step, at the end of step k:

1. checks that the hook state counted exactly one synchronized backward for step k
   (raises, naming the fix); the hook state and the controller read F, k and B_k from the
   run's ``schedule``, which only the coordinator (and the controller's decision) writes;
2. takes the estimate only if it was measured at step k (``state.estimate_step == k``
   and, when the estimate carries ``step``, ``estimate.step == k``) or, on the hooks' host
   route, became readable at step k (``state.estimate_available_step == k``: measured at
   k - F, ``estimate.step`` says so): a previous step's estimate is never reused; with a
   ``grad_scaler`` it divides noise and signal by the square of the loss scale the
   measured step's backward ran with;
3. ``AdaptiveBatchSize.update(k, estimate)`` (the estimate passed on carries its step),
   then the optional ``max_growth`` bound on B_{k+1} / B_k;
4. the controller's B_{k+1} is the schedule's from there (the hook state's batch, a
   ``MicroBatchGNS``'s A_{k+1}); steps the schedulers given to it and sets every param
   group's lr = scheduled_lr x omega_{k+1} (``LRMultiplier``).

Loop checks (what a mistake in the loop would change in the measurement; the table of
docs/coordinator.md, "Mis-uses", with what each costs): the constructor checks every
argument before the model or the optimizers change; each step's micro-batches begin with
no parameter frozen or unfrozen since construction, a micro-batch of b examples, and on a
measuring step a device flag of gradients that are not None or zero (read with the
estimate, the measurement's one host synchronization); a step without any backward, the
DDP forward through the wrapped module or under the user's own no_sync(), and a
measurement of exactly zero noise (the samples read the same examples) are named.
Warnings point at the user's line.

LR schedulers: pass them as ``schedulers=[...]`` and do not step them yourself; the
coordinator steps them once per optimizer step on the un-multiplied (scheduled) rates and
multiplies the result by omega, so chainable schedulers (CosineAnnealingLR) never see
omega. A param group whose lr was changed outside the coordinator is taken as a new
scheduled rate, with a one-time warning.

Checkpoint: ``state_dict()`` holds the run's schedule (F, k, B_k), the samples seen, the
controller, the sampler's consumed position, the LR multiplier and the schedulers, the
hook state's hints and noise pool (``gns_kernels.coordinator.checkpoint``: version 2;
version 1 loads); load the model and optimizers, then ``coord.load_state_dict(sd)``.
"""
from __future__ import annotations

from .coordinator import AdaptiveBatching, Batch, CoordinatorConfig

__all__ = ["AdaptiveBatching", "Batch", "CoordinatorConfig"]
