"""gns_kernels.spectral vs the float64 oracle (gns_kernels.reference), fresh random data.

Accuracy bound (issue 6): every sqrt-trace method within 1e-3 relative of float64
eigvalsh of the same input on random PSD matrices (sizes 1..768, condition up to 1e6),
exactly rank-deficient ones, any scale (1e-30..1e30), Grams of gradients whose singular
values span six decades; finite on every finite PSD input, for every allowed Newton
iteration count. nuclear_stats within 1e-3 of the float64 eager computation.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref
from gns_kernels import spectral as sp

TOL = 1e-3
METHODS = ("eigh", "newton")


@pytest.fixture
def gen(request):
    """A torch.Generator with a fresh seed every run (printed, and kept in the report)."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def rand_psd(gen, m, cond, dtype=torch.float64):
    """Q diag(lambda) Q^T, lambda log-spaced from 1 to 1/cond (random orthogonal Q)."""
    Q, _ = torch.linalg.qr(randn(gen, m, m))
    lam = torch.logspace(0, -math.log10(cond), m, dtype=torch.float64) if m > 1 else torch.ones(1, dtype=torch.float64)
    A = (Q * lam) @ Q.T
    return (0.5 * (A + A.T)).to(dtype)


def rank_deficient(gen, m, r, dtype=torch.float64):
    X = randn(gen, m, r)
    return (X @ X.T).to(dtype)


def grad_with_spectrum(gen, m, n, decades=6):
    """float32 m x n gradient whose singular values are log-spaced over ``decades``."""
    k = min(m, n)
    U, _ = torch.linalg.qr(randn(gen, m, k))
    V, _ = torch.linalg.qr(randn(gen, n, k))
    s = torch.logspace(0, -decades, k, dtype=torch.float64)
    return ((U * s) @ V.T).float()


def rel_err(x, y):
    x, y = x.double(), y.double()
    return ((x - y).abs() / y.abs().clamp_min(1e-300)).max().item()


# ============================================================================ gram
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gram_matches_reference_all_sides_and_groups(gen, dtype):
    shapes = [(7, 13), (13, 7), (7, 13), (9, 9), (300, 257), (7, 13), (1, 5), (5, 1)]
    xs = [randn(gen, *s, dtype=dtype) for s in shapes]
    for side in ("auto", "row", "col"):
        out = gk.gram(xs, side=side)
        assert len(out) == len(xs)
        for x, G in zip(xs, out):
            want = ref.gram(x, side)  # float64 Gram of the same (rounded) values
            assert G.dtype == torch.float32
            assert G.shape == want.shape
            # float32 accumulation: relative to the Gram's scale
            assert (G.double() - want).abs().max() <= 2e-6 * want.abs().max() + 1e-30, (side, x.shape)


def test_gram_auto_takes_smaller_side_and_blocks_are_symmetric(gen):
    x = randn(gen, 3, 600, 513, dtype=torch.float32)  # > one CPU strip (64 rows): blocked path
    out = torch.ops.gns_kernels.gram_batched(x, True)
    assert out.shape == (3, 513, 513)
    assert torch.equal(out, out.mT)  # mirrored blocks: exactly symmetric
    want = x.double().mT @ x.double()
    assert (out.double() - want).abs().max() <= 2e-6 * want.abs().max()
    shapes = [g.shape for g in gk.gram([x[0], x[0].T])]
    assert shapes == [(513, 513), (513, 513)]


@pytest.mark.parametrize("threads", [1, 2])
def test_gram_list_strided_inputs_several_blocks(gen, threads):
    # transposed and sliced views, k = 301: several CPU strips (64 rows), worker threads or not
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = randn(gen, 5, 420, 301, dtype=torch.float32)
        xs = [base[i, :, :] for i in range(3)] + [base[3].T.T, base[4][:, :]]
        for col in (False, True):
            out = torch.ops.gns_kernels.gram_list(xs, col)
            assert len(out) == 5
            for x, G in zip(xs, out):
                assert G.shape == ((301, 301) if col else (420, 420))
                assert torch.equal(G, G.T)  # mirrored blocks: exactly symmetric
                want = ref.gram(x, "col" if col else "row")
                assert (G.double() - want).abs().max() <= 2e-6 * want.abs().max()
        xt = [x.T for x in xs]  # non-contiguous (n, m) views, rows strided
        out = torch.ops.gns_kernels.gram_list(xt, False)
        for x, G in zip(xt, out):
            want = ref.gram(x, "row")
            assert (G.double() - want).abs().max() <= 2e-6 * want.abs().max()
    finally:
        torch.set_num_threads(old)


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


