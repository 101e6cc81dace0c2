"""LRMultiplier composes with LR schedulers (closed form and recursive) and warmup_cosine."""
import math

import pytest
import torch

from gns_kernels.lr import LRMultiplier, warmup_cosine


def _opts():
    p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a = torch.optim.SGD([{"params": [p1], "lr": 0.1}, {"params": [p2], "lr": 0.02}])
    b = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.003)
    return a, b


def test_warmup_cosine_closed_form():
    assert warmup_cosine(0, 100, 10) == pytest.approx(1 / 11)
    assert warmup_cosine(9, 100, 10) == pytest.approx(10 / 11)
    assert warmup_cosine(10, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(55, 100, 10) == pytest.approx(0.5)        # half-way through cosine
    assert warmup_cosine(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(500, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(32.5, 100, 10, 0.2) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    for bad in (dict(t=0, total=0), dict(t=0, total=10, warmup=10), dict(t=0, total=10, min_ratio=2)):
        with pytest.raises(ValueError, match="warmup_cosine"):
            warmup_cosine(**bad)


def test_multiplier_on_lambda_schedule_all_groups():
    a, b = _opts()
    fa = lambda k: warmup_cosine(k, 20, 4)  # noqa: E731
    sa = torch.optim.lr_scheduler.LambdaLR(a, fa)
    sb = torch.optim.lr_scheduler.LambdaLR(b, fa)
    lrm = LRMultiplier([a, b], [sa, sb])
    omegas = [1, 1, 1, 2 ** 0.5, 2 ** 0.5, 2, 2, 3, 3, 3, 3, 3]
    for k, om in enumerate(omegas, start=1):
        a.step(); b.step()
        lrm.step(om)
        f = fa(k)
        assert lrm.lrs == pytest.approx([0.1 * f * om, 0.02 * f * om, 0.003 * f * om], rel=1e-12)


def test_multiplier_on_recursive_cosine_matches_unmultiplied_schedule():
    # CosineAnnealingLR computes its next value from the current lr: the multiplier must
    # not leak into the schedule.
    ref_opt, _ = _opts()
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=15, eta_min=0.001)
    opt, _ = _opts()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=15, eta_min=0.001)
    lrm = LRMultiplier(opt, sched)
    for k in range(1, 15):
        ref_opt.step(); ref.step()
        om = 1.0 + 0.25 * k
        opt.step(); lrm.step(om)
        expected = [g["lr"] * om for g in ref_opt.param_groups]
        assert lrm.lrs == pytest.approx(expected, rel=1e-12)


def test_resume_through_optimizer_state():
    opt, _ = _opts()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9 ** k)
    lrm = LRMultiplier(opt, sched)
    for k in range(3):
        opt.step(); lrm.step(1.5)
    state = (opt.state_dict(), sched.state_dict(), lrm.state_dict())
    opt2, _ = _opts()
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda k: 0.9 ** k)
    opt2.load_state_dict(state[0])
    sched2.load_state_dict(state[1])
    lrm2 = LRMultiplier(opt2, sched2)
    lrm2.load_state_dict(state[2])
    assert lrm2.lrs == lrm.lrs
    opt.step(); lrm.step(2.0)
    opt2.step(); lrm2.step(2.0)
    assert lrm2.lrs == pytest.approx(lrm.lrs, rel=1e-15)
    assert lrm.lrs[0] == pytest.approx(0.1 * 0.9 ** 4 * 2.0)


def test_bad_input():
    opt, _ = _opts()
    with pytest.raises(TypeError, match="optimizers"):
        LRMultiplier([object()])
    lrm = LRMultiplier(opt)
    opt.step()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="multiplier"):
            lrm.step(bad)
