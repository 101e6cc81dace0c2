"""Issue 39, one rank: the reproductions of a refused constructor, the CSV writer's cut row,
a forgotten coordinator load, the loop budget's arguments, the loop steps that change what
the coordinator measures (gradients not zero at a step's start, a parameter frozen
halfway, a micro-batch without backward), batches that are not what the coordinator
planned, and messages that named the wrong mistake or pointed at the package's line.
The DDP / FSDP2 / mesh cases are in tests/distributed/test_loop_mistakes.py."""
from __future__ import annotations

import copy
import csv
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk
from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.data import MicroBatchSampler
from gns_kernels.distributed import MicroBatchGNS

HERE = __file__


def _problem(n=400):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, 6, generator=g)
    return X, X @ torch.randn(6, 1, generator=g) + 0.5 * torch.randn(n, 1, generator=g)


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _readme(every=1, n=400, **kw):
    """The README's one-rank loop parts: (model, opt, coord, loader)."""
    X, Y = _problem(n)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coord = AdaptiveBatching(model, opt, every=every, micro_batch_size=4, initial_batch_size=8,
                             max_batch_size=64, **kw)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    return model, opt, coord, loader


def _loop(model, opt, coord, loader, steps, *, zero_grad=True, set_to_none=True, backward=True,
          freeze_at=None, each=None):
    rows = []
    for batch in coord.batches(loader, max_steps=steps):
        if freeze_at is not None and batch.step == freeze_at:
            model[0].weight.requires_grad_(False)
        for x, y in batch:
            loss = torch.nn.functional.mse_loss(model(x), y) / len(batch)
            if backward:
                loss.backward()
        if each is not None:
            each(batch)
        opt.step()
        if zero_grad:
            opt.zero_grad(set_to_none=set_to_none)
        rows.append(coord.metrics())
    return rows


# ----------------------------------------------------------------------------- item 1
def test_refused_constructor_leaves_model_and_optimizers_as_they_were():
    """One rank: the refused constructor had put its MicroBatchGNS's gradient hook on the
    model and (with lr_schedule) rewritten the param groups; the corrected retry runs."""
    X, Y = _problem()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    w = model[0].weight
    for kw, err, match in [
        (dict(initial_batch_size=6), ValueError, "initial_batch_size: expected a multiple"),
        (dict(initial_batch_size=8, lr_schedule=lambda n: float("nan")), ValueError, "lr_schedule\\(0\\)"),
        (dict(initial_batch_size=8, schedulers=[object()]), TypeError, "schedulers\\[0\\]"),
        (dict(initial_batch_size=8, max_batch_size=10), ValueError, "max_batch_size"),
    ]:
        with pytest.raises(err, match=match):
            AdaptiveBatching(model, opt, micro_batch_size=4, **kw)
        assert not w._post_accumulate_grad_hooks            # no MicroBatchGNS hook left behind
        assert not opt._optimizer_step_post_hooks
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    coord = AdaptiveBatching(model, opt, micro_batch_size=4, initial_batch_size=8, every=1)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    rows = _loop(model, opt, coord, loader, 2)
    assert [r["valid"] for r in rows] == [True, True]
    assert len(w._post_accumulate_grad_hooks) == 1


