"""gns_kernels.optim: SignSGD, Signum, SpecSGD against hand-computed steps; geometry_for."""
from __future__ import annotations

import math

import pytest
import torch

from gns_kernels.optim import SignSGD, Signum, SpecSGD, geometry_for, polar_factor


def _param(values, dtype=torch.float64):
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def _step(opt, p, grad):
    p.grad = torch.tensor(grad, dtype=p.dtype)
    opt.step()


# ---------------------------------------------------------------- SignSGD
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_signsgd_hand_step(dtype):
    p = _param([1.0, -2.0, 0.5, 3.0], dtype)
    opt = SignSGD([p], lr=0.125)
    _step(opt, p, [0.3, -0.1, 0.0, -5.0])        # sign(0) = 0: third coordinate stays
    assert p.tolist() == [0.875, -1.875, 0.5, 3.125]


def test_signsgd_decoupled_weight_decay():
    p = _param([1.0, -2.0, 0.5, 3.0])
    opt = SignSGD([p], lr=0.1, weight_decay=0.5)
    _step(opt, p, [0.3, -0.1, 0.0, -5.0])
    # x (1 - 0.05) - 0.1 sign(g) = [0.95-0.1, -1.9+0.1, 0.475, 2.85+0.1]
    torch.testing.assert_close(p.detach(), torch.tensor([0.85, -1.8, 0.475, 2.95], dtype=torch.float64),
                               rtol=0, atol=1e-15)


def test_signsgd_skips_params_without_grad_and_param_groups():
    a, b = _param([1.0]), _param([1.0])
    opt = SignSGD([{"params": [a], "lr": 0.5}, {"params": [b]}], lr=0.25)
    a.grad = torch.tensor([-3.0], dtype=torch.float64)
    opt.step()
    assert a.item() == 1.5 and b.item() == 1.0


# ---------------------------------------------------------------- Signum
def test_signum_hand_steps():
    p = _param([0.0, 0.0, 0.0])
    opt = Signum([p], lr=0.5, momentum=0.5)
    _step(opt, p, [2.0, -1.0, 2.0])
    # m1 = 0.5 * g1 = [1, -0.5, 1]
    assert opt.state[p]["momentum_buffer"].tolist() == [1.0, -0.5, 1.0]
    assert p.tolist() == [-0.5, 0.5, -0.5]
    _step(opt, p, [-0.5, 3.0, -2.0])
    # m2 = 0.5 m1 + 0.5 g2 = [0.25, 1.25, -0.5]: first coordinate follows the momentum, not g
    assert opt.state[p]["momentum_buffer"].tolist() == [0.25, 1.25, -0.5]
    assert p.tolist() == [-1.0, 0.0, 0.0]


