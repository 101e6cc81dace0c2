"""Attack suite, the loop's stateful objects: after a refused call an object is as it was
before the call, for every ``load_state_dict`` (corrupted entries, another configuration)
and the methods that can refuse; the controller keeps a resumed batch inside its
configuration; metrics writers take tensors, numpy scalars and non-finite values.

Reproductions of issue 28: a rejected sampler load left a half-made sampler at position 0
(a retry with the right seed then raised "already made" and the user restarted the
stream); ``AdaptiveBatchSize.load_state_dict(strict=False)`` kept a batch above the new
cap for ever; ``CSVWriter`` wrote a 0-d tensor as its repr.
"""
from __future__ import annotations

import copy
import csv
import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk
from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.controller import AdaptiveBatchSize
from gns_kernels.data import MicroBatchSampler
from gns_kernels.distributed import MicroBatchGNS
from gns_kernels.lr import LRMultiplier
from gns_kernels.metrics import CSVWriter, to_tensorboard


# ----------------------------------------------------------------------------- helpers
def same(a, b) -> bool:
    """Deep equality of state_dicts: tensors by dtype, shape and bits; floats with nan ==
    nan; containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
                and torch.equal(a.isnan(), b.isnan()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


_BAD_VALUES = [None, "x", -1, 2.5, True, float("nan"), [], {"version": 999}]


def mutations(sd: dict, depth: int = 2, prefix: str = ""):
    """(label, mutated copy) for every key of ``sd`` (and of its nested dicts down to
    ``depth``): the key deleted, and replaced by each of a few wrong values."""
    for key in list(sd):
        label = f"{prefix}{key}"
        bad = copy.deepcopy(sd)
        del bad[key]
        yield f"{label}:deleted", bad
        for v in _BAD_VALUES:
            bad = copy.deepcopy(sd)
            bad[key] = v
            yield f"{label}={v!r}", bad
        if depth > 1 and isinstance(sd[key], dict):
            for sub_label, sub in mutations(sd[key], depth - 1, f"{label}."):
                bad = copy.deepcopy(sd)
                bad[key] = sub
                yield sub_label, bad


def check_refusals_leave_it_unchanged(obj, sd, load, min_refused: int):
    """Load every mutation of ``sd``; each refused load must leave ``obj.state_dict()``
    exactly as before; accepted ones are undone by reloading the original. Returns the
    number refused (so a loader that accepts everything cannot pass)."""
    refused = 0
    for label, bad in mutations(sd):
        before = obj.state_dict()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load(bad)
        except Exception:  # noqa: BLE001 - any refusal; what matters is what it leaves
            refused += 1
            after = obj.state_dict()
            assert same(before, after), f"{type(obj).__name__}: refused {label} changed the state"
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load(sd)
    assert refused >= min_refused, refused
    return refused


def _problem(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 6, generator=g)
    Y = X @ torch.randn(6, 1, generator=g) + 0.5 * torch.randn(n, 1, generator=g)
    return X, Y


def _fresh_coord(geometry="l1", seed=3, max_batch_size=32):
    """A one-rank coordinator (MicroBatchGNS, pool on) on a fresh model, before any step:
    (coordinator, MicroBatchGNS, optimizer, model)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.1 * k))
    mb = MicroBatchGNS(model.parameters(), geometry=geometry, every=2, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8,
                             max_batch_size=max_batch_size, theta=0.6, schedulers=[sched])
    return coord, mb, opt, model


