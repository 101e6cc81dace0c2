"""Hook-state checkpoints (gns_kernels/distributed/_checkpoint.py): the state_dict is the
one written before GNSHookState was split into its GNSConfig and its runtime state (keys
and values), and a state_dict written then loads and resumes the same run."""
from __future__ import annotations

import warnings

import pytest
import torch

from gns_kernels.distributed import GNSHookState, MicroBatchGNS

# Two micro-batches per step of exact binary fractions: every statistic is exact.
GRADS = (([[0.5, -0.25], [0.125, 1.0]], [0.75, -0.5]),
         ([[1.0, 0.25], [-0.5, 0.5]], [0.5, 0.25]))
NEXT = (([[0.25, 0.5], [-0.125, 0.75]], [0.5, 0.5]),
        ([[0.75, -0.25], [0.25, 0.25]], [-0.25, 1.0]))

# state_dict() after one measured step of _run(geometry), as the code before the split
# (commit c49a19c) wrote it
F64 = torch.float64
BEFORE = {
    "l1": {
        "geometry": "l1", "eig_float64": {}, "step": 1, "every": 1, "batch_size": 4,
        "pool": {"rank": 0, "world": 1, "owners": {}, "beta": 0.9, "entries": {
            0: {"P": torch.tensor([0.0, 2.25, 2.25, 9.0]), "n": torch.tensor(1.0, dtype=F64),
                "U": torch.tensor(1.0, dtype=F64)},
            1: {"P": torch.tensor([4.0, 6.25]), "n": torch.tensor(1.0, dtype=F64),
                "U": torch.tensor(1.0, dtype=F64)}}}},
    "nuclear": {
        "geometry": "nuclear", "eig_float64": {"2x2": False}, "step": 1, "every": 1,
        "batch_size": 4,
        "pool": {"rank": 0, "world": 1, "owners": {0: 0}, "beta": 0.9, "entries": {
            0: {"P": torch.tensor([[2.25, -4.5], [-4.5, 11.25]]),
                "n": torch.tensor(1.0, dtype=F64), "U": torch.tensor(1.0, dtype=F64),
                "num": torch.tensor(0.0, dtype=F64), "var": torch.tensor(0.0, dtype=F64),
                "npair": torch.tensor(0.0, dtype=F64)}}}},
}


def _state(geometry):
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    mb = MicroBatchGNS([w, b], geometry=geometry, every=1, batch_size=4, micro_batches=2)
    return mb, (w, b)


def _step(mb, params, grads):
    w, b = params
    for gw, gb in grads:
        w.grad, b.grad = torch.tensor(gw), torch.tensor(gb)
        mb.micro_step()
    return mb.estimate


def _assert_same(a, b, path="sd"):
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
def test_state_dict_is_the_one_written_before(geometry):
    mb, params = _state(geometry)
    _step(mb, params, GRADS)
    _assert_same(mb.state_dict(), BEFORE[geometry])


@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
def test_a_state_dict_written_before_loads_and_resumes(geometry):
    ref, ref_params = _state(geometry)
    _step(ref, ref_params, GRADS)
    expected = _step(ref, ref_params, NEXT)

    mb, params = _state(geometry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # no refusal of the pool
        mb.load_state_dict(BEFORE[geometry])
    assert (mb.step, mb.every, mb.batch_size) == (1, 1, 4)
    assert mb.pool_owners == BEFORE[geometry]["pool"]["owners"]
    _assert_same(mb.state_dict(), BEFORE[geometry])   # loads as it was saved
    got = _step(mb, params, NEXT)
    assert got == expected and got.noise_pooled is not None


def test_checkpoints_from_before_the_hints_and_the_pool_load():
    st = GNSHookState("l1", every=5, batch_size=16, params=[torch.nn.Parameter(torch.zeros(3))])
    st.load_state_dict({"step": 10, "every": 2, "batch_size": 8, "geometry": "l1"})
    assert (st.step, st.every, st.batch_size) == (10, 2, 8)
    assert len(st.pool) == 0 and st.pool_owners == {}


def test_a_rejected_state_dict_changes_nothing():
    mb, params = _state("l1")
    _step(mb, params, GRADS)
    before = mb.state_dict()
    bad = dict(BEFORE["l1"], step=-1)
    with pytest.raises(ValueError, match="^state_dict: step: expected an int >= 0"):
        mb.load_state_dict(bad)
    bad = dict(BEFORE["l1"], pool=dict(BEFORE["l1"]["pool"], owners={0: 3}))
    with pytest.raises(ValueError, match="names a rank >= the saved world size 1"):
        mb.load_state_dict(bad)
    with pytest.raises(TypeError, match="^state_dict: expected a dict, got list"):
        mb.load_state_dict([])
    _assert_same(mb.state_dict(), before)


def test_a_pool_of_another_rank_or_beta_is_refused_with_a_warning():
    sd = BEFORE["l1"]
    mb, _ = _state("l1")
    with pytest.warns(RuntimeWarning, match="saved by rank 1 of 2, this is rank 0 of 1"):
        mb.load_state_dict(dict(sd, pool=dict(sd["pool"], rank=1, world=2, owners={})))
    assert len(mb.pool) == 0 and mb.step == 1
    mb, _ = _state("l1")
    with pytest.warns(RuntimeWarning, match="saved with pool_beta 0.5, this state has 0.9"):
        mb.load_state_dict(dict(sd, pool=dict(sd["pool"], beta=0.5)))
    assert len(mb.pool) == 0