def test_gram_bf16_accumulates_in_float32(gen):
    # 4096 bf16 products: a bf16 accumulator would be off by ~1e-2 relative
    x = randn(gen, 6, 4096, dtype=torch.bfloat16)
    (G,) = gk.gram([x])
    want = x.double() @ x.double().T
    assert G.dtype == torch.float32
    assert (G.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_gram_rejects_bad_input():
    with pytest.raises(ValueError, match=r"tensors\[1\].*2-D"):
        gk.gram([torch.ones(2, 2), torch.ones(3)])
    with pytest.raises(ValueError, match=r"tensors\[0\].*floating"):
        gk.gram([torch.ones(2, 2, dtype=torch.int64)])
    with pytest.raises(ValueError, match="side"):
        gk.gram([torch.ones(2, 2)], side="left")


# ============================================================================ sqrt_trace
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m", [1, 2, 7, 33, 130, 300])
@pytest.mark.parametrize("cond", [1.0, 1e3, 1e6])
def test_sqrt_trace_random_psd(gen, method, m, cond):
    for dtype in (torch.float64, torch.float32):
        A = rand_psd(gen, m, cond, dtype)
        got = gk.sqrt_trace(A, method)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert rel_err(got, ref.sqrt_trace(A)) < TOL, (method, m, cond, dtype)


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_size_768(gen, method):
    A = rand_psd(gen, 768, 1e6, torch.float32)
    assert rel_err(gk.sqrt_trace(A, method), ref.sqrt_trace(A)) < TOL


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m,r", [(300, 10), (64, 1), (64, 3), (768, 10)])
def test_sqrt_trace_exactly_rank_deficient(gen, method, m, r):
    A = rank_deficient(gen, m, r)  # float64, exact zeros up to float64 rounding
    want = ref.sqrt_trace(A)
    assert rel_err(gk.sqrt_trace(A, method), want) < TOL
    # the float32 input (rounding noise on the zero eigenvalues): eigh agrees with float64
    # eigvalsh of the rounded input; newton suppresses the noise, so compare it with the
    # exact value (what the rounded input approximates)
    A32 = A.float()
    target = ref.sqrt_trace(A32) if method == "eigh" else want
    assert rel_err(gk.sqrt_trace(A32, method), target) < TOL


def test_plain_float32_eigvalsh_fails_rank_deficient_bound(gen):
    """Why eigh needs its fallback: the test above can fail (issue 6: 3e-3 at 768)."""
    A = rank_deficient(gen, 768, 10)
    plain = torch.linalg.eigvalsh(A.float()).clamp_min(0).sqrt().sum()
    assert rel_err(plain, ref.sqrt_trace(A)) > TOL
    lam = gk.spectral.psd_eigvalsh(A)
    assert lam.dtype == torch.float64
    assert rel_err(lam.clamp_min(0).sqrt().sum(), ref.sqrt_trace(A)) < 1e-6


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1e12, 1e30])
def test_sqrt_trace_any_scale(gen, method, scale):
    for dtype in (torch.float32, torch.float64):
        A = (rand_psd(gen, 40, 1e6) * scale).to(dtype)
        got = gk.sqrt_trace(A, method)
        assert torch.isfinite(got).all()
        assert rel_err(got, ref.sqrt_trace(A)) < TOL, (method, scale, dtype)
        Z = (rank_deficient(gen, 40, 3) * scale).to(dtype)
        assert rel_err(gk.sqrt_trace(Z, method), ref.sqrt_trace(Z.double() if method == "newton" else Z)) < TOL


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m,n", [(64, 160), (300, 200)])
def test_sqrt_trace_grams_of_gradients_six_decades(gen, method, m, n):
    G = grad_with_spectrum(gen, m, n, decades=6)
    (A,) = gk.gram([G])  # float32 Gram on the smaller side
    assert rel_err(gk.sqrt_trace(A, method), ref.sqrt_trace(A)) < TOL
    exact = ref.nuclear_norm(G)  # and the signal it stands for, ||G||_S1
    assert rel_err(gk.sqrt_trace(A, method), exact) < TOL


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_batched_and_nonfinite_isolated(gen, method):
    A = torch.stack([rand_psd(gen, 20, c) for c in (1.0, 1e2, 1e4, 1e6, 1e3, 10.0)]).reshape(2, 3, 20, 20)
    bad = A.clone()
    bad[1, 2, 3, 4] = float("nan")
    bad[0, 1, 0, 0] = float("inf")
    got = gk.sqrt_trace(bad, method)
    assert got.shape == (2, 3)
    assert torch.isnan(got[1, 2]) and not torch.isfinite(got[0, 1])
    ok = torch.ones(2, 3, dtype=torch.bool)
    ok[1, 2] = ok[0, 1] = False
    want = ref.sqrt_trace(A)
    assert rel_err(got[ok], want[ok]) < TOL


