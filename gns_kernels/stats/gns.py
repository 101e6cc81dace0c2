"""Gradient noise scale estimates from R sample gradients (ranks or ranks x micro-batches):
the estimate (``GNSEstimate``) and its making from reduced statistics
(``estimate_from_stats``, which gk.estimate and every hook call).

Paper eqs. (GNS_estimate_SGD_signSGD), (spec_sample_variance_estimate), (GNS_estimates).
R samples g^j, each the MEAN gradient over b = B/R examples of a
global batch B (equal split), g = mean_j g^j, S an optional shift identical on all samples:

    s2_i = B/(R-1) * ( mean_j (g^j_i - S_i)^2 - (g_i - S_i)^2 )          (clamped at 0)
    C    = B/(R-1) * ( mean_j (G^j-S)(G^j-S)^T - (G-S)(G-S)^T )         (m x m, m <= n;
           the n x n column side when m > n: spectral.smaller_side. The two sides
           agree only for R = 2; the smaller side is the definition, as in the hooks)

    geometry  noise N                           signal M                     GNS = N / M
    'l2'      sum_i s2_i                        ||g||_2^2
    'l1'      ||s||_1^2          (s = sqrt(s2)) ||g||_1^2
    'nuclear' (sum_l tr(C_l^{1/2}))^2           (sum_l ||G_l||_S1)^2         2-D tensors only

Units: N estimates a single-example quantity (tr Sigma, ||sigma||_1^2 or
||C^{1/2}||_S1^2); M is in squared gradient units; the GNS is a number of examples.

bias_correction=True (default) removes the small-R bias of the noise: the l1 noise is
multiplied by 1/c4(R)^2 (exact for Gaussian rank means), each nuclear sqrt-trace is replaced
by gns_kernels.stats.bias.nuclear_sqrt_trace_corrected (second-order Wishart correction,
whose degrees of freedom come from ``nuclear_dof``, gns_kernels.stats.dof: by default
'gauss-sums', estimated from the samples, at R >= 3, 'columns' at R = 2); l2 is unbiased
already. bias_correction=False is the paper's estimator exactly.

signal='raw' (default) is the paper's signal M above. signal='debiased' replaces it by a
bias-reduced one (the raw M contains the noise of the mean gradient, E||g||^2 =
||mu||^2 + tr Sigma / B): l2 ||g||_2^2 - sum_i s2_i / B (unbiased), l1
(sum_i sqrt(max(g_i^2 - s2_i / B, 0)))^2, nuclear (sum_l tr((G_l G_l^T - C_l / B)_+^{1/2}))^2
(gns_kernels.stats.signal.l1_signal_debiased / nuclear_signal_debiased; no exactly unbiased
l1 / nuclear signal exists). The GNS then no longer saturates near B; see docs/fidelity.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validation import SIGNALS, check_int, check_signal
from .bias import l1_noise_factor

Tensor = torch.Tensor

__all__ = [
    "GEOMETRIES",
    "SIGNALS",
    "GNSEstimate",
    "estimate_from_stats",
    "check_geometry",
    "check_counts",
    "as_float",
]

GEOMETRIES = ("l2", "l1", "nuclear")


@dataclass(frozen=True)
class GNSEstimate:
    """One GNS measurement.

    gns = noise / signal (examples). noise, signal: as in the module docstring (noise bias
    corrected when bias_corrected). valid: False when any statistic is non-finite, the
    signal is <= 0 or noise / signal overflows; then gns, noise and signal are nan (never a finite number a controller
    could swallow). signal_unbiased: l2 only, signal - noise / B, an unbiased estimate of
    ||grad L||_2^2 (nan when invalid); None for l1 and nuclear (no unbiased estimator of
    |mu| exists for a Gaussian mean; see docs/estimators.md). noise_raw: the paper's
    uncorrected noise (equal to noise when bias_corrected is False; None if not known).
    step: the optimizer step the samples were measured at, when the producer knows it
    (None otherwise); AdaptiveBatchSize.update skips an estimate whose step differs from
    the step it is given (a stale measurement), unless ``available_step`` says otherwise.
    signal_kind: 'raw' (signal is the paper's) or 'debiased' (signal is the bias-reduced
    one of the module docstring; AdaptiveBatchSize(signal=...) checks it). signal_raw: the
    paper's raw signal (equal to signal when signal_kind is 'raw'; nan when invalid).
    nuclear_dof: nuclear with bias correction, the dof mode the correction used
    ('gauss-sums', 'columns', 'data' or 'rank_one'); None otherwise or when not known.
    noise_pooled: the pooled noise of a hook state with a noise pool (l1 / nuclear with
    bias correction, ``pool_beta`` not None; gns_kernels.stats.pool): the noise formed from
    the EMA of this and the earlier measurements' variances / covariances, in this
    estimate's units. It is the noise EMA the controller uses in place of its own
    (``AdaptiveBatchSize.update``); nan when invalid; None without a pool (gk.estimate,
    l2, the paper's raw estimator). pool_beta: that pool's EMA factor (None without one).
    available_step: a lagged estimate's (the hooks' host route, docs/distributed.md) step
    at which it became readable, later than ``step`` (the measurement of step k is read
    at the next measurement, k + F); None for an estimate readable at its own step (every
    other route, gk.estimate). AdaptiveBatchSize.update(k, est) takes an estimate with
    available_step == k (and step <= k) as current. Its batch_size is the measured step's.
    """

    gns: float
    noise: float
    signal: float
    valid: bool
    signal_unbiased: float | None
    geometry: str
    num_samples: int
    batch_size: float
    bias_corrected: bool
    noise_raw: float | None = None
    step: int | None = None
    signal_kind: str = "raw"
    signal_raw: float | None = None
    nuclear_dof: str | None = None
    noise_pooled: float | None = None
    pool_beta: float | None = None
    available_step: int | None = None

    @property
    def gns_unbiased_signal(self) -> float | None:
        """noise / signal_unbiased (l2 only; nan when that signal is <= 0 or invalid)."""
        if self.signal_unbiased is None:
            return None
        if not self.valid or not self.signal_unbiased > 0:
            return math.nan
        return self.noise / self.signal_unbiased


def check_geometry(geometry: str) -> str:
    """``geometry`` if it is one of GEOMETRIES, else ValueError naming it."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry: expected one of 'l2', 'l1', 'nuclear', got {geometry!r}")
    return geometry


