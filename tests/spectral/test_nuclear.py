"""gns_kernels.spectral.nuclear_stats (both input forms, the request) vs the float64 eager
computation (gns_kernels.reference), within 1e-3; its deprecated aliases."""
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


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("R", [2, 4])
def test_nuclear_stats_matches_reference(gen, method, R):
    B = 8 * R
    layers = samples(gen, R, SHAPES)
    mean_grams, mean_grads = stats_inputs(layers)
    noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), method=method)
    rn, rs = ref.nuclear_stats(layers, B)
    assert noise.dtype == signal.dtype == torch.float32 and noise.shape == (len(SHAPES),)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


@pytest.mark.parametrize("method", METHODS)
def test_nuclear_stats_with_shifts_small_noise(gen, method):
    """noise << signal: a shift close to the mean keeps float32 accurate."""
    R, B = 2, 64
    layers = samples(gen, R, SHAPES, noise=1e-3)
    shifts = [torch.stack([x.float() for x in s]).mean(0) + 1e-4 * randn(gen, *s[0].shape, dtype=torch.float32)
              for s in layers]
    mean_grams, mean_grads = stats_inputs(layers, shifts)
    noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), shifts=shifts, method=method)
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL




@pytest.mark.parametrize("method", METHODS)
def test_nuclear_stats_gram_form_fsdp2(gen, method):
    """FSDP2: only the Gram of the mean (shifted) gradient, and the signal's Gram."""
    R, B = 3, 24
    layers = samples(gen, R, SHAPES)
    shifts = [randn(gen, *s[0].shape, dtype=torch.float32) for s in layers]
    mean_grams, mean_grads = stats_inputs(layers, shifts)
    dd = gk.gram(mean_grads)
    gg = gk.gram([D + S for D, S in zip(mean_grads, shifts)])
    noise, signal = gk.nuclear_stats(mean_grams, mean_grad_grams=dd, signal_grams=gg, scale=B / (R - 1),
                                     method=method)
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL
    # without a shift the signal comes from mean_grad_grams itself
    mean_grams, mean_grads = stats_inputs(layers)
    noise, signal = gk.nuclear_stats(mean_grams, mean_grad_grams=gk.gram(mean_grads), scale=B / (R - 1),
                                     method=method)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


@pytest.mark.parametrize("R", [2, 4])
def test_nuclear_stats_gram_form_bias_correction_takes_other_dims_from_shapes(gen, R):
    B = 4 * R
    layers = samples(gen, R, SHAPES)
    mean_grams, mean_grads = stats_inputs(layers)
    kw = dict(scale=B / (R - 1), bias_correction=True, num_samples=R, batch_size=B)
    want, _ = gk.nuclear_stats(mean_grams, mean_grads, **kw)
    got, _ = gk.nuclear_stats(mean_grams, mean_grad_grams=gk.gram(mean_grads), shapes=[D.shape for D in mean_grads],
                              **kw)
    assert rel_err(got, want) < 1e-5
    # without shapes (and other_dims) the correction has no other dimension to use
    wrong, _ = gk.nuclear_stats(mean_grams, mean_grad_grams=gk.gram(mean_grads),
                                other_dims=[1] * len(SHAPES), **kw)
    assert rel_err(wrong, want) > 1e-3


def test_nuclear_stats_bf16_gradients(gen):
    R, B = 2, 16
    layers = samples(gen, R, SHAPES, dtype=torch.bfloat16)
    mean_grams = [torch.stack(gk.gram(s)).mean(0) for s in layers]  # bf16 in, float32 Grams
    mean_grads = [torch.stack([x.float() for x in s]).mean(0) for s in layers]
    noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1))
    rn, rs = ref.nuclear_stats(layers, B)  # float64 of the same bf16 values
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