@pytest.mark.parametrize("method", METHODS)
def test_sqrt_trace_slightly_indefinite_and_zero(gen, method):
    # C = A - B with B = A up to rounding in most directions (a subtraction's result)
    X = randn(gen, 50, 80, dtype=torch.float32)
    A = X @ X.T
    D = X[:, :75]
    C = A - D @ D.T  # PSD rank 5 in exact arithmetic; float32 rounding makes it indefinite
    got = gk.sqrt_trace(C, method)
    assert torch.isfinite(got)
    exact = ref.sqrt_trace(X[:, 75:].double() @ X[:, 75:].double().T)
    assert rel_err(got, exact) < 0.05  # rounding of A and D D^T dominates; finite and close
    assert gk.sqrt_trace(torch.zeros(5, 5), method).item() == 0.0
    assert gk.sqrt_trace(torch.zeros(0, 4, 4), method).shape == (0,)


def test_newton_every_allowed_iteration_count_is_finite_and_accurate(gen):
    """Every count in [newton_min_iters, 200]: one 200-iteration trajectory (the iteration is
    deterministic, so entry k-1 is the result of iters=k; checked below for a few k)."""
    mats = [rand_psd(gen, 24, 1e6), rand_psd(gen, 24, 1e10), rank_deficient(gen, 24, 1),
            rank_deficient(gen, 24, 5), rand_psd(gen, 24, 1.0), torch.zeros(24, 24, dtype=torch.float64)]
    A = torch.stack(mats)
    want = ref.sqrt_trace(A)
    kmin = sp.newton_min_iters()
    traj = sp._newton_impl(A, sp.NEWTON_MAX_ITERS, sp.NEWTON_EPS, every=True)
    assert torch.isfinite(traj).all()
    for k in range(kmin, sp.NEWTON_MAX_ITERS + 1):
        got = traj[k - 1].double()
        err = ((got - want).abs() / want.clamp_min(1e-300)).where(want > 0, got.abs())
        assert err.max() < TOL, (k, err)
    for k in (kmin, kmin + 3, 77, sp.NEWTON_MAX_ITERS):
        assert torch.equal(gk.sqrt_trace(A, "newton", iters=k), traj[k - 1])
    # well below kmin the iteration has not converged for eigenvalues near eps: not allowed
    early = traj[kmin // 2].double()
    assert ((early - want).abs() / want.clamp_min(1e-300)).where(want > 0, early.abs()).max() > TOL
    with pytest.raises(ValueError, match="iters"):
        gk.sqrt_trace(A, "newton", iters=kmin - 1)
    with pytest.raises(ValueError, match="iters"):
        gk.sqrt_trace(A, "newton", iters=sp.NEWTON_MAX_ITERS + 1)
    with pytest.raises(ValueError, match="eps"):
        gk.sqrt_trace(A, "newton", eps=1e-9)


def test_newton_guard_keeps_indefinite_input_finite(gen):
    """Negative eigenvalues far below -eps (not PSD even up to rounding) make the plain
    coupled iteration diverge; the guard freezes it: finite for every count."""
    A = rand_psd(gen, 16, 10.0) - 0.2 * torch.eye(16, dtype=torch.float64)
    traj = sp._newton_impl(A, 60, sp.NEWTON_EPS, every=True)
    assert torch.isfinite(traj).all()


def test_sqrt_trace_auto_cpu_is_eigh_and_deterministic(gen):
    A = torch.stack([rand_psd(gen, 60, 1e4, torch.float32) for _ in range(5)])
    nt = torch.get_num_threads()
    a = gk.sqrt_trace(A)
    assert torch.get_num_threads() == nt  # the worker-thread section restores it
    assert torch.equal(a, gk.sqrt_trace(A, "eigh"))
    assert torch.equal(a, gk.sqrt_trace(A))


def test_sqrt_trace_rejects_bad_input():
    with pytest.raises(ValueError, match="A: expected square"):
        gk.sqrt_trace(torch.ones(3, 4))
    with pytest.raises(ValueError, match="method"):
        gk.sqrt_trace(torch.eye(3), "svd")
    with pytest.raises(ValueError, match="A: expected a floating"):
        gk.sqrt_trace(torch.eye(3, dtype=torch.int32))


def test_sqrt_trace_validate_flag_and_env(monkeypatch):
    A = torch.eye(4)
    A[0, 1] = 1.0  # not symmetric
    assert torch.isfinite(gk.sqrt_trace(A))  # hot path: no check (symmetrized)
    with pytest.raises(ValueError, match="symmetric"):
        gk.sqrt_trace(A, validate=True)
    monkeypatch.setenv("GNS_KERNELS_VALIDATE", "1")
    with pytest.raises(ValueError, match="symmetric"):
        gk.sqrt_trace(A)
    B = torch.eye(4)
    B[2, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        gk.sqrt_trace(B)


# ============================================================================ nuclear_stats
def _samples(gen, R, shapes, dtype=torch.float32, noise=1.0):
    """R samples per layer: a common mean plus independent noise (as rank gradients)."""
    layers = []
    for s in shapes:
        mean = randn(gen, *s)
        layers.append([(mean + noise * randn(gen, *s)).to(dtype) for _ in range(R)])
    return layers


def _stats_inputs(layers, shifts=None):
    """What a hook holds after the all-reduce: mean local Grams (float32, via gk.gram on the
    smaller side) and mean (shifted) gradients."""
    R = len(layers[0])
    mean_grams, mean_grads = [], []
    for l, samples in enumerate(layers):
        S = None if shifts is None else shifts[l]
        xs = [x.float() if S is None else x.float() - S for x in samples]
        mean_grams.append(torch.stack(gk.gram(xs)).sum(0) / R)
        mean_grads.append(torch.stack(xs).mean(0))
    return mean_grams, mean_grads


SHAPES = [(12, 30), (30, 12), (12, 30), (17, 17), (40, 9), (3, 50), (64, 100)]


@pytest.mark.parametrize("threads", [1, 2])
def test_psd_eigvalsh_list_matches_float64(gen, threads):
    # eigenvalues of scales[l] * (A[l] - B[l]) vs float64 eigvalsh of the same values,
    # m = 300 (one matrix per worker), a rank-deficient difference (float64 fallback), a
    # float64 input, B = None, a zero matrix and a non-finite one (NaN row, others intact)
    m = 300
    X = randn(gen, m, 2 * m, dtype=torch.float32)
    Y = randn(gen, m, 7, dtype=torch.float32)
    A0 = gk.gram([X])[0]
    B0 = (A0.double() - (Y.double() @ Y.double().T)).float()  # A0 - B0: rank 7 + rounding
    A1 = rand_psd(gen, m, 1e4, torch.float64)
    nan = A0.clone()
    nan[3, 5] = math.nan
    As = [A0, A0, A1, torch.zeros(m, m), nan]
    Bs = [None, B0, None, None, None]
    scales = [1e-20, 7.5, 3.0, 2.0, 1.0]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lam, used64 = torch.ops.gns_kernels.psd_eigvalsh_list(As, Bs, scales, sp.EIGH_TOL, [False] * 5)
        lam_w, used64_w = torch.ops.gns_kernels.psd_eigvalsh_list(As, Bs, scales, sp.EIGH_TOL, [True] * 5)
    finally:
        torch.set_num_threads(old)
    assert lam.shape == (5, m) and lam.dtype == torch.float64
    # the rank-7 difference falls back to float64; the well-conditioned Gram does not; the
    # hint solves every finite nonzero matrix in float64 directly, with the fallback's result
    assert used64.tolist() == [False, True, False, False, False]
    assert used64_w.tolist() == [True, True, True, False, False]
    assert torch.equal(lam_w[1], lam[1])
    assert torch.equal(lam_w[3], lam[3])
    for i in range(4):
        S = As[i].double() if Bs[i] is None else As[i].double() - Bs[i].double()
        S = scales[i] * S
        want = torch.linalg.eigvalsh(S)
        got_tr = lam[i].clamp_min(0).sqrt().sum()
        want_tr = want.clamp_min(0).sqrt().sum()
        if i == 3:
            assert torch.equal(lam[i], torch.zeros(m, dtype=torch.float64))
            continue
        assert abs(got_tr - want_tr) <= TOL * want_tr, i
        assert (lam[i] - want).abs().max() <= 1e-4 * want.abs().max(), i
    assert torch.isnan(lam[4]).all()




@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("R", [2, 4])
def test_nuclear_stats_matches_reference(gen, method, R):
    B = 8 * R
    layers = _samples(gen, R, SHAPES)
    mean_grams, mean_grads = _stats_inputs(layers)
    noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), method=method)
    rn, rs = ref.nuclear_stats(layers, B)
    assert noise.dtype == signal.dtype == torch.float32 and noise.shape == (len(SHAPES),)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


