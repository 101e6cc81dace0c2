"""gns_kernels: gradient noise scales in the optimizer's geometry (l2, l1, nuclear),
fused kernels to measure them during data-parallel training, and Algorithm 1 of
"Adaptive Batch Sizes Using Non-Euclidean Gradient Noise Scales" to grow the batch.

Public API (every name below is an attribute of this package; see README.md and docs/):

- offline estimates: ``estimate``, ``GNSEstimate``, ``critical_batch_size``
- fused l1/l2 ops (C++ on CPU, CUDA or Triton on GPU, eager fallback):
  ``variance_norms``, ``variance_norms_multi``, ``square_pack``, ``square_pack_multi``,
  ``accumulate_sq``,
  ``accumulate_sq_multi``
- nuclear (S1) statistics: ``gram``, ``sqrt_trace``, ``nuclear_stats``
- data-parallel measurement: ``GNSHookState``, ``ddp_gns_hook`` (DDP comm hook),
  ``attach_fsdp_gns`` / ``fsdp_gns_shard_placement`` (FSDP2), ``MicroBatchGNS`` (one rank)
- adaptive batching in a training loop: ``AdaptiveBatching`` (one object that owns the step
  counter, the measuring period, the batch size and the learning-rate multiplier),
  ``MicroBatchSampler`` (a DataLoader batch sampler of fixed-size micro-batches),
  ``CSVWriter`` / ``to_tensorboard`` / ``tensorboard_writer`` (metrics)
- Algorithm 1 pieces: ``AdaptiveBatchSize`` (controller), ``AdaptiveBatchSampler`` (data
  loading at a changing batch size), ``LRMultiplier``, ``warmup_cosine`` (learning rate)
- optimizers: ``SignSGD``, ``Signum``, ``SpecSGD``, ``geometry_for``
- ``reference``: float64 formulas every fast path is tested against

Importing the package loads the ops, estimators, controller and optimizers (and the C++
extension, which registers ``torch.ops.gns_kernels.*``); the data-parallel hooks, the
coordinator, samplers, metrics writers and the LR helpers are imported on first access;
neither torch.compile's machinery (torch._dynamo) nor, on a machine without CUDA, Triton
is imported.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

from . import reference  # float64 formulas every fast path is tested against
from .controller import AdaptiveBatchSize
from .estimators import GNSEstimate, critical_batch_size, estimate
from .ops import (
    accumulate_sq, accumulate_sq_multi, square_pack, square_pack_multi, variance_norms,
    variance_norms_multi,
)
from .optim import SignSGD, Signum, SpecSGD, geometry_for
from .spectral import gram, nuclear_stats, sqrt_trace

# public name -> submodule that defines it, imported on first access (PEP 562)
_LAZY: dict[str, str] = {
    "GNSHookState": "distributed",
    "ddp_gns_hook": "distributed",
    "MicroBatchGNS": "distributed",
    "attach_fsdp_gns": "distributed.fsdp",
    "fsdp_gns_shard_placement": "distributed.fsdp",
    "AdaptiveBatchSampler": "sampler",
    "LRMultiplier": "lr",
    "warmup_cosine": "lr",
    "AdaptiveBatching": "adaptive",
    "MicroBatchSampler": "data",
    "CSVWriter": "metrics",
    "to_tensorboard": "metrics",
    "tensorboard_writer": "metrics",
}

# submodules reachable as attributes (gns_kernels.ops, gns_kernels.triton, ...)
_SUBMODULES = (
    "adaptive", "benchmarks", "bias", "cli", "controller", "data", "demo", "distributed",
    "estimators", "lr", "metrics", "nuclear_dof", "ops", "optim", "reference", "sampler", "spectral", "triton",
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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


if TYPE_CHECKING:  # static type checkers see the lazy names without importing them
    from .distributed import GNSHookState, MicroBatchGNS, ddp_gns_hook
    from .distributed.fsdp import attach_fsdp_gns, fsdp_gns_shard_placement
    from .adaptive import AdaptiveBatching
    from .data import MicroBatchSampler
    from .lr import LRMultiplier, warmup_cosine
    from .metrics import CSVWriter, tensorboard_writer, to_tensorboard
    from .sampler import AdaptiveBatchSampler