# ----------------------------------------------------------------------------- item 3
def test_csv_writer_does_not_glue_a_row_onto_a_cut_one(tmp_path):
    """A crash mid-write left 'a,b\\r\\n1,2' (no line end): the next row gave [1,23,4]."""
    p = tmp_path / "m.csv"
    p.write_bytes(b"a,b\r\n1,2")
    with pytest.warns(RuntimeWarning, match="no line end") as rec:
        gk.CSVWriter(p).write({"a": 3, "b": 4})
    assert rec[0].filename == HERE
    gk.CSVWriter(p).write({"a": 5, "b": 6})
    with open(p, newline="") as fh:
        assert list(csv.reader(fh)) == [["a", "b"], ["1", "2"], ["3", "4"], ["5", "6"]]
    q = tmp_path / "whole.csv"
    q.write_bytes(b"a,b\r\n1,2\r\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gk.CSVWriter(q).write({"a": 3, "b": 4})
    assert q.read_bytes() == b"a,b\r\n1,2\r\n3,4\r\n"


# ----------------------------------------------------------------------------- item 4
def test_forgotten_coordinator_load_does_not_compound_the_lr():
    """Resume with the model and the optimizer but not the coordinator: besides the warning
    that names the fix, 'a scheduler stepped by hand?' was also said, and the loaded lr
    (scheduled x the saved multiplier) was taken as a new scheduled rate and multiplied
    again (1.87e-3 then 3.24e-3 in a run like this one), where the coordinator that starts afresh runs 1e-3
    (B_0) then 1e-3 x its own multiplier."""
    model, opt, coord, loader = _readme()
    _loop(model, opt, coord, loader, 10)
    assert coord.lr_multiplier > 1.2
    ck = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    model2, opt2, coord2, loader2 = _readme()
    model2.load_state_dict(ck["model"]); opt2.load_state_dict(ck["opt"])
    seen = []     # (lr the step runs with, its batch)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _loop(model2, opt2, coord2, loader2, 3,
              each=lambda b: seen.append((opt2.param_groups[0]["lr"], coord2.batch_size)))
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and "coord.load_state_dict(ckpt['coord'])" in msgs[0], msgs
    assert rec[0].filename == HERE
    assert seen[0] == (pytest.approx(1e-3, rel=1e-12), 8)
    assert seen[-1][1] > 8
    for lr, B in seen:
        assert lr == pytest.approx(1e-3 * (B / 8) ** 0.5, rel=1e-12)


# ----------------------------------------------------------------------------- item 5
@pytest.mark.parametrize("value, err", [(float("nan"), TypeError), ("100", TypeError),
                                        (float("inf"), TypeError), (-1, ValueError), (2.5, TypeError)])
@pytest.mark.parametrize("name", ["max_samples", "max_steps"])
def test_loop_budget_arguments_are_checked_when_the_loop_is_made(name, value, err):
    """max_samples=nan ran no step and ended silently; '100' gave a bare TypeError."""
    model, opt, coord, loader = _readme()
    with pytest.raises(err, match=f"{name}: expected an int >= 0 or None"):
        coord.batches(loader, **{name: value})
    with pytest.raises(err, match=f"{name}: expected an int >= 0 or None"):
        coord.steps(**{name: value})


def test_loop_budget_accepts_whole_numbers():
    model, opt, coord, loader = _readme()
    assert len(_loop_rows(coord, loader, model, opt, max_samples=np.int64(8), max_steps=1e6)) == 1
    assert len(_loop_rows(coord, loader, model, opt, max_steps=np.int64(3))) == 2


def _loop_rows(coord, loader, model, opt, **kw):
    rows = []
    for batch in coord.batches(loader, **kw):
        for x, y in batch:
            (torch.nn.functional.mse_loss(model(x), y) / len(batch)).backward()
        opt.step(); opt.zero_grad()
        rows.append(coord.metrics())
    return rows


# ----------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("every, at", [(1, 1), (2, 2)])
def test_zero_grad_forgotten_is_refused_at_the_next_measuring_step(every, at):
    """opt.zero_grad() left out: the GNS grew 13 -> 439 in 12 steps (correct loop: 19) and B
    reached its cap of 512 at step 8 (correct: 52). The gradients at a measuring step's
    first micro-batch are checked: None or zero, else the step raises when it ends."""
    model, opt, coord, loader = _readme(every=every)
    with pytest.raises(RuntimeError, match=f"step {at}: the gradients were not zero.*zero_grad\\(\\)"):
        _loop(model, opt, coord, loader, 4, zero_grad=False)
    assert coord.current_step == at


def test_zero_grad_with_zeros_instead_of_none_is_fine():
    model, opt, coord, loader = _readme()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        rows = _loop(model, opt, coord, loader, 4, set_to_none=False)
    assert all(r["valid"] for r in rows)


