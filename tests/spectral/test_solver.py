"""gns_kernels.spectral.solver: the typed solver configs (EighConfig, NewtonConfig), each
field checked once at construction, and the method strings that stand for them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import gns_kernels as gk
from gns_kernels import spectral as sp
from gns_kernels.spectral.solver import METHODS, SolverConfig, check_solver, resolve_method, resolve_solver
from _spectral_data import rand_psd


def test_defaults_are_resolved_and_frozen():
    e, n = sp.EighConfig(), sp.NewtonConfig()
    assert e.tol == sp.EIGH_TOL and e.method == "eigh"
    kmin = sp.newton_min_iters(1e-6)
    assert (n.iters, n.eps, n.precision, n.method) == (kmin + 3, 1e-6, "ieee", "newton")
    assert n == sp.NewtonConfig(iters=kmin + 3, eps=1e-6, precision="ieee")
    f64 = sp.NewtonConfig(precision="float64")
    assert (f64.iters, f64.eps) == (sp.newton_min_iters(1e-12) + 3, 1e-12)
    assert sp.NewtonConfig(precision="tf32").method == "newton-tf32"
    assert sp.NewtonConfig(eps=1e-4).iters == sp.newton_min_iters(1e-4) + 3
    for cfg, field in ((e, "tol"), (n, "iters")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, field, 1)
    with pytest.raises(TypeError):
        sp.NewtonConfig(20)  # keyword-only
    with pytest.raises(TypeError, match="SolverConfig"):
        SolverConfig()


@pytest.mark.parametrize("kw, field", [
    (dict(tol=-1e-4), "tol"),
    (dict(tol=float("nan")), "tol"),
    (dict(tol=float("inf")), "tol"),
    (dict(tol="5e-4"), "tol"),
    (dict(tol=True), "tol"),
])
def test_eigh_config_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        sp.EighConfig(**kw)


@pytest.mark.parametrize("kw, field", [
    (dict(precision="bf16"), "precision"),
    (dict(precision=None), "precision"),
    (dict(eps=1e-9), "eps"),  # below the float32 floor 1e-6
    (dict(eps=1e-13, precision="float64"), "eps"),  # below the float64 floor 1e-12
    (dict(eps=0.5), "eps"),
    (dict(eps="1e-6"), "eps"),
    (dict(eps=True), "eps"),
    (dict(iters=3), "iters"),  # below newton_min_iters(1e-6)
    (dict(iters=sp.NEWTON_MAX_ITERS + 1), "iters"),
    (dict(iters=15.5), "iters"),
    (dict(iters=True), "iters"),
    (dict(iters="20"), "iters"),
])
def test_newton_config_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        sp.NewtonConfig(**kw)


def test_iters_range_follows_eps():
    """The smallest iteration count depends on the shift: allowed at eps 1e-4, not at 1e-6."""
    k4, k6 = sp.newton_min_iters(1e-4), sp.newton_min_iters(1e-6)
    assert k4 < k6
    assert sp.NewtonConfig(iters=k4, eps=1e-4).iters == k4
    with pytest.raises(ValueError, match="^iters:"):
        sp.NewtonConfig(iters=k4, eps=1e-6)


def test_method_strings_resolve_by_route_and_device():
    routes = {"eigh": sp.EighConfig(tol=1e-3), "newton": sp.NewtonConfig(precision="float64"),
              "newton-tf32": sp.NewtonConfig(precision="tf32")}
    cpu, gpu = torch.device("cpu"), torch.device("meta")
    assert resolve_solver("auto", cpu, routes) is routes["eigh"]
    assert resolve_solver("auto", gpu, routes) is routes["newton"]
    for m in ("eigh", "newton", "newton-tf32"):
        assert resolve_solver(m, cpu, routes) is routes[m]
        assert resolve_method(m, gpu) == m
    cfg = sp.NewtonConfig()
    assert resolve_solver(cfg, cpu, routes) is cfg  # a config is taken as it is
    assert METHODS == ("auto", "eigh", "newton", "newton-tf32", "host")
    assert resolve_solver("host", cpu, dict(routes, host=sp.HostConfig())) == sp.HostConfig()
    assert resolve_method("host", gpu) == "host"
    for bad in ("svd", None, 3, sp.EighConfig):
        with pytest.raises(ValueError, match="^method:"):
            check_solver(bad)


def test_sqrt_trace_takes_a_config_bitwise_like_its_string(gen):
    A = torch.stack([rand_psd(gen, 17, 1e4, torch.float32) for _ in range(3)])
    pairs = [
        (dict(method="eigh"), sp.EighConfig()),
        (dict(method="eigh", tol=1e-6), sp.EighConfig(tol=1e-6)),
        (dict(method="newton"), sp.NewtonConfig()),
        (dict(method="newton", iters=30, eps=1e-4), sp.NewtonConfig(iters=30, eps=1e-4)),
        (dict(method="newton", precision="float64"), sp.NewtonConfig(precision="float64")),
        (dict(method="newton-tf32"), sp.NewtonConfig(precision="tf32")),
        (dict(method="auto"), sp.EighConfig()),  # on CPU
        (dict(method="host"), sp.HostConfig()),
    ]
    for kw, cfg in pairs:
        assert torch.equal(gk.sqrt_trace(A, **kw), gk.sqrt_trace(A, method=cfg)), kw


@pytest.mark.parametrize("kw, field", [
    (dict(iters=20), "iters"), (dict(eps=1e-4), "eps"), (dict(tol=1e-3), "tol"), (dict(precision="tf32"), "precision"),
])
def test_sqrt_trace_refuses_loose_keywords_beside_a_config(kw, field):
    for cfg in (sp.EighConfig(), sp.NewtonConfig(), sp.HostConfig()):
        with pytest.raises(ValueError, match=rf"^{field}: set it in the solver config"):
            gk.sqrt_trace(torch.eye(3), method=cfg, **kw)
