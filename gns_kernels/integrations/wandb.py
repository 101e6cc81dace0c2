"""Weights & Biases: ``coord.metrics()`` to a W&B run. What the user adds::

    from gns_kernels.integrations.wandb import WandbWriter
    writer = WandbWriter(run)            # run = wandb.init(...); None: the active wandb.run
    ...
    opt.step(); opt.zero_grad()
    writer.write(coord.metrics())        # after each step

Each ``write`` is one ``run.log({...})`` of the finite numbers of the metrics under
``prefix`` ("gns/gns", "gns/batch_size", "gns/lr_0", ...), with ``gns/step`` the
coordinator's step k; ``run.define_metric("gns/*", step_metric="gns/step")`` (on the
first write) plots them against k whatever W&B's own step counter is at (other logging
of the user's script keeps its steps). nan (a step not measured) and None are left out,
so an unmeasured step leaves no point. By default only rank 0 writes (the metrics are
identical on every rank); ``all_ranks=True`` writes on every rank (each rank its own run).

What it does not do: start or finish the run (``wandb.init`` / ``run.finish`` stay the
user's), or log anything but ``coord.metrics()``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from ._common import missing, rank_world, scalars

__all__ = ["WandbWriter"]


class WandbWriter:
    """Writes ``coord.metrics()`` to a W&B run (the module docstring).

    Args:
        run: a ``wandb`` run (``wandb.init(...)``), or None for the active ``wandb.run`` at
            each write (ValueError when there is none).
        prefix: key prefix ("gns/").
        all_ranks: write on every rank (default: rank 0 only).
        commit: passed to ``run.log`` (None: W&B's default).
    """

    def __init__(self, run: Any = None, prefix: str = "gns/", all_ranks: bool = False,
                 commit: Optional[bool] = None):
        if run is not None and not callable(getattr(run, "log", None)):
            raise TypeError(f"run: expected a wandb run (wandb.init(...)) or None, got {type(run).__name__}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
        self.run, self.prefix, self.all_ranks, self.commit = run, prefix, bool(all_ranks), commit
        self._defined: set = set()

    def _run(self):
        if self.run is not None:
            return self.run
        try:
            import wandb
        except ImportError as exc:
            raise missing("wandb", "wandb", "gns_kernels.integrations.wandb.WandbWriter") from exc
        if wandb.run is None:
            raise ValueError("WandbWriter: no run given and no active wandb.run; call wandb.init(...) "
                             "first or pass run=")
        return wandb.run

    def write(self, metrics: Mapping[str, Any]) -> int:
        """Log the finite numbers of ``metrics`` (``coord.metrics()``); returns how many
        (0 on ranks other than 0 unless ``all_ranks``, and for an empty dict)."""
        if not isinstance(metrics, Mapping):
            raise TypeError(f"WandbWriter.write: metrics: expected a dict (coord.metrics()), got "
                            f"{type(metrics).__name__}")
        if not metrics or (not self.all_ranks and rank_world()[0] != 0):
            return 0
        run = self._run()
        step_key = self.prefix + "step"
        if id(run) not in self._defined and callable(getattr(run, "define_metric", None)):
            run.define_metric(step_key)
            run.define_metric(self.prefix + "*", step_metric=step_key)
            self._defined.add(id(run))
        data = scalars(metrics, self.prefix)
        if "step" in metrics:
            data[step_key] = int(metrics["step"])
        kw = {} if self.commit is None else {"commit": self.commit}
        run.log(data, **kw)
        return len(data)