def _one_rank_run(steps=6, geometry="l1", seed=3):
    """A real one-rank coordinator (MicroBatchGNS, pool on) after ``steps`` steps."""
    X, Y = _problem()
    coord, mb, opt, model = _fresh_coord(geometry, seed)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X), seed=3))
    for _ in coord.steps(max_steps=steps):
        for (x, y), ctx in coord.micro_batches(loader):
            with ctx:
                (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
        opt.step(); opt.zero_grad(); coord.step()
    return coord, mb, opt, loader


# ------------------------------------------------------------- item 2: sampler after a refusal
def test_rejected_sampler_load_leaves_no_half_made_sampler():
    coord, mb, opt, _ = _one_rank_run(steps=5)
    ck = copy.deepcopy(coord.state_dict())
    saved_pos = ck["sampler"]["position"]
    assert saved_pos > 0

    X, Y = _problem()
    c2, *_ = _fresh_coord()
    c2.load_state_dict(ck)
    with pytest.raises(ValueError, match="seed=3"):
        c2.batch_sampler(len(X), seed=4)          # the checkpoint used seed 3
    assert c2.sampler is None
    with pytest.raises(ValueError, match="num_samples"):
        c2.batch_sampler(len(X) + 1, seed=3)
    assert c2.sampler is None
    s = c2.batch_sampler(len(X), seed=3)          # the retry continues at the saved position
    assert s.state_dict()["position"] == saved_pos
    assert same(c2.state_dict()["sampler"], ck["sampler"])
    with pytest.raises(RuntimeError, match="already made"):
        c2.batch_sampler(len(X), seed=3)


# ---------------------------------------------------------- every load_state_dict, corrupted
def test_coordinator_refused_loads_leave_everything_unchanged():
    coord, mb, opt, _ = _one_rank_run(steps=6)
    sd = copy.deepcopy(coord.state_dict())
    assert sd["hook"].get("pool"), "the run must have filled the pool for this test to mean anything"
    lrs = [g["lr"] for g in opt.param_groups]
    n = check_refusals_leave_it_unchanged(coord, sd, coord.load_state_dict, min_refused=60)
    assert [g["lr"] for g in opt.param_groups] == lrs
    assert n > 0


def test_coordinator_refused_load_of_another_configuration():
    coord, *_ = _one_rank_run(steps=4)
    before = coord.state_dict()
    other = copy.deepcopy(before)
    other["controller"]["config"]["theta"] = 0.3
    with pytest.raises(ValueError, match="theta"):
        coord.load_state_dict(other)
    assert same(coord.state_dict(), before)


def test_controller_refused_loads_leave_it_unchanged():
    c = AdaptiveBatchSize(initial_batch_size=8, theta=0.6, every=1, max_batch_size=64, multiple_of=8)
    for k in range(4):
        c.update(k, gk.GNSEstimate(gns=3.0, noise=30.0 * (k + 1), signal=10.0, valid=True,
                                   signal_unbiased=None, geometry="l1", num_samples=2,
                                   batch_size=8.0, bias_corrected=True))
    check_refusals_leave_it_unchanged(c, copy.deepcopy(c.state_dict()), c.load_state_dict,
                                      min_refused=40)
    other = AdaptiveBatchSize(initial_batch_size=8, theta=0.3, every=1).state_dict()
    before = c.state_dict()
    with pytest.raises(ValueError, match="theta"):
        c.load_state_dict(other)
    assert same(c.state_dict(), before)


def test_hook_state_and_sampler_and_lr_refused_loads_leave_them_unchanged():
    coord, mb, opt, _ = _one_rank_run(steps=6, geometry="nuclear")
    check_refusals_leave_it_unchanged(mb, copy.deepcopy(mb.state_dict()), mb.load_state_dict,
                                      min_refused=10)
    s = coord.sampler
    check_refusals_leave_it_unchanged(s, copy.deepcopy(s.state_dict()), s.load_state_dict,
                                      min_refused=10)
    lrm = LRMultiplier([opt])
    lrm.set_multiplier(2.0)
    check_refusals_leave_it_unchanged(lrm, copy.deepcopy(lrm.state_dict()), lrm.load_state_dict,
                                      min_refused=2)


def test_sampler_missing_key_is_named():
    s = MicroBatchSampler(100, 4)
    sd = s.state_dict()
    for key in ("num_samples", "seed", "shuffle", "position"):
        bad = {k: v for k, v in sd.items() if k != key}
        with pytest.raises(ValueError, match=key):
            s.load_state_dict(bad)


# ------------------------------------------------------------ refusing methods, not loads
def test_refused_steps_leave_the_coordinator_unchanged():
    coord, mb, opt, loader = _one_rank_run(steps=3)
    before = coord.state_dict()
    with pytest.raises(ValueError):
        coord.step(coord.current_step + 5)       # not the current step
    assert same(coord.state_dict(), before)
    c = coord.controller
    cb = c.state_dict()
    for bad in (-1, 1.5, "3"):
        with pytest.raises((TypeError, ValueError)):
            c.update(bad, None)
        assert same(c.state_dict(), cb)


# ------------------------------------------------------------------ item 7: the new cap
@pytest.mark.parametrize("cap", [64, 1024])
def test_non_strict_load_brings_the_batch_inside_the_new_cap(cap):
    big = AdaptiveBatchSize(initial_batch_size=16, theta=0.6, every=1, max_batch_size=4096, multiple_of=16)
    big.load_state_dict({**big.state_dict(), "batch_size": 1776})
    assert big.batch_size == 1776
    small = AdaptiveBatchSize(initial_batch_size=16, theta=0.6, every=1, max_batch_size=cap, multiple_of=16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        small.load_state_dict(big.state_dict(), strict=False)
    want = min(1776, cap)
    assert small.batch_size == want
    assert small.lr_multiplier == pytest.approx(math.sqrt(want / 16))
    clamp = [x for x in w if "max_batch_size" in str(x.message)]
    assert len(clamp) == (1 if cap < 1776 else 0)
    # and the next decision stays within the cap
    small.update(big.last_step + 1 if big.last_step is not None else 0,
                 gk.GNSEstimate(gns=1e9, noise=1e9, signal=1.0, valid=True, signal_unbiased=None,
                                geometry="l1", num_samples=2, batch_size=float(want),
                                bias_corrected=True))
    assert small.batch_size <= cap


def test_non_strict_load_raises_a_batch_below_the_new_initial():
    a = AdaptiveBatchSize(initial_batch_size=8, theta=0.6, every=1, multiple_of=8)
    b = AdaptiveBatchSize(initial_batch_size=32, theta=0.6, every=1, multiple_of=8)
    with pytest.warns(RuntimeWarning, match="below initial_batch_size"):
        b.load_state_dict(a.state_dict(), strict=False)
    assert b.batch_size == 32 and b.lr_multiplier == 1.0


def test_coordinator_resume_under_a_smaller_cap():
    coord, *_ = _one_rank_run(steps=6)
    sd = coord.state_dict()
    sd["schedule"]["batch_size"] = 32
    c2, mb, *_ = _fresh_coord(max_batch_size=16)
    with pytest.warns(RuntimeWarning, match="max_batch_size"):
        c2.load_state_dict(sd, strict=False)
    assert c2.batch_size == 16 and mb.batch_size == 16
    assert c2.lr_multiplier == pytest.approx(math.sqrt(2.0))


# ------------------------------------------------------------------ item 4: metrics writers
_VALUES = [
    ("t64", torch.tensor(1 / 3, dtype=torch.float64), 1 / 3),
    ("t32", torch.tensor(0.1, dtype=torch.float32), float(np.float32(0.1))),
    ("tbf16", torch.tensor(1.5, dtype=torch.bfloat16), 1.5),
    ("t1", torch.tensor([2.25]), 2.25),
    ("tint", torch.tensor(7), 7),
    ("tbool", torch.tensor(True), 1),
    ("np64", np.float64(1 / 7), 1 / 7),
    ("np32", np.float32(0.2), float(np.float32(0.2))),
    ("npint", np.int32(-3), -3),
    ("npbool", np.bool_(False), 0),
    ("np0d", np.array(0.75), 0.75),
    ("py", 1e-300, 1e-300),
]


def test_csv_writer_writes_numbers_exactly(tmp_path):
    path = tmp_path / "m.csv"
    w = CSVWriter(path)
    row = {k: v for k, v, _ in _VALUES}
    row.update(nan=float("nan"), tnan=torch.tensor(float("nan")), inf=float("inf"),
               ninf=torch.tensor(-float("inf")), none=None)
    w.write(row)
    with open(path, newline="") as fh:
        header, cells = list(csv.reader(fh))
    got = dict(zip(header, cells))
    for k, _, want in _VALUES:
        assert float(got[k]) == want, (k, got[k])    # the same float64 back: no 4-digit repr
        assert "tensor" not in got[k] and "(" not in got[k]
    assert got["nan"] == got["tnan"] == got["none"] == ""
    assert got["inf"] == "inf" and got["ninf"] == "-inf"


def test_csv_writer_refuses_a_tensor_of_several_numbers_and_writes_nothing(tmp_path):
    path = tmp_path / "m.csv"
    w = CSVWriter(path)
    with pytest.raises(ValueError, match="'loss'.*2 elements"):
        w.write({"step": 0, "loss": torch.zeros(2)})
    assert not path.exists() and w.columns is None      # nothing written, nothing fixed
    w.write({"step": 0, "gns": 1.0})
    assert w.columns == ["step", "gns"]


def test_tensorboard_writer_takes_tensors_and_numpy():
    seen = []

    class Writer:
        def add_scalar(self, tag, value, step):
            seen.append((tag, value, step))
    row = {k: v for k, v, _ in _VALUES}
    row.update(step=torch.tensor(5), nan=torch.tensor(float("nan")), inf=np.float64("inf"),
               vec=torch.zeros(3), text="x")
    n = to_tensorboard(Writer(), row)
    assert n == len(_VALUES) == len(seen)
    for (tag, value, step), (k, _, want) in zip(seen, _VALUES):
        assert tag == "gns/" + k and value == float(want) and type(value) is float and step == 5


# ------------------------------------------------------------- loop mistakes (issue 29)
def _loop_parts(opt_kind="adamw", schedulers=None, grad_scaler=None, n=200):
    X, Y = _problem(n=n)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, max_batch_size=32,
                             schedulers=schedulers, grad_scaler=grad_scaler)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    return model, opt, coord, loader


def _backward_all(coord, loader, model, scaler=None):
    for (x, y), ctx in coord.micro_batches(loader, model):
        with ctx:
            loss = torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps
            (scaler.scale(loss) if scaler is not None else loss).backward()


def test_coord_step_before_optimizer_step_raises_and_changes_nothing():
    """coord.step() before opt.step(): every step ran with the next step's LR (2.12e-3
    instead of 1e-3 at step 0). Now the first such call raises naming the order."""
    model, opt, coord, loader = _loop_parts()
    _backward_all(coord, loader, model)
    before = coord.state_dict()
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(RuntimeError, match="before optimizer.step\\(\\).*then coord.step\\(\\)"):
        coord.step()
    assert same(coord.state_dict(), before) and opt.param_groups[0]["lr"] == lr
    opt.step(); opt.zero_grad()
    coord.step()                                  # the right order goes on
    assert coord.current_step == 1


def test_grad_scaler_not_passed_raises():
    """A GradScaler that steps the optimizers but was not given to the coordinator: the
    noise read scale^2 too large (1.88e11 against 1.12e4) and the EMAs mixed scales."""
    model, opt, coord, loader = _loop_parts()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    _backward_all(coord, loader, model, scaler)
    scaler.step(opt); scaler.update(); opt.zero_grad()
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        coord.step()


def test_grad_scaler_passed_and_a_skipped_step_is_fine():
    """With grad_scaler= a step whose gradient overflowed is skipped by the scaler (no
    optimizer step, the scale drops): that is not the coord.step-before-opt.step mistake."""
    model, opt, coord, loader = _loop_parts(grad_scaler=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    model, opt, coord, loader = _loop_parts(grad_scaler=scaler)
    for k in range(3):
        _backward_all(coord, loader, model, scaler)
        if k == 1:
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt); scaler.update(); opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            coord.step()
    assert coord.current_step == 3


def _muon_adamw_run(pass_both):
    X, Y = _problem(n=200)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    muon, adam = torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)
    mb = MicroBatchGNS(mats, geometry="nuclear", every=1, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, [muon, adam] if pass_both else [muon], micro_batch_size=4,
                             initial_batch_size=8)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    return model, (muon, adam), coord, loader


