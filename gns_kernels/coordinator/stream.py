"""The data side of a coordinated loop: the micro-batch stream, its synchronization
contexts, and what a micro-batch or a loader can be told to hold.

``DataStream`` draws micro-batches from the user's loader across its passes and owns the
coordinator's ``MicroBatchSampler`` (its consumed position is what a checkpoint saves);
``sync_contexts`` gives the contexts of a step's micro-batches (DDP's ``no_sync()`` /
FSDP2's ``set_requires_gradient_sync(False)`` on the first A - 1); ``batch_len`` reads the
examples of a micro-batch where that is certain; ``loader_warnings`` names loaders whose
stream the coordinator cannot follow or save.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from ..data import MicroBatchSampler

__all__ = ["DataStream", "batch_len", "item_size", "sync_contexts", "loader_warnings",
           "micro_batch_error"]


def item_size(item) -> Optional[int]:
    """The examples one part of a micro-batch holds, when it says so plainly: a tensor's
    leading dimension (0-d: None), or the length of a list / tuple of tensors or dicts
    (a detection collate's tuple of images); None for anything else."""
    if isinstance(item, torch.Tensor):
        return int(item.shape[0]) if item.dim() > 0 else None
    if isinstance(item, (list, tuple)) and not hasattr(item, "_fields") and item and all(
            isinstance(x, (torch.Tensor, Mapping)) for x in item):
        return len(item)
    return None


def batch_len(batch) -> Optional[int]:
    """The number of examples of a micro-batch, when it is certain: a batch-first tensor;
    or a mapping (dict, ``BatchEncoding``) / a plain tuple or list (``(x, y)``, a detection
    collate's ``(images, targets)``) whose parts all report the same size (their leading
    dimensions or lengths). None -- nothing to check -- when the parts disagree (a
    sequence-first ``[T, b]`` input beside ``[b]`` labels), when no part reports one, or
    for any other object (a named tuple such as ``PackedSequence``, a dataclass)."""
    if isinstance(batch, torch.Tensor):
        return item_size(batch)
    if isinstance(batch, Mapping):
        parts = list(batch.values())
    elif isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        parts = list(batch)
    else:
        return None
    sizes = {n for n in map(item_size, parts) if n is not None}
    return sizes.pop() if len(sizes) == 1 else None


def micro_batch_error(n: int, index: int, step: int, R: int, A: int, b: int) -> ValueError:
    """The error for micro-batch ``index`` of step ``step`` holding n examples, not b."""
    return ValueError(
        f"micro-batch {index} of step {step} holds {n} examples (the leading dimension its "
        f"tensors agree on), but micro_batch_size is {b}: the coordinator counts B = R x A x b = "
        f"{R} x {A} x {b} examples per step, and the samples seen, the LR multiplier and the "
        "GNS's batch would all be off. Build the loader with DataLoader(ds, "
        "batch_sampler=coord.batch_sampler(len(ds))), or one that yields exactly "
        f"{b} examples per item (batch_size={b}, drop_last=True). (Batch-first [b, ...] tensors "
        "are expected; a sequence-first [T, b] batch whose every tensor leads with T cannot be "
        "told apart)")


class _FSDPSync:
    """Context: FSDP2 ``set_requires_gradient_sync(flag)`` inside, sync re-enabled after."""

    def __init__(self, model, flag: bool):
        self.model, self.flag = model, flag

    def __enter__(self):
        self.model.set_requires_gradient_sync(self.flag)
        return self

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False


def sync_contexts(model, A: int, world_size: int):
    """(no-sync context factory for micro-batches 0..A-2, context factory for the last):
    DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``; nothing to skip on
    one rank without a model. ValueError when several ranks accumulate and no model says
    how to skip the synchronization."""
    if A == 1:
        return None, contextlib.nullcontext
    if hasattr(model, "no_sync") and callable(model.no_sync):  # DDP
        return model.no_sync, contextlib.nullcontext
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return (lambda: _FSDPSync(model, False)), (lambda: _FSDPSync(model, True))
    if world_size > 1:
        raise ValueError(
            "this step accumulates {A} micro-batches on {R} ranks, so the first {A1} must "
            "skip the gradient synchronization, and the coordinator does not know the model: "
            "pass the DDP or FSDP2 model, coord.batches(loader, ..., model=ddp) or "
            "coord.micro_batches(loader, ddp) (or build the coordinator from the model, "
            "AdaptiveBatching(ddp, ...))".format(A=A, R=world_size, A1=A - 1))
    return contextlib.nullcontext, contextlib.nullcontext


class DataStream:
    """The micro-batch stream of one rank: the loader's passes drawn one after another, and
    the coordinator's sampler (its consumed position is what ``state_dict()`` saves).

    ``micro_batch_size``, ``world_size``, ``rank``: b, R and this rank (the sampler's)."""

    def __init__(self, micro_batch_size: int, world_size: int, rank: int):
        self.micro_batch_size, self.world_size, self.rank = micro_batch_size, world_size, rank
        self.sampler: Optional[MicroBatchSampler] = None
        self.pending: Optional[dict] = None   # a position loaded before the sampler was made
        self._loader = None
        self._iter = None

    def make_sampler(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> MicroBatchSampler:
        """The coordinator's ``MicroBatchSampler`` (made once); continues at a position
        loaded earlier. A saved position that does not fit (another ``num_samples``,
        ``shuffle`` or ``seed``) raises ValueError and leaves no sampler behind, so a retry
        with the saved arguments still continues there."""
        if self.sampler is not None:
            raise RuntimeError("AdaptiveBatching.batch_sampler: a sampler was already made for this "
                               "coordinator; reuse coord.sampler")
        sampler = MicroBatchSampler(num_samples, self.micro_batch_size, self.world_size,
                                    self.rank, shuffle=shuffle, seed=seed)
        if self.pending is not None:
            sampler.load_state_dict(self.pending)
        self.sampler, self.pending = sampler, None
        return sampler

    def feeds(self, loader) -> bool:
        """Whether the coordinator's sampler feeds ``loader``: unless the loader names
        another batch sampler (a wrapper or generator around the DataLoader has none)."""
        return self.sampler is not None and getattr(loader, "batch_sampler", self.sampler) is self.sampler

    def next_item(self, loader):
        """The next micro-batch of ``loader``, starting a new pass when one ends."""
        if self._iter is None or self._loader is not loader:
            self._loader, self._iter = loader, iter(loader)
        try:
            return next(self._iter)
        except StopIteration:  # the end of a pass (epoch): the stream goes on
            self._iter = iter(loader)
            try:
                return next(self._iter)
            except StopIteration:
                if iter(loader) is loader:
                    raise RuntimeError(
                        "AdaptiveBatching.micro_batches: the loader is an iterator (a generator?) "
                        "and it is exhausted; the coordinator draws micro-batches across passes, "
                        "so pass a re-iterable loader (a DataLoader, or an object whose __iter__ "
                        "starts a new pass)") from None
                raise RuntimeError("AdaptiveBatching.micro_batches: the loader yielded no batch "
                                   "(empty dataset?)") from None

    def restart(self) -> None:
        """Forget the loader's iterator (a resume: the next draw starts a fresh pass)."""
        self._loader = self._iter = None

    def state_dict(self) -> Optional[dict]:
        return None if self.sampler is None else self.sampler.state_dict()

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """The sampler's saved position (kept until the sampler is made, if it is not yet)."""
        if sd is None:
            return
        if self.sampler is not None:
            self.sampler.load_state_dict(sd)
        else:
            self.pending = sd


def loader_warnings(loader, sampler: Optional[MicroBatchSampler], coordinates: tuple,
                    warn_once: Callable[[str, str], None]) -> None:
    """Loaders whose stream the coordinator cannot follow or save (each warned once through
    ``warn_once(key, message)``): a MicroBatchSampler it did not make (ValueError when its
    b, R or rank differ from ``coordinates``), a DistributedSampler kept from the loop
    before, a DataLoader of a map-style dataset drawing from its own sampler, an
    IterableDataset read by several workers (each iterates its own copy)."""
    dataset = getattr(loader, "dataset", None)
    workers = getattr(loader, "num_workers", 0) or 0
    own = getattr(loader, "batch_sampler", None)
    if isinstance(own, MicroBatchSampler) and own is not sampler:
        theirs = (own.micro_batch_size, own.num_replicas, own.rank)
        if theirs != coordinates:
            raise ValueError(
                f"loader: its MicroBatchSampler has micro_batch_size, num_replicas, rank = "
                f"{theirs}, the coordinator {coordinates}; make it with coord.batch_sampler(len(ds))")
        warn_once("own-sampler", (
            "the loader's MicroBatchSampler was not made by coord.batch_sampler(...): the "
            "coordinator does not advance it, so coord.state_dict() does not save the "
            "stream's position and a resumed run restarts it; use coord.batch_sampler"))
    samplers = (getattr(loader, "sampler", None), getattr(own, "sampler", None))
    distributed = any(isinstance(s, torch.utils.data.DistributedSampler) for s in samplers)
    if (isinstance(loader, torch.utils.data.DataLoader) and not distributed
            and not isinstance(dataset, torch.utils.data.IterableDataset)
            and not isinstance(own, MicroBatchSampler)):
        warn_once("plain-loader", (
            "the loader does not draw from coord.batch_sampler(...): the coordinator cannot "
            "save where the data stream is, so coord.state_dict() holds no data position and "
            "a resumed run restarts the data from its start. Use DataLoader(ds, "
            "batch_sampler=coord.batch_sampler(len(ds))) (it also shards by rank and keeps "
            "every micro-batch at b examples)"))
    if distributed:
        warn_once("distributed-sampler", (
            "the loader draws from a DistributedSampler: its passes neither follow the "
            "coordinator's steps nor resume from coord.state_dict(), every pass repeats the "
            "same order unless set_epoch is called, and its last micro-batch of a pass is short "
            "(refused) unless drop_last=True. Use DataLoader(ds, "
            "batch_sampler=coord.batch_sampler(len(ds))): it shards by rank itself"))
    if isinstance(dataset, torch.utils.data.IterableDataset) and workers > 1:
        warn_once("iterable", (
            f"the loader reads an IterableDataset with num_workers={workers}: each worker "
            "iterates its own copy, so unless the dataset splits its stream with "
            "torch.utils.data.get_worker_info(), every sample is seen "
            f"{workers} times per pass; split it by worker (and by rank), or use "
            "num_workers <= 1, or a map-style dataset with coord.batch_sampler(...)"))
