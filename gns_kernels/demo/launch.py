"""Starting the ranks of one demo run and reporting why they failed.

- Spawned (the default): the launching process opens a `torch.distributed.TCPStore` on
  port 0 (the operating system picks a free port and the store keeps it bound, so no other
  program can take it in between) and starts ``cfg.ranks`` CPU processes
  (torch.multiprocessing, gloo) that join the store as clients.
- torchrun (RANK and WORLD_SIZE set): this process joins the launcher's group (NCCL on
  ``cuda:LOCAL_RANK`` when CUDA is available, gloo otherwise).

Either way the process group gets ``timeout=cfg.timeout`` seconds (``--timeout``), so a
rank that stops responding ends the run in that time instead of torch's 30 minutes.

Failures: each spawned rank that raises writes ``rank<r>.json`` (time, exception type,
message, traceback) into a temporary folder; the launcher reports the EARLIEST one, so the
final line names the real cause (e.g. rank 1's error) and not a peer's consequent
"Connection closed by peer". A rank that ends without a Python exception (killed by a
signal) writes nothing; when it is the failure torch.multiprocessing saw first, it is
named as the cause. A `DemoError` raised in a rank (e.g. a full disk) is re-raised in the
launcher: one line, exit status 2.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from datetime import timedelta

from .config import DemoConfig, DemoError

HOST = "127.0.0.1"


def torchrun_world() -> int | None:
    """WORLD_SIZE under torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def load_corpus_checked(cfg: DemoConfig):
    """The corpus of cfg.corpus; DemoError when missing or too short for --context."""
    from .config import validate_corpus
    from .data import CorpusNotFoundError, load_corpus
    try:
        corpus = load_corpus(cfg.corpus)
    except CorpusNotFoundError as exc:
        raise DemoError(str(exc)) from None
    validate_corpus(cfg, corpus)
    return corpus


def _prepare_folder(cfg: DemoConfig) -> None:
    """Rank 0: remove the folder's stale results, write config.json."""
    for name in ("summary.json", "interrupted.json"):
        if os.path.exists(os.path.join(cfg.out, name)):
            os.remove(os.path.join(cfg.out, name))
    with open(os.path.join(cfg.out, "config.json"), "w") as fh:
        json.dump(asdict(cfg), fh, indent=1)


def _result(cfg: DemoConfig) -> dict | None:
    for name in ("summary.json", "interrupted.json"):
        path = os.path.join(cfg.out, name)
        if os.path.exists(path):
            with open(path) as fh:
                return json.load(fh)
    return None


def launch(cfg: DemoConfig, resume_from: str | None = None) -> dict | None:
    """Run one training run (spawning cfg.ranks CPU processes, or in this process under
    torchrun); returns its summary dict (interrupted.json's content after --stop-at-step),
    None when a rank failed (the cause printed on stderr). DemoError when the cause was a
    DemoError in a rank."""
    corpus = load_corpus_checked(cfg)
    if torchrun_world() is not None:
        _torchrun_worker(cfg, corpus, resume_from)
        return _result(cfg)
    _prepare_folder(cfg)
    import torch.multiprocessing as mp

    store = open_store(cfg.timeout)
    errors = tempfile.mkdtemp(prefix="gns_demo_errors_")
    try:
        mp.spawn(_spawn_worker, args=(cfg.ranks, store.port, cfg, corpus, resume_from, errors),
                 nprocs=cfg.ranks, join=True)
    except Exception as exc:  # a rank failed (or was killed)
        _report_failure(exc, errors)
        return None
    finally:
        shutil.rmtree(errors, ignore_errors=True)
        del store
    return _result(cfg)


def open_store(timeout: float):
    """The rendezvous store of a spawned run, served by this process on a port the system
    picks (port 0) and holds until the store is deleted; the ranks connect to its .port."""
    import torch.distributed as dist

    return dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def first_failure(folder: str) -> dict | None:
    """The earliest failure report (rank<r>.json) in `folder`, None when there is none."""
    reports = []
    for name in os.listdir(folder):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as fh:
                    reports.append(json.load(fh))
            except (OSError, ValueError):
                continue
    return min(reports, key=lambda r: (r["time"], r["rank"])) if reports else None


def _report_failure(exc: BaseException, folder: str) -> None:
    from torch.multiprocessing.spawn import ProcessExitedException

    first = first_failure(folder)
    if isinstance(exc, ProcessExitedException):
        # a rank ended without a Python exception (killed by a signal, or exited): it was
        # the first to end, and the reports of the others are the consequence
        how = (f"was killed by signal {exc.signal_name}" if exc.signal_name
               else f"exited with status {exc.exit_code} without an error message")
        if first is not None:
            print(f"(then rank {first['rank']}: {first['type']}: {first['message']})",
                  file=sys.stderr)
        print(f"gns-kernels demo: error: rank {exc.error_index} {how}", file=sys.stderr)
        return
    if first is None:  # no rank could report: killed by a signal, or died at start-up
        last = str(exc).strip().splitlines()
        print(f"gns-kernels demo: error: a training process failed: {last[-1] if last else exc}",
              file=sys.stderr)
        return
    if first["demo_error"]:
        raise DemoError(first["message"])
    sys.stderr.write(first["traceback"])
    print(f"gns-kernels demo: error: rank {first['rank']} failed first: {first['type']}: "
          f"{first['message']}", file=sys.stderr)


def _write_failure(folder: str, rank: int, exc: BaseException) -> None:
    message = str(exc).strip().splitlines()
    report = {"time": time.time(), "rank": rank, "type": type(exc).__name__,
              "message": message[0] if len(message) == 1 else " ".join(m.strip() for m in message),
              "demo_error": isinstance(exc, DemoError),
              "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
    tmp = os.path.join(folder, f".rank{rank}.json")
    with open(tmp, "w") as fh:
        json.dump(report, fh)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))


def _threads_per_rank(world: int) -> int:
    """Threads of one spawned rank: OMP_NUM_THREADS when it is set to a positive integer
    (several runs side by side), else cpu_count // world (at least 1)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // world)


def _spawn_worker(rank: int, world: int, port: int, cfg: DemoConfig, corpus, resume_from,
                  errors: str):
    import torch
    import torch.distributed as dist

    try:
        from .loop import train

        torch.set_num_threads(_threads_per_rank(world))
        timeout = timedelta(seconds=cfg.timeout)
        store = dist.TCPStore(HOST, port, None, False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            train(cfg, corpus, torch.device("cpu"), resume_from)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        _write_failure(errors, rank, exc)
        raise


def _torchrun_worker(cfg: DemoConfig, corpus, resume_from):
    import torch
    import torch.distributed as dist

    from .loop import train

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout))
    try:
        # every rank has checked --out before rank 0 writes into it
        dist.barrier()
        if dist.get_rank() == 0:
            _prepare_folder(cfg)
        dist.barrier()
        train(cfg, corpus, device, resume_from)
    finally:
        if created:
            dist.destroy_process_group()