def test_signum_zero_momentum_equals_signsgd():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(a.detach().clone())
    oa, ob = Signum([a], lr=0.01, momentum=0.0, weight_decay=0.1), SignSGD([b], lr=0.01, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


def test_signum_weight_decay_not_in_momentum():
    p = _param([1.0])
    opt = Signum([p], lr=0.1, momentum=0.5, weight_decay=1.0)
    _step(opt, p, [-0.25])
    assert opt.state[p]["momentum_buffer"].tolist() == [-0.125]
    assert p.item() == pytest.approx(1.0 * 0.9 + 0.1, abs=1e-15)


# ---------------------------------------------------------------- polar factor / SpecSGD
@pytest.mark.parametrize(
    "G,P",
    [
        ([[3.0, 0.0], [0.0, -2.0]], [[1.0, 0.0], [0.0, -1.0]]),
        ([[1.0, 1.0], [1.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]),            # rank 1: partial isometry
        ([[3.0, 4.0, 0.0]], [[0.6, 0.8, 0.0]]),                          # a row: G / ||G||_2
        ([[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]),
        ([[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]),           # sign(0) = 0
    ],
)
def test_polar_factor_hand(G, P):
    out = polar_factor(torch.tensor(G, dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor(P, dtype=torch.float64), rtol=0, atol=1e-14)


def test_polar_factor_rotation_times_scale():
    # G = R(30 deg) diag(3, 0.5) R(70 deg)^T: U = R(30), V = R(70), U V^T = R(-40 deg)
    def rot(deg):
        t = math.radians(deg)
        return torch.tensor([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]], dtype=torch.float64)

    G = rot(30) @ torch.diag(torch.tensor([3.0, 0.5], dtype=torch.float64)) @ rot(70).T
    torch.testing.assert_close(polar_factor(G), rot(-40), rtol=0, atol=1e-14)


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (5, 5)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_polar_factor_vs_inverse_sqrt(shape, dtype, tol):
    # independent formula: P = G (G^T G)^{-1/2} (tall) or (G G^T)^{-1/2} G (wide), via eigh
    G = torch.randn(*shape, dtype=torch.float64)
    if shape[0] >= shape[1]:
        w, V = torch.linalg.eigh(G.T @ G)
        ref = G @ (V @ torch.diag(w.rsqrt()) @ V.T)
    else:
        w, V = torch.linalg.eigh(G @ G.T)
        ref = (V @ torch.diag(w.rsqrt()) @ V.T) @ G
    out = polar_factor(G.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)


def test_specsgd_plain_step_with_weight_decay():
    p = _param([[1.0, 2.0], [3.0, 4.0]])
    opt = SpecSGD([p], lr=0.5, weight_decay=0.2)
    _step(opt, p, [[3.0, 0.0], [0.0, -2.0]])
    # x * 0.9 - 0.5 * diag(1, -1)
    torch.testing.assert_close(p.detach(), torch.tensor([[0.4, 1.8], [2.7, 4.1]], dtype=torch.float64),
                               rtol=0, atol=1e-14)


@pytest.mark.parametrize("nesterov,expected", [(False, [1.0, 1.0]), (True, [-1.0, 1.0])])
def test_specsgd_momentum_hand(nesterov, expected):
    p = _param([[0.0, 0.0], [0.0, 0.0]])
    opt = SpecSGD([p], lr=1.0, momentum=0.5, nesterov=nesterov)
    _step(opt, p, [[2.0, 0.0], [0.0, 2.0]])     # m1 = diag(1, 1) (nesterov: diag(1.5, 1.5))
    torch.testing.assert_close(p.detach(), -torch.eye(2, dtype=torch.float64), rtol=0, atol=1e-14)
    _step(opt, p, [[-0.8, 0.0], [0.0, 1.0]])
    # m2 = 0.5 m1 + 0.5 g2 = diag(0.1, 1.0) -> P = diag(1, 1)
    # nesterov: lerp(g2, m2, 0.5) = diag(-0.35, 1.0) -> P = diag(-1, 1)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                               torch.diag(torch.tensor([0.1, 1.0], dtype=torch.float64)), rtol=0, atol=1e-15)
    step2 = torch.diag(torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(p.detach(), -torch.eye(2, dtype=torch.float64) - step2, rtol=0, atol=1e-14)


def test_specsgd_rejects_non_matrix_params():
    with pytest.raises(ValueError, match="2-D"):
        SpecSGD([torch.nn.Parameter(torch.zeros(3))])
    opt = SpecSGD([torch.nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match=r"params\[0\] has shape \(2, 2, 2\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2, 2))]})


def test_specsgd_bfloat16_param():
    p = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    opt = SpecSGD([p], lr=0.5)
    p.grad = torch.tensor([[3.0, 0.0], [0.0, -2.0]], dtype=torch.bfloat16)
    opt.step()
    assert p.dtype == torch.bfloat16 and p.tolist() == [[-0.5, 0.0], [0.0, 0.5]]


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "make,exc,name",
    [
        (lambda ps: SignSGD(ps, lr=-1.0), ValueError, "lr"),
        (lambda ps: SignSGD(ps, weight_decay=-0.1), ValueError, "weight_decay"),
        (lambda ps: Signum(ps, momentum=1.0), ValueError, "momentum"),
        (lambda ps: Signum(ps, momentum=-0.5), ValueError, "momentum"),
        (lambda ps: Signum(ps, lr=float("nan")), ValueError, "lr"),
        (lambda ps: SpecSGD(ps, momentum=1.2), ValueError, "momentum"),
        (lambda ps: SpecSGD(ps, nesterov=True), ValueError, "nesterov"),
        (lambda ps: SpecSGD(ps, lr="0.1"), TypeError, "lr"),
    ],
)
def test_bad_arguments(make, exc, name):
    with pytest.raises(exc, match=name):
        make([torch.nn.Parameter(torch.zeros(2, 2))])


# ---------------------------------------------------------------- geometry_for
def _ps():
    return [torch.nn.Parameter(torch.zeros(2, 2))]


@pytest.mark.parametrize(
    "make,geometry",
    [
        (lambda: torch.optim.SGD(_ps(), lr=0.1), "l2"),
        (lambda: torch.optim.SGD(_ps(), lr=0.1, momentum=0.9, nesterov=True), "l2"),
        (lambda: SignSGD(_ps()), "l1"),
        (lambda: Signum(_ps()), "l1"),
        (lambda: torch.optim.Adam(_ps()), "l1"),
        (lambda: torch.optim.AdamW(_ps()), "l1"),
        (lambda: SpecSGD(_ps()), "nuclear"),
        (lambda: torch.optim.Muon(_ps()), "nuclear"),
    ],
)
def test_geometry_for(make, geometry):
    opt = make()
    assert geometry_for(opt) == geometry
    assert geometry_for(type(opt)) == geometry


def test_geometry_for_subclass_and_composites():
    class MySGD(torch.optim.SGD):
        pass

    assert geometry_for(MySGD(_ps(), lr=0.1)) == "l2"
    assert geometry_for([torch.optim.Muon(_ps()), torch.optim.AdamW(_ps())]) == "nuclear"
    assert geometry_for((Signum, torch.optim.AdamW)) == "l1"
    with pytest.raises(ValueError, match="mixed"):
        geometry_for([torch.optim.SGD, torch.optim.AdamW])
    with pytest.raises(ValueError, match="empty"):
        geometry_for([])


def test_geometry_for_unknown():
    with pytest.raises(ValueError, match="RMSprop"):
        geometry_for(torch.optim.RMSprop(_ps()))
    with pytest.raises(ValueError, match="str"):
        geometry_for("adamw")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_is_not_a_silent_finite_step(bad):
    G = torch.ones(3, 2, dtype=torch.float64)
    G[1, 0] = bad
    assert torch.isnan(polar_factor(G)).all()
    p = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = SpecSGD([p], lr=0.1)
    p.grad = G
    opt.step()
    assert torch.isnan(p).all()


@pytest.mark.parametrize("make", [lambda ps: SignSGD(ps, lr=0.5), lambda ps: Signum(ps, lr=0.5)])
def test_sign_methods_non_finite_gradient_gives_nan(make):
    # torch.sign(nan) == 0 would be a silent non-step: the NaN must reach the parameter
    p = _param([1.0, 1.0, 1.0])
    opt = make([p])
    _step(opt, p, [float("nan"), float("-inf"), -2.0])
    assert math.isnan(p[0].item()) and math.isnan(p[1].item()) and p[2].item() == 1.5
