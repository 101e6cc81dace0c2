"""Optimizers of the paper's geometries and the optimizer -> GNS geometry map.

SignSGD, Signum (l1 GNS), SpecSGD (nuclear GNS); torch.optim.SGD (l2), Adam/AdamW (l1)
and torch.optim.Muon (nuclear) are reused as they are. See ``geometry_for``.
"""
from .geometry import geometry_for
from .sign import SignSGD, Signum
from .spectral import SpecSGD, polar_factor

__all__ = ["SignSGD", "Signum", "SpecSGD", "polar_factor", "geometry_for"]
