"""gns_kernels.spectral.nuclear_stats / nuclear_stats_from_grams vs the float64 eager
computation (gns_kernels.reference), within 1e-3."""
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
def test_nuclear_stats_from_grams_fsdp2(gen, method):
    """FSDP2: only the Gram of the mean (shifted) gradient, and the signal's Gram."""
    R, B = 3, 24
    layers = samples(gen, R, SHAPES)
    shifts = [randn(gen, *s[0].shape, dtype=torch.float32) for s in layers]
    mean_grams, mean_grads = stats_inputs(layers, shifts)
    dd = gk.gram(mean_grads)
    gg = gk.gram([D + S for D, S in zip(mean_grads, shifts)])
    noise, signal = sp.nuclear_stats_from_grams(mean_grams, dd, signal_grams=gg, scale=B / (R - 1),
                                                method=method)
    rn, rs = ref.nuclear_stats(layers, B)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL
    # without a shift the signal comes from mean_grad_grams itself
    mean_grams, mean_grads = stats_inputs(layers)
    noise, signal = sp.nuclear_stats_from_grams(mean_grams, gk.gram(mean_grads), scale=B / (R - 1),
                                                method=method)
    assert rel_err(noise, rn) < TOL and rel_err(signal, rs) < TOL


@pytest.mark.parametrize("R", [2, 4])
def test_nuclear_stats_from_grams_bias_correction_takes_other_dims_from_shapes(gen, R):
    B = 4 * R
    layers = samples(gen, R, SHAPES)
    mean_grams, mean_grads = stats_inputs(layers)
    kw = dict(scale=B / (R - 1), bias_correction=True, num_samples=R, batch_size=B)
    want, _ = gk.nuclear_stats(mean_grams, mean_grads, **kw)
    got, _ = sp.nuclear_stats_from_grams(mean_grams, gk.gram(mean_grads), shapes=[D.shape for D in mean_grads],
                                         **kw)
    assert rel_err(got, want) < 1e-5
    # without shapes (and other_dims) the correction has no other dimension to use
    wrong, _ = sp.nuclear_stats_from_grams(mean_grams, gk.gram(mean_grads),
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
    from gns_kernels.bias import nuclear_sqrt_trace_corrected

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
    noise, signal = sp.nuclear_stats_from_grams([torch.zeros(0, 0)], [torch.zeros(0, 0)], scale=1.0,
                                                method=method)
    assert noise.tolist() == [0.0] and signal.tolist() == [0.0]


def test_nuclear_stats_rejects_bad_input(gen):
    A = torch.eye(4)
    D = torch.ones(4, 6)
    with pytest.raises(ValueError, match="mean_grads.*nuclear_stats_from_grams"):
        gk.nuclear_stats([A], None, scale=1.0)
    with pytest.raises(TypeError):
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
    with pytest.raises(ValueError, match="method"):
        gk.nuclear_stats([A], [D], scale=1.0, method="svd")
    with pytest.raises(ValueError, match="eig_hints"):
        gk.nuclear_stats([A], [D], scale=1.0, eig_hints={"4x6": True})
    with pytest.raises(ValueError, match=r"mean_grad_grams\[0\]"):
        sp.nuclear_stats_from_grams([A], [torch.eye(3)], scale=1.0)
    with pytest.raises(ValueError, match=r"signal_grams\[0\]"):
        sp.nuclear_stats_from_grams([A], [A], signal_grams=[torch.eye(3)], scale=1.0)
    with pytest.raises(ValueError, match="mean_grad_grams: expected 1"):
        sp.nuclear_stats_from_grams([A], [A, A], scale=1.0)
    with pytest.raises(ValueError, match=r"shapes\[0\]"):
        sp.nuclear_stats_from_grams([A], [A], scale=1.0, shapes=[(5, 6)])
    with pytest.raises(ValueError, match="shapes"):
        sp.nuclear_stats_from_grams([A], [A], scale=1.0, eig_hints=sp.EigHints())
    A2 = A.clone()
    A2[0, 3] = 5.0
    assert torch.isfinite(gk.nuclear_stats([A2], [D], scale=1.0)[0]).all()  # no check on the hot path
    with pytest.raises(ValueError, match=r"mean_grams\[0\].*symmetric"):
        gk.nuclear_stats([A2], [D], scale=1.0, validate=True)
    with pytest.raises(ValueError, match=r"mean_grad_grams\[0\].*symmetric"):
        sp.nuclear_stats_from_grams([A], [A2], scale=1.0, validate=True)


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
def test_nuclear_stats_select_solves_only_the_selection(gen, method):
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
    n1, s1, used = sp.nuclear.nuclear_stats_select(mean_grams, mean_grads, select=(sel_n, sel_s), **kw)
    n2, s2, _ = sp.nuclear.nuclear_stats_select(
        mean_grams, mean_grads, select=([not b for b in sel_n], [not b for b in sel_s]), **kw)
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
    assert (used is None) == (method == "newton")
    if used is not None:
        assert used.dtype == torch.bool and used.shape == (L,)


def test_nuclear_stats_select_rejects_bad_selection(gen):
    layers = samples(gen, 2, SHAPES[:2])
    mean_grams, mean_grads = stats_inputs(layers)
    for bad in ([True], ([True], [True, True]), ([True, True], [1, 0]), ([True, True],)):
        with pytest.raises(ValueError, match="select"):
            sp.nuclear.nuclear_stats_select(mean_grams, mean_grads, select=bad)


def test_nuclear_stats_select_report_without_recording(gen):
    """record_hints=False leaves the hints untouched and returns the report instead."""
    layers = samples(gen, 2, SHAPES)
    mean_grams, mean_grads = stats_inputs(layers)
    h1, h2 = sp.EigHints(), sp.EigHints()
    _, _, used = sp.nuclear.nuclear_stats_select(mean_grams, mean_grads, scale=2.0, method="eigh",
                                                 eig_hints=h1, record_hints=False)
    h1.apply()
    assert len(h1) == 0
    gk.nuclear_stats(mean_grams, mean_grads, scale=2.0, method="eigh", eig_hints=h2)
    h2.apply()
    h1.record([tuple(D.shape) for D in mean_grads], used.tolist())
    h1.apply()
    assert h1.state_dict() == h2.state_dict() and len(h2) > 0