@pytest.mark.parametrize("method", METHODS)
def test_nuclear_stats_with_shifts_small_noise(gen, method):
    """noise << signal: a shift close to the mean keeps float32 accurate."""
    R, B = 2, 64
    layers = _samples(gen, R, SHAPES, noise=1e-3)
    shifts = [torch.stack([x.float() for x in s]).mean(0) + 1e-4 * randn(gen, *s[0].shape, dtype=torch.float32)
              for s in layers]
    mean_grams, mean_grads = _stats_inputs(layers, shifts)
    noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), shifts=shifts, method=method)
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


@pytest.mark.parametrize("method", METHODS)
def test_nuclear_stats_from_grams_fsdp2(gen, method):
    """FSDP2: only the Gram of the mean (shifted) gradient, and the signal's Gram."""
    R, B = 3, 24
    layers = _samples(gen, R, SHAPES)
    shifts = [randn(gen, *s[0].shape, dtype=torch.float32) for s in layers]
    mean_grams, mean_grads = _stats_inputs(layers, shifts)
    dd = gk.gram(mean_grads)
    gg = gk.gram([D + S for D, S in zip(mean_grads, shifts)])
    noise, signal = gk.nuclear_stats(mean_grams, mean_grad_grams=dd, signal_grams=gg, scale=B / (R - 1),
                                     method=method)
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