# ----------------------------------------------------------------------------- item 8
def test_parameter_frozen_halfway_is_named():
    """One rank, a parameter frozen halfway: measured over fewer parameters, gns_ema fell
    from 16.3 to 1.3 (correct loop 16.8), no message (DDP stopped its hook)."""
    model, opt, coord, loader = _readme()
    with pytest.raises(RuntimeError, match="step 2: parameters were frozen.*0.weight"):
        _loop(model, opt, coord, loader, 4, freeze_at=2)
    assert coord.current_step == 2
    model[0].weight.requires_grad_(True)      # undone: the loop goes on
    _loop(model, opt, coord, loader, 3)
    assert coord.current_step == 3


def test_parameter_unfrozen_halfway_is_named():
    X, Y = _problem()
    model = _model()
    model[0].bias.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coord = AdaptiveBatching(model, opt, every=1, micro_batch_size=4, initial_batch_size=8)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    _loop(model, opt, coord, loader, 1)
    model[0].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match="unfrozen.*0.bias"):
        _loop(model, opt, coord, loader, 2)


# ----------------------------------------------------------------------------- item 9
def test_micro_batch_of_another_size_is_refused_and_nothing_is_consumed():
    """The loop's old DataLoader(batch_size=2 b): 512 samples used where samples_seen said
    256, the LR multiplier from half the real batch."""
    X, Y = _problem()
    model, opt, coord, good = _readme()
    bad = DataLoader(TensorDataset(X, Y), batch_size=8)
    with pytest.raises(ValueError, match="micro-batch 0 of step 0 holds 8 examples.*micro_batch_size is 4"):
        _loop(model, opt, coord, bad, 2)
    assert (coord.current_step, coord.samples_seen, coord.sampler.position) == (0, 0, 0)
    assert len(_loop(model, opt, coord, good, 2)) == 2      # the right loader goes on


def test_short_last_micro_batch_is_refused():
    X, Y = _problem(n=18)
    model, opt, coord, _ = _readme()
    loader = DataLoader(TensorDataset(X, Y), batch_size=4)   # 4, 4, 4, 4, 2
    with pytest.raises(ValueError, match="micro-batch . of step . holds 2 examples"):
        _loop(model, opt, coord, loader, 6)


def test_kept_distributed_sampler_warns_at_the_users_line():
    X, Y = _problem(n=64)
    model, opt, coord, _ = _readme()
    ds = TensorDataset(X, Y)
    loader = DataLoader(ds, batch_size=4, drop_last=True,
                        sampler=torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0))
    with pytest.warns(RuntimeWarning, match="DistributedSampler.*batch_sampler=coord.batch_sampler") as rec:
        _loop(model, opt, coord, loader, 1)
    assert rec[0].filename == HERE


# ----------------------------------------------------------------------------- item 10
def test_leftover_coord_step_in_a_batches_loop_names_it():
    """After opt.step() it blamed MicroBatchGNS.micro_step()."""
    model, opt, coord, loader = _readme()
    with pytest.raises(RuntimeError, match="ends by itself.*remove the coord.step\\(\\) call"):
        for batch in coord.batches(loader, max_steps=3):
            for x, y in batch:
                (torch.nn.functional.mse_loss(model(x), y) / len(batch)).backward()
            opt.step(); opt.zero_grad()
            coord.step()
    assert coord.current_step == 1


def test_batch_iterated_twice_and_nested_loops_are_named():
    """Both said 'call coord.step()'."""
    model, opt, coord, loader = _readme()
    for batch in coord.batches(loader, max_steps=1):
        for x, y in batch:
            (torch.nn.functional.mse_loss(model(x), y) / len(batch)).backward()
        with pytest.raises(RuntimeError, match="already iterated: a Batch is iterated once"):
            iter(batch)
        with pytest.raises(RuntimeError, match="loop of this coordinator is still running"):
            coord.batches(loader)
        opt.step(); opt.zero_grad()
    assert coord.current_step == 1
    for batch in coord.batches(loader, max_steps=2):   # the loop ended: a new one may start
        for x, y in batch:
            (torch.nn.functional.mse_loss(model(x), y) / len(batch)).backward()
        opt.step(); opt.zero_grad()
    assert coord.current_step == 2


def test_micro_batches_without_backward_are_named():
    """The whole step without backward gave only 'invalid GNS measurement skipped'."""
    model, opt, coord, loader = _readme()
    with pytest.raises(RuntimeError, match="step 0: no backward ran in this step.*loss.backward\\(\\)"), \
            pytest.warns(RuntimeWarning, match="micro-batch 1 of step 0 had no backward"):
        _loop(model, opt, coord, loader, 2, backward=False)


