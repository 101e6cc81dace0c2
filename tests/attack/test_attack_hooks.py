"""Attacks on the hook states and the training-loop coordinator: bad configuration, and
corrupted or mismatched state_dicts. Every rejection names the argument (or key), and a
rejected state_dict leaves the object exactly as it was."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.distributed import GNSHookState, MicroBatchGNS


# ----------------------------------------------------------------------- GNSHookState
@pytest.mark.parametrize("kw,exc,pat", [
    (dict(geometry="l3"), ValueError, "geometry"),
    (dict(every=0), ValueError, "every"),
    (dict(every=1.5), TypeError, "every"),
    (dict(every=True), TypeError, "every"),
    (dict(batch_size=-1), ValueError, "batch_size"),
    (dict(batch_size=math.nan), ValueError, "batch_size"),
    (dict(batch_size=math.inf), ValueError, "batch_size"),
    (dict(batch_size="64"), TypeError, "batch_size"),
    (dict(shift="first"), ValueError, "shift"),
])
def test_hook_state_bad_config(kw, exc, pat):
    args = dict(geometry="l1", every=1, batch_size=8)
    args.update(kw)
    with pytest.raises(exc, match=pat):
        GNSHookState(**args)


def _good_hook_sd():
    st = GNSHookState(geometry="nuclear", every=4, batch_size=32)
    st.step = 9
    return st.state_dict()


_HOOK_CORRUPT = [
    ("not a dict", lambda sd: [1, 2], TypeError, "expected a dict"),
    ("missing step", lambda sd: sd.pop("step"), KeyError, "step"),
    ("missing geometry", lambda sd: sd.pop("geometry"), KeyError, "geometry"),
    ("other geometry", lambda sd: sd.update(geometry="l1"), ValueError, "geometry"),
    ("every 0", lambda sd: sd.update(every=0), ValueError, "every"),
    ("every float", lambda sd: sd.update(every=2.0), TypeError, "every"),
    ("step negative", lambda sd: sd.update(step=-1), ValueError, "step"),
    ("step string", lambda sd: sd.update(step="3"), TypeError, "step"),
    ("batch nan", lambda sd: sd.update(batch_size=math.nan), ValueError, "batch_size"),
    ("batch zero", lambda sd: sd.update(batch_size=0), ValueError, "batch_size"),
    ("hints not bools", lambda sd: sd.update(eig_float64={"768x768": "yes"}), ValueError, "eig_float64"),
    ("hints not a dict", lambda sd: sd.update(eig_float64=[True]), ValueError, "eig_float64"),
]


@pytest.mark.parametrize("case,mutate,exc,pat", _HOOK_CORRUPT, ids=[c[0] for c in _HOOK_CORRUPT])
def test_hook_state_corrupt_state_dict_rejected_unchanged(case, mutate, exc, pat):
    st = GNSHookState(geometry="nuclear", every=2, batch_size=16)
    st.step = 3
    st.eig_hints.load_state_dict({"64x32": True})
    before = copy.deepcopy(st.state_dict())
    sd = _good_hook_sd()
    out = mutate(sd)
    if case == "not a dict":
        sd = out
    with pytest.raises(exc, match=pat):
        st.load_state_dict(sd)
    assert st.state_dict() == before


def test_hook_state_round_trip():
    sd = _good_hook_sd()
    st = GNSHookState(geometry="nuclear", every=1, batch_size=1)
    st.load_state_dict(copy.deepcopy(sd))
    assert st.state_dict() == sd and st.step == 9 and st.every == 4 and st.batch_size == 32


# ----------------------------------------------------------------------- MicroBatchGNS
@pytest.mark.parametrize("kw,exc,pat", [
    (dict(micro_batches=None), ValueError, "micro_batches"),
    (dict(micro_batches=0), ValueError, "micro_batches"),
    (dict(micro_batches=2.0), ValueError, "micro_batches"),
    (dict(geometry="nuclear", params="1d"), ValueError, "params"),
    (dict(params="tensor"), TypeError, "params"),
])
def test_microbatch_bad_config(kw, exc, pat):
    lin = torch.nn.Linear(3, 2)
    bias_only = [lin.bias]
    args = dict(params=list(lin.parameters()), geometry="l1", every=1, batch_size=8, micro_batches=2)
    args.update(kw)
    if args["params"] == "1d":
        args["params"] = bias_only
    elif args["params"] == "tensor":
        args["params"] = lin.weight
    with pytest.raises(exc, match=pat):
        MicroBatchGNS(**args)


# ----------------------------------------------------------------------- AdaptiveBatching
def _coord(every=2):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    state = GNSHookState(geometry="l1", every=every, batch_size=8)
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2,
                             rank=0, schedulers=[sched], max_batch_size=64)
    return coord, state, opt


def _good_coord_sd():
    coord, state, opt = _coord()
    for k in range(3):  # a few steps of the simulated hook: state.step follows the backward
        state.advance_step()
        opt.step()
        coord.step()
    return coord.state_dict()


_COORD_CORRUPT = [
    ("version", lambda sd: sd.update(version=99), ValueError, "version"),
    ("missing hook", lambda sd: sd.pop("hook"), KeyError, "hook"),
    ("missing controller", lambda sd: sd.pop("controller"), KeyError, "controller"),
    ("controller not a dict", lambda sd: sd.update(controller=3), ValueError, "controller"),
    ("schedulers not a list", lambda sd: sd.update(schedulers=None), ValueError, "schedulers"),
    ("two schedulers saved", lambda sd: sd.update(schedulers=sd["schedulers"] * 2), ValueError, "schedulers"),
    ("step negative", lambda sd: sd["schedule"].update(step=-2), ValueError, "step"),
    ("schedule missing", lambda sd: sd.pop("schedule"), KeyError, "schedule"),
    ("schedule every 0", lambda sd: sd["schedule"].update(every=0), ValueError, "every"),
    ("samples string", lambda sd: sd.update(samples_seen="12"), TypeError, "samples_seen"),
    ("hook every 0", lambda sd: sd["hook"].update(geometry="nuclear"), ValueError, "geometry"),
    ("schedule batch nan", lambda sd: sd["schedule"].update(batch_size=math.nan), (ValueError, TypeError),
     "batch_size"),
]


@pytest.mark.parametrize("case,mutate,exc,pat", _COORD_CORRUPT, ids=[c[0] for c in _COORD_CORRUPT])
def test_coordinator_corrupt_state_dict_rejected_unchanged(case, mutate, exc, pat):
    coord, state, opt = _coord()
    state.advance_step()
    opt.step()
    coord.step()
    before = copy.deepcopy(coord.state_dict())
    lrs = [g["lr"] for g in opt.param_groups]
    sd = copy.deepcopy(_good_coord_sd())
    mutate(sd)
    with pytest.raises(exc, match=pat):
        coord.load_state_dict(sd)
    assert coord.state_dict() == before
    assert [g["lr"] for g in opt.param_groups] == lrs
    assert state.step == before["schedule"]["step"] and state.batch_size == before["schedule"]["batch_size"]


def test_coordinator_good_state_dict_still_loads():
    sd = _good_coord_sd()
    coord, state, _ = _coord()
    coord.load_state_dict(copy.deepcopy(sd))
    assert coord.state_dict() == sd
