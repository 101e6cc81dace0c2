"""Writers for the per-step metrics dict of ``AdaptiveBatching.metrics()`` (or any flat
dict of numbers): CSV rows and TensorBoard scalars.

- ``CSVWriter(path)``: appends one row per ``write(metrics)``; the header is written once
  (the first dict's keys, or ``columns``). Re-opening an existing file (a resumed run)
  keeps its header and appends; a last line cut by a crash mid-write (no line end) is
  ended where it stops, with a warning, so the new rows never glue onto it. Tensors with one element and numpy scalars are written as
  the number they hold (a larger tensor raises ValueError naming its key). None and nan are
  written as empty cells, booleans as 0/1, +-inf as ``inf`` / ``-inf``, floats as Python's
  shortest round-trip ``repr`` (``float(cell)`` gives back the same float64).
- ``to_tensorboard(writer, metrics, step)``: ``writer.add_scalar(prefix + key, value,
  step)`` for every finite number (booleans as 0/1; None, nan and non-numbers skipped),
  the style of AdaptDL's ``to_tensorboard(writer, step)``; ``step`` defaults to
  ``metrics["step"]``. ``tensorboard_writer(log_dir)`` makes a
  ``torch.utils.tensorboard.SummaryWriter``; the ``tensorboard`` package is an optional
  dependency, imported only then (ImportError naming ``pip install tensorboard`` when it
  is missing).

The metrics of a step hold noise and signal as well as gns and the EMAs, so the
controller's decisions can be recomputed from the CSV: N_k and M_k from the EMA rule over
the measured rows, B_{k+1} = max(ceil(N_k / (theta^2 M_k)), B_k) rounded and capped.
"""
from __future__ import annotations

import csv
import math
import os
from numbers import Integral, Real
from typing import Any, Iterable, Mapping, Optional

from ._validation import warn_user as _warn_user

__all__ = ["CSVWriter", "to_tensorboard", "tensorboard_writer", "scalars"]


def as_scalar(v: Any) -> Any:
    """A metric value as a plain Python scalar: a one-element tensor or numpy array (0-d
    included) and numpy scalars become ``bool`` / ``int`` / ``float`` through ``.item()``;
    anything else is returned as it is. Raises ValueError for a tensor or array with more
    than one element (a metric is one number)."""
    item = getattr(v, "item", None)
    if item is None or isinstance(v, (bool, int, float, str)):
        return v
    numel = getattr(v, "numel", None)
    size = numel() if callable(numel) else getattr(v, "size", 1)
    if size != 1:
        raise ValueError(f"a metric must be one number, got a {type(v).__name__} with {size} "
                         "elements")
    return item()


def _cell(v: Any) -> str:
    v = as_scalar(v)
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, Integral):
        return str(int(v))
    if isinstance(v, Real):
        f = float(v)
        return "" if math.isnan(f) else repr(f)
    return str(v)


