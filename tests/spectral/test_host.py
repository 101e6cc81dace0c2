"""The host route (issue 43): spectral.host's float64 eigenvalue sums on the calling thread
and on a HostJob's background thread, HostConfig, and nuclear_stats / sqrt_trace with
method "host" against independent float64 references."""
from __future__ import annotations

import dataclasses
import math
import random
import threading
import time

import pytest
import torch

import gns_kernels as gk
from gns_kernels import spectral as sp
from gns_kernels.spectral import host
from _spectral_data import SHAPES, rank_deficient, rand_psd, randn, samples, stats_inputs


def _ref_sums(A: torch.Tensor, pair: bool) -> torch.Tensor:
    """[tr A_+^{1/2}, pair sum, tr A, ||A||_F^2] in float64, written out independently:
    the pair sum as the full k x k table, tr A and ||A||_F^2 from the entries."""
    x = A.double()
    lam = torch.linalg.eigvalsh(0.5 * (x + x.T))
    s = lam.clamp_min(0).sqrt()
    den = s[:, None] + s[None, :]
    tab = torch.where(den > 0, s[:, None] * s[None, :] / torch.where(den > 0, den, 1.0), 0.0)
    return torch.stack([s.sum(), tab.sum() if pair else torch.zeros((), dtype=torch.float64),
                        x.diagonal().sum(), (x * x).sum()])


def _mats(gen):
    """Odd sizes, rank-deficient, float32 and float64, one indefinite (a subtraction's)."""
    X = randn(gen, 21, 40)
    return [rand_psd(gen, 1, 1.0), rand_psd(gen, 7, 1e3, torch.float32), rand_psd(gen, 33, 1e6),
            rank_deficient(gen, 65, 5), rank_deficient(gen, 40, 3).float(), X @ X.T - X[:, :38] @ X[:, :38].T,
            1e-200 * rand_psd(gen, 9, 10.0)]


def test_host_eigen_sums_match_an_independent_float64_reference(gen):
    mats = _mats(gen)
    pair = [i % 2 == 0 for i in range(len(mats))]
    got = sp.host_eigen_sums(mats, pair)
    assert got.shape == (4, len(mats)) and got.dtype == torch.float64 and got.device.type == "cpu"
    for i, (A, p) in enumerate(zip(mats, pair)):
        want = _ref_sums(A, p)
        scale = A.double().abs().max().item() * A.shape[0]  # >= ||A||_2 (no squares: 1e-200 stays)
        assert abs(got[0, i] - want[0]) <= 1e-12 * want[0].abs() + 1e-300, i
        assert abs(got[1, i] - want[1]) <= 1e-12 * want[1].abs() + 1e-300, i
        if not p:
            assert got[1, i] == 0
        assert abs(got[2, i] - want[2]) <= 1e-12 * scale, i  # the sum of the eigenvalues
        assert abs(got[3, i] - want[3]) <= 1e-12 * want[3], i
    # the same bits without the pair sums asked for (rows 0, 2, 3)
    assert torch.equal(sp.host_eigen_sums(mats)[[0, 2, 3]], got[[0, 2, 3]])


