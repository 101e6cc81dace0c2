"""gns_kernels.reference (the float64 oracle) against closed forms worked out by hand.

Every other test compares a fast path with reference.py, so reference.py itself is checked
here on tiny inputs whose statistics are known exactly (two samples with a known variance,
diagonal and rotated matrices with known square-root traces and singular values).
"""
from __future__ import annotations

import math

import pytest
import torch

from gns_kernels import reference as ref


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_coordinate_variance_two_samples():
    # samples (1, 3) and (3, 7), B = 2 (b = 1 example each): unbiased variances 2 and 8
    s2 = ref.coordinate_variance([t(1.0, 3.0), t(3.0, 7.0)], batch_size=2)
    assert torch.equal(s2, t(2.0, 8.0))
    # B = 6 (b = 3 examples per sample): one example's variance is 3x a sample mean's
    assert torch.equal(ref.coordinate_variance([t(1.0, 3.0), t(3.0, 7.0)], batch_size=6), t(6.0, 24.0))
    assert torch.equal(ref.mean_of_samples([t(1.0, 3.0), t(3.0, 7.0)]), t(2.0, 5.0))


def test_coordinate_variance_three_samples():
    # 0, 3, 6: mean 3, squared deviations 9 + 0 + 9 = 18, unbiased variance 9; B = 3
    assert torch.equal(ref.coordinate_variance([t(0.0), t(3.0), t(6.0)], batch_size=3), t(9.0))


def test_raw_gns_l2_l1_two_samples():
    rg = [[t(1.0, 3.0)], [t(3.0, 7.0)]]
    # l2: noise 2 + 8 = 10, signal 2^2 + 5^2 = 29
    assert ref.raw_gns(rg, 2, "l2") == (10.0, 29.0)
    # l1: noise (sqrt 2 + sqrt 8)^2 = (3 sqrt 2)^2 = 18, signal (2 + 5)^2 = 49
    noise, signal = ref.raw_gns(rg, 2, "l1")
    assert noise == pytest.approx(18.0, rel=1e-15) and signal == 49.0


def test_raw_gns_nuclear_two_samples():
    # G1 = 2 E11, G2 = 0: mean E11 (||.||_S1 = 1), deviations +-E11,
    # C = B/(R(R-1)) * 2 E11 = 2 E11 (B = 2): tr C^{1/2} = sqrt 2, noise = 2, signal = 1
    g1 = t([2.0, 0.0], [0.0, 0.0])
    rg = [[g1, t(5.0)], [torch.zeros(2, 2, dtype=torch.float64), t(1.0)]]  # the 1-D tensor is ignored
    noise, signal = ref.raw_gns(rg, 2, "nuclear")
    assert noise == pytest.approx(2.0, rel=1e-15) and signal == pytest.approx(1.0, rel=1e-15)


def test_sqrt_trace_diagonal_and_rotated():
    assert float(ref.sqrt_trace(torch.diag(t(4.0, 9.0, 0.0)))) == 5.0
    assert float(ref.sqrt_trace(torch.diag(t(-1.0, 16.0)))) == 4.0  # negative rounding clamped
    c, s = math.cos(0.7), math.sin(0.7)
    Q = t([c, -s], [s, c])
    A = Q @ torch.diag(t(1.0, 4.0)) @ Q.T  # eigenvalues 1, 4 in a rotated basis
    assert float(ref.sqrt_trace(A)) == pytest.approx(3.0, rel=1e-14)
    batched = torch.stack([torch.diag(t(1.0, 1.0)), torch.diag(t(9.0, 16.0))])
    assert ref.sqrt_trace(batched).tolist() == [2.0, 7.0]


def test_nuclear_norm_closed_forms():
    assert float(ref.nuclear_norm(torch.diag(t(3.0, -2.0)))) == pytest.approx(5.0, rel=1e-15)
    u, v = t(1.0, 2.0, 2.0), t(3.0, 4.0)  # rank one: ||u v^T||_S1 = |u| |v| = 3 * 5
    assert float(ref.nuclear_norm(torch.outer(u, v))) == pytest.approx(15.0, rel=1e-14)


def test_gram_sides():
    G = t([1.0, 2.0, 3.0])
    assert ref.gram_side(G.shape) == "row" and ref.gram_side((3, 1)) == "col"
    assert torch.equal(ref.gram(G), t([14.0]))
    assert torch.equal(ref.gram(G, "col"), torch.outer(t(1.0, 2.0, 3.0), t(1.0, 2.0, 3.0)))


