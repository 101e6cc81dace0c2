"""Which GNS geometry matches an optimizer (paper sections 2-3, Table 4 caption):

- l2      : torch.optim.SGD (plain, momentum or Nesterov) — Euclidean steepest descent
- l1      : SignSGD, Signum, torch.optim.Adam, torch.optim.AdamW — sign-like (l-infinity)
            methods; Adam reduces to sign descent (Balles & Hennig 2018)
- nuclear : SpecSGD, torch.optim.Muon — spectral (S-infinity) methods

Subclasses map like their base. A list/tuple of optimizers (a composite set-up) maps to
their common geometry; the paper's Muon-for-matrices + AdamW-for-1-D combination maps to
"nuclear" (the GNS is then measured on the 2-D parameters only). Anything else raises
ValueError naming the optimizer: pass the geometry explicitly in that case.
"""
from __future__ import annotations

from typing import Any

import torch

from .sign import SignSGD, Signum
from .spectral import SpecSGD

__all__ = ["geometry_for"]

_GEOMETRIES: tuple[tuple[tuple[type, ...], str], ...] = (
    ((SpecSGD, torch.optim.Muon), "nuclear"),
    ((SignSGD, Signum, torch.optim.Adam, torch.optim.AdamW), "l1"),
    ((torch.optim.SGD,), "l2"),
)


def _one(optimizer: Any) -> str:
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for classes, geometry in _GEOMETRIES:
        if issubclass(cls, classes):
            return geometry
    raise ValueError(
        f"geometry_for: no known GNS geometry for optimizer {cls.__module__}.{cls.__qualname__}; "
        "known: SGD -> 'l2'; SignSGD, Signum, Adam, AdamW -> 'l1'; SpecSGD, Muon -> 'nuclear'. "
        "Pass geometry='l2'|'l1'|'nuclear' explicitly."
    )


def geometry_for(optimizer: Any) -> str:
    """"l2" | "l1" | "nuclear" for an optimizer instance or class (or a list of them).

    For a list: all the same geometry -> that one; nuclear together with l1 optimizers
    (Muon/SpecSGD for matrices + AdamW for the rest) -> "nuclear"; other mixes -> ValueError.
    """
    if isinstance(optimizer, (list, tuple)):
        if not optimizer:
            raise ValueError("geometry_for: optimizer list is empty")
        found = {_one(o) for o in optimizer}
        if len(found) == 1:
            return found.pop()
        if found == {"nuclear", "l1"}:
            return "nuclear"
        raise ValueError(f"geometry_for: optimizers of mixed geometries {sorted(found)}; "
                         "pass the geometry explicitly")
    return _one(optimizer)
