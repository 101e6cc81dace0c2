"""Helpers shared by the integrations (no third-party imports here)."""
from __future__ import annotations

from .._validation import warn_user  # noqa: F401 (warnings at the user's trainer.fit / train line)
from ..metrics import scalars  # noqa: F401 (the integrations' logger payload)


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
