"""The module path of a measurement: how many package functions and modules it passes
through, and how often it returns to a module it already left (issue 42).

Usage: ``python bench/trace_path.py [path name ...]`` (CPU, a few seconds). Prints, for
each traced path, ``functions / modules / returns`` twice (every module counted; the
spectral solver as one visit, below) and the module path; for the micro-batch l1
measurement also which checks saw its tensor lists and how often (``validations``).

Paths traced (CPU tensors, the default settings unless said: pool on, signal 'raw', bias
correction on, method 'auto'):

- ``micro l1`` / ``micro nuclear``: one MicroBatchGNS measurement on one rank, the call of
  ``MicroBatchGNS._measure_local`` at the last micro-step of a measured step (A = 4
  micro-batches of a 16-24-8 two-layer MLP), from its first line until it returns (the
  sums recorded on the state).
- ``ddp-record l1`` / ``ddp-record nuclear``: the DDP comm hook's state after it records a
  measurement. A 1-process gloo DDP with a MicroBatchGNS as its hook state (one rank
  measures only with micro-batches as the samples; GNSHookState's record and estimate are
  the same code) runs a measured step; the ``Sums`` the hook hands to ``state.record`` is
  taken, and the trace runs ``state.record(sums)`` and then the first read of
  ``state.estimate``, which forms the GNSEstimate (``Sums.read``: the device values, the
  share / pool totals; the eigensolver hints; ``estimate_from_sums``).

Each path is traced at the SECOND measurement of its object (the first one, and a read of
its estimate, run untraced first: imports done, the noise pool holding its entries,
nothing pending), i.e. the steady state of a run.

Counting method (``trace``, ``count``):

1. ``sys.setprofile`` sees every Python call on the calling thread while the traced
   callable runs (work that the spectral solver hands to its worker threads is not seen).
   A call counts when its function's module (``f_globals['__name__']``) is
   ``gns_kernels`` or below.
2. A function is identified by (module, name, first line) and recorded at its FIRST call
   only, in order: a loop over parameters or pool keys, or a leaf called again, adds
   nothing. Not recorded: module bodies (``<module>``: imports) and list / dict / set
   comprehensions (``<listcomp>``, ``<dictcomp>``, ``<setcomp>``: Python 3.12 inlines them
   into their function, PEP 709, so counting them would make the numbers depend on the
   Python version); lambdas and generator expressions are functions and count.
3. The module path is the recorded sequence's modules with consecutive repeats collapsed.
   ``functions`` = number of recorded functions, ``modules`` = number of distinct modules,
   ``returns`` = number of path entries whose module appears earlier in the path (the path
   enters a module it had already left).
4. Solver as one visit (the second count): a call into ``gns_kernels.spectral`` from
   outside it is recorded as one visit of the module ``gns_kernels.spectral`` (the
   solver: sqrt-traces, Grams, the eigen / Newton paths, their checks and hints), and
   nothing is recorded until that call returns (its internals, and any callback of ours
   it runs, are the solver's business). Every other module counts as in the full count,
   including the distributed shared solve (``distributed._share``,
   ``distributed._share_solve``), which is this package's orchestration of the solver,
   not the solver.

The micro-batch nuclear measurement (pool on) goes through the solve it shares with the
DDP and FSDP2 hooks: ``distributed._share`` (the share: assignment, the parts' columns,
the stream, the vector) and ``distributed._share_solve`` (its solver: the kept matrices,
the solver's arguments, the one block of solver calls, the rows), each entered once per
stage (construction, a part, the launch), then the solver once; counting the solver's
internals, most of its returns are inside the solver's call (``spectral``'s modules and
the ``stats`` modules it calls: ``bias``, ``dof``, ``pooled``, ``pool``).

The tests (tests/test_trace_path.py) bound the returns at <= 6: the first count for the
micro-batch l1 measurement and for the DDP state's path after record (l1 and nuclear),
the second (the solver as one visit, which it enters once) for the micro-batch nuclear
measurement. They also check, with ``validations`` (every call of a
``gns_kernels._validation`` function or of a package function named like a check, with
the tensor lists among its arguments), that the micro-batch measurement's two tensor
lists are each checked once, by one entry.
Measured counts: bench/RESULTS.md, "The module path of a measurement".
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from typing import Callable, NamedTuple, Optional

import torch

PACKAGE = "gns_kernels"
SOLVER = "gns_kernels.spectral"
SKIPPED = frozenset({"<module>", "<listcomp>", "<dictcomp>", "<setcomp>"})


class Trace(NamedTuple):
    """The first-visit record of a traced call: ``functions`` as (module, name, first
    line) in order of first call, and ``calls`` the number of calls of each (all calls,
    not only the first)."""

    functions: list
    calls: dict


class Count(NamedTuple):
    functions: int
    modules: int
    returns: int
    path: list


def trace(fn: Callable[[], object], solver_opaque: bool = False) -> Trace:
    """Run ``fn()`` under the profiler and record the package functions it calls (the
    module docstring's method; ``solver_opaque``: its step 4)."""
    seen: dict = {}
    order: list = []
    inside: list = []  # the frame of the solver call in progress (solver_opaque)

    def prof(frame, event, arg):
        if inside:
            if event == "return" and frame is inside[0]:
                inside.clear()
            return
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not (mod == PACKAGE or mod.startswith(PACKAGE + ".")):
            return
        code = frame.f_code
        if code.co_name in SKIPPED:
            return
        if solver_opaque and (mod == SOLVER or mod.startswith(SOLVER + ".")):
            inside.append(frame)
            key = (SOLVER, code.co_name, code.co_firstlineno, mod)
        else:
            key = (mod, code.co_name, code.co_firstlineno)
        if key not in seen:
            seen[key] = 0
            order.append(key)
        seen[key] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return Trace(order, seen)


CHECK_WORDS = ("check", "validat")
VALIDATION = "gns_kernels._validation"


def validations(fn: Callable[[], object]) -> list:
    """The package's checks that ``fn()`` runs, in call order: (module, function, lists) for
    every call of a function of ``gns_kernels._validation`` or of a package function whose
    name contains 'check' or 'validat' (not 'unchecked'), lists being the tensor lists
    among its arguments, each as the tuple of its tensors' ids (the tests count how often
    each list is checked)."""
    calls: list = []

    def prof(frame, event, arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        code = frame.f_code
        if not (mod == PACKAGE or mod.startswith(PACKAGE + ".")):
            return
        named = any(w in code.co_name for w in CHECK_WORDS) and "unchecked" not in code.co_name
        if not (named or mod == VALIDATION) or code.co_name in SKIPPED:
            return
        nargs = code.co_argcount + code.co_kwonlyargcount
        lists = []
        for name in code.co_varnames[:nargs]:
            v = frame.f_locals.get(name)
            if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
                lists.append(tuple(id(t) for t in v))
        calls.append((mod, code.co_name, tuple(lists)))

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def count(t: Trace) -> Count:
    """functions, modules, returns and the module path of a trace (module docstring)."""
    path: list = []
    for key in t.functions:
        if not path or path[-1] != key[0]:
            path.append(key[0])
    returns, earlier = 0, set()
    for m in path:  # consecutive entries differ: one that appeared earlier was left since
        returns += m in earlier
        earlier.add(m)
    return Count(len(t.functions), len({k[0] for k in t.functions}), returns, path)


# ----------------------------------------------------------------------------- drivers
def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))


