"""PoolKeys: the parameter order that keys a hook state's noise pool, and the pooled
matrices' solve owners.

The noise pool (gns_kernels.stats.pool.NoisePool) keys each parameter's entry by its position
in the state's parameter order (``params=`` at construction, or ``bind_params``), so that
``state_dict()`` can save it; a parameter outside any order is keyed ("id", id(param)) and
not saved. Nuclear with a pool: ``owners`` maps a pool key to the rank that solves (and
pools) that matrix, one global assignment that ``SolveShare`` fills and every rank keeps.
Binding a new order re-keys the entries already pooled and the owners. ``pool_key`` is the
one rule (``PoolKeys.keys`` for the micro-batch measurement's settings, the core's
``MeasurementPlan.key`` for the transports).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch

from .config import unique_params

Tensor = torch.Tensor

__all__ = ["PoolKeys", "pool_key"]


def pool_key(order: Optional[Mapping[int, int]], param: Tensor):
    """The noise pool's key of ``param``: its position in ``order`` (id -> position), else
    ("id", id(param)) (not saved by ``state_dict()``)."""
    if order is not None:
        i = order.get(id(param))
        if i is not None:
            return i
    return ("id", id(param))


class PoolKeys:
    """The parameter order (``order``: id -> position, None without one) and the solve
    owners (``owners``: pool key -> rank) of one hook state."""

    def __init__(self, params: Optional[Iterable[Tensor]] = None):
        self.order: Optional[dict[int, int]] = (
            None if params is None else {id(p): i for i, p in enumerate(params)})
        self.owners: dict = {}

    @property
    def has_order(self) -> bool:
        return self.order is not None

    def keys(self, params: Iterable[Tensor]) -> tuple:
        """The pool keys of ``params``, in their order (``pool_key``)."""
        order = self.order
        return tuple(pool_key(order, p) for p in params)

    def bind(self, params: Iterable[Tensor], pool) -> None:
        """Take the order of ``params`` (a tensor listed twice counts once) and re-key the
        entries of ``pool`` (a NoisePool or None) and the owners already held."""
        plist = unique_params(params)
        if not plist:
            raise ValueError("params: expected at least one parameter, got an empty iterable")
        order = {id(p): i for i, p in enumerate(plist)}
        old_ids = {v: k for k, v in self.order.items()} if self.order is not None else None

        def remap(key):
            """The key under the new order: ("id", id) -> its position; a position of the
            old order -> the same parameter's new position; with no old order (e.g. a pool
            loaded from a checkpoint before any order was bound) positions stay."""
            if isinstance(key, tuple):
                return order.get(key[1])
            if old_ids is None:
                return key
            return order.get(old_ids.get(key))

        if pool is not None and len(pool):
            pool.rekey(remap)
        owners = ((remap(k), o) for k, o in self.owners.items())
        self.owners = {k: o for k, o in owners if k is not None}
        self.order = order