def test_nuclear_stats_bf16_gradients(gen):
    R, B = 2, 16
    layers = _samples(gen, R, SHAPES, dtype=torch.bfloat16)
    mean_grams = [torch.stack(gk.gram(s)).mean(0) for s in layers]  # bf16 in, float32 Grams
    mean_grads = [torch.stack([x.float() for x in s]).mean(0) for s in layers]
    noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1))
    rn, rs = ref.nuclear_stats(layers, B)  # float64 of the same bf16 values
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


@pytest.mark.parametrize("R", [2, 4])
def test_nuclear_stats_bias_correction(gen, R):
    B = 4 * R
    layers = _samples(gen, R, SHAPES)
    mean_grams, mean_grads = _stats_inputs(layers)
    noise, _ = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), bias_correction=True,
                                num_samples=R, batch_size=B)
    from gns_kernels.bias import nuclear_sqrt_trace_corrected

    want = []
    for samples in layers:
        m, n = samples[0].shape
        C = ref.row_covariance(samples, B)
        want.append(nuclear_sqrt_trace_corrected(torch.linalg.eigvalsh(C), R, B, other_dim=max(m, n)))
    want = torch.stack(want)
    rn, _ = ref.nuclear_stats(layers, B)
    assert (want > rn).all()  # the correction changes the value: the test can fail
    assert rel_err(noise, want) < TOL


def test_nuclear_stats_handles_indefinite_c_and_nonfinite(gen):
    R, B = 2, 1000  # identical samples but rounding: C ~ 0, slightly indefinite
    x = randn(gen, 30, 40, dtype=torch.float32)
    layers = [[x, x.clone()]]
    mean_grams, mean_grads = _stats_inputs(layers)
    for method in METHODS:
        noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), method=method)
        assert torch.isfinite(noise).all() and noise.item() <= 1e-2 * signal.item() * math.sqrt(B)
        assert rel_err(signal, ref.nuclear_norm(x)) < TOL
    bad = [mean_grads[0].clone()]
    bad[0][0, 0] = float("nan")
    noise, signal = gk.nuclear_stats(mean_grams, bad, scale=1.0)
    assert torch.isnan(noise).all() and torch.isnan(signal).all()


