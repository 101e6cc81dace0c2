"""gns_kernels.probe: the critical-batch criterion on synthetic loss curves with known
answers, theta from a GNS, the branch's LR rule and data stream, the GNS measurement
against gk.estimate, and (tests/demo/test_demo_probe.py) the plumbing on a tiny demo run."""
import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels.probe import (controller_lr_rule, critical_batch, measure_gns, run_branch,
                               run_probe, samples_to_target, summarize, theta_for)


def _linear_curve(S, start=3.0, target=2.0, every=100, end=4000):
    """Loss falling linearly from `start` at 0 to `target` at S examples (and on below),
    evaluated every `every` examples: the samples to target are S exactly. S None: a curve
    that stays above the target."""
    xs = list(range(0, end + 1, every))
    if S is None:
        return xs, [start - 0.5 * (start - target) * x / end for x in xs]
    return xs, [start - (start - target) * x / S for x in xs]


def test_samples_to_target_interpolates_between_evaluations():
    assert samples_to_target([0, 100, 200], [3.0, 2.0, 1.0], 1.5) == pytest.approx(150.0)
    assert samples_to_target([0, 100, 200], [3.0, 2.0, 1.0], 2.0) == pytest.approx(100.0)
    assert samples_to_target([0, 100, 200], [3.0, 2.0, 1.0], 2.75) == pytest.approx(25.0)
    assert samples_to_target([0, 100, 200], [3.0, 2.0, 1.0], 0.5) is None
    assert samples_to_target([0, 100], [1.0, 0.5], 2.0) == 0.0          # already below at the start
    # the FIRST crossing counts, a later rise does not undo it
    assert samples_to_target([0, 10, 20, 30], [3.0, 1.0, 4.0, 0.5], 2.0) == pytest.approx(5.0)
    # a non-finite evaluation never reaches, and no interpolation from it
    assert samples_to_target([0, 10, 20], [3.0, math.nan, 1.0], 2.0) == 20.0


@pytest.mark.parametrize("samples, losses, target", [
    ([], [], 1.0), ([0, 1], [1.0], 1.0), ([0, 0], [2.0, 1.0], 1.0), ([10, 5], [2.0, 1.0], 1.0),
    ([0, 1], [2.0, 1.0], math.nan)])
def test_samples_to_target_bad_input(samples, losses, target):
    with pytest.raises(ValueError, match="samples_to_target"):
        samples_to_target(samples, losses, target)


def test_critical_batch_known_answers():
    # S(B) = 1000, 1100, 1200, 2000, never: ratios 1, 1.1, 1.2, 2.0 -> 64 passes, 128 fails
    curves = {16: _linear_curve(1000), 32: _linear_curve(1100), 64: _linear_curve(1200),
              128: _linear_curve(2000), 256: _linear_curve(None)}
    r = critical_batch(curves, 2.0, 1.25)
    assert r.samples_to_target[16] == pytest.approx(1000)
    assert r.samples_to_target[128] == pytest.approx(2000)
    assert r.samples_to_target[256] is None
    assert r.ratios[64] == pytest.approx(1.2) and r.ratios[256] is None
    assert r.b_crit_grid == 64 and r.censored == ""
    # log B linear in log r between (64, 1.2) and (128, 2.0): by hand
    t = (math.log(1.25) - math.log(1.2)) / (math.log(2.0) - math.log(1.2))
    assert r.b_crit == pytest.approx(64 * 2 ** t)
    assert 64 < r.b_crit < 128


def test_critical_batch_geometric_midpoint():
    # ratio 1 at 64 and 1.25^2 at 128: the crossing is halfway in log r, so sqrt(64 * 128)
    curves = {16: _linear_curve(1000), 64: _linear_curve(1000), 128: _linear_curve(1562.5)}
    r = critical_batch(curves, 2.0, 1.25)
    assert r.b_crit_grid == 64
    assert r.b_crit == pytest.approx(math.sqrt(64 * 128))
    # a larger tolerance moves it: ratio 1.5625 is now inside, 128 is the grid's top
    r2 = critical_batch(curves, 2.0, 1.6)
    assert r2.b_crit_grid == 128 and r2.b_crit == 128 and r2.censored == "grid top"


def test_critical_batch_needs_every_smaller_batch_to_pass():
    # 32 fails (1.3) although 64 passes (1.1): the critical batch is 16, not 64
    curves = {16: _linear_curve(1000), 32: _linear_curve(1300), 64: _linear_curve(1100)}
    r = critical_batch(curves, 2.0, 1.25)
    assert r.b_crit_grid == 16
    assert 16 < r.b_crit < 32


