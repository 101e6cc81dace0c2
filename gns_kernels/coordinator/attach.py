"""The measurement a coordinator runs over: built from the model (or taken as given),
checked before anything is attached, and the data-parallel group it measures over.

``measurement_for(model, ...)`` builds the GNS measurement a model needs -- a
``GNSHookState`` as the DDP comm hook (over DDP's own process group), one attached to
FSDP2's reduce-scatters, a ``MicroBatchGNS`` on one rank -- and returns it with the
function that attaches it, which the coordinator calls only once every argument passed
its checks (a refused constructor leaves the model as it was; ``discard`` undoes what
building did outside the measurement). ``refuse_layout`` refuses parameter layouts the
measurement does not handle; ``data_parallel`` gives R and this rank.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..distributed.fsdp import FSDPGNSHandle, prepare_fsdp_gns
from ..distributed.microbatch import MicroBatchGNS
from ..distributed.state import GNSHookState

__all__ = ["measurement_for", "build", "refuse_layout", "discard", "kind_of", "data_parallel", "resolve"]


def refuse_layout(model, kind: str) -> None:
    """ValueError for a DDP model or a plain module whose parameters are DTensors (tensor,
    sequence or expert parallelism): the GNS samples are the data-parallel replicas, and
    under those layouts the ranks of the world are not all replicas (R would be taken as
    the world size; the measured values differ between the ranks of one replica). FSDP2's
    own checks are ``attach_fsdp_gns``'s."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            raise ValueError(
                f"model: parameter {name!r} is a DTensor on a mesh of shape "
                f"{tuple(mesh.shape)} (dims {mesh.mesh_dim_names}) with placements "
                f"{tuple(p.placements)} under {kind}: a layout the GNS measurement does not "
                "handle (tensor / sequence / expert parallelism). Supported: DDP, FSDP2 "
                "(fully_shard) over a 1-D data-parallel mesh, or one rank; the GNS samples are "
                "the data-parallel replicas")


def discard(gns) -> None:
    """Undo what building a measurement did outside it (a refused constructor): the
    gradient hook a MicroBatchGNS put on one parameter."""
    detach = getattr(gns, "detach", None)
    if callable(detach):
        detach()


def kind_of(gns) -> tuple[str, GNSHookState, Optional[FSDPGNSHandle]]:
    """("fsdp" | "micro" | "ddp", the hook state, the FSDP2 handle or None) of a
    measurement object; TypeError for anything else."""
    if isinstance(gns, FSDPGNSHandle):
        return "fsdp", gns.state, gns
    if isinstance(gns, MicroBatchGNS):
        return "micro", gns, None
    if isinstance(gns, GNSHookState):
        return "ddp", gns, None
    raise TypeError("gns: expected a GNSHookState (DDP comm hook state), a MicroBatchGNS "
                    "or the FSDPGNSHandle returned by attach_fsdp_gns, got "
                    f"{type(gns).__name__}")


def data_parallel(kind: str, state: GNSHookState, handle: Optional[FSDPGNSHandle]):
    """(R, rank) of the data-parallel group the measurement runs over: the FSDP2 mesh's
    shard group, or the hook state's process group (the default group when None);
    (None, None) without torch.distributed (one process)."""
    import torch.distributed as dist

    if kind == "fsdp" and handle.dp_size is not None:
        return handle.dp_size, handle.dp_rank
    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    group = state.process_group
    return dist.get_world_size(group), dist.get_rank(group)


def measurement_for(gns, optimizers, cfg) -> tuple:
    """(the model or None, the measurement, the function that attaches it or None) for a
    coordinator given ``gns`` with settings ``cfg`` (a ``CoordinatorConfig``): a
    measurement object as it is (``geometry`` refused: its own applies); for a model, the
    measurement built (``build``), not yet attached."""
    if not isinstance(gns, torch.nn.Module):
        if cfg.geometry is not None:
            raise ValueError("geometry: given with a measurement object (GNSHookState, "
                             "MicroBatchGNS, FSDP handle), whose own geometry applies; pass "
                             "geometry= only with the model")
        return None, gns, None
    measurement, attach = build(gns, optimizers, cfg.geometry,
                                100 if cfg.every is None else cfg.every, cfg.initial_batch_size,
                                cfg.micro_batch_size, cfg.world_size, cfg.signal,
                                0.9 if cfg.beta_noise is None else cfg.beta_noise)
    return gns, measurement, attach


