"""Launch a function on W gloo ranks (spawned processes) and collect what each returns.

Robust for CI: rendezvous through a FileStore in a fresh temporary folder (no TCP port
that could collide), a process-group timeout, an overall deadline after which the
children we started are terminated (by their pids), and results passed back as files.
"""
from __future__ import annotations

import os
import tempfile
import warnings
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

PG_TIMEOUT_S = 60


def _entry(rank: int, world: int, folder: str, module: str, fn_name: str, kwargs: dict) -> None:
    import importlib

    import torch.distributed as dist

    torch.set_num_threads(1)
    out = os.path.join(folder, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
            world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
        fn = getattr(importlib.import_module(module), fn_name)
        result = fn(rank, world, **kwargs)
        dist.barrier()
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # report to the parent, then exit non-zero
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(module: str, fn_name: str, world: int, timeout: float = 150.0, **kwargs) -> list:
    """Run ``module.fn_name(rank, world, **kwargs)`` on ``world`` gloo ranks; return the
    per-rank results (a list indexed by rank). Raises AssertionError with the child's
    traceback on failure, TimeoutError after ``timeout`` seconds (children terminated)."""
    with tempfile.TemporaryDirectory(prefix="gns_ddp_") as folder:
        ctx = mp.start_processes(_entry, args=(world, folder, module, fn_name, kwargs),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        failure = None
        try:
            while True:
                try:
                    if ctx.join(timeout=1.0):
                        break
                except Exception as exc:  # a child raised or died
                    failure = exc
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn_name} on {world} ranks did not finish in {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        errors = []
        for r in range(world):
            path = os.path.join(folder, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result")
                continue
            rec = torch.load(path, weights_only=True)
            if rec["ok"]:
                results.append(rec["result"])
            else:
                errors.append(f"rank {r}:\n{rec['error']}")
        if failure is not None and not errors and len(results) == world and _exit_signal(failure):
            # every rank finished, passed the barrier and wrote its result; a rank then died
            # by a signal in teardown (gloo's worker threads at interpreter exit:
            # docs/reliability.md, "Process exit"): the results stand, the crash is reported
            warnings.warn(f"{fn_name} on {world} ranks: a rank died after writing its result "
                          f"({failure})", RuntimeWarning, stacklevel=2)
            return results
        if errors or failure is not None:
            raise AssertionError(f"{fn_name} on {world} ranks failed: {failure}\n" + "\n".join(errors))
        return results


def _exit_signal(failure: BaseException) -> bool:
    """A child killed by a signal (not one that raised or exited with an error code)."""
    return getattr(failure, "signal_name", None) is not None or "terminated with signal" in str(failure)


# ------------------------------------------------------------------ rank-side helpers
def gather_per_rank(tensors):
    """[[rank j's tensor p for p] for j]: all_gather each tensor (call outside counted regions)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out = [[None] * len(tensors) for _ in range(world)]
    for p, t in enumerate(tensors):
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t.contiguous())
        for j in range(world):
            out[j][p] = buf[j]
    return out


def collective_seq() -> int:
    """The default process group's collective sequence number (counts every collective)."""
    import torch.distributed as dist

    return dist.group.WORLD._get_sequence_number_for_group()


def run_scenarios(fn, rank, world, scenarios: dict) -> dict:
    """{name: fn(rank, world, **kwargs)} for each scenario, in one process group (a barrier
    after each): the workers' run_many."""
    import torch.distributed as dist

    out = {}
    for name, kwargs in scenarios.items():
        out[name] = fn(rank, world, **kwargs)
        dist.barrier()
    return out


def rel(a, b) -> float:
    """|a - b| / |b| (b = 0: / 1e-300) of two numbers."""
    return abs(a - b) / max(abs(b), 1e-300)


# the hooks' estimate vs gk.estimate on the all-gathered local gradients (float32 hooks;
# the nuclear solves' tolerances): test_fsdp, test_hsdp, test_tp
GATHERED_TOL = {"l2": 1e-5, "l1": 1e-5, "nuclear": 1e-3}


def scenario_records(results: list, name: str) -> list:
    """Every rank's result of scenario ``name`` (``run_scenarios`` output per rank)."""
    return [r[name] for r in results]


def check_estimates_agree(records, mesh: str, expected: str, tol: float, ref_tol=None) -> int:
    """The estimates (gns, noise, signal, valid, noise_pooled) of every measuring record:
    ``est[mesh]`` within ``tol`` relative of ``est[expected]`` (None on both for a lagged
    route), and, with ``ref_tol``, of ``ref`` (gk.estimate on the gathered gradients).
    Returns how many were compared (a test asserts it is at least one)."""
    checked = 0
    for rec in records:
        if not rec["measuring"]:
            continue
        a, b = rec["est"][mesh], rec["est"][expected]
        assert (a is None) == (b is None), rec["est"]  # the host route: both lag alike
        if a is None:
            continue
        assert a[3] and b[3], (a, b)
        for i, what in enumerate(("gns", "noise", "signal")):
            assert rel(a[i], b[i]) < tol, (what, a[i], b[i])
        if a[4] is not None or b[4] is not None:
            assert rel(a[4], b[4]) < tol, ("noise_pooled", a[4], b[4])
        if ref_tol is not None:
            for i in range(3):
                assert rel(a[i], rec["ref"][i]) < ref_tol, (i, a, rec["ref"])
        checked += 1
    return checked


def same_state(a, b, where: str = "") -> None:
    """Equal nested states (tensors bit for bit, NaN equal to NaN); AssertionError naming
    the first path that differs."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{where}/{i}")
    else:
        assert a == b or (a != a and b != b), (where, a, b)
