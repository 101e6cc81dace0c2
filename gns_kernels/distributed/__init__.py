"""Distributed GNS: one measurement core and three sibling transports over it.

- GNSConfig: the hook states' configuration (geometry, shift, params, ...), checked once.
- GNSHookState: a GNSConfig plus the runtime state: the schedule it reads (k % F == 0,
  global batch size), the noise pool, results.
- ddp_gns_hook: DDP comm hook (one all-reduce per bucket on every step).
- MicroBatchGNS: gradient-accumulation micro-batches as samples (one rank, or ranks x
  micro-batches through the DDP hook).
- fsdp.attach_fsdp_gns (imported lazily by gns_kernels): the FSDP2 reduce-scatter.
The core (_measurement.py: the typed sums, the per-measurement plan, the shared solve's
reader) is what the transports share; none imports another. See docs/distributed.md.
"""
from .config import GNSConfig
from .state import GNSHookState
from .ddp import ddp_gns_hook
from .microbatch import MicroBatchGNS

__all__ = ["GNSConfig", "GNSHookState", "ddp_gns_hook", "MicroBatchGNS"]
