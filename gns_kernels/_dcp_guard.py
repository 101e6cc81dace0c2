"""The refusal of a per-rank state handed to torch.distributed.checkpoint (DCP) as it is.

DCP keeps one copy of a key that every rank holds, so a state whose noise pool is per rank
(``AdaptiveBatching``, the hook states) must go through
``gns_kernels.integrations.dcp.DCPState``, which keys each rank's share apart. The
``state_dict()`` of those objects calls ``refuse_unwrapped_dcp`` first. This module sits at
the bottom of the package (it imports nothing from it), so the coordinator and the hook
states can use it without importing the integrations above them.
"""
from __future__ import annotations

import sys

_WRAPPER_MODULE = "gns_kernels.integrations.dcp"
_DCP_MODULES = ("torch.distributed.checkpoint.state_dict_saver",
                "torch.distributed.checkpoint.state_dict_loader")

DCP_MESSAGE = ("{what}: handed to torch.distributed.checkpoint as it is; DCP keeps one copy "
               "of a key that every rank holds, so every rank would load one rank's noise "
               "pool. Wrap it: {{'coord': gns_kernels.integrations.dcp.DCPState(coord)}} "
               "(docs/integrations.md)")


def called_by_dcp() -> bool:
    """True when a ``state_dict()`` call comes straight from torch.distributed.checkpoint's
    save or load (a frame of its state_dict_saver / state_dict_loader is on the stack with
    no ``DCPState`` frame in between)."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return False
        mod = frame.f_globals.get("__name__", "")
        if mod == _WRAPPER_MODULE:
            return False
        if mod in _DCP_MODULES:
            return True
        frame = frame.f_back
    return False


def refuse_unwrapped_dcp(what: str) -> None:
    """RuntimeError naming ``what`` and the DCPState wrapper when DCP calls directly."""
    if called_by_dcp():
        raise RuntimeError(DCP_MESSAGE.format(what=what))
