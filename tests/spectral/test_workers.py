"""gns_kernels.spectral._workers: per-call single-threaded workers."""
from __future__ import annotations

import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref
from gns_kernels import spectral as sp
from _spectral_data import (METHODS, SHAPES, TOL, grad_with_spectrum, rand_psd, randn,  # noqa: F401
                            rank_deficient, rel_err, samples, sparse_row_covariance, stats_inputs,
                            with_eigenvalues)


def test_worker_threads_do_not_outlive_the_call(gen):
    # idle BLAS worker threads make GNU OpenMP throttle its spinning: every later
    # multi-threaded LAPACK call in the process got ~4x slower (spectral._map_cpu)
    import threading

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        xs = [randn(gen, 200, 300, dtype=torch.float32) for _ in range(3)]
        gk.gram(xs)
        gk.sqrt_trace(torch.stack(gk.gram(xs)), "eigh")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gns_spectral")]


@pytest.mark.parametrize("threads", [1, 2])
def test_map_cpu_is_a_serial_map_and_restores_the_thread_count(threads):
    from gns_kernels.spectral._workers import _map_cpu

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seen = []
        out = _map_cpu(lambda i: (seen.append(torch.get_num_threads()), i * i)[1], list(range(7)))
        assert out == [i * i for i in range(7)]  # input order
        assert seen == [1] * 7 if threads > 1 else seen == [threads] * 7
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(old)
