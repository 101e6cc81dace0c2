"""Settings: what a measurement reads from its hook state, read once where it starts.

A measurement needs its state's configuration (geometry, bias correction, signal, solver
method), the nuclear dof for its number of samples, the schedule's step k, global batch B
and loss scale, the noise pool with its keys and solve owners, and the eigensolver hints.
``GNSHookState.settings`` reads all of them at once into this frozen record, so that the
code that measures (the micro-batch measurement, ``_micro_measure.py``) calls leaf
functions that never call back into the state, its configuration or its schedule. The
pool, the owners and the hints are the state's own objects (a measurement updates them);
the other fields are plain values.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

if TYPE_CHECKING:  # types only: this module imports nothing of the package at run time
    from ..stats.pool import NoisePool
    from ..spectral.hints import EigHints
    from .config import GNSConfig

__all__ = ["Settings"]


class Settings(NamedTuple):
    """One measurement's settings (module docstring).

    config: the state's GNSConfig (frozen; geometry, bias_correction, signal, method, ...);
    l1_debiased: ``config.l1_debiased``; dof: the nuclear correction's dof for the
    measurement's samples ('gauss-sums' or 'columns'; None without a nuclear correction or
    when no sample count was given); keys: the noise-pool keys of the parameters the
    settings were asked for, in their order; step, batch_size (float), grad_scale: the
    schedule's k, B and loss scale; pool, pool_owners, eig_hints: the state's noise pool
    (or None), its solve owners (pool key -> rank) and its eigensolver hints; method: the
    nuclear solver the hooks run on the device of the parameters the settings were asked
    for ('eigh', 'newton' or 'host': ``config.hook_method``; the CPU's without parameters).
    """

    config: "GNSConfig"
    l1_debiased: bool
    dof: Optional[str]
    keys: tuple
    step: int
    batch_size: float
    grad_scale: float
    pool: Optional["NoisePool"]
    pool_owners: dict
    eig_hints: "EigHints"
    method: str = "eigh"