def test_one_micro_batch_without_backward_invalidates_the_measurement():
    """A micro-batch skipped (or micro_step twice) on a measuring step counted a zero
    gradient as a sample; now that measurement is invalid (skipped by the controller) with
    a warning at the user's line, and the next one is valid."""
    X, Y = _problem()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=12, micro_batches=3)
    for step in range(2):
        for a in range(3):
            if not (step == 0 and a == 1):
                (torch.nn.functional.mse_loss(model(X[4 * a:4 * a + 4]), Y[4 * a:4 * a + 4]) / 3).backward()
            if step == 0 and a == 1:
                with pytest.warns(RuntimeWarning, match="micro-batch 2 of step 0 had no backward") as rec:
                    mb.micro_step()
                assert rec[0].filename == HERE
            else:
                mb.micro_step()
        opt.step(); opt.zero_grad()
        est = mb.estimate
        assert est.valid == (step == 1) and (est.gns == est.gns) == (step == 1)


def test_coord_step_twice_is_named():
    X, Y = _problem()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    for (x, y), ctx in coord.micro_batches(loader):
        with ctx:
            (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
    opt.step(); opt.zero_grad(); coord.step()
    opt.step()
    with pytest.raises(RuntimeError, match="coord.step\\(\\) called twice"):
        coord.step()


def test_coverage_warning_names_the_model_form_and_the_users_line():
    """Muon + AdamW with only [muon]: the fix read AdaptiveBatching(state, ...)."""
    X, Y = _problem()
    model = _model()
    mats = [p for p in model.parameters() if p.dim() == 2]
    muon = torch.optim.Muon(mats, lr=0.02)
    coord = AdaptiveBatching(model, [muon], every=1, micro_batch_size=4, initial_batch_size=8)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    with pytest.warns(RuntimeWarning, match="AdaptiveBatching\\(model, \\[muon, adamw\\]") as rec:
        _loop(model, muon, coord, loader, 1)
    assert rec[0].filename == HERE and "state" not in str(rec[0].message)


def test_warnings_point_at_the_users_line():
    """Every warning of the loop pointed at the package's line (stacklevel)."""
    X, Y = _problem()
    # an lr set by hand
    model, opt, coord, loader = _readme()
    with pytest.warns(RuntimeWarning, match="changed outside the coordinator") as rec:
        _loop(model, opt, coord, loader, 2, each=lambda b: opt.param_groups[0].__setitem__("lr", 0.5))
    assert {w.filename for w in rec} == {HERE}
    # an optimizer passed but not stepped
    model = _model()
    a = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    b = torch.optim.SGD(list(model.parameters())[2:], lr=0.1)
    coord = AdaptiveBatching(model, [a, b], every=1, micro_batch_size=4, initial_batch_size=8)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    with pytest.warns(RuntimeWarning, match="did not step") as rec:
        _loop(model, a, coord, loader, 1)
    assert {w.filename for w in rec} == {HERE}
    # a second backward without micro_step (MicroBatchGNS in the user's own loop)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=1, batch_size=8, micro_batches=2)
    with pytest.warns(RuntimeWarning, match="two backward passes without micro_step") as rec:
        for _ in range(2):
            torch.nn.functional.mse_loss(model(X[:4]), Y[:4]).backward()
    assert rec[0].filename == HERE
    # a resumed batch that is not a multiple of the new R x b
    model, opt, coord, loader = _readme()
    sd = coord.state_dict()
    sd["schedule"]["batch_size"] = 12
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    coord2 = AdaptiveBatching(model2, opt2, every=1, micro_batch_size=8, initial_batch_size=16,
                              max_batch_size=64)
    with pytest.warns(RuntimeWarning, match="not a multiple of 8") as rec:
        coord2.load_state_dict(sd, strict=False)
    assert {w.filename for w in rec} == {HERE}


def test_readme_loop_and_explicit_loop_raise_no_new_warning():
    model, opt, coord, loader = _readme(every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = _loop(model, opt, coord, loader, 6)
    assert max(r["next_batch_size"] for r in rows) > 8
    X, Y = _problem()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mb = MicroBatchGNS(model.parameters(), geometry="l1", every=2, batch_size=8, micro_batches=2)
    coord = AdaptiveBatching(mb, opt, micro_batch_size=4, initial_batch_size=8, max_batch_size=64)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)), num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in coord.steps(max_steps=6):
            for (x, y), ctx in coord.micro_batches(loader):
                with ctx:
                    (torch.nn.functional.mse_loss(model(x), y) / coord.accum_steps).backward()
            opt.step(); opt.zero_grad(); coord.step()