def test_row_covariance_two_samples():
    e11 = t([1.0, 0.0], [0.0, 0.0])
    # mean 0, deviations +-E11: C = B/(R(R-1)) * 2 E11 = 2 E11 (B = 2, R = 2)
    C = ref.row_covariance([e11, -e11], batch_size=2)
    assert torch.equal(C, 2 * e11)
    # both sides give the same square-root trace (3 x 2 matrices: row 3 x 3, col 2 x 2)
    a, b = t([1.0, 0.0], [2.0, 1.0], [0.0, 3.0]), t([0.0, 1.0], [1.0, 1.0], [2.0, 0.0])
    row = ref.sqrt_trace(ref.row_covariance([a, b], 2, "row"))
    col = ref.sqrt_trace(ref.row_covariance([a, b], 2, "col"))
    # deviations +-(a - b)/2 = +-D: C = 2 D D^T (B = 2, R = 2): tr C^{1/2} = sqrt 2 ||D||_S1
    D = (a - b) / 2
    want = math.sqrt(2.0) * float(torch.linalg.svdvals(D).sum())
    assert float(row) == pytest.approx(want, rel=1e-13) and float(col) == pytest.approx(want, rel=1e-13)


def test_row_covariance_sides_at_three_samples():
    # R = 3: tr(C^{1/2}) is the nuclear norm of the deviations stacked along the other
    # side, times sqrt(B/(R(R-1))); the row and col sides are different numbers
    a, b, c = t([1.0, 0.0], [2.0, 1.0], [0.0, 3.0]), t([0.0, 1.0], [1.0, 1.0], [2.0, 0.0]), \
        t([1.0, 1.0], [0.0, 0.0], [0.0, 1.0])
    mean = (a + b + c) / 3
    dev = [a - mean, b - mean, c - mean]
    k = math.sqrt(4.0 / 6.0)  # B = 4, R = 3
    want_row = k * float(torch.linalg.svdvals(torch.cat(dev, dim=1)).sum())  # 3 x 6
    want_col = k * float(torch.linalg.svdvals(torch.cat(dev, dim=0)).sum())  # 9 x 2
    row = float(ref.sqrt_trace(ref.row_covariance([a, b, c], 4, "row")))
    col = float(ref.sqrt_trace(ref.row_covariance([a, b, c], 4, "col")))
    assert row == pytest.approx(want_row, rel=1e-12) and col == pytest.approx(want_col, rel=1e-12)
    assert abs(row - col) > 0.01 * row  # 3.3% apart here


def test_variance_norms_closed_form():
    d, q = t(1.0, 2.0), t(2.0, 5.0)  # s2 = 2 * (2 - 1, 5 - 4) = (2, 2)
    got = ref.variance_norms(d, q, 2.0)
    assert got.tolist() == pytest.approx([2 * math.sqrt(2.0), 3.0, 4.0, 5.0], rel=1e-15)
    got = ref.variance_norms(d, q, 2.0, shift=t(1.0, 1.0))  # g = d + shift = (2, 3)
    assert got.tolist() == pytest.approx([2 * math.sqrt(2.0), 5.0, 4.0, 13.0], rel=1e-15)


def test_variance_norms_clamp_and_nan():
    got = ref.variance_norms(t(2.0, 1.0), t(3.0, 2.0), 1.0)  # s2 = (3 - 4, 2 - 1) = (-1 -> 0, 1)
    assert got.tolist() == [1.0, 3.0, 1.0, 5.0]
    got = ref.variance_norms(t(1.0, 1.0), t(float("nan"), 2.0), 1.0)  # NaN stays NaN
    assert math.isnan(got[0]) and math.isnan(got[2]) and got[1] == 2.0 and got[3] == 2.0


def test_variance_norms_same_for_any_shift():
    # samples (1, 3) and (3, 7): the shifted moments give the same variance for any shift
    a, b = t(1.0, 3.0), t(3.0, 7.0)
    for S in (t(0.0, 0.0), t(2.0, 5.0), t(-4.0, 10.0)):
        d = ((a - S) + (b - S)) / 2
        q = ((a - S) ** 2 + (b - S) ** 2) / 2
        got = ref.variance_norms(d, q, 2.0, S)  # scale B/(R-1) = 2 with B = 2, R = 2
        assert got.tolist() == pytest.approx([math.sqrt(2.0) + math.sqrt(8.0), 7.0, 10.0, 29.0], rel=1e-15)


def test_square_pack_and_accumulate_sq():
    assert ref.square_pack(t(1.0, -2.0), t(3.0, 0.0)).tolist() == [-2.0, -2.0, 4.0, 4.0]
    assert ref.square_pack(t(1.0, -2.0)).tolist() == [1.0, -2.0, 1.0, 4.0]
    sq, prev = ref.accumulate_sq(t(3.0), t(1.0), t(5.0))
    assert sq.tolist() == [9.0] and prev.tolist() == [3.0]


def test_bad_input():
    with pytest.raises(ValueError, match="at least 2 samples"):
        ref.coordinate_variance([t(1.0)], 1)
    with pytest.raises(ValueError, match=r"samples\[1\]"):
        ref.mean_of_samples([t(1.0), t(1.0, 2.0)])
    with pytest.raises(ValueError, match="square"):
        ref.sqrt_trace(t([1.0, 2.0]))
    with pytest.raises(ValueError, match="geometry"):
        ref.raw_gns([[t(1.0)], [t(2.0)]], 2, "l3")
