"""Ground truth from per-example gradients (torch.func vmap(grad)) on the built-in MLP and
attention block: the estimators, averaged over simulated partitions into ranks, agree with
the exact single-example noise.

Stated tolerances (R = 8 ranks of b = 16 examples, 160 partitions, 4 standard errors of
margin computed from the draws):
  l2 noise (tr Sigma) and l2 signal_unbiased: unbiased, within 4 standard errors;
  l1 corrected ||s||_1: within 3% of ||sigma||_1; the raw one within 3% of c4(R) ||sigma||_1;
  nuclear corrected sum_l tr(C_l^1/2): within 5% of the exact value.
"""
from __future__ import annotations

import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels import stats
from gns_kernels.demo import synthetic as syn


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: intra-op threads only add contention on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=["mlp", "attention"])
def problem(request):
    kind = request.param
    model = syn.make_model(kind, seed=0)
    X, Y = syn.make_data(kind, 1024, seed=1)
    pe = syn.per_example_grads(model, X, Y)
    return kind, model, X, Y, pe, syn.ground_truth(pe)


def test_per_example_grads_exact(problem):
    kind, model, X, Y, pe, _ = problem
    for i in (0, 5, 17):
        model.zero_grad()
        syn.mse_loss(model(X[i : i + 1])[0], Y[i]).backward()
        for name, p in model.named_parameters():
            assert torch.allclose(pe[name][i], p.grad, rtol=1e-10, atol=1e-12), name


def test_ground_truth_moments(problem):
    _, _, _, _, pe, truth = problem
    for name, g in pe.items():
        assert torch.allclose(truth.mean[name], g.mean(0), rtol=1e-12, atol=1e-15)
        assert torch.allclose(truth.variance[name], g.var(0, unbiased=False), rtol=1e-10, atol=1e-15)
        if g.dim() == 3:
            m, n = g.shape[1:]
            dev = g - g.mean(0)
            full = (dev @ dev.mT if m <= n else dev.mT @ dev).mean(0)
            assert torch.allclose(truth.row_cov[name], full, rtol=1e-10, atol=1e-15)
    # the truths are the paper's single-example quantities
    assert truth.noise("l2") == pytest.approx(float(sum(v.sum() for v in truth.variance.values())))
    assert truth.gns("l1") == pytest.approx(truth.noise("l1") / truth.signal("l1"))
    with pytest.raises(ValueError, match="geometry"):
        truth.noise("l3")


def _mean_se(v):
    t = torch.tensor(v, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(t.numel()))


def test_estimators_match_ground_truth(problem):
    kind, _, _, _, pe, truth = problem
    R, b, draws = 8, 16, 160
    sim = syn.simulate_ranks_batched(pe, R, R * b, draws, torch.Generator().manual_seed(3))
    names = list(sim)
    vals = {k: [] for k in ("l2", "l2_sig", "l1", "l1_raw", "nuc", "nuc_raw")}
    for t in range(draws):
        rg = [[sim[k][t, j] for k in names] for j in range(R)]
        e2, e1, en = (gk.estimate(rg, R * b, geo) for geo in ("l2", "l1", "nuclear"))
        vals["l2"].append(e2.noise)
        vals["l2_sig"].append(e2.signal_unbiased)
        vals["l1"].append(math.sqrt(e1.noise))
        vals["l1_raw"].append(math.sqrt(e1.noise_raw))
        vals["nuc"].append(math.sqrt(en.noise))
        vals["nuc_raw"].append(math.sqrt(en.noise_raw))

    m, se = _mean_se(vals["l2"])
    assert abs(m - truth.noise("l2")) <= 4 * se, (kind, m / truth.noise("l2"))
    m, se = _mean_se(vals["l2_sig"])
    assert abs(m - truth.signal("l2")) <= 4 * se, (kind, m / truth.signal("l2"))

    T1 = math.sqrt(truth.noise("l1"))
    m, se = _mean_se(vals["l1"])
    assert abs(m / T1 - 1) + 4 * se / T1 <= 0.03, (kind, m / T1)
    m, se = _mean_se(vals["l1_raw"])
    assert abs(m / T1 - stats.c4(R)) + 4 * se / T1 <= 0.03, (kind, m / T1)

    TN = math.sqrt(truth.noise("nuclear"))
    m, se = _mean_se(vals["nuc"])
    assert abs(m / TN - 1) + 4 * se / TN <= 0.05, (kind, m / TN)
    mr, ser = _mean_se(vals["nuc_raw"])
    assert mr < m  # the correction moves toward the truth from below


def test_simulate_ranks():
    pe = {"w": torch.arange(12.0).reshape(4, 3), "v": torch.arange(4.0)}
    g = torch.Generator().manual_seed(0)
    sim = syn.simulate_ranks_batched(pe, 2, 6, 5, g)
    assert sim["w"].shape == (5, 2, 3) and sim["v"].shape == (5, 2)
    # each rank mean is a mean of 3 rows of the same examples for every parameter
    w_idx = (sim["w"][..., 0] / 3.0)  # row k of w starts at 3k: mean row index
    assert torch.allclose(w_idx, sim["v"])
    rg = syn.simulate_ranks({"w": torch.ones(1, 2, 2)}, 4, 8, g)
    assert len(rg) == 4 and all(torch.equal(r[0], torch.ones(2, 2)) for r in rg)
    with pytest.raises(ValueError, match="batch_size"):
        syn.simulate_ranks(pe, 4, 6)
    with pytest.raises(ValueError, match="num_ranks"):
        syn.simulate_ranks(pe, 0, 6)
    with pytest.raises(ValueError, match="kind"):
        syn.make_model("cnn")
    with pytest.raises(ValueError, match="kind"):
        syn.make_data("cnn")