# ----------------------------------------------------------------------------- the checks' limits
def test_limit_loss_not_divided_by_len_batch_is_not_caught():
    """A constant gradient scale leaves every measurement's GNS as it is: the loop runs on
    without a word (docs/coordinator.md, 'What the package cannot tell')."""
    model, opt, coord, loader = _readme()
    ref = _readme()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for batch in coord.batches(loader, max_steps=1):
            for x, y in batch:
                torch.nn.functional.mse_loss(model(x), y).backward()      # not / len(batch)
            opt.step(); opt.zero_grad()
        _loop(*ref, 1)
    assert coord.metrics()["gns"] == pytest.approx(ref[2].metrics()["gns"], rel=1e-5)


def test_limit_parameter_unused_in_a_step_is_measured_without_it():
    """Conditional computation (a branch some steps skip, requires_grad unchanged): that
    step's GNS covers the parameters that got gradients, by design; no message."""
    X, Y = _problem()

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 1), torch.nn.Linear(6, 1)
            self.use_b = True

        def forward(self, x):
            return self.a(x) + (self.b(x) if self.use_b else 0)

    model = Branch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coord = AdaptiveBatching(model, opt, every=1, micro_batch_size=4, initial_batch_size=8)
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for batch in coord.batches(loader, max_steps=3):
            model.use_b = batch.step != 1
            for x, y in batch:
                (torch.nn.functional.mse_loss(model(x), y) / len(batch)).backward()
            opt.step(); opt.zero_grad()
            assert coord.metrics()["valid"]


def test_limit_sequence_first_batches_read_the_wrong_dimension():
    """The micro-batch check reads the first tensor's leading dimension: a sequence-first
    batch [T, b] is refused (collate batch-first)."""
    model, opt, coord, _ = _readme()
    seq_first = [(torch.randn(7, 4, 6), torch.randn(7, 4, 1))] * 4
    with pytest.raises(ValueError, match="holds 7 examples"):
        next(iter(next(iter(coord.batches(seq_first, max_steps=1)))))


# ----------------------------------------------------------------------------- more of the same kinds
def test_ranks_or_micro_batches_reading_the_same_examples_warn():
    """A loader that repeats one micro-batch (or, on several ranks, one not sharded by
    rank): identical samples, noise exactly 0, a GNS of 0 and a batch that never grows."""
    X, Y = _problem()
    model, opt, coord, _ = _readme()
    same = [(X[:4], Y[:4])] * 8
    with pytest.warns(RuntimeWarning, match="noise measured at step 0 is exactly 0.*same examples") as rec:
        _loop(model, opt, coord, same, 1)
    assert rec[0].filename == HERE


def test_a_sampler_not_made_by_the_coordinator():
    X, Y = _problem()
    model, opt, coord, _ = _readme()
    ds = TensorDataset(X, Y)
    wrong = DataLoader(ds, batch_sampler=MicroBatchSampler(len(ds), 8, 1, 0))
    with pytest.raises(ValueError, match="micro_batch_size, num_replicas, rank = \\(8, 1, 0\\)"):
        _loop(model, opt, coord, wrong, 1)
    own = DataLoader(ds, batch_sampler=MicroBatchSampler(len(ds), 4, 1, 0))
    with pytest.warns(RuntimeWarning, match="not made by coord.batch_sampler"):
        _loop(model, opt, coord, own, 1)


