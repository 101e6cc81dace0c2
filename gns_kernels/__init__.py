"""gns_kernels: gradient noise scales in the optimizer's geometry (l2, l1, nuclear),
fused kernels to measure them during data-parallel training, and Algorithm 1 of
"Adaptive Batch Sizes Using Non-Euclidean Gradient Noise Scales" to grow the batch.

See README.md and ../shared/DESIGN.md for the math and the public API.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import reference  # noqa: F401  (float64 oracle)
from .spectral import gram, sqrt_trace, nuclear_stats  # noqa: F401
from .controller import AdaptiveBatchSize  # noqa: F401
from .ops import (  # noqa: F401
    variance_norms, square_pack, accumulate_sq, variance_norms_multi, accumulate_sq_multi,
    square_pack_multi,
)
from .optim import SignSGD, Signum, SpecSGD, geometry_for  # noqa: F401
from .estimators import GNSEstimate, estimate, estimate_from_stats, critical_batch_size  # noqa: F401
from .distributed import GNSHookState, ddp_gns_hook, MicroBatchGNS  # noqa: F401
from .distributed.fsdp import attach_fsdp_gns, fsdp_gns_shard_placement, FSDPGNSHandle  # noqa: F401