def test_nuclear_stats_rejects_bad_input(gen):
    A = torch.eye(4)
    D = torch.ones(4, 6)
    with pytest.raises(ValueError, match="exactly one"):
        gk.nuclear_stats([A], scale=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        gk.nuclear_stats([A], [D], mean_grad_grams=[A], scale=1.0)
    with pytest.raises(ValueError, match=r"mean_grams\[0\].*does not match"):
        gk.nuclear_stats([torch.eye(5)], [D], scale=1.0)
    with pytest.raises(ValueError, match="mean_grads: expected 1"):
        gk.nuclear_stats([A], [D, D], scale=1.0)
    with pytest.raises(ValueError, match="num_samples"):
        gk.nuclear_stats([A], [D], scale=1.0, bias_correction=True)
    with pytest.raises(ValueError, match="scale"):
        gk.nuclear_stats([A], [D], scale=-1.0)
    with pytest.raises(ValueError, match=r"shifts\[0\]"):
        gk.nuclear_stats([A], [D], scale=1.0, shifts=[torch.ones(6, 4)])
    with pytest.raises(ValueError, match=r"mean_grad_grams\[0\]"):
        gk.nuclear_stats([A], mean_grad_grams=[torch.eye(3)], scale=1.0)
    A2 = A.clone()
    A2[0, 3] = 5.0
    assert torch.isfinite(gk.nuclear_stats([A2], [D], scale=1.0)[0]).all()  # no check on the hot path
    with pytest.raises(ValueError, match=r"mean_grams\[0\].*symmetric"):
        gk.nuclear_stats([A2], [D], scale=1.0, validate=True)


# ============================================================================ torch.library
def test_opcheck(gen):
    from torch.library import opcheck

    x = randn(gen, 3, 9, 14, dtype=torch.float32)
    opcheck(torch.ops.gns_kernels.gram_batched, (x, False))
    opcheck(torch.ops.gns_kernels.gram_batched, (x.bfloat16(), True))
    opcheck(torch.ops.gns_kernels.gram_list, (list(x.unbind(0)), False))
    opcheck(torch.ops.gns_kernels.gram_list, ([x[0].bfloat16(), x[1].bfloat16()], True))
    A = torch.stack([rand_psd(gen, 9, 1e3, torch.float32) for _ in range(2)])
    opcheck(torch.ops.gns_kernels.psd_eigvalsh, (A, 2e-4))
    opcheck(torch.ops.gns_kernels.psd_eigvalsh_list, ([A[0], A[1]], [None, 0.5 * A[0]], [2.0, 0.25], 2e-4,
                                                      [False, True]))
    opcheck(torch.ops.gns_kernels.newton_sqrt_trace, (A, 25, 1e-6, None))


def test_torch_compile_fullgraph(gen):
    R, B = 2, 16
    layers = _samples(gen, R, SHAPES[:3])

    def measure(xs0, xs1):
        g0, g1 = gk.gram(xs0), gk.gram(xs1)
        mean_grams = [(a + b) / 2 for a, b in zip(g0, g1)]
        mean_grads = [(a + b) / 2 for a, b in zip(xs0, xs1)]
        return gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1))

    xs0 = [s[0] for s in layers]
    xs1 = [s[1] for s in layers]
    compiled = torch.compile(measure, fullgraph=True, backend="aot_eager")
    n, s = compiled(xs0, xs1)
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(n, rn) < TOL and rel_err(s, rs) < TOL