def test_bad_beta_noise_is_named_as_given():
    """AdaptiveBatching(model, beta_noise=1.5) was refused naming pool_beta, an argument
    of an object the user never built."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="^beta_noise: expected a number in \\[0, 1\\)"):
        AdaptiveBatching(model, opt, micro_batch_size=4, initial_batch_size=8, beta_noise=1.5)


def test_added_param_group_is_not_a_thawed_parameter():
    model, opt, coord, loader = _readme()
    _loop(model, opt, coord, loader, 1)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _loop(model, opt, coord, loader, 2)
    assert coord.current_step == 2
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-3 * coord.lr_multiplier, rel=1e-12)


# ----------------------------------------------------------------------------- the review's round
def _rows(body, steps=4, **kw):
    model, opt, coord, loader = _readme(**kw)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a correct loop warns about nothing
        for batch in coord.batches(loader, max_steps=steps):
            body(model, opt, batch)
            rows.append((coord.metrics()["gns"], coord.batch_size))
    return rows


def _mse(model, x, y, n):
    return torch.nn.functional.mse_loss(model(x), y) / n


def _readme_body(model, opt, batch):
    for x, y in batch:
        _mse(model, x, y, len(batch)).backward()
    opt.step()
    opt.zero_grad()


def test_zero_grad_inside_the_first_micro_batch_is_a_correct_loop():
    """The gradients are read when the step's first backward begins, not when its first
    micro-batch is handed out: zeroing them inside the first micro-batch (before the forward,
    or between the forward and the backward, as Lightning does) is correct, and gives the
    README loop's numbers."""
    def before_forward(model, opt, batch):
        for i, (x, y) in enumerate(batch):
            if i == 0:
                opt.zero_grad()
            _mse(model, x, y, len(batch)).backward()
        opt.step()

    def before_backward(model, opt, batch):
        for i, (x, y) in enumerate(batch):
            loss = _mse(model, x, y, len(batch))
            if i == 0:
                opt.zero_grad(set_to_none=False)
            loss.backward()
        opt.step()

    want = _rows(_readme_body)
    assert _rows(before_forward) == want
    assert _rows(before_backward) == want


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_micro_batches_is_named(set_to_none):
    """opt.zero_grad() in every micro-batch kept only the last micro-batch's gradient: the GNS
    came out 145-3867 against 5-21 and B reached its cap at step 0, without a word."""
    def body(model, opt, batch):
        for x, y in batch:
            opt.zero_grad(set_to_none=set_to_none)
            _mse(model, x, y, len(batch)).backward()
        opt.step()

    match = "reset between the step's micro-batches" if set_to_none else "zeroed between the step's micro-batches"
    model, opt, coord, loader = _readme()
    with pytest.raises(RuntimeError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # MicroBatchGNS may also see a micro-batch as missing
        for batch in coord.batches(loader, max_steps=3):
            body(model, opt, batch)


def test_optimizer_stepped_twice_or_inside_the_batch_is_named():
    def twice(model, opt, batch):
        for x, y in batch:
            _mse(model, x, y, len(batch)).backward()
        opt.step()
        opt.step()
        opt.zero_grad()

    def inside(model, opt, batch):
        for x, y in batch:
            _mse(model, x, y, len(batch)).backward()
            opt.step()
            opt.zero_grad()

    with pytest.raises(RuntimeError, match="stepped 2 times in one step"):
        _rows(twice)
    with pytest.raises(RuntimeError, match="opt.step\\(\\) ran after micro-batch 1 of the step's 2"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, coord, loader = _readme()
            for batch in coord.batches(loader, max_steps=2):
                inside(model, opt, batch)


def test_zero_grad_before_step_is_named():
    def body(model, opt, batch):
        for x, y in batch:
            _mse(model, x, y, len(batch)).backward()
        opt.zero_grad()
        opt.step()

    with pytest.raises(RuntimeError, match="opt.zero_grad\\(\\) came before opt.step\\(\\)"):
        _rows(body)


def test_batch_size_read_only_when_certain():
    """Correct loops the size check refused (a detection collate's tuple of images, a
    PackedSequence) run; a mapping that is not a dict (BatchEncoding is a UserDict) and a
    tuple that starts with a 0-d tensor are checked."""
    import collections

    from torch.nn.utils.rnn import pack_sequence

    from gns_kernels.coordinator.stream import batch_len as _batch_len

    x4 = torch.randn(4, 3)
    imgs = tuple(torch.randn(3, 5, 5) for _ in range(4))
    assert _batch_len((imgs, tuple({"boxes": torch.randn(2, 4)} for _ in range(4)))) == 4
    assert _batch_len(pack_sequence([torch.randn(5, 2), torch.randn(3, 2)])) is None
    assert _batch_len((torch.randn(7, 4), torch.randn(4))) is None       # sequence-first: unknown
    assert _batch_len(collections.UserDict(input_ids=torch.zeros(8, 3, dtype=torch.long))) == 8
    assert _batch_len((torch.tensor(1.0), torch.randn(8, 3))) == 8
    assert _batch_len((x4, torch.randn(4))) == 4 and _batch_len(x4) == 4

    X, Y = _problem()

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return len(X)

        def __getitem__(self, i):
            return X[i].reshape(2, 3), {"y": Y[i]}

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coord = AdaptiveBatching(model, opt, every=1, micro_batch_size=4, initial_batch_size=8)
    loader = DataLoader(Items(), batch_sampler=coord.batch_sampler(len(X)),
                        collate_fn=lambda b: tuple(zip(*b)))     # a detection-style collate
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in coord.batches(loader, max_steps=2):
            for xs, ts in batch:
                x = torch.stack(xs)
                y = torch.stack([t["y"] for t in ts])
                _mse(model, x, y, len(batch)).backward()
            opt.step()
            opt.zero_grad()
    assert coord.samples_seen >= 16 and coord.current_step == 2


def test_wrapped_loader_still_advances_the_sampler_and_a_plain_loader_is_named():
    """A generator or a prefetching wrapper around DataLoader(batch_sampler=coord's) left the
    sampler at position 0 (a resume restarted the stream); a plain DataLoader's position
    cannot be saved, which is said once."""
    model, opt, coord, loader = _readme()

    class Prefetch:
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            return iter(self.inner)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in coord.batches(Prefetch(loader), max_steps=3):
            _readme_body(model, opt, batch)
    assert coord.state_dict()["sampler"]["position"] == coord.samples_seen >= 24
    X, Y = _problem()
    model, opt, coord, _ = _readme()
    plain = DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True, drop_last=True)
    with pytest.warns(RuntimeWarning, match="does not draw from coord.batch_sampler") as rec:
        for batch in coord.batches(plain, max_steps=2):
            _readme_body(model, opt, batch)
    assert rec[0].filename == HERE
    gen = (b for b in [next(iter(loader))] * 2)
    model, opt, coord, _ = _readme()
    with pytest.raises(RuntimeError, match="is an iterator \\(a generator\\?\\) and it is exhausted"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for batch in coord.batches(gen, max_steps=3):
                _readme_body(model, opt, batch)


def test_removed_param_group_is_named():
    model, opt, coord, loader = _readme()
    with pytest.raises(RuntimeError, match="removed from the optimizers' param groups: 0.weight, 0.bias"):
        for batch in coord.batches(loader, max_steps=4):
            if batch.step == 2:
                opt.param_groups.pop(0) if len(opt.param_groups) > 1 else None
                opt.param_groups[0]["params"] = opt.param_groups[0]["params"][2:]
            _readme_body(model, opt, batch)


def test_two_backward_passes_of_one_micro_batch_warn_nothing():
    def body(model, opt, batch):
        for x, y in batch:
            _mse(model, x, y, 2 * len(batch)).backward()
            _mse(model, x, y, 2 * len(batch)).backward()
        opt.step()
        opt.zero_grad()

    assert len(_rows(body)) == 4


def test_resume_below_b0_is_said_by_the_coordinator():
    X, Y = _problem()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coord = AdaptiveBatching(model, opt, every=1, micro_batch_size=4, initial_batch_size=8)
    sd = coord.state_dict()
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    coord2 = AdaptiveBatching(model2, opt2, every=1, micro_batch_size=8, initial_batch_size=16)
    with pytest.warns(RuntimeWarning, match="AdaptiveBatching: resumed .* below this run's initial_batch_size 16") as rec:
        coord2.load_state_dict(sd, strict=False)
    assert not any("AdaptiveBatchSize" in str(w.message) for w in rec)
    assert coord2.batch_size == 16