@pytest.mark.parametrize("method", ["eigh", "newton"])
@pytest.mark.parametrize("R", [2, 4])
def test_nuclear_stats_bias_correction(gen, R, method):
    """Both solvers give the eigenvalue-based correction of the float64 covariance (the
    Newton path through the pair sum, without eigenvalues)."""
    B = 4 * R
    layers = samples(gen, R, SHAPES)
    mean_grams, mean_grads = stats_inputs(layers)
    noise, _ = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), bias_correction=True,
                                num_samples=R, batch_size=B, method=method)
    from gns_kernels.stats import nuclear_sqrt_trace_corrected

    want = []
    for smp in layers:
        m, n = smp[0].shape
        C = ref.row_covariance(smp, B)
        want.append(nuclear_sqrt_trace_corrected(torch.linalg.eigvalsh(C), R, B, other_dim=max(m, n)))
    want = torch.stack(want)
    rn, _ = ref.nuclear_stats(layers, B)
    assert (want > rn).all()  # the correction changes the value: the test can fail
    assert rel_err(noise, want) < TOL


def test_nuclear_stats_handles_indefinite_c_and_nonfinite(gen):
    R, B = 2, 1000  # identical samples but rounding: C ~ 0, slightly indefinite
    x = randn(gen, 30, 40, dtype=torch.float32)
    layers = [[x, x.clone()]]
    mean_grams, mean_grads = stats_inputs(layers)
    for method in METHODS:
        noise, signal = gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), method=method)
        assert torch.isfinite(noise).all() and noise.item() <= 1e-2 * signal.item() * math.sqrt(B)
        assert rel_err(signal, ref.nuclear_norm(x)) < TOL
    bad = [mean_grads[0].clone()]
    bad[0][0, 0] = float("nan")
    noise, signal = gk.nuclear_stats(mean_grams, bad, scale=1.0)
    assert torch.isnan(noise).all() and torch.isnan(signal).all()




@pytest.mark.parametrize("method", METHODS)
def test_nuclear_stats_empty_side_contributes_zero(gen, method):
    # a 0 x n gradient has a 0 x 0 Gram: noise 0, signal 0, the other layers unchanged
    R, B = 2, 16
    layers = samples(gen, R, SHAPES[:2])
    mean_grams, mean_grads = stats_inputs(layers)
    noise, signal = gk.nuclear_stats([torch.zeros(0, 0)] + mean_grams, [torch.zeros(0, 6)] + mean_grads,
                                     scale=B / (R - 1), method=method)
    assert noise[0].item() == 0.0 and signal[0].item() == 0.0
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(noise[1:], rn) < TOL and rel_err(signal[1:], rs) < TOL
    noise, signal = gk.nuclear_stats([torch.zeros(0, 0)], [torch.zeros(7, 0)], scale=1.0, method=method,
                                     bias_correction=True, num_samples=2, batch_size=4.0)
    assert noise.tolist() == [0.0] and signal.tolist() == [0.0]
    noise, signal = gk.nuclear_stats([torch.zeros(0, 0)], mean_grad_grams=[torch.zeros(0, 0)], scale=1.0,
                                     method=method)
    assert noise.tolist() == [0.0] and signal.tolist() == [0.0]


