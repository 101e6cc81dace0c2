"""The coordinator of an adaptive-batch run (``AdaptiveBatching``), one room per job:
``config`` (settings), ``attach`` (the measurement), ``stream`` (the data), ``watch`` and
``guard`` (the loop checks), ``lrs`` (learning rates), ``reading`` (estimate, metrics),
``checkpoint`` (the state_dict format), ``core`` (the coordinator itself)."""
from .config import CoordinatorConfig
from .core import AdaptiveBatching, Batch

__all__ = ["AdaptiveBatching", "Batch", "CoordinatorConfig"]
