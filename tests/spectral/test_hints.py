"""gns_kernels.spectral.EigHints: the per-shape float64 hint of the eigenvalue path."""
from __future__ import annotations

import pytest
import torch

import gns_kernels as gk
from gns_kernels import reference as ref
from gns_kernels import spectral as sp
from _spectral_data import TOL, randn, sparse_row_covariance


def test_hints_lookup_record_apply_state_dict():
    h = sp.EigHints()
    assert h.lookup([(768, 256), (3, 4)]) == [False, False]
    h.record([(768, 256), (3, 4), (768, 256)], [True, False, False])  # any matrix of a shape
    assert h.lookup([(768, 256)]) == [False]  # not applied yet
    h.apply()
    assert h.lookup([(768, 256), (3, 4), (9, 9)]) == [True, False, False]
    assert h.state_dict() == {"768x256": True, "3x4": False}
    h.record([(768, 256)], [False])
    h.record([(5, 5)], [True])
    h.discard()  # a measurement that did not finish leaves no trace
    assert h.state_dict() == {"768x256": True, "3x4": False}
    h.record([(768, 256)], [False])
    h.apply()  # the last measurement that saw a shape decides; unseen shapes keep theirs
    assert h.state_dict() == {"768x256": False, "3x4": False}
    h2 = sp.EigHints(h.state_dict())
    assert h2.state_dict() == h.state_dict() and len(h2) == 2
    sd = h2.state_dict()
    sd["1x1"] = True  # a copy: the hints are not changed through it
    assert "1x1" not in h2.state_dict()
    assert sp.shape_key(torch.Size([768, 256])) == "768x256"


def test_hints_reject_bad_state():
    h = sp.EigHints({"4x4": True})
    for bad in ({"4x4": 1}, {4: True}, ["4x4"], {"4 by 4": True}, {"": True}):
        with pytest.raises(ValueError, match="eig_float64"):
            h.load_state_dict(bad)
    assert h.state_dict() == {"4x4": True}  # unchanged by a refused load
    with pytest.raises(ValueError, match="state_dict: eig_float64"):
        h.load_state_dict({"4x4": None}, name="state_dict: eig_float64")
    with pytest.raises(ValueError, match="used64"):
        h.record([(4, 4)], [True, False])


def test_nuclear_stats_eig_hints_record_and_use(gen):
    # layer 0: sparse rows (rank-deficient: the float32 error bound fails, or float32 LAPACK
    # fails outright, float64 fallback); layer 1: well-conditioned full-rank Gram (float32
    # accepted). The hints say so after apply(); the hinted call (float64 directly) is as
    # accurate, and layer 1 takes the same path bit for bit.
    A0, D0, _ = sparse_row_covariance(int(torch.randint(0, 2**31, (1,), generator=gen)))
    X = [randn(gen, 40, 120, dtype=torch.float32) for _ in range(2)]
    A1 = torch.stack(gk.gram(X)).mean(0)
    D1 = torch.stack(X).mean(0)
    hints = sp.EigHints()
    n, s = gk.nuclear_stats([A0, A1], [D0, D1], scale=8.0, eig_hints=hints)
    assert hints.state_dict() == {}  # recorded, not yet applied
    hints.apply()
    assert hints.state_dict() == {"256x256": True, "40x120": False}
    n_h, s_h = gk.nuclear_stats([A0, A1], [D0, D1], scale=8.0, eig_hints=hints)
    assert torch.equal(n_h[1], n[1]) and torch.equal(s_h[1], s[1])  # no hint: same path
    for noise, signal in ((n, s), (n_h, s_h)):
        for l, (A, D) in enumerate(((A0, D0), (A1, D1))):
            C = 8.0 * (A.double() - D.double() @ D.double().T)
            assert float(noise[l]) == pytest.approx(float(ref.sqrt_trace(C)), rel=TOL)
            assert float(signal[l]) == pytest.approx(float(ref.nuclear_norm(D)), rel=TOL)
    # the hinted path is the float64 solve: the result the fallback gives
    hints.apply()
    n64, _ = gk.nuclear_stats([A0], [D0], scale=8.0, eig_hints=hints)
    assert torch.equal(n64, n[:1])
    # the Gram form (FSDP2), keyed by the shapes passed
    h2 = sp.EigHints()
    gk.nuclear_stats([A0, A1], mean_grad_grams=gk.gram([D0, D1]), scale=8.0, shapes=[(256, 256), (40, 120)],
                     eig_hints=h2)
    h2.apply()
    assert h2.state_dict() == {"256x256": True, "40x120": False}


def test_newton_method_records_nothing(gen):
    h = sp.EigHints({"40x120": True})
    X = [randn(gen, 40, 120, dtype=torch.float32) for _ in range(2)]
    gk.nuclear_stats([torch.stack(gk.gram(X)).mean(0)], [torch.stack(X).mean(0)], scale=2.0, method="newton",
                     eig_hints=h)
    h.apply()
    assert h.state_dict() == {"40x120": True}