def build(model, optimizers, geometry, every, B0, b, world_size, signal,
          beta_noise) -> tuple[object, Optional[Callable[[], None]]]:
    """The GNS measurement for ``model``, and a function that attaches it (None: nothing
    to attach): a DDP model gets a GNSHookState registered as its comm hook (over DDP's
    own process group), an FSDP2 model one attached to its reduce-scatters, a plain module
    on one rank a MicroBatchGNS. Measured parameters: the first optimizer's (Muon's
    matrices in Muon + AdamW, as the paper measures); geometry: ``geometry`` or
    ``gk.geometry_for(optimizers)``; the noise pool's EMA factor is ``beta_noise`` (one
    setting: the pooled noise is the controller's noise EMA). Refuses here, before anything
    is attached, a layout the measurement does not handle (``refuse_layout``) and a model
    that already carries a comm hook."""
    import torch.distributed as dist

    from ..distributed import ddp_gns_hook
    from ..optim import geometry_for

    geometry = geometry_for(optimizers) if geometry is None else geometry
    params = [p for g in optimizers[0].param_groups for p in g["params"]]
    mine = {id(p) for p in model.parameters()}
    fsdp = callable(getattr(model, "set_requires_gradient_sync", None))
    if not any(id(p) in mine for p in params):
        raise ValueError(
            "optimizers: the first optimizer's parameters (the measured ones) are not this "
            "model's parameters"
            + (": fully_shard replaces a module's parameters with sharded ones, so build the "
               "optimizers AFTER fully_shard(model), from model.parameters()" if fsdp else
               "; build the optimizers from model.parameters() of the model passed here"))
    kw = dict(geometry=geometry, every=every, pool_beta=beta_noise)
    if signal is not None:
        kw["signal"] = signal
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if not fsdp:
        refuse_layout(model, "DDP" if ddp else "module")
    if ddp:
        if getattr(model, "_comm_hooks", None):
            hook, hstate = model._comm_hooks[0]
            name = getattr(hook, "__name__", type(hook).__name__)
            if isinstance(hstate, GNSHookState):
                raise ValueError(
                    f"gns: this DDP model already has the comm hook {name} with a "
                    f"{type(hstate).__name__} (DDP takes one comm hook): pass that state "
                    "instead of the model, AdaptiveBatching(state, ...), or build DDP afresh")
            raise ValueError(
                f"gns: this DDP model already has a comm hook ({name}); DDP takes one, and the "
                "GNS hook does the gradient all-reduce itself: build DDP without "
                "register_comm_hook and pass it here")
        state = GNSHookState(batch_size=B0, params=params, process_group=model.process_group, **kw)
        return state, lambda: model.register_comm_hook(state, ddp_gns_hook)
    if fsdp:  # FSDP2 (fully_shard)
        state = GNSHookState(batch_size=B0, params=params, **kw)
        return prepare_fsdp_gns(model, state)
    ready = dist.is_available() and dist.is_initialized()
    R = world_size if world_size is not None else (dist.get_world_size() if ready else 1)
    if R != 1:
        raise ValueError(
            f"gns: a plain module on {R} ranks; wrap it first (DistributedDataParallel, or "
            "fully_shard for FSDP2) and pass the wrapped model")
    return MicroBatchGNS(params, batch_size=B0, micro_batches=B0 // b, **kw), None


def resolve(gns, cfg, form: str, grad_scaler):
    """(kind, hook state, FSDP2 handle or None, the run's settings) of a coordinator over
    ``gns``: ``cfg`` (a ``CoordinatorConfig``) resolved against the data-parallel group and
    the hook state (``CoordinatorConfig.resolve``); ``form`` "model" when the coordinator
    built the measurement. TypeError / ValueError naming what does not fit; nothing changes."""
    kind, state, handle = kind_of(gns)
    R, rank = data_parallel(kind, state, handle)
    if R is None:   # one process without torch.distributed: as given (simulated ranks)
        R = 1 if cfg.world_size is None else cfg.world_size
        rank = 0 if cfg.rank is None else cfg.rank
    elif cfg.rank is not None:
        rank = cfg.rank
    config = cfg.resolve(world_size=R, rank=rank, state_every=state.every,
                         state_signal=getattr(state, "signal", "raw"),
                         pool_beta=getattr(state, "pool_beta", None),
                         measures_micro_batches=kind == "micro", built_state=form == "model")
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise TypeError(f"grad_scaler: expected a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    return kind, state, handle, config