def test_only_one_of_two_optimizers_passed_warns_once():
    """Muon + AdamW with only [muon] passed: AdamW's LR was never scaled, silently."""
    model, (muon, adam), coord, loader = _muon_adamw_run(pass_both=False)
    with pytest.warns(RuntimeWarning, match="2 parameters received gradients but are in none.*0.bias, 2.bias"):
        _backward_all(coord, loader, model)
    muon.step(); adam.step(); muon.zero_grad(); adam.zero_grad(); coord.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward_all(coord, loader, model)      # once
    model, _, coord, loader = _muon_adamw_run(pass_both=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward_all(coord, loader, model)


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            yield torch.randn(6, generator=g), torch.randn(1, generator=g)


def test_iterable_dataset_with_several_workers_warns():
    """An IterableDataset read by 2 workers: every sample came twice, silently."""
    model, opt, coord, _ = _loop_parts()
    loader = DataLoader(_Stream(64), batch_size=4, num_workers=2)
    with pytest.warns(RuntimeWarning, match="num_workers=2.*get_worker_info"):
        _backward_all(coord, loader, model)
    # the two workers' copies gave the step's two micro-batches the same examples: the
    # measured noise is exactly 0, which the coordinator names too (issue 39)
    opt.step(); opt.zero_grad()
    with pytest.warns(RuntimeWarning, match="noise measured at step 0 is exactly 0"):
        coord.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward_all_one = DataLoader(_Stream(64), batch_size=4, num_workers=0)
        _backward_all(coord, _backward_all_one, model)


def test_forgotten_coordinator_load_on_resume_warns():
    """Model and optimizer loaded but not the coordinator: the stream restarted at 0 and B
    fell back to B_0 with only an 'lr changed' warning."""
    model, opt, coord, loader = _loop_parts()
    for _ in range(3):
        _backward_all(coord, loader, model)
        opt.step(); opt.zero_grad(); coord.step()
    ck = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    model2, opt2, coord2, loader2 = _loop_parts()
    model2.load_state_dict(ck["model"]); opt2.load_state_dict(ck["opt"])
    with pytest.warns(RuntimeWarning, match="coord.load_state_dict\\(ckpt\\['coord'\\]\\)"):
        _backward_all(coord2, loader2, model2)
    model3, opt3, coord3, loader3 = _loop_parts()
    model3.load_state_dict(ck["model"]); opt3.load_state_dict(ck["opt"])
    coord3.load_state_dict(coord.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward_all(coord3, loader3, model3)


def test_frozen_ddp_parameter_is_named_not_hidden():
    """A DDP parameter frozen halfway stops DDP's buckets, so the hook never runs; the
    coordinator said only 'register the hook'. A parameter frozen after the coordinator was
    built is now named when the next step's micro-batches begin (issue 39: on one rank and
    under FSDP2 it was measured over fewer parameters without a word); a parameter unused
    in a forward still gets DDP's unused-parameter rule named at coord.step()."""
    from gns_kernels.distributed import GNSHookState

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = GNSHookState(geometry="l1", every=1, batch_size=8)
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2, rank=0)
    loader = [(torch.randn(4, 3), torch.randn(4, 1))] * 4
    model[0].weight.requires_grad_(False)                   # frozen halfway
    with pytest.raises(RuntimeError, match="parameters were frozen.*0.weight"):
        next(coord.micro_batches(loader, model))
    model[0].weight.requires_grad_(True)
    for (x, y), ctx in coord.micro_batches(loader, model):  # no hook ran: state.step stays 0
        with ctx:
            torch.nn.functional.mse_loss(model[1](x.new_ones(4, 4)), y).backward()  # model[0] unused
    opt.step()
    with pytest.raises(RuntimeError, match="find_unused_parameters.*A parameter unused in this forward"):
        coord.step()
