"""The steep-spectrum accuracy family (issue 43 item 5) at small sides: the noise of every
route nuclear_stats offers (eigh, the CPU default; the float64 Newton chain; host) within
max(1e-3, 2 e_in) of float64 eigh of the same float32 inputs, e_in what the float32 inputs
already lost. The family and its definitions: bench/accuracy_family.py (the full family,
sides to 768, runs there). newton-tf32 stays outside the bound (docs/spectral.md) and is
not tested against it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import gns_kernels as gk

_PATH = Path(__file__).resolve().parents[2] / "bench" / "accuracy_family.py"
_spec = importlib.util.spec_from_file_location("accuracy_family", _PATH)
af = importlib.util.module_from_spec(_spec)
sys.modules["accuracy_family"] = af
_spec.loader.exec_module(af)

SIDES = (64, 96, 128, 192)
RS = (2, 4, 8)
SEEDS = (2, 3)  # two of the family's seeds whose corner cases a float32 D D^T fails


@pytest.fixture(scope="module")
def family():
    """(case, measurement): 2 seeds x 4 sides x 3 R x (1 random spectrum + 1 corner),
    generated on one intra-op thread (small float64 products on a loaded 2-core machine
    took a minute multi-threaded, under a second on one; restored for the routes)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [(c, af.make(c)) for seed in SEEDS for c in af.cases(seed, SIDES, RS, 1)]
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("route", ["eigh", "newton", "host"])
def test_every_route_meets_the_steep_spectrum_bound(family, route):
    bad = []
    for c, m in family:
        (err, bound), = af.evaluate(m, [route]).values()
        if not err <= bound:
            bad.append((err / bound, c))
    assert not bad, bad


def test_auto_on_cpu_is_the_eigh_route(family):
    c, m = family[0]
    assert torch.equal(gk.nuclear_stats([m["A32"]], [m["D32"]], scale=m["scale"])[0],
                       gk.nuclear_stats([m["A32"]], [m["D32"]], scale=m["scale"], method="eigh")[0])


def test_the_family_is_sharp(family):
    """A float32 D D^T (the eigh route before issue 43; the hooks' eigh path still passes
    one) breaks the bound on the family's corner cases: the family can tell."""
    worst = max(af.evaluate(m, ["eigh-grams"])["eigh-grams"][0] / max(1e-3, 2 * m["e_in"])
                for c, m in family if c["ratio"] == 10.0)
    assert worst > 1.0


def test_the_case_definitions():
    """e_in and the reference are what the module says: C_in formed in float64 from the
    float32 inputs; a case is reproducible from its parameters."""
    cs = af.cases(3, (16,), (2, 4), 2)
    assert len(cs) == 2 * 3 and sum(c["ratio"] == 10.0 for c in cs) == 2
    a, b = af.make(cs[1]), af.make(cs[1])
    assert torch.equal(a["A32"], b["A32"]) and a["A32"].dtype == a["D32"].dtype == torch.float32
    C_in = a["scale"] * (a["A32"].double() - a["D32"].double() @ a["D32"].double().T)
    assert torch.equal(C_in, a["C_in"]) and a["t_in"] == af.sqrt_trace64(C_in)
