"""The checkpoint of a hook state: ``state_dict()`` and ``load_state_dict()``'s work.

What is saved (unchanged since the noise pool was added; a checkpoint of any earlier
version loads): "geometry"; "eig_float64" (the nuclear eigensolver hints, spectral.EigHints);
"step", "every" and "batch_size" while the state owns its schedule (a coordinator saves the
run's itself); "pool" with a noise pool: {"rank", "world", "owners", "beta", "entries"},
THIS RANK's share keyed by positions in the state's parameter order (entries keyed by
object identity are left out, with a warning). A pool saved by another rank or world
size, or with another pool_beta, is refused with a warning and starts afresh. The
configuration (shift, signal, method, ...) is not saved: it is the constructor's.

"lagged", only while a host-route measurement awaits its join (docs/distributed.md, "The
host route"): {"rank", "world", "step", "num_samples", "scale", "batch_size",
"grad_scale", "dof", "rows" (the shared vector's row names), "L" (its columns), "part"
(THIS RANK's rows x L part, device and host rows, as float64 Python floats: exact; None
without a measured matrix)}; ``state_dict`` waits for the host job first. It is loaded
iff the saved world size and rows equal this state's (the same decision on every rank:
the joining all-reduce has the same size everywhere); otherwise it is dropped with a
warning (the next measuring step then has no estimate). Another rank's part is fine: the
ranks' parts are summed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._validation import warn_user
from ..stats.pool import NoisePool
from ..schedule import check_batch_size
from .config import check_count

__all__ = ["rank_world", "hook_state_dict", "load_hook_state_dict"]

_POOL_PARTS = ("beta", "entries")


def rank_world(process_group) -> tuple[int, int]:
    """(rank, world size) of ``process_group``; (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def hook_state_dict(state) -> dict:
    """The state_dict of hook state ``state`` (its measurement already read)."""
    sd = {"geometry": state.geometry, "eig_float64": state.eig_hints.state_dict()}
    if state.schedule.owner is None:   # a coordinator saves the run's schedule itself
        sd.update(step=state.step, every=state.every, batch_size=state.batch_size)
    if state.pool is not None:
        unkeyed = [k for k in state.pool.keys() if isinstance(k, tuple)]
        if unkeyed:
            warn_user(
                f"{type(state).__name__}.state_dict: {len(unkeyed)} noise-pool entries are keyed by "
                "object identity (no parameter order: pass params= or call bind_params), so "
                "they are not saved; a resumed run starts their pool afresh")
        rank, world = rank_world(state.process_group)
        pool = state.pool.state_dict(key_map=lambda k: None if isinstance(k, tuple) else k)
        owners = {k: int(o) for k, o in state.pool_owners.items() if not isinstance(k, tuple)}
        sd["pool"] = {"rank": rank, "world": world, "owners": owners, **pool}
    lagged = getattr(state, "_lagged", None)
    if lagged is not None:
        sd["lagged"] = _lagged_state(state, lagged)
    return sd


def _lagged_state(state, lagged) -> dict:
    """The "lagged" entry (module docstring): waits for the host job."""
    share = lagged.share
    part = share.part()
    if part is not None and share.stream is not None:  # formed on the side stream: wait for it
        torch.cuda.current_stream(part.device).wait_stream(share.stream)
    rank, world = rank_world(state.process_group)
    names = sorted(share.rows, key=share.rows.get)
    return {"rank": rank, "world": world, "step": int(lagged.step),
            "num_samples": int(lagged.num_samples), "scale": float(share.scale),
            "batch_size": lagged.batch_size, "grad_scale": lagged.grad_scale, "dof": lagged.dof,
            "rows": names, "L": 0 if part is None else int(part.shape[1]),
            "part": None if part is None else part.detach().cpu().reshape(-1).tolist()}


def _check_lagged(state, lg):
    """Check a saved "lagged" entry (ValueError when malformed); the LaggedMeasurement
    this state takes, or None (with a warning) for another world size or other rows."""
    from ._measurement import LaggedMeasurement
    from ._share import SolveShare

    keys = {"rank", "world", "step", "num_samples", "scale", "batch_size", "grad_scale", "dof",
            "rows", "L", "part"}
    if not isinstance(lg, dict) or not keys <= set(lg):
        raise ValueError(f"state_dict: 'lagged' must be a dict with {sorted(keys)}")
    for name, lo in (("rank", 0), ("world", 1), ("step", 0), ("num_samples", 2), ("L", 0)):
        v = lg[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"state_dict: lagged[{name!r}] must be an int >= {lo}, got {v!r}")
    for name in ("scale", "batch_size", "grad_scale"):
        v = lg[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"state_dict: lagged[{name!r}] must be a number > 0, got {v!r}")
    if lg["dof"] not in (None, "columns", "gauss-sums"):
        raise ValueError(f"state_dict: lagged['dof'] must be None, 'columns' or 'gauss-sums', got {lg['dof']!r}")
    rows = lg["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, str) for r in rows):
        raise ValueError("state_dict: lagged['rows'] must be a list of row names")
    part = lg["part"]
    if part is not None and (not isinstance(part, list) or len(part) != len(rows) * lg["L"]
                             or not all(isinstance(v, float) for v in part)):
        raise ValueError(f"state_dict: lagged['part'] must be None or {len(rows)} x {lg['L']} floats")
    name = type(state).__name__
    rank, world = rank_world(state.process_group)
    share = SolveShare(world, rank, float(lg["scale"]), state.bias_correction, lg["num_samples"],
                       float(lg["batch_size"]), dof=lg["dof"] or "columns", signal=state.signal,
                       pool=state.pool, grad_scale=float(lg["grad_scale"]), method=state.method)
    mine = sorted(share.rows, key=share.rows.get)
    if lg["world"] != world or rows != mine:
        warn_user(
            f"{name}.load_state_dict: the host-route measurement of step {lg['step']} awaiting "
            f"its join was saved by a world of {lg['world']} with rows {rows}; this is a world "
            f"of {world} with rows {mine}: it is dropped (the next measuring step has no "
            "estimate)")
        return None
    if part is not None:
        share.restore(torch.tensor(part, dtype=torch.float64).view(len(rows), lg["L"]))
    else:
        share.restore(None)
    return LaggedMeasurement(share, lg["step"], lg["num_samples"], lg["dof"], float(lg["batch_size"]),
                             float(lg["grad_scale"]))


def _check_pool(state, pool_sd) -> bool:
    """Check a saved pool (ValueError when malformed); whether this state takes it (False,
    with a warning, for another rank, world size or pool_beta)."""
    if not isinstance(pool_sd, dict) or not {"rank", "world"} <= set(pool_sd):
        raise ValueError("state_dict: 'pool' must be a dict with rank, world, beta, entries")
    for name, lo in (("rank", 0), ("world", 1)):
        v = pool_sd[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"state_dict: pool[{name!r}] must be an int >= {lo}, got {v!r}")
    NoisePool.check_state_dict({k: v for k, v in pool_sd.items() if k in _POOL_PARTS},
                               "state_dict: pool")
    owners = pool_sd.get("owners", {})
    if not isinstance(owners, dict) or not all(
            isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in owners.values()):
        raise ValueError("state_dict: pool['owners'] must map keys to rank numbers >= 0")
    rank, world = rank_world(state.process_group)
    if any(o >= pool_sd["world"] for o in owners.values()):
        raise ValueError(f"state_dict: pool['owners'] names a rank >= the saved world "
                         f"size {pool_sd['world']}")
    name = type(state).__name__
    if (pool_sd["rank"], pool_sd["world"]) != (rank, world):
        warn_user(
            f"{name}.load_state_dict: the noise pool was saved by rank "
            f"{pool_sd['rank']} of {pool_sd['world']}, this is rank {rank} of {world}: "
            "it is not loaded (each rank pools its own share; save and load every "
            "rank's state_dict) and starts afresh")
        return False
    if float(pool_sd["beta"]) != state.pool_beta:
        warn_user(
            f"{name}.load_state_dict: the noise pool was saved with pool_beta "
            f"{pool_sd['beta']}, this state has {state.pool_beta}: it is not loaded and "
            "starts afresh")
        return False
    return True


def load_hook_state_dict(state, sd: dict) -> None:
    """Load ``sd`` into hook state ``state`` (its measurement already read). Every entry is
    checked before anything changes: a rejected state_dict leaves the state as it was."""
    # the schedule is the state's to load when it owns it; a coordinator loads the run's
    # itself (and a checkpoint's copy here, from before, is not read)
    own = state.schedule.owner is None
    for key in (("step", "every", "batch_size") if own else ()) + ("geometry",):
        if key not in sd:
            raise KeyError(f"state_dict: missing key {key!r}")
    if sd["geometry"] != state.geometry:
        raise ValueError(f"state_dict: geometry {sd['geometry']!r} differs from this state's {state.geometry!r}")
    if own:
        every = check_count("state_dict: every", sd["every"])
        step = check_count("state_dict: step", sd["step"], minimum=0)
        batch_size = check_batch_size(sd["batch_size"])
    # absent in checkpoints written before the hints existed
    hints = type(state.eig_hints)()
    hints.load_state_dict(sd.get("eig_float64", {}), name="state_dict: eig_float64")
    pool_sd = sd.get("pool")  # absent before the noise pool existed, or without one
    use_pool = pool_sd is not None and state.pool is not None and _check_pool(state, pool_sd)
    # absent unless a host-route measurement awaited its join
    lagged = _check_lagged(state, sd["lagged"]) if sd.get("lagged") is not None else None
    state.eig_hints.load_state_dict(sd.get("eig_float64", {}), name="state_dict: eig_float64")
    if state.pool is not None:
        if use_pool:
            state.pool.load_state_dict({k: v for k, v in pool_sd.items() if k in _POOL_PARTS},
                                       name="state_dict: pool")
        else:
            state.pool.clear()
        # which rank solves (and pools) each matrix is one global assignment: every rank
        # takes the saved one whenever the world size matches (also when its own pool
        # is refused), so all ranks agree on it
        same_world = pool_sd is not None and pool_sd.get("world") == rank_world(state.process_group)[1]
        state.pool_owners = dict(pool_sd.get("owners", {})) if same_world else {}
    if own:
        state.every, state.step, state.batch_size = every, step, batch_size
    old = state._lagged
    if old is not None:  # this state's own measurement awaiting its join gives way
        old.cancel()
    state._lagged = lagged