class CSVWriter:
    """Append metrics dicts to a CSV file, header once.

    Args:
        path: the CSV file (created with its parent folder if missing).
        columns: the column order; None takes the first dict's keys (or the existing
            file's header when appending to one).
        write_rows: False on ranks other than 0 makes ``write`` a no-op (one file per run).
    """

    def __init__(self, path: str, columns: Optional[Iterable[str]] = None, write_rows: bool = True):
        self.path = os.fspath(path)
        self.columns = list(columns) if columns is not None else None
        self.enabled = bool(write_rows)
        if self.enabled and os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as fh:
                header = next(csv.reader(fh), None)
            if header:
                if self.columns is not None and self.columns != header:
                    raise ValueError(f"CSVWriter: {self.path} has columns {header}, not the "
                                     f"columns given {self.columns}; write to a new file")
                self.columns = header
                self._header_written = True
                return
        self._header_written = False

    def write(self, metrics: Mapping[str, Any]) -> None:
        """Append one row; keys missing from ``metrics`` give empty cells, keys not in the
        columns raise ValueError (the header is fixed once written)."""
        if not self.enabled:
            return
        if not isinstance(metrics, Mapping):
            raise TypeError(f"CSVWriter.write: expected a dict of metrics, got {type(metrics).__name__}")
        if not metrics:
            return
        columns = self.columns if self.columns is not None else list(metrics.keys())
        extra = [k for k in metrics if k not in columns]
        if extra:
            raise ValueError(f"CSVWriter.write: keys {extra} are not columns of {self.path} "
                             f"({columns}); pass columns= with every key up front")
        row = []
        for k in columns:
            try:
                row.append(_cell(metrics.get(k)))
            except ValueError as exc:
                raise ValueError(f"CSVWriter.write: {k!r}: {exc}") from None
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        cut = self._cut_last_line()
        with open(self.path, "a", newline="") as fh:
            if cut:
                fh.write("\r\n")   # end the cut row where it stops; ours starts on a line of its own
            w = csv.writer(fh)
            if not self._header_written:
                w.writerow(columns)
            w.writerow(row)
        self.columns = columns
        self._header_written = True


    def _cut_last_line(self) -> bool:
        """Whether the file's last line has no line end (a run stopped in the middle of
        writing a row): that row is kept as it stands (it may be incomplete; a warning says
        so), and the next row must start on a new line instead of being glued onto it.
        Checked before the first row this writer appends (one byte read)."""
        if getattr(self, "_checked_end", False):
            return False
        self._checked_end = True
        try:
            with open(self.path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell() == 0:
                    return False
                fh.seek(-1, os.SEEK_END)
                last = fh.read(1)
        except FileNotFoundError:
            return False
        if last in (b"\n", b"\r"):
            return False
        _warn_user(f"CSVWriter: the last line of {self.path} has no line end (a run stopped while "
                   "writing it?): it is kept as it stands and may be incomplete; the new rows "
                   "start on the next line")
        return True


def scalars(metrics: Mapping[str, Any], prefix: str = "gns/", keep_step: bool = False) -> dict:
    """The finite numbers of ``coord.metrics()`` as {prefix + key: float} (booleans as 0/1;
    None, nan, inf, strings and multi-element tensors left out; 'step' left out unless
    ``keep_step``): what a logger takes."""
    out = {}
    for key, v in metrics.items():
        if (key == "step" and not keep_step) or v is None:
            continue
        try:
            v = as_scalar(v)
        except ValueError:
            continue
        if isinstance(v, bool):
            v = 1.0 if v else 0.0
        elif isinstance(v, Real):
            v = float(v)
            if not math.isfinite(v):
                continue
        else:
            continue
        out[prefix + key] = v
    return out


def to_tensorboard(writer, metrics: Mapping[str, Any], step: Optional[int] = None,
                   prefix: str = "gns/") -> int:
    """Write the finite numbers of ``metrics`` as scalars; returns how many were written.

    writer: anything with ``add_scalar(tag, value, global_step)`` (a SummaryWriter).
    step: the global step (default ``metrics["step"]``)."""
    if not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(f"to_tensorboard: writer must have add_scalar(tag, value, step) (a "
                        f"torch.utils.tensorboard.SummaryWriter), got {type(writer).__name__}")
    if step is None:
        step = metrics.get("step")
    step = as_scalar(step)
    values = scalars(metrics, prefix)
    for tag, v in values.items():
        writer.add_scalar(tag, v, step)
    return len(values)


def tensorboard_writer(log_dir: Optional[str] = None, **kwargs):
    """``torch.utils.tensorboard.SummaryWriter(log_dir, **kwargs)``; ImportError with the
    install command when the optional ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch raises this when tensorboard is not installed
        raise ImportError("gns_kernels.metrics.tensorboard_writer needs the optional 'tensorboard' "
                          "package: pip install tensorboard") from exc
    return SummaryWriter(log_dir, **kwargs)