def check_counts(num_samples, batch_size) -> tuple[int, float]:
    """(R, B): R = num_samples an integer >= 2, B = batch_size a finite integer number of
    examples, a multiple of R (the equal split); ValueError naming the argument otherwise."""
    if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 2:
        raise ValueError(f"num_samples: expected an integer >= 2 (samples of the gradient), got {num_samples}")
    R = int(num_samples)
    try:
        B = float(batch_size)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size: expected a number, got {batch_size!r}") from None
    if not math.isfinite(B) or B != int(B):
        raise ValueError(f"batch_size: expected a finite integer number of examples, got {batch_size!r}")
    if B < R:
        raise ValueError(
            f"batch_size: expected at least the number of samples ({R}) (each sample averages "
            f"B/R >= 1 examples), got {batch_size}"
        )
    if int(B) % R != 0:
        raise ValueError(
            f"batch_size: expected a multiple of the number of samples ({R}); the estimators "
            f"assume an equal split of B into R samples of B/R examples, got {int(B)}"
        )
    return R, B


def as_float(x) -> float:
    """A statistic (a number or a one-element tensor) as a Python float (a tensor is read on
    the host)."""
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"expected a scalar statistic, got a tensor of shape {tuple(x.shape)}")
        return float(x.detach().double().cpu())
    return float(x)


