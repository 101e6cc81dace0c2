"""``torch.distributed.checkpoint`` (DCP) for the coordinator and the hook states.

DCP keeps ONE copy of a key that several ranks hold (it takes a plain value or tensor
under the same key on every rank to be replicated). The coordinator's state is per rank:
the noise pool holds this rank's share of every parameter (and is tagged with the rank),
the nuclear eigensolver hints are those of the matrices this rank solves. Passed to DCP
as it is, every rank would load one rank's pool. ``DCPState`` keeps every rank's share
under its own key, as torchtitan keys its data loader (``dataloader.dp_rank_{r}``)::

    from gns_kernels.integrations.dcp import DCPState
    dcp.save({"model": ..., "optim": ..., "coord": DCPState(coord)}, checkpoint_id=path)
    dcp.load({"model": ..., "optim": ..., "coord": DCPState(coord)}, checkpoint_id=path)

(``DCPState(coord)`` is Stateful: DCP calls its ``state_dict()`` on save and its
``load_state_dict()`` after a load; build it once and keep it in the dict you hand DCP.)

What it writes, on rank r of W (all values are bytes or ints, which DCP stores as
objects, not as tensors, so a freshly built coordinator with an empty noise pool loads
them; DCP loads tensors only into tensors of the saved shape that already exist):

- ``rank_{r}``: ``obj.state_dict()`` of this rank, serialized with ``torch.save`` and read
  back with ``torch.load(weights_only=True)`` (no code runs from our bytes);
- ``shared``: the same without the noise pool (identical on every rank up to the
  per-rank eigensolver hints; DCP keeps one copy): what a rank that the checkpoint has no
  share for (a larger world) resumes from;
- ``world_size``: W.

Load: rank r takes ``rank_{r}``, which round-trips ``state_dict()`` bit for bit on every
rank when the world size is the same. On another world size ``obj.load_state_dict`` does
what it does for a per-rank ``torch.save`` today: the sampler re-shards the stream, the
batch is rounded to the new R x b, and the noise pool restarts with a warning. A world
grown beyond W has ranks with no ``rank_{r}`` key: DCP's default planner refuses missing
keys, so load with ``planner=DefaultLoadPlanner(allow_partial_load=True)``; such a rank
resumes from ``shared`` and its pool restarts with a warning.

Safety: DCP itself reads every non-tensor entry of a checkpoint (ours, a data loader's,
a train state's) with ``torch.load(weights_only=False)``; our payload inside is read
with ``weights_only=True`` and checked by ``load_state_dict``, but a DCP checkpoint from an
untrusted source can run code through DCP's own reading whatever this module does.
"""
from __future__ import annotations

import io
from typing import Any

import torch

from ._common import rank_world, warn_user


__all__ = ["DCPState", "PREFIX"]

PREFIX = "rank_"
_VERSION = 1


def _dumps(sd: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _loads(blob, name: str) -> dict:  # noqa: D401
    if isinstance(blob, io.BytesIO):
        blob = blob.getvalue()
    if not isinstance(blob, (bytes, bytearray)):
        raise ValueError(f"DCPState.load_state_dict: {name!r} must be bytes (written by "
                         f"DCPState.state_dict), got {type(blob).__name__}")
    sd = torch.load(io.BytesIO(bytes(blob)), map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ValueError(f"DCPState.load_state_dict: {name!r} does not hold a state_dict")
    return sd


def _without_pool(sd: dict) -> dict:
    """The state_dict with the per-rank noise pool left out (coordinator or hook state)."""
    out = dict(sd)
    if isinstance(out.get("hook"), dict):
        out["hook"] = {k: v for k, v in out["hook"].items() if k != "pool"}
    out.pop("pool", None)
    return out


def _has_pool(sd: dict) -> bool:
    return "pool" in sd or (isinstance(sd.get("hook"), dict) and "pool" in sd["hook"])


class DCPState:
    """Stateful for ``torch.distributed.checkpoint``: ``obj`` (an ``AdaptiveBatching``, a
    ``GNSHookState`` / ``MicroBatchGNS``, or anything with ``state_dict`` /
    ``load_state_dict`` whose state is per rank) with every rank's share under its own key
    (the module docstring). What the user adds::

        state = {"model": model_sd, "optim": optim_sd, "coord": DCPState(coord)}
        dcp.save(state, checkpoint_id=path)      # and dcp.load(state, checkpoint_id=path)

    group: the process group whose rank and size key the shares (default: the world).
    """

    def __init__(self, obj: Any, group=None):
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"obj: expected an object with state_dict() and load_state_dict() "
                            f"(AdaptiveBatching, GNSHookState, MicroBatchGNS), got {type(obj).__name__}")
        self.obj, self.group = obj, group

    def state_dict(self) -> dict:
        rank, world = rank_world(self.group)
        sd = self.obj.state_dict()
        tag = {"rank": rank, "world_size": world}
        return {"version": _VERSION, "world_size": world,
                f"{PREFIX}{rank}": _dumps({**tag, "state": sd}),
                "shared": _dumps({**tag, "state": _without_pool(sd)})}

    def load_state_dict(self, state: dict) -> None:
        rank, world = rank_world(self.group)
        if not isinstance(state, dict) or state.get("version") != _VERSION:
            raise ValueError(f"DCPState.load_state_dict: expected a state of version {_VERSION} "
                             f"(written by DCPState.state_dict), got {type(state).__name__}")
        saved_world = state.get("world_size")
        if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
            raise ValueError(f"DCPState.load_state_dict: 'world_size' must be an int >= 1, got "
                             f"{saved_world!r}")
        key = f"{PREFIX}{rank}"
        # a key the checkpoint lacks (allow_partial_load) keeps the value this rank's own
        # state_dict() put there; the tag inside tells a loaded share from that one
        rec = _loads(state[key], key) if key in state else None
        if rec is not None and (rec.get("rank"), rec.get("world_size")) != (rank, saved_world):
            rec = None
        if rec is None:
            if rank < saved_world:
                raise KeyError(f"DCPState.load_state_dict: the checkpoint was saved on {saved_world} "
                               f"ranks but its share {key!r} was not loaded")
            if "shared" not in state:
                raise KeyError("DCPState.load_state_dict: no 'shared' state in the checkpoint")
            rec = _loads(state["shared"], "shared")
            if rec.get("world_size") != saved_world:
                raise KeyError("DCPState.load_state_dict: the 'shared' state was not loaded from "
                               "the checkpoint")
            warn_user(   # at the user's dcp.load(...) line, past torch's checkpoint frames
                f"DCPState: the checkpoint was saved on {saved_world} ranks and holds no share "
                f"for rank {rank} of {world}; resuming from the shared state, this rank's noise "
                "pool starts afresh")
        if not isinstance(rec.get("state"), dict):
            raise ValueError("DCPState.load_state_dict: the saved share holds no state_dict")
        self.obj.load_state_dict(rec["state"])

    def __repr__(self) -> str:
        return f"DCPState({type(self.obj).__name__})"