def _sparse_row_covariance(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two ranks' embedding-like gradients (20 nonzero rows each of 256): the mean Gram,
    the mean gradient and C = 8 (A - D D^T), which has many exactly-zero rows and columns."""
    g = torch.Generator().manual_seed(seed)
    m = n = 256
    G1, G2 = torch.zeros(m, n), torch.zeros(m, n)
    G1[torch.randperm(m, generator=g)[:20]] = 1e-2 * torch.randn(20, n, generator=g)
    G2[torch.randperm(m, generator=g)[:20]] = 1e-2 * torch.randn(20, n, generator=g)
    A = (G1 @ G1.T + G2 @ G2.T) / 2
    D = (G1 + G2) / 2
    return A, D, 8.0 * (A - D @ D.T)


def test_eigh_survives_float32_convergence_failure():
    """float32 LAPACK eigvalsh fails to converge on such matrices (seen in the DDP hook on an
    embedding gradient); sqrt_trace('eigh') and nuclear_stats must fall back to float64."""
    failed = 0
    for seed in range(6):
        A, D, C = _sparse_row_covariance(seed)
        try:
            torch.linalg.eigvalsh(C)
        except torch.linalg.LinAlgError:
            failed += 1
        want = float(ref.sqrt_trace(C))
        assert float(sp.sqrt_trace(C, method="eigh")) == pytest.approx(want, rel=1e-3)
        noise, signal = sp.nuclear_stats([A], [D], scale=8.0)
        assert float(noise[0]) == pytest.approx(want, rel=1e-3)
        assert float(signal[0]) == pytest.approx(float(ref.nuclear_norm(D)), rel=1e-3)
    assert failed > 0, "the float32 failure this test guards against no longer occurs here"


def test_nuclear_stats_eig_float64_hint_and_report(gen):
    # layer 0: sparse rows (rank-deficient: the float32 error bound fails, or float32 LAPACK
    # fails outright, float64 fallback); layer 1: well-conditioned full-rank Gram (float32
    # accepted). The report says so; the hint (float64 directly) is as accurate.
    A0, D0, _ = _sparse_row_covariance(int(torch.randint(0, 2**31, (1,), generator=gen)))
    X = [randn(gen, 40, 120, dtype=torch.float32) for _ in range(2)]
    A1 = torch.stack(gk.gram(X)).mean(0)
    D1 = torch.stack(X).mean(0)
    report: list = []
    n, s = gk.nuclear_stats([A0, A1], [D0, D1], scale=8.0, eig_report=report)
    assert report == [True, False]
    n_h, s_h = gk.nuclear_stats([A0, A1], [D0, D1], scale=8.0, eig_float64=report)
    assert torch.equal(n_h[1], n[1]) and torch.equal(s_h[1], s[1])  # no hint: same path
    for noise, signal in ((n, s), (n_h, s_h)):
        for l, (A, D) in enumerate(((A0, D0), (A1, D1))):
            C = 8.0 * (A.double() - D.double() @ D.double().T)
            assert float(noise[l]) == pytest.approx(float(ref.sqrt_trace(C)), rel=TOL)
            assert float(signal[l]) == pytest.approx(float(ref.nuclear_norm(D)), rel=TOL)
    with pytest.raises(ValueError, match="eig_float64"):
        gk.nuclear_stats([A0, A1], [D0, D1], scale=8.0, eig_float64=[True])
    with pytest.raises(ValueError, match="eig_report"):
        gk.nuclear_stats([A0, A1], [D0, D1], scale=8.0, eig_report=(1, 2))


def test_eigh_float32_nan_output_takes_the_float64_path(gen, monkeypatch):
    # float32 LAPACK can return NaN eigenvalues for a finite matrix without raising (seen on
    # the sparse-row covariances above): the NaN error bound must trigger the fallback,
    # never become the result
    real = torch.linalg.eigvalsh

    def nan_in_float32(x, *a, **k):
        lam = real(x, *a, **k)
        return torch.full_like(lam, math.nan) if x.dtype == torch.float32 else lam

    A = torch.stack([rand_psd(gen, m, 1e3, torch.float32) for m in (300,) * 2])
    B = torch.stack([rand_psd(gen, 40, 1e3, torch.float32) for _ in range(3)])
    want_A, want_B = ref.sqrt_trace(A.double()), ref.sqrt_trace(B.double())
    monkeypatch.setattr(torch.linalg, "eigvalsh", nan_in_float32)
    for X, want in ((A, want_A), (B, want_B)):  # per-matrix path (m >= 256) and chunks
        assert rel_err(sp.sqrt_trace(X, "eigh"), want) < TOL
    lam, used64 = torch.ops.gns_kernels.psd_eigvalsh_list(list(A), [None, None], [1.0, 1.0], sp.EIGH_TOL,
                                                          [False, False])
    assert used64.tolist() == [True, True]
    assert rel_err(lam.clamp_min(0).sqrt().sum(-1), want_A) < TOL
