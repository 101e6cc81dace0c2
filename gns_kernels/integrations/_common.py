"""Helpers shared by the integrations (no third-party imports here)."""
from __future__ import annotations

import math
from numbers import Real
from typing import Any, Mapping

from ..metrics import as_scalar


def scalars(metrics: Mapping[str, Any], prefix: str = "gns/", keep_step: bool = False) -> dict:
    """The finite numbers of ``coord.metrics()`` as {prefix + key: float} (booleans as 0/1;
    None, nan, inf, strings and multi-element tensors left out; 'step' left out unless
    ``keep_step``): what a logger takes."""
    out = {}
    for key, v in metrics.items():
        if (key == "step" and not keep_step) or v is None:
            continue
        try:
            v = as_scalar(v)
        except ValueError:
            continue
        if isinstance(v, bool):
            v = 1.0 if v else 0.0
        elif isinstance(v, Real):
            v = float(v)
            if not math.isfinite(v):
                continue
        else:
            continue
        out[prefix + key] = v
    return out


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def missing(package: str, extra: str, what: str) -> ImportError:
    return ImportError(f"{what} needs the optional '{package}' package: pip install "
                       f"'gns-kernels[{extra}]' (or pip install {package})")