def test_critical_batch_censored_when_the_next_never_reaches():
    curves = {16: _linear_curve(1000), 32: _linear_curve(1200), 64: _linear_curve(None)}
    r = critical_batch(curves, 2.0, 1.25)
    assert r.b_crit_grid == 32 and r.b_crit == 32 and r.censored == "not reached above"


def test_critical_batch_bad_input():
    with pytest.raises(ValueError, match="never reaches the target"):
        critical_batch({16: _linear_curve(None), 32: _linear_curve(1000)}, 2.0)
    with pytest.raises(ValueError, match="tolerance"):
        critical_batch({16: _linear_curve(1000)}, 2.0, 0.9)
    with pytest.raises(ValueError, match="batch sizes"):
        critical_batch({16.5: _linear_curve(1000)}, 2.0)


def test_theta_for_inverts_algorithm_1():
    assert theta_for(100.0, 400.0) == pytest.approx(0.5)
    assert theta_for(36.0, 100.0) == pytest.approx(0.6)
    # Algorithm 1 at that theta asks for the batch back (before rounding)
    gns, B = 77.3, 190.0
    th = theta_for(gns, B)
    assert gns / th ** 2 == pytest.approx(B)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="theta_for"):
            theta_for(bad, 10.0)


def test_summarize_spread():
    rs = [critical_batch({16: _linear_curve(1000), 64: _linear_curve(S)}, 2.0, 1.25)
          for S in (1000, 1562.5, 4000)]
    s = summarize(rs)
    # S = 4000: ratio 4 at 64, so log B = log 16 + (log 1.25 / log 4) log 4 -> 16 x 1.25
    assert s["b_crit_max"] == 64 and s["b_crit_min"] == pytest.approx(20.0)
    assert s["b_crit_grid_min"] == 16 and s["b_crit_grid_max"] == 64
    assert s["b_crit_median"] == pytest.approx(math.sqrt(16 * 64))
    assert s["ratios"][64]["mean"] == pytest.approx((1.0 + 1.5625 + 4.0) / 3)
    assert s["ratios"][64]["reached"] == 3


def test_controller_lr_rule():
    rule = controller_lr_rule(lambda n: 0.5 if n >= 1000 else 1.0, 900, 16, "sqrt")
    assert rule(0, 64) == pytest.approx(2.0)          # schedule(900) = 1, sqrt(64/16) = 2
    assert rule(100, 16) == pytest.approx(0.5)        # schedule(1000) = 0.5
    assert controller_lr_rule(None, 0, 16, "linear")(0, 64) == pytest.approx(4.0)
    assert controller_lr_rule(None, 0, 16, "none")(0, 64) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="lr_scaling"):
        controller_lr_rule(None, 0, 16, "cube")


def _toy(seed=0):
    torch.manual_seed(seed)
    w_true = torch.randn(5)

    def draw(n, gen):
        x = torch.randn(n, 5, generator=gen)
        return x, x @ w_true + 0.3 * torch.randn(n, generator=gen)

    def loss_fn(model, batch):
        x, y = batch
        return ((model(x).squeeze(-1) - y) ** 2).mean()
    return draw, loss_fn


def test_run_branch_applies_the_lr_rule_and_reads_one_stream():
    draw, loss_fn = _toy()
    init = torch.nn.Linear(5, 1, bias=False)
    state = {k: v.clone() for k, v in init.state_dict().items()}

    def start():
        m = torch.nn.Linear(5, 1, bias=False)
        m.load_state_dict(state)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.param_groups[0]["base_lr"] = 0.05       # as AdaptiveBatching stores it
        return m, [opt]

    evaluate = lambda m: 0.0   # noqa: E731
    rule = lambda n, B: 2.0 if n == 0 else 0.0      # noqa: E731  (only the first step moves)
    s, _ = run_branch(start, draw, loss_fn, evaluate, 8, seed=3, max_samples=24, eval_every=8,
                      lr_rule=rule)
    assert s == [0, 8, 16, 24]
    s, _ = run_branch(start, draw, loss_fn, evaluate, 8, seed=3, max_samples=28, eval_every=16,
                      lr_rule=rule)
    assert s == [0, 16, 24]    # every 16 examples and at the end (28 would pass the budget)
    # by hand: one SGD step of lr 0.05 x 2 on the first 8 examples of seed 3's stream
    m, _ = start()
    batch = draw(8, torch.Generator().manual_seed(3))
    g = torch.autograd.grad(loss_fn(m, batch), list(m.parameters()))[0]
    expect = state["weight"] - 0.1 * g
    captured = {}   # the weights at the last evaluation

    def ev(model):
        captured["w"] = model.weight.detach().clone()
        return 0.0
    run_branch(start, draw, loss_fn, ev, 8, seed=3, max_samples=24, eval_every=8, lr_rule=rule)
    torch.testing.assert_close(captured["w"], expect, rtol=1e-6, atol=1e-7)


