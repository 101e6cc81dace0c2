"""Helpers shared by the integrations (no third-party imports here)."""
from __future__ import annotations

import sys
import warnings

from ..metrics import scalars  # noqa: F401 (the integrations' logger payload)

# the packages between a trainer stack's user and our callbacks: a warning raised in a
# callback is attributed to the first frame outside them (the user's trainer.fit / train)
_STACK_PACKAGES = frozenset({"gns_kernels", "torch", "lightning", "pytorch_lightning",
                             "lightning_fabric", "transformers", "accelerate", "contextlib",
                             "functools"})


def warn_user(message: str, category: type = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line: the first
    frame whose module is not ours, torch's or the trainer stack's (Lightning,
    transformers, accelerate), e.g. ``trainer.fit(...)`` or ``trainer.train()``, however
    deep in the stack the callback that warns was called."""
    frame = sys._getframe(1)
    level = 2
    while frame is not None and \
            str(frame.f_globals.get("__name__", "")).split(".")[0] in _STACK_PACKAGES:
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def rank_world(group=None) -> tuple[int, int]:
    """(rank, world size) of ``group`` (default: the default group); (0, 1) without
    torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def missing(package: str, extra: str, what: str) -> ImportError:
    return ImportError(f"{what} needs the optional '{package}' package: pip install "
                       f"'gns-kernels[{extra}]' (or pip install {package})")
