"""The module path of a measurement (issue 42), counted by bench/trace_path.py (its module
docstring states the method): the micro-batch l1 measurement, the micro-batch nuclear
measurement (the spectral solver as one visit) and the DDP hook state's path after record
return to a module they already left at most 6 times, and the micro-batch
measurement checks its tensor lists once (one check entry, each list seen once by each
check; no check in the ops face or the Triton launcher). On the code before issue 42's
part D the micro-batch l1 path made 21 returns and checked the mean-gradient list twice;
before the shared solve's restructuring the nuclear path made 14 (the solver visited 4
times)."""
from __future__ import annotations

import importlib.util
import pathlib
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_RETURNS = 6


@pytest.fixture(scope="module")
def tp():
    spec = importlib.util.spec_from_file_location("trace_path", REPO / "bench" / "trace_path.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_micro_batch_l1_measurement_path(tp):
    c = tp.count(tp.micro_measurement("l1"))
    assert c.returns <= MAX_RETURNS, " > ".join(c.path)
    # the measurement reads its settings once and calls leaves that do not call back: the
    # state, its configuration and its schedule each appear once before the record
    assert c.path[0] == "gns_kernels.distributed.microbatch"
    assert c.path[-1] == "gns_kernels.distributed.state"  # the record
    body = c.path[:-1]
    for mod in ("gns_kernels.distributed.state", "gns_kernels.distributed.config", "gns_kernels.schedule"):
        assert body.count(mod) == 1, " > ".join(c.path)


def test_micro_batch_nuclear_measurement_path(tp):
    """The micro-batch nuclear measurement (one rank, the noise pool on: the shared solve),
    the spectral solver counted as one visit: the shared solve keeps the matrices and
    prepares the solver's arguments in its solver module, then calls the solver in one
    block."""
    c = tp.count(tp.micro_measurement("nuclear", solver_opaque=True))
    assert c.returns <= MAX_RETURNS, " > ".join(c.path)
    assert c.path.count(tp.SOLVER) == 1, " > ".join(c.path)
    assert c.path[-1] == "gns_kernels.distributed.state"  # the record


@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
def test_ddp_state_path_after_record(tp, geometry):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gloo on one process may warn about its device
        c = tp.count(tp.ddp_record(geometry))
    assert c.returns <= MAX_RETURNS, " > ".join(c.path)
    assert c.path[0] == "gns_kernels.distributed.state"


def test_micro_batch_measurement_checks_its_lists_once(tp):
    calls = tp.micro_measurement("l1", tracer=tp.validations)
    checks = tp.list_checks(calls)
    for (mod, fn), per_list in checks.items():
        assert all(n == 1 for n in per_list), f"{fn} saw a list {max(per_list)} times: {checks}"
        assert mod == "gns_kernels._validation", f"{mod}.{fn} checked the lists again: {checks}"
    # the mean gradients and the mean squares: each checked once, by one entry
    assert checks[("gns_kernels._validation", "check_list")] == [1, 1], checks
    entry = [c for c in calls if c[1] == "check_vn_lists"]
    assert len(entry) == 1 and len(entry[0][2]) == 2, checks


def test_count_method(tp):
    """returns: entries of the collapsed module path whose module appeared earlier;
    functions and modules: first visits only."""
    t = tp.Trace([("a", "f", 1), ("a", "g", 2), ("b", "h", 3), ("a", "i", 4), ("c", "j", 5),
                  ("b", "k", 6), ("b", "l", 7)], {})
    c = tp.count(t)
    assert c.path == ["a", "b", "a", "c", "b"] and c.returns == 2
    assert (c.functions, c.modules) == (7, 3)