def test_nuclear_stats_rejects_bad_input(gen):
    A = torch.eye(4)
    D = torch.ones(4, 6)
    with pytest.raises(ValueError, match="^mean_grads:.*mean_grad_grams="):
        gk.nuclear_stats([A], None, scale=1.0)
    with pytest.raises(ValueError, match="^mean_grads: not with mean_grad_grams"):
        gk.nuclear_stats([A], [D], mean_grad_grams=[A], scale=1.0)
    with pytest.raises(ValueError, match="^shifts: not with mean_grad_grams"):
        gk.nuclear_stats([A], mean_grad_grams=[A], shifts=[D], scale=1.0)
    with pytest.raises(ValueError, match="^side: not with mean_grad_grams"):
        gk.nuclear_stats([A], mean_grad_grams=[A], side="col", scale=1.0)
    with pytest.raises(ValueError, match="^signal_grams: only with mean_grad_grams"):
        gk.nuclear_stats([A], [D], signal_grams=[A], scale=1.0)
    with pytest.raises(ValueError, match="^shapes: only with mean_grad_grams"):
        gk.nuclear_stats([A], [D], shapes=[(4, 6)], scale=1.0)
    with pytest.raises(ValueError, match="^request:"):
        gk.nuclear_stats([A], [D], scale=1.0, request={"sums": True})
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
    with pytest.raises(ValueError, match="method"):
        gk.nuclear_stats([A], [D], scale=1.0, method="svd")
    with pytest.raises(ValueError, match="eig_hints"):
        gk.nuclear_stats([A], [D], scale=1.0, eig_hints={"4x6": True})
    with pytest.raises(ValueError, match=r"mean_grad_grams\[0\]"):
        gk.nuclear_stats([A], mean_grad_grams=[torch.eye(3)], scale=1.0)
    with pytest.raises(ValueError, match=r"signal_grams\[0\]"):
        gk.nuclear_stats([A], mean_grad_grams=[A], signal_grams=[torch.eye(3)], scale=1.0)
    with pytest.raises(ValueError, match="mean_grad_grams: expected 1"):
        gk.nuclear_stats([A], mean_grad_grams=[A, A], scale=1.0)
    with pytest.raises(ValueError, match=r"shapes\[0\]"):
        gk.nuclear_stats([A], mean_grad_grams=[A], scale=1.0, shapes=[(5, 6)])
    with pytest.raises(ValueError, match="shapes"):
        gk.nuclear_stats([A], mean_grad_grams=[A], scale=1.0, eig_hints=sp.EigHints())
    A2 = A.clone()
    A2[0, 3] = 5.0
    assert torch.isfinite(gk.nuclear_stats([A2], [D], scale=1.0)[0]).all()  # no check on the hot path
    with pytest.raises(ValueError, match=r"mean_grams\[0\].*symmetric"):
        gk.nuclear_stats([A2], [D], scale=1.0, validate=True)
    with pytest.raises(ValueError, match=r"mean_grad_grams\[0\].*symmetric"):
        gk.nuclear_stats([A], mean_grad_grams=[A2], scale=1.0, validate=True)


@pytest.mark.parametrize("R", [2, 3, 4])
def test_nuclear_noise_depends_on_the_gram_side_unless_r_is_2(gen, R):
    # the package's definition is the smaller side; the column side agrees only for R = 2
    B = 4 * R
    layers = samples(gen, R, [(6, 10)])
    smp = [x.float() for x in layers[0]]
    D = torch.stack(smp).mean(0)
    row = torch.stack(gk.gram(smp, side="row")).mean(0)
    col = torch.stack(gk.gram(smp, side="col")).mean(0)
    n_row, s_row = gk.nuclear_stats([row], [D], scale=B / (R - 1))
    n_col, s_col = gk.nuclear_stats([col], [D], scale=B / (R - 1))
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(n_row, rn) < TOL and rel_err(s_row, rs) < TOL  # the smaller side is the oracle's
    assert rel_err(s_col, s_row) < TOL  # the signal is side-independent
    if R == 2:
        assert rel_err(n_col, n_row) < TOL
    else:
        assert rel_err(n_col, n_row) > 1e-2


