"""The one measurement core (gns_kernels/distributed/_measurement.py) under the three
transports: the typed record of the sums, the per-measurement plan, and the transports
as siblings (no transport imports another's private names). Single process."""
from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

import gns_kernels as gk
from gns_kernels.distributed import GNSHookState
from gns_kernels.distributed._measurement import Measurement, ParamPlan, Sums

DIST = pathlib.Path(gk.__file__).parent / "distributed"
TRANSPORTS = ("ddp", "fsdp", "microbatch")


# ------------------------------------------------------------------ Sums
def test_sums_read_calls_callables_in_field_order_and_sums_rows_exactly():
    calls = []

    def value(name, v):
        def f():
            calls.append(name)
            return v
        return f

    g = torch.Generator().manual_seed(3)
    # rows whose float64 sum in any order loses digits: huge and tiny terms of both signs
    rows = torch.randn(37, 5, generator=g, dtype=torch.float64) * torch.tensor([1e16, 1.0, 1e-8, 3.0, 1e8],
                                                                               dtype=torch.float64)
    rows = torch.cat([rows, -rows[:5]])
    sums = Sums(4, 7, l_terms=value("l", rows), nuc_noise=value("n", torch.tensor(2.5, dtype=torch.float64)),
                nuc_signal=value("s", 1.5), nuc_signal_debiased=None, nuclear_dof="columns",
                noise_pooled=value("p", torch.tensor([0.25], dtype=torch.float64)))
    assert sums.on_host()
    out = sums.read()
    assert calls == ["l", "n", "s", "p"]
    want = [math.fsum(c) for c in rows.T.tolist()]  # exactly rounded sums of the columns
    assert out.l_terms.tolist() == want
    assert out.nuc_noise == 2.5 and isinstance(out.nuc_noise, float)
    assert out.nuc_signal == 1.5 and out.nuc_signal_debiased is None
    assert out.noise_pooled.tolist() == [0.25]  # a 1-element 1-d tensor keeps its shape
    assert (out.num_samples, out.step, out.nuclear_dof) == (4, 7, "columns")


def test_sums_on_host_sees_device_values_and_callables():
    class OnDevice:
        device_type = "cuda"

        def __call__(self):
            return 1.0

    assert not Sums(2, 0, nuc_noise=OnDevice()).on_host()
    assert not Sums(2, 0, l_terms=torch.zeros(4, device="meta")).on_host()
    assert Sums(2, 0, l_terms=torch.zeros(4)).on_host()


def test_record_measurement_is_record_of_its_sums():
    """The field-by-field form and the record give the same estimate (the values checked
    against estimate_from_stats, not against the code under test)."""
    a = GNSHookState("l1", every=1, batch_size=16, pool_beta=None)
    b = GNSHookState("l1", every=1, batch_size=16, pool_beta=None)
    terms = torch.tensor([3.0, 2.0, 5.0, 7.0], dtype=torch.float64)
    a.record_measurement(4, terms, None, None, 6)
    b.record(Sums(4, 6, l_terms=terms.clone()))
    ref = gk.stats.estimate_from_stats("l1", 3.0, 2.0, 4, 16, True)
    for st in (a, b):
        assert st.estimate_step == 6
        est = st.estimate
        assert (est.gns, est.noise, est.signal, est.valid) == (ref.gns, ref.noise, ref.signal, ref.valid)


# ------------------------------------------------------------------ the plan
def test_plan_resolves_each_parameter_once_per_measurement():
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5)),
              torch.nn.Parameter(torch.randn(2, 6))]
    shifts = {p: torch.randn(p.shape) for p in params}
    asked = []

    def shift(p):
        asked.append(id(p))
        return shifts[p]

    st = GNSHookState("nuclear", every=1, batch_size=8, shift=shift, params=params[1:])
    plan = st.plan()
    first = [plan.of(p) for p in params]
    again = [plan.of(p) for p in params]
    assert all(x is y for x, y in zip(first, again))
    # params[0] is not in params=, params[1] is not 2-D: only params[2] is measured, and
    # only a measured parameter's shift is asked for, once
    assert [pp.measured for pp in first] == [False, False, True]
    assert asked == [id(params[2])]
    assert first[0].shift is None and torch.equal(first[2].shift, shifts[params[2]])
    # pool keys: positions in params= order; a parameter outside it by identity
    assert first[1].key == 0 and first[2].key == 1 and first[0].key == ("id", id(params[0]))
    assert not any(pp.keep for pp in first)  # only shift="last" keeps the mean
    # a new measurement asks again (a momentum buffer may be a new tensor every step)
    st.plan().of(params[2])
    assert asked == [id(params[2])] * 2


def test_plan_keeps_the_mean_for_shift_last():
    p = torch.nn.Parameter(torch.randn(3, 2))
    st = GNSHookState("l1", every=1, batch_size=8, shift="last")
    plan = st.plan()
    pp = plan.of(p)
    assert pp == ParamPlan(True, None, ("id", id(p)), True)  # the first measurement is unshifted
    mean = torch.randn(6)
    plan.keep_mean(p, pp, mean)
    nxt = st.plan().of(p)
    assert torch.equal(nxt.shift, mean.view(3, 2)) and nxt.shift is st.shift_for(p)


def test_plan_refuses_a_bad_shift_naming_it():
    p = torch.nn.Parameter(torch.randn(3, 2))
    st = GNSHookState("l2", every=1, batch_size=8, shift=lambda q: torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shift: expected a tensor of shape"):
        st.plan().of(p)
    st = GNSHookState("l2", every=1, batch_size=8, shift=lambda q: 1.0)
    with pytest.raises(TypeError, match="shift: expected a tensor"):
        st.plan().of(p)


def test_measurement_scale_and_dof():
    st = GNSHookState("nuclear", every=1, batch_size=24)
    m = Measurement(st, 3, 3, 1)
    assert m.scale == 24 / 2 and m.step == 0 and m.dof == "gauss-sums"
    assert Measurement(st, 3, 6, 1, per_sample=False).dof == "columns"


# ------------------------------------------------------------------ siblings
def _imports(path: pathlib.Path):
    """(module, names) of every import in ``path`` (module relative to the distributed
    package: 'ddp', '_measurement', ... ; '' for other packages)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = (node.module or "") if node.level == 1 else ""
            out.append((mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.append(("", [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transports_are_siblings(transport):
    """No transport imports another (so none of another's private names): what they
    share is in the core."""
    for mod, names in _imports(DIST / f"{transport}.py"):
        assert mod not in TRANSPORTS or mod == transport, f"{transport}.py imports {names} from {mod}.py"
    # the core is below the transports: it imports none of them
    for mod, _ in _imports(DIST / "_measurement.py"):
        assert mod not in TRANSPORTS + ("state",), mod


def test_old_state_dict_still_loads():
    """A state_dict written before the core (no eig_float64, no pool: a checkpoint from
    before the hints and the pool existed) and today's round trip both load."""
    p = torch.nn.Parameter(torch.randn(3, 4))
    st = GNSHookState("nuclear", every=5, batch_size=32, params=[p])
    st.load_state_dict({"step": 10, "every": 5, "batch_size": 64, "geometry": "nuclear"})
    assert (st.step, st.batch_size) == (10, 64)
    sd = st.state_dict()
    assert set(sd) == {"step", "every", "batch_size", "geometry", "eig_float64", "pool"}
    other = GNSHookState("nuclear", every=5, batch_size=32, params=[p])
    other.load_state_dict(sd)
    assert (other.step, other.batch_size) == (10, 64)