def micro_measurement(geometry: str, solver_opaque: bool = False, tracer: Optional[Callable] = None,
                      **kw):
    """The trace of the second measurement's ``MicroBatchGNS._measure_local`` (one rank,
    A = 4; ``kw``: more MicroBatchGNS arguments); ``tracer(fn)``: another record of the
    call than ``trace`` (e.g. ``validations``)."""
    import gns_kernels as gk

    model = _model()
    mb = gk.MicroBatchGNS(list(model.parameters()), geometry=geometry, every=1, batch_size=16,
                          micro_batches=4, **kw)
    gen = torch.Generator().manual_seed(1)
    orig = mb._measure_local
    out: list = []

    def traced(*args, **kwargs):
        call = lambda: orig(*args, **kwargs)  # noqa: E731
        out.append(trace(call, solver_opaque) if tracer is None else tracer(call))

    for step in range(2):
        if step == 1:
            mb._measure_local = traced
        for a in range(4):
            (model(torch.randn(4, 16, generator=gen)).pow(2).mean() / 4).backward()
            mb.micro_step()
        mb.estimate  # noqa: B018 -- read: nothing pending at the next measurement
        model.zero_grad(set_to_none=True)
    del mb._measure_local
    return out[0]


@contextlib.contextmanager
def _one_process_group():
    """A 1-process gloo group (FileStore in a fresh folder), destroyed on exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("trace_path: a process group is already initialized")
    with tempfile.TemporaryDirectory(prefix="trace_path_") as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                                rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def ddp_record(geometry: str, solver_opaque: bool = False, **kw) -> Trace:
    """The trace of ``state.record(sums)`` and the first read of ``state.estimate`` for the
    second measurement of a 1-process gloo DDP whose comm hook state is a MicroBatchGNS
    (A = 3; ``kw``: more MicroBatchGNS arguments)."""
    import gns_kernels as gk
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _one_process_group():
        model = _model()
        mb = gk.MicroBatchGNS(list(model.parameters()), geometry=geometry, every=1, batch_size=12,
                              micro_batches=3, **kw)
        ddp = DDP(model)
        ddp.register_comm_hook(mb, gk.ddp_gns_hook)
        gen = torch.Generator().manual_seed(2)
        taken: list = []
        for step in range(2):
            if step == 1:
                mb.record = taken.append  # the hook's record, kept for the trace
            for a in range(3):
                with (ddp.no_sync() if a < 2 else contextlib.nullcontext()):
                    (ddp(torch.randn(4, 16, generator=gen)).pow(2).mean() / 3).backward()
                mb.micro_step()
            if step == 0:
                mb.estimate  # noqa: B018
            model.zero_grad(set_to_none=True)
        del mb.record
        (sums,) = taken

        def after_record():
            mb.record(sums)
            mb.estimate  # noqa: B018

        t = trace(after_record, solver_opaque)
        del ddp
    return t


PATHS = {
    "micro l1": lambda opaque: micro_measurement("l1", opaque),
    "micro nuclear": lambda opaque: micro_measurement("nuclear", opaque),
    "ddp-record l1": lambda opaque: ddp_record("l1", opaque),
    "ddp-record nuclear": lambda opaque: ddp_record("nuclear", opaque),
}


def _short(m: str) -> str:
    return m[len(PACKAGE) + 1:] if m.startswith(PACKAGE + ".") else m


def list_checks(calls: list) -> dict:
    """{(module, function): [number of its calls that received each tensor list, ...]}
    from ``validations``' record: which checks saw the measurement's tensor lists, and
    how often each."""
    seen: dict = {}
    for mod, name, lists in calls:
        for ids in lists:
            seen.setdefault((mod, name), {}).setdefault(ids, 0)
            seen[(mod, name)][ids] += 1
    return {k: sorted(v.values()) for k, v in seen.items()}


def report(names: Optional[list] = None) -> None:
    for name in names or list(PATHS):
        full = count(PATHS[name](False))
        opaque = count(PATHS[name](True))
        print(f"{name}: functions / modules / returns {full.functions} / {full.modules} / "
              f"{full.returns}; solver as one visit {opaque.functions} / {opaque.modules} / "
              f"{opaque.returns}")
        print("    " + " > ".join(_short(m) for m in full.path))
        if opaque.path != full.path:
            print("    solver as one visit: " + " > ".join(_short(m) for m in opaque.path))
        if name == "micro l1":
            checks = list_checks(micro_measurement("l1", tracer=validations))
            print("    checks that saw its tensor lists (calls per list): " + ", ".join(
                f"{_short(m)}.{f} {n}" for (m, f), n in checks.items()))


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    report(sys.argv[1:] or None)