def test_nuclear_stats_bitwise_the_same_on_1_and_2_threads(gen):
    R, B = 3, 24
    layers = samples(gen, R, SHAPES + [(300, 260)])
    mean_grams, mean_grads = stats_inputs(layers)
    old = torch.get_num_threads()
    out = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out.append(gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1)))
            out.append(gk.nuclear_stats(mean_grams, mean_grads, scale=B / (R - 1), bias_correction=True,
                                        num_samples=R, batch_size=B))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(out[:2], out[2:]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_nuclear_stats_rejects_integer_gradients():
    with pytest.raises(ValueError, match=r"mean_grads\[0\].*floating"):
        gk.nuclear_stats([torch.eye(2)], [torch.ones(2, 3, dtype=torch.int64)], scale=1.0)


@pytest.mark.parametrize("method", METHODS)
def test_nuclear_stats_request_select_solves_only_the_selection(gen, method):
    """The selected noise / signal entries match the float64 reference; the others are 0;
    the two halves of a split add up to the full result."""
    R, B = 3, 24
    layers = samples(gen, R, SHAPES)
    mean_grams, mean_grads = stats_inputs(layers)
    rn, rs = ref.nuclear_stats(layers, B)
    L = len(SHAPES)
    sel_n = [l % 2 == 0 for l in range(L)]
    sel_s = [l % 3 == 1 for l in range(L)]
    kw = dict(scale=B / (R - 1), method=method)
    n1, s1, used, *_ = gk.nuclear_stats(mean_grams, mean_grads, request=sp.NuclearRequest(select=(sel_n, sel_s)),
                                        **kw)
    n2, s2, *_ = gk.nuclear_stats(
        mean_grams, mean_grads, request=sp.NuclearRequest(select=([not b for b in sel_n], [not b for b in sel_s])),
        **kw)
    for l in range(L):
        if sel_n[l]:
            assert rel_err(n1[l:l + 1], rn[l:l + 1]) < TOL
        else:
            assert n1[l] == 0
        if sel_s[l]:
            assert rel_err(s1[l:l + 1], rs[l:l + 1]) < TOL
        else:
            assert s1[l] == 0
    assert rel_err(n1 + n2, rn) < TOL and rel_err(s1 + s2, rs) < TOL
    assert (used is None) == (method in ("newton", "host"))  # host: every solve float64, nothing to report
    if used is not None:
        assert used.dtype == torch.bool and used.shape == (L,)


def test_nuclear_stats_request_select_rejects_bad_selection(gen):
    layers = samples(gen, 2, SHAPES[:2])
    mean_grams, mean_grads = stats_inputs(layers)
    for bad in ([True], ([True, True], [1, 0]), ([True, True],)):  # refused by NuclearRequest
        with pytest.raises(ValueError, match="^select:"):
            sp.NuclearRequest(select=bad)
    for bad in (([True], [True, True]), ([True, True, True], [True, True])):  # refused by the call (L = 2)
        with pytest.raises(ValueError, match="^select: expected (noise|signal)_mask as 2 bools"):
            gk.nuclear_stats(mean_grams, mean_grads, request=sp.NuclearRequest(select=bad))


def test_nuclear_stats_request_select_report_without_recording(gen):
    """record_hints=False leaves the hints untouched and returns the report instead."""
    layers = samples(gen, 2, SHAPES)
    mean_grams, mean_grads = stats_inputs(layers)
    h1, h2 = sp.EigHints(), sp.EigHints()
    used = gk.nuclear_stats(mean_grams, mean_grads, scale=2.0, method="eigh", eig_hints=h1,
                            request=sp.NuclearRequest(record_hints=False)).used64
    h1.apply()
    assert len(h1) == 0
    gk.nuclear_stats(mean_grams, mean_grads, scale=2.0, method="eigh", eig_hints=h2)
    h2.apply()
    h1.record([tuple(D.shape) for D in mean_grads], used.tolist())
    h1.apply()
    assert h1.state_dict() == h2.state_dict() and len(h2) > 0


# ---- the typed solver config ----------------------------------------------------------
def test_nuclear_stats_takes_a_config_bitwise_like_its_string(gen):
    """Each method string stands for a config (nuclear.ROUTES): the config gives the same
    bits, with the bias correction and the debiased signal too."""
    R, B = 3, 24
    mean_grams, mean_grads = stats_inputs(samples(gen, R, SHAPES))
    kw = dict(scale=B / (R - 1), bias_correction=True, num_samples=R, batch_size=B, signal="debiased")
    for name, cfg in (("eigh", sp.EighConfig()), ("auto", sp.EighConfig()),
                      ("newton", sp.NewtonConfig(iters=20, eps=1e-11, precision="float64")),
                      ("newton-tf32", sp.NewtonConfig(precision="tf32")), ("host", sp.HostConfig())):
        want = gk.nuclear_stats(mean_grams, mean_grads, method=name, **kw)
        got = gk.nuclear_stats(mean_grams, mean_grads, method=cfg, **kw)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), name
    assert sp.nuclear.ROUTES == {"eigh": sp.EighConfig(), "newton": sp.nuclear.NOISE_CHAIN,
                                 "newton-tf32": sp.NewtonConfig(precision="tf32"), "host": sp.HostConfig()}
    assert sp.nuclear.NOISE_CHAIN == sp.NewtonConfig(
        iters=sp.nuclear.NOISE_NEWTON[0], eps=sp.nuclear.NOISE_NEWTON[1], precision="float64")
    # another chain is honoured: a larger shift changes the float64 sums of the Newton chain
    req = sp.NuclearRequest(sums=True)
    base = gk.nuclear_stats(mean_grams, mean_grads, method="newton", request=req, **kw)
    other = gk.nuclear_stats(mean_grams, mean_grads, method=sp.NewtonConfig(eps=1e-3, precision="float64"),
                             request=req, **kw)
    assert not torch.equal(other.sums[:2], base.sums[:2])
    assert torch.equal(other.sums[2:], base.sums[2:])  # tr C, ||C||_F^2: no solve


