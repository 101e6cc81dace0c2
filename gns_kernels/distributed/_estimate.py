"""Build the hooks' GNSEstimate from reduced sums with gk.estimate's semantics."""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def estimate_from_sums(geometry: str, l_terms: Optional[Tensor], nuc_noise, nuc_signal,
                       num_samples: int, batch_size: float, bias_correction: bool, *,
                       signal: str = "raw", nuc_signal_debiased=None,
                       nuclear_dof: Optional[str] = None, noise_pooled_sum=None,
                       pool_beta: Optional[float] = None):
    """l_terms: float64 [sum ||s||_1, sum ||g||_1, sum s2, sum ||g||_2^2] (l1 / l2), plus
    [debiased l1 signal sum] for l1 with signal='debiased'; nuc_noise, nuc_signal:
    sum_l tr(C_l^{1/2}) (already corrected when bias_correction) and sum_l ||G_l||_S1
    (nuclear); nuc_signal_debiased: the debiased nuclear signal sum (signal='debiased');
    noise_pooled_sum, pool_beta: the noise pool's sum and EMA factor (None: no pool)."""
    from ..estimators import estimate_from_stats

    deb = None
    if geometry == "l1":
        noise, sig = float(l_terms[0]), float(l_terms[1])
        if signal == "debiased":
            deb = float(l_terms[4]) if len(l_terms) > 4 else float("nan")
    elif geometry == "l2":
        noise, sig = float(l_terms[2]), float(l_terms[3])
    else:
        noise, sig = float(nuc_noise), float(nuc_signal)
        if signal == "debiased":
            deb = float(nuc_signal_debiased) if nuc_signal_debiased is not None else float("nan")
    return estimate_from_stats(geometry, noise, sig, num_samples, batch_size, bias_correction,
                               signal=signal, signal_debiased_sum=deb, nuclear_dof=nuclear_dof,
                               noise_pooled_sum=noise_pooled_sum, pool_beta=pool_beta)
