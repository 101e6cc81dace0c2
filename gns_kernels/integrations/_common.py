"""Helpers shared by the integrations (no third-party imports here)."""
from __future__ import annotations

from ..metrics import scalars  # noqa: F401 (the integrations' logger payload)


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def missing(package: str, extra: str, what: str) -> ImportError:
    return ImportError(f"{what} needs the optional '{package}' package: pip install "
                       f"'gns-kernels[{extra}]' (or pip install {package})")
