"""What a measurement starting now reads from its hook state (GNSHookState inherits it):
the noise pool's keys (the parameter order), the measurement plan (which parameters, their
shifts and pool keys) and the settings read once (``Settings``). Reads the state's fields
(``_config``, ``_keys``, ``_param_ids``, ``_last_mean``, ``pool``, ``eig_hints``,
``schedule``, ``shift``, ``geometry``).
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from ._measurement import MeasurementPlan, resolve_shift
from ._settings import Settings
from .config import hook_method

Tensor = torch.Tensor

__all__ = ["MeasurementPlanning"]


class MeasurementPlanning:
    """The pool keys, plan and settings of a GNSHookState (module docstring)."""

    # ---------------------------------------------------------------- pool keys
    def bind_params(self, params: Iterable[Tensor]) -> None:
        """Fix the parameter order that keys the noise pool in ``state_dict()`` (the
        position of each parameter in ``params``, e.g. the optimizer's param_groups order;
        a tensor listed twice counts once). ``params=`` at construction does the same.
        Entries already pooled under another key are re-keyed."""
        self._keys.bind(params, self.pool)

    @property
    def has_param_order(self) -> bool:
        """Whether a parameter order keys the noise pool (``params=`` or ``bind_params``),
        so that ``state_dict()`` can save it."""
        return self._keys.has_order

    @property
    def pool_owners(self) -> dict:
        """Nuclear with a pool: pool key -> the rank that solves (and pools) that matrix."""
        return self._keys.owners

    @pool_owners.setter
    def pool_owners(self, owners: dict) -> None:
        self._keys.owners = owners

    def pool_key(self, param: Tensor):
        """The noise pool's key of ``param``: its position in the parameter order, else
        ("id", id(param)) (not saved by ``state_dict()``)."""
        return self.plan().key(param)

    # ---------------------------------------------------------------- measurement plan
    def plan(self) -> MeasurementPlan:
        """The plan of a measurement starting now: per parameter, whether it is measured,
        its shift, its noise-pool key and whether its mean is kept (``shift="last"``),
        each resolved once (``MeasurementPlan.of``). The transports ask for it once per
        measurement."""
        return MeasurementPlan(ids=self._param_ids, matrices_only=self.geometry == "nuclear",
                               shift=self.shift, last=self._last_mean, order=self._keys.order)

    def settings(self, params: Sequence[Tensor] = (), num_samples: Optional[int] = None,
                 per_sample: bool = True) -> Settings:
        """The settings of a measurement starting now, read once (a frozen ``Settings``):
        the configuration, the nuclear solver for ``params``' device (``hook_method``), the
        nuclear dof for ``num_samples`` samples (``per_sample`` as
        ``resolved_nuclear_dof``; None without ``num_samples``), the noise-pool keys of
        ``params``, the schedule's step, batch size and loss scale, the noise pool, its solve
        owners and the eigensolver hints. The micro-batch measurement takes them here and
        reads nothing else from the state."""
        cfg = self._config
        method = hook_method(cfg.method, params[0].device if len(params) else "cpu")
        l1_debiased = cfg.l1_debiased
        dof = None if num_samples is None else cfg.resolved_nuclear_dof(num_samples, per_sample)
        sched = self.schedule
        return Settings(config=cfg, l1_debiased=l1_debiased, dof=dof, keys=self._keys.keys(params),
                        step=sched.step, batch_size=float(sched.batch_size), grad_scale=sched.grad_scale,
                        pool=self.pool, pool_owners=self._keys.owners, eig_hints=self.eig_hints,
                        method=method)

    def measures(self, param: Tensor) -> bool:
        """Whether ``param`` contributes to the statistics of this geometry."""
        return self.plan().measures(param)

    def shift_for(self, param: Tensor) -> Optional[Tensor]:
        """The shift tensor of ``param`` for the current measurement (None: no shift)."""
        return resolve_shift(self.shift, self._last_mean, param)

    def keep_mean(self, param: Tensor, mean_grad: Tensor) -> None:
        """Store the measured mean gradient as the next shift (only when shift == 'last')."""
        if isinstance(self.shift, str):  # only shift == "last" keeps the mean
            self._last_mean.keep(param, mean_grad)
