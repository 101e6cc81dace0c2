"""The one-rank measurement of MicroBatchGNS: its A micro-batches as the samples.

``measure_micro_batches`` turns the sums of a rank's micro-batches (``MicroSums``) and the
accumulated gradient into the measurement's statistics, the ``Sums`` the state records:
one rank, A samples, variance scale B / (A - 1), the nuclear dof 'columns' (no
micro-batch's own gradient is kept).

It is the measurement's one orchestrator. What it needs of the state (batch size, step,
loss scale, flags, the noise pool and its keys, the hints) comes in one frozen
``Settings``, read once before it starts (``GNSHookState.settings``), and it calls leaf
functions in order that never call back into the state: l1 / l2 -- the one check of the
tensor lists (``_validation.check_vn_lists``; the fused op below is the unchecked entry,
``ops.variance_norms_multi_unchecked``), the debiased l1 signal (``_stats``), the noise
pool's fold (``pooling``); nuclear -- with a noise pool the shared solve on one rank
(``SolveShare``, no collective; it also folds the covariances into the pool), without one
the guarded spectral solve (``_stats.nuclear_stats_or_nan``); on the host route (method
"host", or "auto" off the CPU: ``Settings.method``) always the shared solve, staged
and not solved here: the result is then a ``LaggedMeasurement``. The caller records the
result (``GNSHookState.record``, or ``record_lagged`` for a LaggedMeasurement, which
joins the previous host measurement).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from .. import ops
from .._validation import check_scale, check_vn_lists
from ._measurement import LaggedMeasurement, ShareReader, Sums
from ._micro_sums import MicroSums
from ._settings import Settings
from ._share import SolveShare
from ._stats import l1_signal_debiased_sum, nuclear_stats_or_nan

Tensor = torch.Tensor

__all__ = ["measure_micro_batches"]


def measure_micro_batches(s: Settings, A: int, sums: MicroSums, live: Sequence[Tensor],
                          grads: Sequence[Tensor]) -> Union[Sums, LaggedMeasurement]:
    """The statistics of A >= 2 micro-batches on one rank (module docstring): their Sums,
    or on the host route the staged LaggedMeasurement.

    s: the measurement's settings (``GNSHookState.settings(live, A, per_sample=False)``:
    its keys are those of ``live``); sums: the step's MicroSums (poisoned already when a
    micro-batch had no backward); live: the measured parameters that have a gradient;
    grads: their float32 contiguous ``.grad`` (the mean over the A micro-batches)."""
    scale = s.batch_size / (A - 1)
    if s.config.geometry == "nuclear":
        return _nuclear(s, A, scale, [sums.gsum[id(p)].mul_(A) for p in live],
                        [g.float() for g in grads], bool(live))
    qs = [sums.sq[id(p)].mul_(A).view(-1) for p in live]
    ds = [g.view(-1) for g in grads]
    check_vn_lists(ds, qs, None)  # the lists' one check: the op below does not check them again
    scale = check_scale(scale)
    terms = ops.variance_norms_multi_unchecked(ds, qs, scale).double()
    if s.l1_debiased:
        deb = (l1_signal_debiased_sum(ds, qs, [None] * len(ds), scale, s.batch_size)
               if ds else torch.zeros((), dtype=torch.float64))
        terms = torch.cat([terms, deb.to(terms.device).reshape(1)])
    pooled = None
    pool = s.pool
    if pool is not None:  # one rank: every coordinate of every parameter
        if ds:
            pool.to(ds[0].device)
        roots = [pool.fold_variance(key, d, q, scale, A, s.grad_scale)
                 for key, d, q in zip(s.keys, ds, qs)]
        pooled = (torch.stack(roots).sum() if roots
                  else torch.full((), float("nan"), dtype=torch.float64))
    return Sums(A, s.step, l_terms=terms, noise_pooled=pooled)


def _nuclear(s: Settings, A: int, scale: float, grams: list, grads: list,
             any_live: bool) -> Union[Sums, LaggedMeasurement]:
    """Nuclear: grams, A sum_a gram(d_a) (the mean Grams); grads, the mean gradients."""
    cfg = s.config
    pool = s.pool
    host = any_live and s.method == "host"
    if (pool is not None or host) and any_live:
        if pool is not None:
            pool.to(grads[0].device)
        # the shared-solve path on one rank (no collective): it also folds the
        # covariances into the noise pool; the host route stages it (no solve here)
        share = SolveShare(1, 0, scale, cfg.bias_correction, A, s.batch_size, hints=s.eig_hints,
                           dof=s.dof or "columns", signal=cfg.signal, pool=pool,
                           grad_scale=s.grad_scale, owners=s.pool_owners, method=s.method)
        share.add_grads(grams, grads, None, None, s.keys if pool is not None else None)
        share.launch(None, None, lag=host)
        if share.stream is not None:
            # CUDA: the solves read .grad on a side stream; later in-place changes of
            # .grad (unscale, clipping, zero_grad) must wait for them (device order,
            # no host synchronization)
            torch.cuda.current_stream(share.stream.device).wait_stream(share.stream)
        if host:
            return LaggedMeasurement(share, s.step, A, s.dof, s.batch_size, s.grad_scale)
        r = ShareReader(share)
        return Sums(A, s.step, nuc_noise=r.noise, nuc_signal=r.signal,
                    nuc_signal_debiased=r.signal_deb, nuclear_dof=s.dof, noise_pooled=r.pooled)
    deb = None
    if any_live:
        noise, signal = nuclear_stats_or_nan(grams, grads, None, scale, cfg.bias_correction, A,
                                             s.batch_size, hints=s.eig_hints, method=s.method)
        n, sig = noise.double().sum(), signal.double().sum()  # read with the estimate
        if cfg.signal == "debiased":
            _, sd = nuclear_stats_or_nan(grams, grads, None, scale, False, A, s.batch_size,
                                         signal="debiased", method=s.method)
            deb = sd.double().sum()
    else:
        n = sig = float("nan")
    return Sums(A, s.step, nuc_noise=n, nuc_signal=sig, nuc_signal_debiased=deb, nuclear_dof=s.dof,
                noise_pooled=None if pool is None else n)
