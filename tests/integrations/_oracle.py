"""The bias-corrected l1 GNS in float64 from its formula (docs/estimators.md), for the
integration tests that check what a trainer callback measured against the micro-batch
gradients they read beside it."""
from __future__ import annotations

import math

import torch


def l1_gns(micro, b):
    """GNS of R = len(micro) equal micro-batches of b examples each: ``micro[j]`` is the
    list of micro-batch j's gradient tensors (any common scale: it cancels)."""
    R = len(micro)
    x = torch.stack([torch.cat([t.double().flatten() for t in m]) for m in micro])
    g = x.mean(0)
    s2 = (b * R / (R - 1) * ((x * x).mean(0) - g * g)).clamp_min(0)
    c4 = math.sqrt(2 / (R - 1)) * math.exp(math.lgamma(R / 2) - math.lgamma((R - 1) / 2))
    return float(s2.sqrt().sum() ** 2 / c4 ** 2 / g.abs().sum() ** 2)