def test_nuclear_stats_eigh_tol_reaches_the_solver(gen):
    """EighConfig(tol=0) re-solves every matrix in float64 (the solver report says so)."""
    R, B = 2, 16
    mean_grams, mean_grads = stats_inputs(samples(gen, R, SHAPES))
    req = sp.NuclearRequest()
    strict = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method=sp.EighConfig(tol=0.0), request=req)
    loose = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method=sp.EighConfig(), request=req)
    assert bool(strict.used64.all()) and not bool(loose.used64.all())


def test_nuclear_stats_refuses_what_its_routes_cannot_run(gen):
    mean_grams, mean_grads = stats_inputs(samples(gen, 2, SHAPES[:2]))
    with pytest.raises(ValueError, match="^precision: nuclear_stats runs its Newton chains"):
        gk.nuclear_stats(mean_grams, mean_grads, method=sp.NewtonConfig())  # float32 iterates
    with pytest.raises(ValueError, match="^method:"):
        gk.nuclear_stats(mean_grams, mean_grads, method=sp.EighConfig)  # the class, not a config
    fold = sp.NuclearRequest(sums=True, pool_fold=lambda ls, C: C)
    with pytest.raises(ValueError, match="^pool_fold: needs the Newton route .* or the host route"):
        gk.nuclear_stats(mean_grams, mean_grads, method="eigh", request=fold)


def test_nuclear_stats_request_returns_the_result(gen):
    """request: the raw noise with the sums, the covariances, the pooled sums; the Gram form
    gives the same bits as the gradient form on the Newton route (float64 D D^T there)."""
    R, B = 3, 24
    mean_grams, mean_grads = stats_inputs(samples(gen, R, SHAPES))
    L = len(SHAPES)
    req = sp.NuclearRequest(sums=True, covariances=True, pool_fold=lambda ls, C: 0.5 * C)
    res = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method="newton", request=req,
                           bias_correction=True, num_samples=R, batch_size=B)
    raw = gk.nuclear_stats(mean_grams, mean_grads, B / (R - 1), method="newton")
    assert isinstance(res, sp.NuclearResult) and res.used64 is None
    assert torch.equal(res.noise, raw[0]) and torch.equal(res.signal, raw[1])  # sums: raw noise
    assert res.sums.shape == (4, L) and res.sums.dtype == torch.float64
    assert torch.equal(res.sums[0].float(), res.noise)
    assert [l for l, _ in res.covariances] == list(range(L))
    for (l, C), A in zip(res.covariances, mean_grams):
        assert C.shape == A.shape
        assert float(res.sums[2, l]) == pytest.approx(float(C.double().diagonal().sum()), rel=1e-5)
    # tr((C/2)^{1/2}) = tr(C^{1/2}) / sqrt(2)
    assert rel_err(res.pooled[0], res.sums[0] / math.sqrt(2.0)) < 1e-6
    from gns_kernels.spectral.grams import grams64_on_sides
    dd = grams64_on_sides(mean_grads, ["row" if D.shape[0] <= D.shape[1] else "col" for D in mean_grads])
    g = gk.nuclear_stats(mean_grams, mean_grad_grams=dd, scale=B / (R - 1), method="newton", request=req,
                         shapes=[D.shape for D in mean_grads])
    assert torch.equal(g.noise, res.noise) and torch.equal(g.sums, res.sums)
    empty = gk.nuclear_stats([], [], request=req)
    assert empty.sums.shape == (4, 0) and empty.pooled.shape == (2, 0) and empty.covariances == []


# ---- the deprecated aliases -------------------------------------------------------------
def _warned_here(caught, lineno):
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(dep) == 1, [str(w.message) for w in caught]
    assert dep[0].filename == __file__ and dep[0].lineno == lineno  # the caller's line
    return str(dep[0].message)