class _ModeRecorder(torch.nn.Module):
    """Linear(5, 1) behind a dropout; every forward records (phase, training, grad enabled)."""

    def __init__(self, log):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.lin = torch.nn.Linear(5, 1, bias=False)
        self.log, self.phase = log, "train"

    def forward(self, x):
        self.log.append((self.phase, self.training, torch.is_grad_enabled()))
        return self.lin(self.drop(x))


@pytest.mark.parametrize("start_in_eval_mode", [False, True])
def test_run_branch_evaluates_in_eval_mode_without_grad_and_trains_in_train_mode(start_in_eval_mode):
    """Every evaluate call (the one at 0 included) sees model.eval() under no_grad, so dropout
    is off and the evaluation is deterministic; every training step runs in train mode."""
    draw, loss_fn = _toy()
    log, models, xv = [], [], torch.randn(64, 5, generator=torch.Generator().manual_seed(1))

    def start():
        torch.manual_seed(0)
        m = _ModeRecorder(log)
        if start_in_eval_mode:
            m.eval()
        models.append(m)
        return m, [torch.optim.SGD(m.parameters(), lr=0.01)]

    def evaluate(m):
        m.phase = "eval"
        try:
            a, b = m(xv), m(xv)
            assert not a.requires_grad
            torch.testing.assert_close(a, b)     # dropout off: the same twice
            return a.pow(2).mean().item()
        finally:
            m.phase = "train"
    s, _ = run_branch(start, draw, loss_fn, evaluate, 8, seed=0, max_samples=32, eval_every=16,
                      lr_rule=lambda n, B: 1.0)
    assert s == [0, 16, 32]
    evals = [r for r in log if r[0] == "eval"]
    steps = [r for r in log if r[0] == "train"]
    assert len(evals) == 2 * len(s) and len(steps) == 4
    assert all(not training and not grad for _, training, grad in evals)
    assert all(training and grad for _, training, grad in steps)
    # the mode is put back after each evaluation (the branch's model after the last one)
    assert models[0].training is True


def test_run_probe_on_a_toy_problem_orders_the_batches():
    """A noisy least-squares problem from a poor start: every branch runs and the result
    holds a B_crit inside the grid; the plumbing, not a value."""
    draw, loss_fn = _toy(1)
    xv, yv = draw(512, torch.Generator().manual_seed(99))

    def start():
        torch.manual_seed(5)
        m = torch.nn.Linear(5, 1, bias=False)
        return m, [torch.optim.SGD(m.parameters(), lr=0.02)]

    def evaluate(m):
        return loss_fn(m, (xv, yv)).item()
    res = run_probe(start, draw, loss_fn, evaluate, [2, 4, 8, 64], seeds=[0, 1], samples=256,
                    lr_rule=controller_lr_rule(None, 0, 2, "sqrt"), evals=16)
    assert set(res["seeds"]) == {0, 1}
    for v in res["seeds"].values():
        assert set(v["curves"]) == {2, 4, 8, 64}
        assert v["result"].ratios[2] == pytest.approx(1.0)
        assert 2 <= v["result"].b_crit <= 64
    with pytest.raises(ValueError, match="batch_sizes"):
        run_probe(start, draw, loss_fn, evaluate, [8], [0], 64, lambda n, B: 1.0)


def test_measure_gns_equals_estimate_on_the_same_draws():
    draw, loss_fn = _toy(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    params = list(model.parameters())

    def lf(m, batch):
        x, y = batch
        return ((m(x).squeeze(-1) - y) ** 2).mean()
    out = measure_gns(model, params, draw, lf, micro_batch=3, micro_batches=4, repeats=1, seed=11)
    gen = torch.Generator().manual_seed(11)
    samples = [[t.detach() for t in torch.autograd.grad(lf(model, draw(3, gen)), params)]
               for _ in range(4)]
    for g in ("l1", "nuclear", "l2"):
        est = gk.estimate(samples, batch_size=12, geometry=g, bias_correction=False)
        assert out[g]["gns"] == pytest.approx(est.gns, rel=1e-5)
    # repeats average noise and signal separately, then divide
    out2 = measure_gns(model, params, draw, lf, 3, 4, repeats=3, seed=11)
    e = out2["l2"]
    assert e["gns"] == pytest.approx(e["noise"] / e["signal"])
    assert len(e["gns_each"]) == 3 and e["gns_each"][0] == pytest.approx(out["l2"]["gns"], rel=1e-5)
    assert all(p.grad is None for p in params)
    with pytest.raises(ValueError, match="micro_batches"):
        measure_gns(model, params, draw, lf, 3, 1)
