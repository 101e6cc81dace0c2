"""Shared pieces of the multi-rank step-time benchmarks (DDP and FSDP2 overhead).

- ``launch_ranks(rank_main, cfg, world, timeout)``: spawn ``world`` gloo ranks, wait with a
  deadline, return rank 0's result (loaded with ``torch.load(weights_only=True)``).
- ``process_group(rank, world, folder)``: the ranks' gloo group (file store in ``folder``).
- ``timed_step(models, opts, cfg, rank)``: one training step of a named configuration,
  timed with ``time.perf_counter``.
- ``interleaved_times(step, states, ...)``: the timing schedule. Configurations run step
  by step in a rotating order (configuration c's i-th step runs next to the others' i-th
  steps), so drifts of the machine load hit all of them alike. F rows: ``rounds * F``
  steps per configuration with ``state.every = F`` and ``state.step = 0`` (steps 0, F,
  2F, ... measure); F = 1 rows: ``f1_rounds * f1_block`` steps, all measuring.
- ``LiveBytes`` / ``peak_memory(step, states, names)``: peak bytes of the tensor storages
  allocated during a backward that are alive at once, observed through a
  ``TorchDispatchMode`` and weak references to the storages (nothing in the code
  measured is patched or wrapped).
- ``format_tables(times, F, labels, baseline_of)``: the summary tables.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
import weakref
from datetime import timedelta
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "launch_ranks",
    "process_group",
    "save_result",
    "timed_step",
    "interleaved_times",
    "LiveBytes",
    "peak_memory",
    "format_tables",
]


# ----------------------------------------------------------------------------- processes
def launch_ranks(rank_main, cfg: dict, world: int, timeout: float, label: str = "bench overhead") -> dict:
    """Spawn ``world`` processes running ``rank_main(rank, world, folder, cfg)`` (a picklable
    module-level function that writes its result with ``save_result``); wait at most
    ``timeout`` seconds, terminate stragglers, return rank 0's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gns_bench_") as folder:
        ctx = mp.start_processes(rank_main, args=(world, folder, cfg), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=2.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: ranks did not finish in {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(10)
        return torch.load(os.path.join(folder, "result.pt"), weights_only=True)


@contextlib.contextmanager
def process_group(rank: int, world: int, folder: str, timeout_s: float = 600.0):
    """A gloo process group for this rank (file store ``folder/store``), one torch thread
    per rank; destroyed on exit."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_result(rank: int, folder: str, out: dict) -> None:
    """Rank 0 writes ``out`` (tensors, numbers, strings, lists, dicts) to
    ``folder/result.pt``; every rank then waits at a barrier."""
    import torch.distributed as dist

    if rank == 0:
        torch.save(out, os.path.join(folder, "result.pt"))
    dist.barrier()


# ----------------------------------------------------------------------------- timing
def timed_step(models: Mapping, opts: Mapping, cfg: dict, rank: int) -> Callable:
    """step(name, around_backward=None) -> seconds of one training step of configuration
    ``name`` (zero_grad, forward, backward, optimizer step) on random byte tokens from a
    pool of 8 batches of cfg["local_batch"] x cfg["context"] (seeded per rank, cycled
    across all configurations). ``models[name](inputs, targets)`` returns the loss.
    ``around_backward``: a zero-argument callable returning a context manager entered
    around the backward (the memory probe)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    pool = [torch.randint(0, 256, (cfg["local_batch"], cfg["context"] + 1), generator=gen) for _ in range(8)]
    counter = [0]

    def step(name, around_backward=None):
        tok = pool[counter[0] % len(pool)]
        counter[0] += 1
        t0 = time.perf_counter()
        opts[name].zero_grad(set_to_none=True)
        loss = models[name](tok[:, :-1], tok[:, 1:])
        if around_backward is None:
            loss.backward()
        else:
            with around_backward():
                loss.backward()
        opts[name].step()
        return time.perf_counter() - t0

    return step


def interleaved_times(step: Callable, states: Mapping, names: Sequence[str], *, every: int, rounds: int,
                      f1_rounds: int, f1_block: int, warmup: int,
                      f_names: Optional[Iterable[str]] = None) -> tuple[dict, dict]:
    """Run the schedule; return (times, estimates).

    ``states``: name -> GNSHookState of the configurations that measure. ``warmup``
    untimed measuring steps per configuration first. Then the F rows (``f_names``, default
    all ``names``): ``rounds * every`` steps each with ``state.every = every`` from
    ``state.step = 0``; then the F = 1 rows (all ``names``): ``f1_rounds * f1_block`` steps
    each (``every = 1``: only these). Steps of different configurations alternate one by
    one in a rotating order.
    ``times["<name>_F<f>"]``: seconds per step; ``estimates[name]``: [gns, valid] of the
    last estimate (None if none)."""
    names = list(names)
    f_names = names if f_names is None else [n for n in names if n in set(f_names)]
    for st in states.values():
        st.every = 1
    for name in names:
        for _ in range(warmup):
            step(name)
    times = {f"{n}_F{f}": [] for n in names for f in (1, every)}
    phases = [(every, rounds * every, f_names)] if every > 1 else []  # every = 1: the F = 1 rows only
    for f, n_steps, order in phases + [(1, f1_rounds * f1_block, names)]:
        for name in order:
            if name in states:
                states[name].every = f
                states[name].step = 0  # steps 0, f, 2f, ... measure
        for i in range(n_steps):
            for name in order[i % len(order):] + order[:i % len(order)]:
                times[f"{name}_F{f}"].append(step(name))
    estimates = {}
    for name, st in states.items():
        e = st.estimate
        estimates[name] = None if e is None else [float(e.gns), bool(e.valid)]
    return times, estimates


# ----------------------------------------------------------------------------- memory
def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated while this mode is active (on the
    thread that entered it) that are alive at the same time.

    A storage counts from the op that returns it (an output that shares no storage with
    the op's inputs: views, in-place and ``out=`` results are not new memory) with its
    current size, until it is freed or resized to 0 (FSDP2 frees parameter memory that
    way), whichever thread does it: the mode holds only a weak reference to each storage
    and re-reads their sizes at every new allocation, where the peak can only grow.
    Allocations made on other threads (a future's callback running on a gloo thread) and
    memory allocated by resizing a storage (FSDP2's all-gathered parameters) are not
    counted. ``peak``, ``live``: bytes; ``count``: storages counted.
    """

    def __init__(self):
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}  # data_ptr when counted -> the storage
        self.peak = 0
        self.count = 0

    @property
    def live(self) -> int:
        total = 0
        for ptr, ref in list(self._refs.items()):
            s = ref()
            if s is None:
                self._refs.pop(ptr, None)
            else:
                total += s.nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for t in _tensors((args, kwargs or {})):
            s = _storage(t)
            if s is not None:
                inputs.add(s.data_ptr())
        new = False
        for t in _tensors(out):
            s = _storage(t)
            if s is None or s.nbytes() == 0:
                continue
            ptr = s.data_ptr()
            if ptr in inputs:
                continue
            old = self._refs.get(ptr)
            old = None if old is None else old()
            if old is not None and old.data_ptr() == ptr:
                continue  # already counted (an op returning a tensor it allocated earlier)
            self._refs[ptr] = weakref.ref(s)
            self.count += 1
            new = True
        if new:
            self.peak = max(self.peak, self.live)
        return out


def backward_peak_bytes(step: Callable, name: str) -> int:
    """Peak live bytes allocated during the backward of one ``step(name)`` (``LiveBytes``)."""
    box = {}

    def around():
        box["mode"] = LiveBytes()
        return box["mode"]

    step(name, around)
    return box["mode"].peak


def peak_memory(step: Callable, states: Mapping, names: Sequence[str], tries: int = 2) -> dict:
    """name -> peak live bytes allocated during the backward of a measurement step
    (``state.every = 1`` for every measuring configuration), the minimum over ``tries``
    steps (the order of frees on gloo's threads varies run to run)."""
    for st in states.values():
        st.every = 1
    return {name: min(backward_peak_bytes(step, name) for _ in range(tries)) for name in names}


# ----------------------------------------------------------------------------- tables
def format_tables(times: Mapping[str, list], F: int, labels: Mapping[str, str],
                  baseline_of: Mapping[str, str], cost_labels: Mapping[str, str]) -> str:
    """The summary of ``interleaved_times``'s ``times``.

    When "base", "l1" and "s1" all have F = 1 and F rows: the paper's table (mean s/step
    and overhead vs base at F = 1 and F), then for each measuring configuration (named in
    ``cost_labels``) the cost of one measurement step, its mean F = 1 step minus that of
    its baseline (``baseline_of``), and that cost / F (amortized). A per-configuration
    table (``labels``, each relative to its baseline) follows when other configurations
    ran, or replaces the paper's table when one of the three is missing."""
    mean = {k: statistics.fmean(v) for k, v in times.items() if v}
    names = [n for n in labels if f"{n}_F1" in mean]
    lines = []
    main = all(f"{n}_F{f}" in mean for n in ("base", "l1", "s1") for f in (1, F))
    if main:
        lines += ["| F | steps / config | baseline (s/step) | + l1 GNS (s/step) | overhead | + S1 GNS (s/step) | overhead |",
                  "|---|---|---|---|---|---|---|"]
        for f in dict.fromkeys((1, F)):  # F = 1: one row
            b, l1, s1 = mean[f"base_F{f}"], mean[f"l1_F{f}"], mean[f"s1_F{f}"]
            lines.append(f"| {f} | {len(times[f'base_F{f}'])} | {b:.4f} | {l1:.4f} | {100 * (l1 / b - 1):+.1f}% | "
                         f"{s1:.4f} | {100 * (s1 / b - 1):+.1f}% |")
        lines.append("")
        for n in names:
            b = baseline_of.get(n)
            if n not in cost_labels or f"{b}_F1" not in mean:
                continue
            b1 = mean[f"{b}_F1"]
            cost = mean[f"{n}_F1"] - b1
            lines.append(f"One {cost_labels[n]} measurement step costs {cost:+.4f} s over the F=1 baseline "
                         f"({100 * cost / b1:+.1f}%); / {F} = {cost / F:+.6f} s/step "
                         f"({100 * cost / F / b1:+.2f}% at F={F}, amortized).")
    if not main or any(n not in ("base", "l1", "s1") for n in names):
        lines += ["", f"| configuration | F=1 s/step | vs baseline | F={F} s/step | vs baseline | steps (F=1 / F={F}) |",
                  "|---|---|---|---|---|---|"]
        for n in names:
            b = baseline_of.get(n)
            cells = []
            for f in (1, F):
                k, kb = f"{n}_F{f}", f"{b}_F{f}"
                cells.append(f"{mean[k]:.4f}" if k in mean else "-")
                cells.append(f"{100 * (mean[k] / mean[kb] - 1):+.1f}%" if k in mean and kb in mean else "")
            lines.append(f"| {labels[n]} | {' | '.join(cells)} | "
                         f"{len(times.get(f'{n}_F1', []))} / {len(times.get(f'{n}_F{F}', []))} |")
    return "\n".join(lines).strip("\n")