def test_deprecated_aliases_warn_at_the_callers_line_and_give_the_same_bits(gen):
    import inspect
    import warnings

    R, B = 3, 24
    layers = samples(gen, R, SHAPES)
    shifts = [0.1 * randn(gen, *s[0].shape, dtype=torch.float32) for s in layers]
    mean_grams, mean_grads = stats_inputs(layers, shifts)
    L = len(SHAPES)
    sel = ([l % 2 == 0 for l in range(L)], [l % 3 != 1 for l in range(L)])
    kw = dict(scale=B / (R - 1), bias_correction=True, num_samples=R, batch_size=B)
    dd = gk.gram(mean_grads)
    gg = gk.gram([D + S for D, S in zip(mean_grads, shifts)])
    shapes = [D.shape for D in mean_grads]
    for method in ("eigh", "newton"):
        kw["method"] = method
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            old = sp.nuclear_stats_from_grams(mean_grams, dd, signal_grams=gg, shapes=shapes, **kw)
        assert "nuclear_stats_from_grams is deprecated" in _warned_here(caught, line)
        new = gk.nuclear_stats(mean_grams, mean_grad_grams=dd, signal_grams=gg, shapes=shapes, **kw)
        assert all(torch.equal(a, b) for a, b in zip(old, new))

        cov_old: list = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            old = sp.nuclear.nuclear_stats_select(mean_grams, mean_grads, shifts=shifts, select=sel,
                                                  return_sums=True, cov_out=cov_old, **kw)
        assert "nuclear_stats_select is deprecated" in _warned_here(caught, line)
        new = gk.nuclear_stats(mean_grams, mean_grads, shifts=shifts, **kw,
                               request=sp.NuclearRequest(select=sel, sums=True, covariances=True))
        assert len(old) == 4 and all(torch.equal(a, b) for a, b in zip(old, new) if a is not None)
        assert (old[2] is None) == (method == "newton")
        assert [l for l, _ in cov_old] == [l for l, _ in new.covariances] == [l for l in range(L) if sel[0][l]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(cov_old, new.covariances))

        if method == "newton":
            fold = lambda ls, C: C * 0.25  # noqa: E731
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                line = inspect.currentframe().f_lineno + 1
                old = sp.nuclear.nuclear_stats_from_grams_select(
                    mean_grams, dd, signal_grams=gg, shapes=shapes, select=sel, return_sums=True,
                    project=True, pool_fold=fold, **kw)
            assert "nuclear_stats_from_grams_select is deprecated" in _warned_here(caught, line)
            new = gk.nuclear_stats(mean_grams, mean_grad_grams=dd, signal_grams=gg, shapes=shapes, **kw,
                                   request=sp.NuclearRequest(select=sel, sums=True, pool_fold=fold))
            assert len(old) == 5
            for a, b in zip(old, (new.noise, new.signal, new.used64, new.sums, new.pooled)):
                assert (a is None and b is None) or torch.equal(a, b)
            with pytest.warns(DeprecationWarning), \
                    pytest.raises(ValueError, match="pool_fold: needs method 'newton' and return_sums=True"):
                sp.nuclear.nuclear_stats_from_grams_select(mean_grams, dd, pool_fold=fold, **kw)


def test_deprecated_aliases_are_quiet_for_the_package_itself(gen):
    """The package's own calls (distributed._share, until it moves to nuclear_stats) do not
    warn: a user could not act on it."""
    import warnings

    mean_grams, mean_grads = stats_inputs(samples(gen, 2, SHAPES[:2]))
    dd = gk.gram(mean_grads)
    code = "out = nuclear_stats_from_grams_select(mean_grams, dd, 2.0, select=None, project=True)"
    scope = {"__name__": "gns_kernels.distributed._share", "mean_grams": mean_grams, "dd": dd,
             "nuclear_stats_from_grams_select": sp.nuclear.nuclear_stats_from_grams_select}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(code, scope)
    assert len(scope["out"]) == 3
    scope["__name__"] = "user_code"
    with pytest.warns(DeprecationWarning, match="nuclear_stats_from_grams_select"):
        exec(code, scope)
