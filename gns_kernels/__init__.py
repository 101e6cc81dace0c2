"""gns_kernels: gradient noise scales in the optimizer's geometry (l2, l1, nuclear),
fused kernels to measure them during data-parallel training, and Algorithm 1 of
"Adaptive Batch Sizes Using Non-Euclidean Gradient Noise Scales" to grow the batch.

Public API (every name below is an attribute of this package; see README.md and docs/),
one name per job:

- the training loop: ``AdaptiveBatching`` (given the model and optimizers it measures the
  GNS, runs Algorithm 1, sets the batch, the LR and the data stream), ``warmup_cosine``
  (a schedule for its ``lr_schedule=``), ``CSVWriter`` (its metrics to a CSV file)
- the measurement, for loops that wire it themselves: ``GNSHookState`` + ``ddp_gns_hook``
  (DDP comm hook), ``attach_fsdp_gns`` / ``fsdp_gns_shard_placement`` (FSDP2),
  ``MicroBatchGNS`` (micro-batches as the samples, one rank)
- Algorithm 1 by hand: ``AdaptiveBatchSize``
- offline estimates: ``estimate``, ``GNSEstimate``, ``critical_batch_size``
- fused l1/l2 ops (C++ on CPU, CUDA or Triton on GPU, eager fallback), the building
  blocks of a hook: ``variance_norms``, ``square_pack``, ``accumulate_sq`` and their
  ``_multi`` forms (one launch over a list of tensors)
- nuclear (S1) statistics: ``gram``, ``sqrt_trace``, ``nuclear_stats``
- optimizers: ``SignSGD``, ``Signum``, ``SpecSGD``, ``geometry_for``
- ``reference``: float64 formulas every fast path is tested against

Names that were public before and moved (``LRMultiplier``, ``MicroBatchSampler``,
``AdaptiveBatchSampler``, ``to_tensorboard``, ``tensorboard_writer``) raise an
AttributeError that names their replacement (CHANGELOG.md).

Importing the package loads the ops, the estimators (gns_kernels.stats), controller and
optimizers (and the C++ extension, which registers ``torch.ops.gns_kernels.*``); the
data-parallel hooks, the coordinator, metrics writers and the LR helpers are imported on
first access; neither torch.compile's machinery (torch._dynamo) nor, on a machine without
CUDA, Triton is imported.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

from . import reference  # float64 formulas every fast path is tested against
from .controller import AdaptiveBatchSize
from .ops import (
    accumulate_sq, accumulate_sq_multi, square_pack, square_pack_multi, variance_norms,
    variance_norms_multi,
)
from .optim import SignSGD, Signum, SpecSGD, geometry_for
from .spectral import gram, nuclear_stats, sqrt_trace
from .stats.critical import critical_batch_size
from .stats.gns import GNSEstimate
from .stats.offline import estimate

# public name -> submodule that defines it, imported on first access (PEP 562)
_LAZY: dict[str, str] = {
    "GNSHookState": "distributed",
    "ddp_gns_hook": "distributed",
    "MicroBatchGNS": "distributed",
    "attach_fsdp_gns": "distributed.fsdp",
    "fsdp_gns_shard_placement": "distributed.fsdp",
    "warmup_cosine": "lr",
    "AdaptiveBatching": "adaptive",
    "CSVWriter": "metrics",
}

# names that were public here before: what replaces them (CHANGELOG.md)
_MOVED: dict[str, str] = {
    "LRMultiplier": "AdaptiveBatching scales the LR itself (lr_schedule= or schedulers=); the "
                    "class is gns_kernels.lr.LRMultiplier",
    "MicroBatchSampler": "use coord.batch_sampler(len(dataset)); the class is "
                         "gns_kernels.data.MicroBatchSampler",
    "AdaptiveBatchSampler": "removed with the old loop stack; use AdaptiveBatching and "
                            "coord.batch_sampler(len(dataset))",
    "to_tensorboard": "use coord.to_tensorboard(writer); the function is "
                      "gns_kernels.metrics.to_tensorboard",
    "tensorboard_writer": "use torch.utils.tensorboard.SummaryWriter; the helper is "
                          "gns_kernels.metrics.tensorboard_writer",
}

# submodules reachable as attributes (gns_kernels.ops, gns_kernels.triton, ...)
_SUBMODULES = (
    "adaptive", "benchmarks", "bias", "cli", "controller", "data", "demo", "distributed",
    "estimators", "lr", "metrics", "nuclear_dof", "ops", "optim", "reference", "spectral", "stats",
    "triton",
)

__all__ = [
    "__version__",
    "reference",
    "estimate",
    "GNSEstimate",
    "critical_batch_size",
    "variance_norms",
    "variance_norms_multi",
    "square_pack",
    "square_pack_multi",
    "accumulate_sq",
    "accumulate_sq_multi",
    "gram",
    "sqrt_trace",
    "nuclear_stats",
    "AdaptiveBatchSize",
    "SignSGD",
    "Signum",
    "SpecSGD",
    "geometry_for",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later accesses skip __getattr__
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _MOVED:
        raise AttributeError(f"gns_kernels.{name} is no longer a top-level name: {_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


if TYPE_CHECKING:  # static type checkers see the lazy names without importing them
    from .distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook
    from .distributed.fsdp import attach_fsdp_gns, fsdp_gns_shard_placement
    from .adaptive import AdaptiveBatching
    from .lr import warmup_cosine
    from .metrics import CSVWriter