def test_host_eigen_sums_nonfinite_empty_and_bad_flags(gen):
    A = rand_psd(gen, 6, 10.0)
    bad, inf = A.clone(), A.clone()
    bad[2, 3] = math.nan
    inf[0, 0] = math.inf
    got = sp.host_eigen_sums([A, bad, torch.zeros(0, 0), inf], [True] * 4)
    assert torch.isnan(got[:, 1]).all() and torch.isnan(got[:, 3]).all()
    assert torch.equal(got[:, 2], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(got[:, 0], sp.host_eigen_sums([A], [True])[:, 0])  # isolated
    assert sp.host_eigen_sums([]).shape == (4, 0)
    with pytest.raises(ValueError, match="^pair:"):
        sp.host_eigen_sums([A, A], [True])
    with pytest.raises(ValueError, match="^pair:"):
        sp.host_eigen_sums([A], [1])


def _host_threads():
    return [t for t in threading.enumerate() if t.name.startswith("gns_host")]


def test_host_job_is_bit_identical_under_injected_delays(gen, monkeypatch):
    """Random per-matrix delays (two jobs at once, their items interleaved differently each
    time) change nothing: the same bits as an undelayed job. (Against host_eigen_sums on the
    calling thread the values agree to rounding, not always in bits: LAPACK's thread count
    in a worker follows MKL's process setting, the calling thread's follows its own, and
    earlier torch.set_num_threads calls of the process can make them differ.)"""
    mats = [rand_psd(gen, k, 1e6) for k in (64, 3, 96, 17, 128, 64)] + [rank_deficient(gen, 80, 7)]
    pair = [True, False, True, True, False, True, True]
    want = sp.HostJob(mats, pair=pair).result()
    here = sp.host_eigen_sums(mats, pair)
    assert torch.allclose(want, here, rtol=1e-12, atol=1e-12 * float(here.abs().max()))
    rnd = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    lock = threading.Lock()

    def delay(i):
        with lock:
            return rnd.uniform(0.0, 0.02)

    monkeypatch.setattr(host, "_DELAY", delay)
    for _ in range(3):
        a, b = sp.HostJob(mats, pair=pair), sp.HostJob(mats[::-1], pair=pair[::-1])
        ra, rb = a.result(), b.result()
        assert torch.equal(ra, want) and torch.equal(rb, want.flip(1))
        assert a.done() and b.done() and not a.cancelled()
    assert _host_threads() == []  # no idle thread outlives its job


def test_host_job_runs_on_its_own_thread_after_the_event(gen, monkeypatch):
    """The event is waited on by the worker (named gns_host-<id>), not by the caller; the
    caller goes on while the job runs; no thread is left after result()."""
    seen = []
    release = threading.Event()

    class Event:  # a CUDA event stand-in: synchronize() blocks until the copy is done
        def synchronize(self):
            seen.append(threading.current_thread().name)
            release.wait(5.0)

    A = rand_psd(gen, 24, 1e3)
    job = sp.HostJob([A, A], pair=[True, False], event=Event())
    time.sleep(0.05)
    assert not job.done()  # waiting on the event; the caller is free
    release.set()
    got = job.result(timeout=30)
    assert seen == [f"gns_host-{job.id}"]
    assert torch.equal(got, sp.host_eigen_sums([A, A], [True, False]))
    assert job.done() and _host_threads() == []


def test_host_job_cancel_stops_between_items(gen, monkeypatch):
    monkeypatch.setattr(host, "_DELAY", lambda i: 0.2)
    A = rand_psd(gen, 16, 10.0)
    job = sp.HostJob([A] * 20)
    job.cancel()
    t0 = time.perf_counter()
    with pytest.raises(sp.HostJobCancelled, match="cancelled before its last item"):
        job.result(timeout=30)
    assert time.perf_counter() - t0 < 2.0  # at most the item in progress, not the 20 x 0.2 s
    assert job.cancelled() and job.done() and _host_threads() == []
    # a cancel after the end changes nothing
    monkeypatch.setattr(host, "_DELAY", None)
    done = sp.HostJob([A])
    want = done.result()
    done.cancel()
    assert torch.equal(done.result(), want) and not done.cancelled()


def test_host_job_reraises_the_workers_exception_and_times_out(monkeypatch):
    def fn(x):
        if x == 2:
            raise ValueError("item 2 is bad")
        return x * 10

    assert sp.HostJob([0, 1, 3], fn).result() == [0, 10, 30]
    job = sp.HostJob([0, 1, 2, 3], fn)
    with pytest.raises(ValueError, match="item 2 is bad"):
        job.result()
    assert job.done() and _host_threads() == []
    monkeypatch.setattr(host, "_DELAY", lambda i: 0.5)
    slow = sp.HostJob([0, 1], fn)
    with pytest.raises(TimeoutError):
        slow.result(timeout=0.05)
    assert slow.result() == [0, 10]
    with pytest.raises(ValueError, match="^pair:"):
        sp.HostJob([0], fn, pair=[True])
    with pytest.raises(ValueError, match="^fn:"):
        sp.HostJob([0], 3)


def test_host_config_is_a_frozen_validated_config():
    cfg = sp.HostConfig()
    assert cfg.method == "host" and cfg.max_pending == 1 and cfg == sp.HostConfig(max_pending=1)
    assert sp.HostConfig(max_pending=3).max_pending == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_pending = 2
    with pytest.raises(TypeError):
        sp.HostConfig(2)  # keyword-only
    for bad in (0, -1, 1.0, True, "1", None):
        with pytest.raises(ValueError, match="^max_pending:"):
            sp.HostConfig(max_pending=bad)
    assert "HostConfig" in sp.__all__ and "HostConfig" not in gk.__all__


def test_sqrt_trace_host_is_float64_eigvalsh(gen):
    A = torch.stack([rand_psd(gen, 20, c, torch.float32) for c in (1.0, 1e4, 1e7)])
    A[1] = A[1] + 1e-3 * torch.triu(torch.ones(20, 20))  # not symmetric: (A + A^T)/2 is solved
    got = gk.sqrt_trace(A, "host")
    assert got.dtype == torch.float32 and got.shape == (3,)
    want = torch.stack([torch.linalg.eigvalsh(0.5 * (a + a.T)).clamp_min(0).sqrt().sum()
                        for a in A.double()])
    assert torch.allclose(got.double(), want, rtol=1e-7, atol=0)
    assert torch.equal(gk.sqrt_trace(A, "host"), gk.sqrt_trace(A, method=sp.HostConfig()))
    A64 = A.double()
    assert torch.allclose(gk.sqrt_trace(A64, "host"), want, rtol=1e-13, atol=0)
    bad = A.clone()
    bad[2, 0, 0] = math.nan
    out = gk.sqrt_trace(bad, "host")
    assert torch.isnan(out[2]) and torch.equal(out[:2], got[:2])
    assert gk.sqrt_trace(torch.zeros(2, 0, 0), "host").shape == (2,)
    assert gk.sqrt_trace(torch.zeros(0, 4, 4), "host").shape == (0,)


# ---- nuclear_stats(method="host") --------------------------------------------------------
SH = SHAPES + [(0, 5), (9, 31)]  # an empty side, an odd size
EIGH64 = sp.EighConfig(tol=0.0)  # the eigh route solving every matrix in float64: the reference


def _ref_noise(mean_grams, mean_grads, scale, shifts=None):
    """float64 per layer: the covariance C = scale (A - D D^T) formed in float64 from the
    float32 inputs, on the side of the mean Gram."""
    out = []
    for A, D in zip(mean_grams, mean_grads):
        k = A.shape[-1]
        D64 = D.double()
        dd = D64 @ D64.T if D.shape[0] == k else D64.T @ D64
        out.append(scale * (A.double() - dd))
    return out


def test_nuclear_stats_host_matches_float64_eigh(gen):
    """raw, corrected, sums, covariances, the debiased signal, shifts: within 1e-10 of the
    eigh route solving in float64 (sums) and of an independent float64 computation."""
    R, B = 3, 24
    layers = samples(gen, R, SH)
    shifts = [None if l % 3 == 0 else 0.1 * randn(gen, *s[0].shape, dtype=torch.float32)
              for l, s in enumerate(layers)]
    mean_grams, mean_grads = stats_inputs(layers, shifts)
    scale = B / (R - 1)
    L = len(SH)
    req = sp.NuclearRequest(sums=True, covariances=True)
    kw = dict(scale=scale, shifts=shifts, bias_correction=True, num_samples=R, batch_size=B)
    h = gk.nuclear_stats(mean_grams, mean_grads, method="host", request=req, **kw)
    e = gk.nuclear_stats(mean_grams, mean_grads, method=EIGH64, request=req, **kw)
    assert h.used64 is None and bool(e.used64[[l for l in range(L) if SH[l][0]]].all())
    assert h.sums.dtype == torch.float64 and h.sums.shape == (4, L)
    assert torch.allclose(h.sums, e.sums, rtol=1e-10, atol=0)
    assert torch.allclose(h.noise, e.noise, rtol=1e-6, atol=0) and torch.allclose(h.signal, e.signal, rtol=1e-6, atol=0)
    for (l, C), (l2, C2) in zip(h.covariances, e.covariances):
        assert l == l2 and torch.equal(C, C2)
    # independent: C formed here in float64; the signal ||D + S||_S1 by float64 SVD
    for l, C in enumerate(_ref_noise(mean_grams, mean_grads, scale)):
        if C.shape[-1] == 0:
            assert h.sums[:, l].eq(0).all() and h.noise[l] == 0 and h.signal[l] == 0
            continue
        want = _ref_sums(C, True)
        assert torch.allclose(h.sums[:2, l], want[:2], rtol=1e-10, atol=0), l
        G = mean_grads[l].double() + (shifts[l].double() if shifts[l] is not None else 0.0)
        assert abs(h.signal[l].item() - torch.linalg.svdvals(G).sum().item()) <= 1e-5 * h.signal[l].item(), l
    # the correction from the eigenvalues: the eigh route's (and stats.bias's) value
    cor = gk.nuclear_stats(mean_grams, mean_grads, method="host", **kw)
    cor_e = gk.nuclear_stats(mean_grams, mean_grads, method=EIGH64, **kw)
    assert torch.allclose(cor[0], cor_e[0], rtol=1e-6, atol=0) and torch.equal(cor[1], h.signal)
    from gns_kernels.stats.bias import nuclear_sqrt_trace_corrected
    for l, C in enumerate(_ref_noise(mean_grams, mean_grads, scale)):
        if C.shape[-1]:
            other = SH[l][1] if SH[l][0] <= SH[l][1] else SH[l][0]
            want = nuclear_sqrt_trace_corrected(torch.linalg.eigvalsh(C), R, B, other_dim=other)
            assert abs(cor[0][l].item() - want.item()) <= 1e-6 * want.item(), l
    # the debiased signal
    deb = gk.nuclear_stats(mean_grams, mean_grads, method="host", signal="debiased", **kw)
    deb_e = gk.nuclear_stats(mean_grams, mean_grads, method=EIGH64, signal="debiased", **kw)
    assert torch.allclose(deb[1], deb_e[1], rtol=1e-6, atol=0)


def test_nuclear_stats_host_gram_form_and_select(gen):
    R, B = 2, 16
    layers = samples(gen, R, SH)
    mean_grams, mean_grads = stats_inputs(layers)
    from gns_kernels.spectral.grams import grams64_on_sides
    sides = ["row" if D.shape[0] <= D.shape[1] else "col" for D in mean_grads]
    dd = grams64_on_sides(mean_grads, sides)
    shapes = [tuple(D.shape) for D in mean_grads]
    L = len(SH)
    full = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method="host", request=sp.NuclearRequest(sums=True))
    g = gk.nuclear_stats(mean_grams, mean_grad_grams=dd, shapes=shapes, scale=B / (R - 1), method="host",
                         request=sp.NuclearRequest(sums=True))
    assert torch.equal(g.sums, full.sums) and torch.equal(g.noise, full.noise) and torch.equal(g.signal, full.signal)
    sel_n = [l % 2 == 0 for l in range(L)]
    sel_s = [l % 3 != 1 for l in range(L)]
    part = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method="host",
                            request=sp.NuclearRequest(select=(sel_n, sel_s), sums=True))
    for l in range(L):
        assert part.noise[l] == (full.noise[l] if sel_n[l] else 0)
        assert part.signal[l] == (full.signal[l] if sel_s[l] else 0)
        assert torch.equal(part.sums[:, l], full.sums[:, l] if sel_n[l] else torch.zeros(4, dtype=torch.float64))
    none = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method="host",
                            request=sp.NuclearRequest(select=([False] * L, [False] * L), sums=True))
    assert none.noise.eq(0).all() and none.signal.eq(0).all() and none.sums.eq(0).all()
    # eig_hints: the host route records nothing (no float32 attempt to learn from)
    hints = sp.EigHints()
    gk.nuclear_stats(mean_grams, mean_grad_grams=dd, shapes=shapes, scale=B / (R - 1), method="host",
                     eig_hints=hints)
    assert hints.state_dict() == sp.EigHints().state_dict()


