"""gns_kernels.spectral.nuclear_args: NuclearRequest (each bad field raises naming it) and
the one-form rule of nuclear_stats's inputs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gns_kernels import spectral as sp
from gns_kernels.spectral.nuclear_args import check_form, check_select


def test_request_defaults_and_normalized_select():
    r = sp.NuclearRequest()
    assert (r.select, r.record_hints, r.sums, r.covariances, r.pool_fold) == (None, True, False, False, None)
    r = sp.NuclearRequest(select=([True, False], [False, True]))
    assert r.select == ((True, False), (False, True))  # tuples: the request stays immutable
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.sums = True
    assert check_select(r.select, 2) == ([True, False], [False, True])
    assert check_select(None, 3) == ([True] * 3, [True] * 3)
    with pytest.raises(TypeError):
        sp.NuclearRequest(None)  # keyword-only


def _fold(ls, C):
    return C


@pytest.mark.parametrize("kw, field", [
    (dict(select=[True, True]), "select"),
    (dict(select=([True],)), "select"),
    (dict(select=([True], [1])), "select"),
    (dict(select=([True], ["yes"])), "select"),
    (dict(record_hints=1), "record_hints"),
    (dict(sums="yes"), "sums"),
    (dict(covariances=None), "covariances"),
    (dict(pool_fold=3, sums=True), "pool_fold"),
    (dict(pool_fold=_fold), "pool_fold"),  # needs sums=True
])
def test_request_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        sp.NuclearRequest(**kw)


def test_select_length_is_checked_against_the_layers():
    with pytest.raises(ValueError, match=r"^select: expected signal_mask as 2 bools"):
        check_select(((True, True), (True,)), 2)


def test_inputs_of_one_form_only():
    A, D = torch.eye(2), torch.ones(2, 3)
    check_form([D], None, [D], "row", None, None)  # gradient form
    check_form(None, [A], None, "auto", [A], [(2, 3)])  # Gram form
    for args, field in (((None, None, None, "auto", [A], None), "signal_grams"),
                        (([D], None, None, "auto", None, [(2, 3)]), "shapes"),
                        (([D], [A], None, "auto", None, None), "mean_grads"),
                        ((None, [A], [D], "auto", None, None), "shifts"),
                        ((None, [A], None, "col", None, None), "side")):
        with pytest.raises(ValueError, match=rf"^{field}:"):
            check_form(*args)
