"""Build the hooks' GNSEstimate from reduced sums with gk.estimate's semantics."""
from __future__ import annotations

from typing import Optional

from ._measurement import Sums


def estimate_from_sums(geometry: str, sums: Sums, batch_size: float, bias_correction: bool, *,
                       signal: str = "raw", pool_beta: Optional[float] = None):
    """sums: a measurement's ``Sums`` read to the host (``Sums.read``): l_terms float64
    [sum ||s||_1, sum ||g||_1, sum s2, sum ||g||_2^2] (l1 / l2), plus [debiased l1 signal
    sum] for l1 with signal='debiased'; nuc_noise, nuc_signal: sum_l tr(C_l^{1/2}) (already
    corrected when bias_correction) and sum_l ||G_l||_S1 (nuclear); nuc_signal_debiased:
    the debiased nuclear signal sum (signal='debiased'); noise_pooled: the noise pool's
    sum (None: no pool), pool_beta its EMA factor."""
    from ..stats.gns import estimate_from_stats

    deb = None
    l_terms = sums.l_terms
    if geometry == "l1":
        noise, sig = float(l_terms[0]), float(l_terms[1])
        if signal == "debiased":
            deb = float(l_terms[4]) if len(l_terms) > 4 else float("nan")
    elif geometry == "l2":
        noise, sig = float(l_terms[2]), float(l_terms[3])
    else:
        noise, sig = float(sums.nuc_noise), float(sums.nuc_signal)
        if signal == "debiased":
            d = sums.nuc_signal_debiased
            deb = float(d) if d is not None else float("nan")
    return estimate_from_stats(geometry, noise, sig, sums.num_samples, batch_size, bias_correction,
                               signal=signal, signal_debiased_sum=deb, nuclear_dof=sums.nuclear_dof,
                               noise_pooled_sum=sums.noise_pooled, pool_beta=pool_beta)
