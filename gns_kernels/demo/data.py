"""The demo corpus: the Python standard library's own ``.py`` sources, as raw bytes.

- Where: ``sysconfig.get_paths()["stdlib"]`` (or any folder given as ``root``/``--corpus``),
  walked recursively for ``*.py`` files; ``site-packages``, ``dist-packages`` and
  ``__pycache__`` folders are skipped so only the standard library itself is read.
- Split by FILE, deterministically: a file goes to validation when
  ``int(sha1(relative_path)[:8], 16) % 1000 < 1000 * val_fraction`` (default 5%), so the
  split is the same on every machine, run and rank, and no file contributes to both.
- Tokens: bytes, vocabulary 256. Files are concatenated in sorted relative-path order,
  each followed by a NUL byte (0) as a document separator.
- Samples: `TokenWindows` cuts the concatenation into non-overlapping windows of
  ``context + 1`` bytes (window i starts at byte ``i * context``; inputs are the first
  ``context`` bytes, targets the last ``context``, shifted by one). Randomness comes from
  the batch sampler (``gk.AdaptiveBatching.batch_sampler``), which draws window indices in
  a seeded random order.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CorpusNotFoundError", "Corpus", "TokenWindows", "default_corpus_root",
           "is_validation_file", "load_corpus"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CorpusNotFoundError(FileNotFoundError):
    """The corpus folder is missing or holds no .py files."""


def default_corpus_root() -> str:
    """The standard library folder of the running Python."""
    return sysconfig.get_paths()["stdlib"]


def is_validation_file(relative_path: str, val_fraction: float = 0.05) -> bool:
    """Deterministic split by file: sha1 of the '/'-joined relative path."""
    key = relative_path.replace(os.sep, "/").encode("utf-8")
    return int(hashlib.sha1(key).hexdigest()[:8], 16) % 1000 < round(1000 * val_fraction)


@dataclass
class Corpus:
    """Byte streams of the train and validation files (uint8 tensors) and their file counts."""
    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    root: str


def load_corpus(root: str | None = None, val_fraction: float = 0.05,
                max_bytes: int | None = None) -> Corpus:
    """Read every .py file under `root` (default: the stdlib) and split it by file.

    max_bytes: optional cap on the bytes read per split (files taken in sorted order),
    for quick tests. Raises CorpusNotFoundError when root is missing or empty of .py files,
    ValueError on a bad val_fraction.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    root = default_corpus_root() if root is None else os.fspath(root)
    if not os.path.isdir(root):
        raise CorpusNotFoundError(f"corpus folder not found: {root!r} (give --corpus PATH, "
                                  "a folder containing .py files)")
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                paths.append(os.path.relpath(os.path.join(dirpath, name), root))
    paths.sort(key=lambda p: p.replace(os.sep, "/"))
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    counts = {False: 0, True: 0}
    for rel in paths:
        is_val = is_validation_file(rel, val_fraction)
        if max_bytes is not None and sizes[is_val] >= max_bytes:
            continue
        try:
            with open(os.path.join(root, rel), "rb") as fh:
                blob = fh.read()
        except OSError:
            continue  # unreadable file (permissions, broken link): not part of the corpus
        parts[is_val].append(blob + b"\0")
        sizes[is_val] += len(blob) + 1
        counts[is_val] += 1
    if counts[False] == 0 or counts[True] == 0:
        raise CorpusNotFoundError(
            f"corpus folder {root!r} has {counts[False]} training and {counts[True]} validation "
            ".py files; need at least one of each (give --corpus PATH with more .py files)")

    def to_tensor(chunks):
        return torch.from_numpy(np.frombuffer(b"".join(chunks), dtype=np.uint8).copy())

    return Corpus(train=to_tensor(parts[False]), val=to_tensor(parts[True]),
                  train_files=counts[False], val_files=counts[True], root=root)


class TokenWindows:
    """Non-overlapping windows of context+1 bytes over a uint8 stream.

    len(self) = (len(stream) - 1) // context; ``batch(indices)`` -> (inputs, targets), both
    int64 of shape (len(indices), context), targets = inputs shifted left by one byte;
    ``self[i]`` is window i alone (a map-style dataset for a DataLoader).
    """

    def __init__(self, stream: torch.Tensor, context: int):
        if stream.dtype != torch.uint8 or stream.dim() != 1:
            raise ValueError("TokenWindows: stream must be a 1-D uint8 tensor")
        if context < 1:
            raise ValueError(f"TokenWindows: context must be >= 1, got {context}")
        self.stream = stream
        self.context = context
        self.num_windows = (stream.numel() - 1) // context
        if self.num_windows < 1:
            raise ValueError(f"TokenWindows: stream of {stream.numel()} bytes is shorter than "
                             f"one window of {context + 1}")

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window `index` as (inputs, targets) of shape (context,), so that a DataLoader over
        a batch sampler of window indices yields the (b, context) pairs of ``batch``."""
        x, y = self.batch([int(index)])
        return x[0], y[0]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.num_windows):
            raise IndexError(f"TokenWindows: window index out of range [0, {self.num_windows})")
        offs = idx[:, None] * self.context + torch.arange(self.context + 1)[None, :]
        win = self.stream[offs].long()
        return win[:, :-1], win[:, 1:]

    def evenly_spaced(self, count: int) -> list[int]:
        """`count` window indices spread evenly over the stream (a fixed validation set)."""
        count = min(count, self.num_windows)
        return np.linspace(0, self.num_windows - 1, count).round().astype(np.int64).tolist()
