"""A map over independent matrices on single-threaded CPU worker threads."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def _map_cpu(fn, items: list) -> list:
    """[fn(x) for x in items], one item per task on torch.get_num_threads() worker threads.

    torch's intra-op thread count is set to 1 for the duration of the call and restored
    afterwards (a process-wide setting, so do not call this concurrently with other torch
    work that relies on it). That setting does not reach LAPACK inside the worker threads:
    measured (torch 2.13 CPU, MKL), a worker's float64 eigvalsh gives the bits of a serial
    call at the process's thread count, not those of a serial call under
    torch.set_num_threads(1) (they differ in the last bits). Results are placed by index
    and are the same run to run and whichever worker runs an item; they depend on
    torch.get_num_threads() (one thread: the serial path below).

    The worker threads are started for this call and joined before it returns: none
    outlives the call (an idle thread that has run BLAS stays registered with GNU OpenMP
    and slows later multi-threaded LAPACK calls in the process; bench/RESULTS.md).
    With one thread or one item, fn runs serially on the calling thread.
    """
    n = torch.get_num_threads()
    if n <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=min(n, len(items)), thread_name_prefix="gns_spectral") as pool:
            return list(pool.map(fn, items))
    finally:
        torch.set_num_threads(n)
