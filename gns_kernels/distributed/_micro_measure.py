"""The one-rank measurement of MicroBatchGNS: its A micro-batches as the samples.

``measure_micro_batches`` turns the sums of a rank's micro-batches (``MicroSums``) and the
accumulated gradient into the measurement's statistics, recorded on the state: the core's
``Measurement`` with one rank and A samples (its shared solve without a collective; the
nuclear dof is 'columns': no micro-batch's own gradient is kept).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import ops
from ._measurement import Measurement, Sums
from ._micro_sums import MicroSums
from ._stats import l1_signal_debiased_sum, nuclear_stats_or_nan

Tensor = torch.Tensor

__all__ = ["measure_micro_batches"]


def measure_micro_batches(state, sums: MicroSums, live: Sequence[Tensor], grads: Sequence[Tensor],
                          A: int, poisoned: bool) -> None:
    """Measure from A >= 2 micro-batches on one rank and ``state.record`` the statistics.

    state: the MicroBatchGNS; live: its measured parameters that have a gradient; grads:
    their float32 contiguous ``.grad`` (the mean over the A micro-batches); poisoned: a
    micro-batch had no backward, so the measurement is invalid (NaN sums)."""
    m = Measurement(state, 1, A, 0, per_sample=False)
    scale = m.scale
    keys = [m.plan.of(p).key for p in live]
    pool = state.pool
    if pool is not None and live:
        pool.to(live[0].device)
    if poisoned:  # a micro-batch without backward: the measurement is invalid
        sums.poison()
    if state.geometry == "nuclear":
        grams = [sums.gsum[id(p)].mul_(A) for p in live]
        grads = [g.float() for g in grads]
        if pool is not None and live:
            # the shared-solve path on one rank (no collective): it also folds the
            # covariances into the noise pool
            m.share.add_grads(grams, grads, None, None, keys)
            m.record_nuclear(None, None)
            if m.share.stream is not None:
                # CUDA: the solves read .grad on a side stream; later in-place changes of
                # .grad (unscale, clipping, zero_grad) must wait for them (device order,
                # no host synchronization)
                torch.cuda.current_stream(m.share.stream.device).wait_stream(m.share.stream)
            return
        deb = None
        if live:
            noise, signal = nuclear_stats_or_nan(grams, grads, None, scale, state.bias_correction,
                                                 A, m.batch_size,
                                                 hints=state.eig_hints, method=state.method)
            n, s = noise.double().sum(), signal.double().sum()  # read with the estimate
            if state.signal == "debiased":
                _, sd = nuclear_stats_or_nan(grams, grads, None, scale, False, A,
                                             m.batch_size, signal="debiased",
                                             method=state.method)
                deb = sd.double().sum()
        else:
            n = s = float("nan")
        state.record(Sums(A, m.step, nuc_noise=n, nuc_signal=s, nuc_signal_debiased=deb,
                          nuclear_dof=m.dof, noise_pooled=None if pool is None else n))
    else:
        qs = [sums.sq[id(p)].mul_(A).view(-1) for p in live]
        ds = [g.view(-1) for g in grads]
        terms = ops.variance_norms_multi(ds, qs, scale).double()
        if state.l1_debiased:
            deb = (l1_signal_debiased_sum(ds, qs, [None] * len(ds), scale, m.batch_size)
                   if ds else torch.zeros((), dtype=torch.float64))
            terms = torch.cat([terms, deb.to(terms.device).reshape(1)])
        pooled = None
        if pool is not None:  # one rank: every coordinate of every parameter
            roots = [pool.fold_variance(key, d, q, scale, A, state.grad_scale)
                     for key, d, q in zip(keys, ds, qs)]
            pooled = (torch.stack(roots).sum() if roots
                      else torch.full((), float("nan"), dtype=torch.float64))
        m.record_l(terms, pooled)
