"""Gradient noise scale estimates from R sample gradients (ranks or ranks x micro-batches).

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
by gns_kernels.bias.nuclear_sqrt_trace_corrected (second-order Wishart correction, whose
degrees of freedom come from ``nuclear_dof``: by default 'gauss-sums', estimated from the
samples, at R >= 3, 'columns' at R = 2); l2 is unbiased already. bias_correction=False is
the paper's estimator exactly.

signal='raw' (default) is the paper's signal M above. signal='debiased' replaces it by a
bias-reduced one (the raw M contains the noise of the mean gradient, E||g||^2 =
||mu||^2 + tr Sigma / B): l2 ||g||_2^2 - sum_i s2_i / B (unbiased), l1
(sum_i sqrt(max(g_i^2 - s2_i / B, 0)))^2, nuclear (sum_l tr((G_l G_l^T - C_l / B)_+^{1/2}))^2
(gns_kernels.nuclear_dof.l1_signal_debiased / nuclear_signal_debiased; no exactly unbiased
l1 / nuclear signal exists). The GNS then no longer saturates near B; see docs/fidelity.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from . import bias as _bias
from . import nuclear_dof as _nuclear_dof
from ._validation import SIGNALS, check_int, check_signal
from .ops import eager_variance_sums
from .spectral import smaller_side

Tensor = torch.Tensor

__all__ = [
    "GEOMETRIES",
    "SIGNALS",
    "CBS_RULES",
    "GNSEstimate",
    "estimate",
    "estimate_from_stats",
    "critical_batch_size",
]

GEOMETRIES = ("l2", "l1", "nuclear")
CBS_RULES = ("fraction", "inflection", "efficiency")  # the rules of critical_batch_size


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
    the step it is given (a stale measurement).
    signal_kind: 'raw' (signal is the paper's) or 'debiased' (signal is the bias-reduced
    one of the module docstring; AdaptiveBatchSize(signal=...) checks it). signal_raw: the
    paper's raw signal (equal to signal when signal_kind is 'raw'; nan when invalid).
    nuclear_dof: nuclear with bias correction, the dof mode the correction used
    ('gauss-sums', 'columns', 'data' or 'rank_one'); None otherwise or when not known.
    noise_pooled: the pooled noise of a hook state with a noise pool (l1 / nuclear with
    bias correction, ``pool_beta`` not None; gns_kernels.pooling): the noise formed from
    the EMA of this and the earlier measurements' variances / covariances, in this
    estimate's units. It is the noise EMA the controller uses in place of its own
    (``AdaptiveBatchSize.update``); nan when invalid; None without a pool (gk.estimate,
    l2, the paper's raw estimator). pool_beta: that pool's EMA factor (None without one).
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

    @property
    def gns_unbiased_signal(self) -> float | None:
        """noise / signal_unbiased (l2 only; nan when that signal is <= 0 or invalid)."""
        if self.signal_unbiased is None:
            return None
        if not self.valid or not self.signal_unbiased > 0:
            return math.nan
        return self.noise / self.signal_unbiased


def _check_geometry(geometry: str) -> str:
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry: expected one of 'l2', 'l1', 'nuclear', got {geometry!r}")
    return geometry


def _check_counts(num_samples, batch_size) -> tuple[int, float]:
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


def _as_float(x) -> float:
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
    computed: pass the sqrt-traces from bias.nuclear_sqrt_trace_corrected (spectral ops with
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
    _check_geometry(geometry)
    R, B = _check_counts(num_samples, batch_size)
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
    n = _as_float(noise_raw_sum)
    s = _as_float(signal_raw_sum)
    n_unc = _as_float(noise_uncorrected_sum) if noise_uncorrected_sum is not None else None
    s_deb = _as_float(signal_debiased_sum) if (debiased and geometry != "l2") else None
    if geometry != "l2" and (n < 0 or s < 0 or (n_unc is not None and n_unc < 0)
                             or (s_deb is not None and not s_deb >= 0)):
        # l1 / nuclear sums are sums of norms: a negative one is corrupt, not a signal
        n = s = math.nan
    if geometry == "l2":
        noise, signal_raw, noise_raw = n, s, n
    elif geometry == "l1":
        factor = _bias.l1_noise_factor(R) if bias_correction else 1.0
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
        p = _as_float(noise_pooled_sum)
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


def _check_real_tensor(name: str, t: Tensor) -> None:
    """A real (floating or integer, not bool/complex) tensor with data (not on meta)."""
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name}: expected a real floating-point tensor, got dtype {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (CPU or CUDA), got device meta")


def _normalise_samples(rank_grads) -> list[list[Tensor]]:
    if isinstance(rank_grads, Tensor) or rank_grads is None:
        raise ValueError(
            "rank_grads: expected a list (one entry per sample) of lists of tensors, got "
            f"{type(rank_grads).__name__}"
        )
    samples = list(rank_grads)
    if len(samples) == 0:
        raise ValueError("rank_grads: empty; expected at least 2 samples (ranks or micro-batches)")
    out = []
    for j, sample in enumerate(samples):
        params = [sample] if isinstance(sample, Tensor) else list(sample)
        for p, t in enumerate(params):
            if not isinstance(t, Tensor):
                raise ValueError(f"rank_grads[{j}][{p}]: expected a tensor, got {type(t).__name__}")
            _check_real_tensor(f"rank_grads[{j}][{p}]", t)
        out.append(params)
    if len(out) < 2:
        raise ValueError(f"rank_grads: expected at least 2 samples for a variance, got {len(out)}")
    n_params = len(out[0])
    if n_params == 0:
        raise ValueError("rank_grads[0]: empty; expected at least one gradient tensor per sample")
    for j, params in enumerate(out):
        if len(params) != n_params:
            raise ValueError(
                f"rank_grads[{j}]: has {len(params)} tensors, rank_grads[0] has {n_params}; "
                "every sample must hold the same parameters"
            )
        for p, t in enumerate(params):
            if t.device != out[0][0].device:
                raise ValueError(
                    f"rank_grads[{j}][{p}]: expected device {out[0][0].device} like "
                    f"rank_grads[0][0], got {t.device}"
                )
            if t.shape != out[0][p].shape:
                raise ValueError(
                    f"rank_grads[{j}][{p}]: shape {tuple(t.shape)} differs from "
                    f"rank_grads[0][{p}] shape {tuple(out[0][p].shape)}"
                )
    if sum(t.numel() for t in out[0]) == 0:
        raise ValueError("rank_grads: the gradient tensors hold no elements")
    return out


def _normalise_shift(shift, first: list[Tensor]) -> list[Tensor | None]:
    if shift is None:
        return [None] * len(first)
    shifts = [shift] if isinstance(shift, Tensor) else list(shift)
    if len(shifts) != len(first):
        raise ValueError(f"shift: expected {len(first)} tensors (one per parameter, or None), got {len(shifts)}")
    for p, (s, t) in enumerate(zip(shifts, first)):
        if s is not None and (not isinstance(s, Tensor) or s.shape != t.shape):
            got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise ValueError(f"shift[{p}]: expected None or a tensor of shape {tuple(t.shape)}, got {got}")
        if s is not None:
            _check_real_tensor(f"shift[{p}]", s)
    return shifts


def estimate(
    rank_grads: Sequence[Sequence[Tensor]],
    batch_size: int,
    geometry: str = "l1",
    bias_correction: bool = True,
    shift: Sequence[Tensor | None] | Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    *,
    nuclear_dof: str = "auto",
    signal: str = "raw",
) -> GNSEstimate:
    """GNS of R sample gradients in the given geometry (see the module docstring).

    rank_grads: R >= 2 samples, each a list of tensors (one per parameter, same shapes in
      every sample; a bare tensor counts as a one-parameter list); sample j holds the MEAN
      gradient over batch_size / R examples.
    batch_size: global batch B, a multiple of R.
    geometry: 'l2', 'l1' or 'nuclear' (nuclear uses 2-D tensors only; others are ignored).
    bias_correction: correct the small-R bias of the noise (l1: 1/c4(R)^2; nuclear:
      bias.nuclear_sqrt_trace_corrected per matrix); False gives the paper's estimator.
    nuclear_dof: degrees of freedom nu of each matrix's covariance estimate for the nuclear
      correction (docs/estimators.md, docs/fidelity.md):
      'auto' (default): 'gauss-sums' when R >= 3, else 'columns' -- what the DDP hook
        (ranks as samples) computes, so the default estimate equals the hook's;
      'gauss-sums': nu from the per-sample sums sum_j ||d_j d_j^T||_F^2,
        sum_j ||d_j||_F^4 and the Gram M = sum_j d_j d_j^T (d_j = x_j - mean, Gaussian
        rank means; gns_kernels.nuclear_dof.dof_from_samples_gaussian); R >= 3;
      'columns': (R-1) * n, n the matrix's longer side (Gaussian independent columns; an
        over-estimate of nu for correlated inputs: on real networks at local batch 16 it
        removes 2-20% of the small-R bias, 'gauss-sums' 49-112%:
        docs/record/fidelity-experiments.md);
      'data': estimated from the samples' fourth moments without a Gaussian assumption
        (bias.nuclear_dof_from_samples; R >= 4; O(R^2 m^2 n), needs cross-sample terms a
        hook cannot form); 'rank_one': (R-1) * n b / (n + b).
    signal: 'raw' (default, the paper's) or 'debiased' (module docstring).
    shift: None, or one tensor (or None) per parameter, identical for all samples (e.g. the
      momentum buffer). The statistics are computed from x^j = g^j - S. In exact arithmetic
      S changes nothing; in floating point it changes only rounding: the variance is the
      centered two-pass form mean_j (x^j - mean x)^2 (no cancellation), whose relative
      rounding error is about eps * |g - S| / sigma (sigma the per-coordinate standard
      deviation of the samples), so a shift close to g helps in float32 and a shift far
      from g (|S| >> |g|) costs accuracy.
    dtype: arithmetic of the statistics (float64 by default).
    Returns GNSEstimate; non-finite gradients give valid=False. On CPU the result does not
    depend on the number of threads (torch.set_num_threads) for 'l2' and 'l1' (sums in a
    fixed order); 'nuclear' uses BLAS/LAPACK (matmul, eigvalsh, svdvals), whose last bits
    may.
    """
    _check_geometry(geometry)
    samples = _normalise_samples(rank_grads)
    R, B = _check_counts(len(samples), batch_size)
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    shifts = _normalise_shift(shift, samples[0])
    scale = B / (R - 1)
    n_params = len(samples[0])

    def shifted(p: int) -> tuple[Tensor, Tensor | None]:
        x = torch.stack([samples[j][p].detach().to(dtype) for j in range(R)])
        S = shifts[p]
        if S is None:
            return x, None
        S = S.detach().to(device=x.device, dtype=dtype)
        return x - S, S

    check_signal(signal)
    debiased = signal == "debiased"
    if geometry in ("l2", "l1"):
        sums = torch.zeros(4, dtype=dtype)
        deb = torch.zeros((), dtype=torch.float64)
        for p in range(n_params):
            x, S = shifted(p)
            d = x.mean(dim=0)
            v = (x - d).square().mean(dim=0)  # centered two-pass variance: no cancellation
            g = d if S is None else d + S
            sums = sums + eager_variance_sums(scale * v, g, dtype).cpu()
            if debiased and geometry == "l1":
                deb = deb + _nuclear_dof.l1_signal_debiased(g, scale * v, B).cpu()
        if geometry == "l2":
            return estimate_from_stats(geometry, sums[2], sums[3], R, B, bias_correction, signal=signal)
        return estimate_from_stats(geometry, sums[0], sums[1], R, B, bias_correction, signal=signal,
                                   signal_debiased_sum=deb if debiased else None)

    mode = _bias.resolve_nuclear_dof(nuclear_dof, R)
    # a 0 x n matrix adds nothing to either sum (tr C^{1/2} = ||G||_S1 = 0): skipped
    mats = [p for p in range(n_params) if samples[0][p].dim() == 2 and samples[0][p].numel() > 0]
    if not mats:
        raise ValueError(
            "rank_grads: geometry 'nuclear' needs at least one non-empty 2-D tensor per sample "
            "(0 x n matrices hold nothing and are skipped)"
        )
    noise_sum, noise_unc, signal_sum, deb_sum = 0.0, 0.0, 0.0, 0.0
    for p in mats:
        x, S = shifted(p)
        if smaller_side(x.shape) == "col":  # the Gram side of spectral.nuclear_stats and the hooks
            x = x.mT
            S = None if S is None else S.mT
        m, n = x.shape[-2], x.shape[-1]
        d = x.mean(dim=0)
        y = x - d  # centered: C = B/(R-1) mean_j y_j y_j^T, free of the A - d d^T cancellation
        C = scale * (y @ y.mT).mean(dim=0)
        if not bool(torch.isfinite(C).all()):
            ev = torch.full((m,), math.nan, dtype=dtype, device=C.device)
        else:
            ev = torch.linalg.eigvalsh(0.5 * (C + C.mT))
        raw = torch.where(ev < 0, torch.zeros_like(ev), ev).sqrt().sum()
        if bias_correction:
            if mode in ("data", "gauss-sums"):
                # nan for non-finite x: an invalid estimate
                nu = (_bias.nuclear_dof_from_samples(x) if mode == "data"
                      else _nuclear_dof.dof_from_samples_gaussian(x))
                corr = _bias.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu / (R - 1))
            else:
                corr = _bias.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=n, dof_model=mode)
        else:
            corr = raw
        g = d if S is None else d + S
        finite_g = bool(torch.isfinite(g).all())
        if finite_g:
            sv = torch.linalg.svdvals(g).sum()
        else:
            sv = torch.tensor(math.nan, dtype=dtype)
        if debiased:
            if finite_g and bool(torch.isfinite(C).all()):
                deb_sum = deb_sum + _as_float(_nuclear_dof.nuclear_signal_debiased(g, C, B))
            else:
                deb_sum = math.nan
        noise_sum = noise_sum + _as_float(corr)
        noise_unc = noise_unc + _as_float(raw)
        signal_sum = signal_sum + _as_float(sv)
    return estimate_from_stats(
        "nuclear", noise_sum, signal_sum, R, B, bias_correction, noise_uncorrected_sum=noise_unc,
        signal=signal, signal_debiased_sum=deb_sum if debiased else None, nuclear_dof=mode,
    )


def critical_batch_size(gns, geometry: str, rule: str = "fraction", kappa: float = 0.5) -> float:
    """Critical batch size from a GNS (paper Sec. 3.3 and Appendix C).

    gns: a number (or a GNSEstimate, whose .gns is used; nan when it is invalid).
    rule:
      'fraction'   smallest B reaching a fraction kappa in (0, 1) of the deterministic
                   improvement: l2 (SGD): kappa/(1-kappa) * GNS (= GNS at kappa = 1/2);
                   l1 / nuclear: (1/(1-sqrt(kappa)))^2 * GNS. (B = GNS/theta^2 is
                   kappa = (1-theta)^2.)
      'inflection' inflection point of (1-sqrt(GNS/B))^2: 16/9 * GNS (l1 / nuclear only).
      'efficiency' maximum improvement per example: 4 * GNS (l1 / nuclear only).
    For l2 the improvement curve is concave with its efficiency maximum at B = 1, so
    'inflection' and 'efficiency' are undefined there (ValueError).
    """
    _check_geometry(geometry)
    if isinstance(gns, GNSEstimate):
        gns = gns.gns
    try:
        g = float(gns)
    except (TypeError, ValueError):
        raise ValueError(f"gns: expected a number or a GNSEstimate, got {gns!r}") from None
    if g < 0:
        raise ValueError(f"gns: expected a non-negative noise scale, got {g}")
    if rule == "fraction":
        k = float(kappa)
        if not 0.0 < k < 1.0:
            raise ValueError(f"kappa: expected a fraction in (0, 1), got {kappa}")
        if geometry == "l2":
            return k / (1.0 - k) * g
        return g / (1.0 - math.sqrt(k)) ** 2
    if rule in ("inflection", "efficiency"):
        if geometry == "l2":
            raise ValueError(
                f"rule: {rule!r} is undefined for geometry 'l2' (SGD's improvement curve is "
                "concave with no inflection point); use rule='fraction'"
            )
        return (16.0 / 9.0 if rule == "inflection" else 4.0) * g
    raise ValueError(f"rule: expected one of {CBS_RULES}, got {rule!r}")
