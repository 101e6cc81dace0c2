"""Build the hooks' GNSEstimate from reduced sums with gk.estimate's semantics."""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def estimate_from_sums(geometry: str, l_terms: Optional[Tensor], nuc_noise, nuc_signal,
                       num_samples: int, batch_size: float, bias_correction: bool):
    """l_terms: float64 [sum ||s||_1, sum ||g||_1, sum s2, sum ||g||_2^2] (l1 / l2);
    nuc_noise, nuc_signal: sum_l tr(C_l^{1/2}) (already corrected when bias_correction)
    and sum_l ||G_l||_S1 (nuclear)."""
    from ..estimators import estimate_from_stats

    if geometry == "l1":
        noise, signal = float(l_terms[0]), float(l_terms[1])
    elif geometry == "l2":
        noise, signal = float(l_terms[2]), float(l_terms[3])
    else:
        noise, signal = float(nuc_noise), float(nuc_signal)
    return estimate_from_stats(geometry, noise, signal, num_samples, batch_size, bias_correction)