def test_nuclear_stats_host_pool_fold_matches_newton(gen):
    """pool_fold on the host route: the same contract as on the Newton route (called once per
    Gram size with the selected layers and their float64 covariances), pooled rows within
    the Newton chain's accuracy of it, and float64-exact against eigvalsh of the folded P."""
    R, B = 3, 24
    layers = samples(gen, R, SH)
    mean_grams, mean_grads = stats_inputs(layers)
    L = len(SH)
    calls = {"host": [], "newton": []}

    def folder(route):
        def fold(ls, C):
            calls[route].append((list(ls), C.dtype, tuple(C.shape)))
            return 0.5 * C + 0.1 * C.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(
                C.shape[-1], dtype=C.dtype)
        return fold

    sel = ([l != 1 for l in range(L)], [True] * L)
    res = {}
    for route in ("host", "newton"):
        res[route] = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method=route,
                                      request=sp.NuclearRequest(select=sel, sums=True, pool_fold=folder(route),
                                                                covariances=True))
    assert calls["host"] == calls["newton"] and all(dt == torch.float64 for _, dt, _ in calls["host"])
    h, n = res["host"], res["newton"]
    assert h.pooled.shape == (2, L) and h.pooled[:, 1].eq(0).all()
    assert torch.allclose(h.pooled[0], n.pooled[0], rtol=1e-6, atol=0)  # the float64 chain's trace
    assert torch.allclose(h.pooled[1], n.pooled[1], rtol=1e-4, atol=0)  # its quadrature pair sum
    assert torch.allclose(h.sums[:2], n.sums[:2], rtol=1e-4, atol=0)
    fold = folder("ref")
    calls["ref"] = []
    for l, C in h.covariances:
        P = fold([l], C.double()[None])[0]
        want = _ref_sums(P, True)
        assert torch.allclose(h.pooled[:, l], want[:2], rtol=1e-10, atol=0), l