def estimate_from_stats(
    geometry: str,
    noise_raw_sum,
    signal_raw_sum,
    num_samples: int,
    batch_size: float,
    bias_correction: bool = True,
    noise_uncorrected_sum=None,
    *,
    step: int | None = None,
    signal: str = "raw",
    signal_debiased_sum=None,
    nuclear_dof: str | None = None,
    noise_pooled_sum=None,
    pool_beta: float | None = None,
) -> GNSEstimate:
    """Build a GNSEstimate from reduced statistics (used by estimate() and the hooks).

    Arguments (floats or 0-d tensors), summed over all parameters/layers:
      'l2':      noise_raw_sum = sum_i s2_i           signal_raw_sum = ||g||_2^2
      'l1':      noise_raw_sum = ||s||_1               signal_raw_sum = ||g||_1
      'nuclear': noise_raw_sum = sum_l tr(C_l^{1/2})   signal_raw_sum = sum_l ||G_l||_S1
    For 'nuclear' the correction needs the eigenvalues, so it is applied where they are
    computed: pass the sqrt-traces from stats.bias.nuclear_sqrt_trace_corrected (spectral ops with
    bias_correction=True) when bias_correction is True, and optionally the uncorrected sum
    as noise_uncorrected_sum (recorded as noise_raw). For 'l1' this function applies the
    factor 1/c4(R) to ||s||_1 when bias_correction is True. Then noise/signal are squared
    for l1/nuclear. Validity: any non-finite statistic, a negative noise, a signal <= 0, a
    negative l1 / nuclear sum (a sum of norms) or a GNS beyond the float range gives
    valid=False with gns, noise, signal = nan. step: recorded as GNSEstimate.step.
    signal: 'raw' (default) or 'debiased' (module docstring). 'debiased' uses, for l2,
      signal_raw_sum - noise_raw_sum / B (no extra input); for l1 / nuclear,
      signal_debiased_sum: sum_i sqrt(max(g_i^2 - s2_i / B, 0)) (l1) or
      sum_l tr((G_l G_l^T - C_l / B)_+^{1/2}) (nuclear), squared here. A debiased signal
      <= 0 (the noise dominates the whole mean gradient) gives valid=False.
    nuclear_dof: recorded as GNSEstimate.nuclear_dof (nuclear with bias correction).
    noise_pooled_sum: a noise pool's sum (l1: sum of the pooled, corrected ||s||_1 parts;
    nuclear: sum_l of the pooled, corrected tr(P_l^{1/2})), squared into noise_pooled (nan
    when it is not a finite number >= 0 or the estimate is invalid); pool_beta recorded.
    """
    check_geometry(geometry)
    R, B = check_counts(num_samples, batch_size)
    if step is not None:
        step = check_int("step", step, 0)
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    check_signal(signal)
    debiased = signal == "debiased"
    if debiased and geometry != "l2" and signal_debiased_sum is None:
        raise ValueError(f"signal_debiased_sum: signal='debiased' needs the debiased signal sum for "
                         f"geometry {geometry!r}, got None")
    dof_label = nuclear_dof if (geometry == "nuclear" and bias_correction) else None
    n = as_float(noise_raw_sum)
    s = as_float(signal_raw_sum)
    n_unc = as_float(noise_uncorrected_sum) if noise_uncorrected_sum is not None else None
    s_deb = as_float(signal_debiased_sum) if (debiased and geometry != "l2") else None
    if geometry != "l2" and (n < 0 or s < 0 or (n_unc is not None and n_unc < 0)
                             or (s_deb is not None and not s_deb >= 0)):
        # l1 / nuclear sums are sums of norms: a negative one is corrupt, not a signal
        n = s = math.nan
    if geometry == "l2":
        noise, signal_raw, noise_raw = n, s, n
    elif geometry == "l1":
        factor = l1_noise_factor(R) if bias_correction else 1.0
        noise, signal_raw, noise_raw = (n * factor) * (n * factor), s * s, n * n
    else:
        noise, signal_raw = n * n, s * s
        if bias_correction:
            noise_raw = n_unc * n_unc if n_unc is not None else None
        else:
            noise_raw = noise
    if not debiased:
        sig = signal_raw
    elif geometry == "l2":
        sig = signal_raw - n / B  # E||g||^2 = ||mu||^2 + tr Sigma / B: unbiased
    else:
        sig = s_deb * s_deb
    kind = signal
    valid = (
        math.isfinite(noise)
        and math.isfinite(sig)
        and math.isfinite(signal_raw)
        and noise >= 0
        and sig > 0
        and (noise_raw is None or math.isfinite(noise_raw))
    )
    nan = math.nan
    pooled = None
    if noise_pooled_sum is not None:
        p = as_float(noise_pooled_sum)
        pooled = p * p if (math.isfinite(p) and p >= 0 and math.isfinite(p * p)) else nan
    pool = dict(noise_pooled=pooled, pool_beta=pool_beta)
    if not valid:
        return GNSEstimate(nan, nan, nan, False, nan if geometry == "l2" else None,
                           geometry, R, B, bias_correction, nan, step, kind, nan, dof_label,
                           **dict(pool, noise_pooled=None if pooled is None else nan))
    gns = noise / sig
    sig_unb = signal_raw - noise / B if geometry == "l2" else None
    if not math.isfinite(gns):  # signal so small that the quotient overflows
        return GNSEstimate(nan, nan, nan, False, nan if geometry == "l2" else None,
                           geometry, R, B, bias_correction, nan, step, kind, nan, dof_label,
                           **dict(pool, noise_pooled=None if pooled is None else nan))
    return GNSEstimate(gns, noise, sig, True, sig_unb, geometry, R, B,
                       bias_correction, noise_raw, step, kind, signal_raw, dof_label, **pool)
