"""Distributed GNS: the DDP comm hook, its state, and micro-batch statistics.

- GNSHookState: schedule (k % F == 0), global batch size, geometry, shift, results.
- ddp_gns_hook: DDP comm hook (one all-reduce per bucket on every step).
- MicroBatchGNS: gradient-accumulation micro-batches as samples (one rank, or ranks x
  micro-batches through the DDP hook).
See docs/distributed.md.
"""
from .state import GNSHookState
from .ddp import ddp_gns_hook
from .microbatch import MicroBatchGNS

__all__ = ["GNSHookState", "ddp_gns_hook", "MicroBatchGNS"]
