"""Coordinator checkpoints written before the current layout still resume.

Version 1 (before the run's schedule was saved once) kept F, k and B at the top level and in
the controller's and the hook's entries. A version-1 state_dict written by that code (one
rank, SGD -> l2, every=2, after 5 steps) resumes to the same next steps that code took; and
a version-2 state_dict rewritten in the version-1 layout (with a noise pool) resumes exactly
as the version-2 one does."""
from __future__ import annotations

import copy
import math
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk

# written by AdaptiveBatching.state_dict() at commit e4c5c30 (state_dict version 1)
V1_STATE = {'version': 1, 'step': 5, 'samples_seen': 72, 'batch_size': 16, 'world_size': 1, 'micro_batch_size': 4, 'every': 2, 'controller': {'version': 1, 'config': {'initial_batch_size': 8, 'theta': 0.5, 'beta_noise': 0.9, 'beta_signal': 0.9, 'every': 2, 'warmup_steps': 0, 'max_batch_size': 64, 'multiple_of': 4, 'lr_scaling': 'sqrt', 'signal': 'raw', 'max_growth': None}, 'batch_size': 16, 'noise_ema': 186.45700286865232, 'signal_ema': 52.93117824554444, 'target_batch_size': 14.090523509882203, 'last_step': 4, 'last_measured_step': 4, 'num_measurements': 3, 'num_skipped': 0}, 'lr_multiplier': {'multiplier': 1.4142135623730951}, 'schedulers': [], 'sampler': {'version': 2, 'position': 72, 'num_samples': 400, 'seed': 0, 'shuffle': True, 'num_replicas': 1, 'micro_batch_size': 4}, 'hook': {'step': 5, 'every': 2, 'batch_size': 16, 'geometry': 'l2', 'eig_float64': {}}}
V1_MODEL = {'model': {'0.weight': [[-0.49051633477211, -0.15479251742362976, -0.24637164175510406, -0.5311927199363708, 0.021923525258898735, -0.35910600423812866], [0.3566867709159851, -0.04230402037501335, 0.20631739497184753, 0.5528030395507812, -0.08478964120149612, 0.26719680428504944], [-0.2543400824069977, -0.140468031167984, -0.32068535685539246, 0.058451537042856216, -0.2808440625667572, 0.3835815489292145], [0.10279065370559692, 0.4278680980205536, -0.020078210160136223, -0.4313696324825287, 0.3456617593765259, -0.3992606997489929], [-0.07755730301141739, -0.44312360882759094, 0.019075904041528702, 0.3731217086315155, -0.33559656143188477, -0.25726982951164246], [-0.30016642808914185, 0.3376007378101349, -0.34858208894729614, -0.46979615092277527, -0.3023781180381775, -0.20555856823921204], [-0.2331971824169159, -0.23603643476963043, -0.31798219680786133, -0.25894442200660706, 0.11419839411973953, -0.09120189398527145], [-0.09046784788370132, -0.18996992707252502, 0.1573428362607956, -0.2290995568037033, -0.2559487223625183, -0.12016184628009796]], '0.bias': [-0.10568598657846451, 0.36920860409736633, 0.20750246942043304, -0.2164408415555954, -0.0119605902582407, 0.2601574659347534, 0.2330581545829773, 0.10998927801847458], '2.weight': [[-0.6230519413948059, 0.8234578967094421, 0.053169578313827515, -0.5710870027542114, 0.4764571487903595, -0.5555729269981384, -0.32982420921325684, -0.07263004034757614]], '2.bias': [-0.1720963567495346]}, 'opt_lr': 0.07071067811865477}
# that code's next 4 steps after the checkpoint: (batch_size, lr_0, gns)
V1_NEXT = [(16, 0.07071067811865477, math.nan), (16, 0.07071067811865477, 4.293700249802711), (16, 0.07071067811865477, math.nan), (16, 0.07071067811865477, 9.698734255595863)]


def _problem(n=400):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, 6, generator=g)
    return X, X @ torch.randn(6, 1, generator=g) + 0.5 * torch.randn(n, 1, generator=g)


def _build(opt_cls=torch.optim.SGD, lr=0.05):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = opt_cls(model.parameters(), lr=lr)
    coord = gk.AdaptiveBatching(model, opt, every=2, micro_batch_size=4, initial_batch_size=8,
                                max_batch_size=64, theta=0.5)
    X, Y = _problem()
    loader = DataLoader(TensorDataset(X, Y), batch_sampler=coord.batch_sampler(len(X)))
    return model, opt, coord, loader


def _run(model, opt, coord, loader, steps):
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in coord.batches(loader, max_steps=coord.current_step + steps):
            for x, y in batch:
                (torch.nn.functional.mse_loss(model(x), y) / len(batch)).backward()
            opt.step()
            opt.zero_grad()
            m = coord.metrics()
            out.append((m["batch_size"], m["lr_0"], m["gns"]))
    return out


def _same(a, b):
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b))


def test_version_1_checkpoint_resumes_to_the_same_steps():
    model, opt, coord, loader = _build()
    model.load_state_dict({k: torch.tensor(v) for k, v in V1_MODEL["model"].items()})
    coord.load_state_dict(copy.deepcopy(V1_STATE))
    assert coord.current_step == 5 and coord.batch_size == 16 and coord.samples_seen == 72
    assert opt.param_groups[0]["lr"] == V1_MODEL["opt_lr"]
    got = _run(model, opt, coord, loader, 4)
    assert _same(got, V1_NEXT), (got, V1_NEXT)


def _equal(a, b) -> bool:
    """Nested dicts / lists of plain values and tensors, equal entry by entry."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _as_version_1(sd: dict) -> dict:
    """A version-2 state_dict in the version-1 layout (what the code before wrote)."""
    v1 = {k: copy.deepcopy(v) for k, v in sd.items() if k != "schedule"}
    s = sd["schedule"]
    v1.update(version=1, step=s["step"], batch_size=s["batch_size"], every=s["every"])
    v1["controller"]["batch_size"] = s["batch_size"]
    v1["controller"]["config"]["every"] = s["every"]
    v1["hook"].update(step=s["step"], every=s["every"], batch_size=s["batch_size"])
    return v1


def test_version_1_layout_with_a_noise_pool_resumes_as_version_2():
    model, opt, coord, loader = _build(torch.optim.AdamW, 0.01)   # l1: a noise pool
    _run(model, opt, coord, loader, 5)
    sd = coord.state_dict()
    assert sd["version"] == 2 and "pool" in sd["hook"]
    assert "every" not in sd["controller"]["config"] and "batch_size" not in sd["controller"]
    assert not {"step", "every", "batch_size"} & set(sd["hook"])   # F, k, B saved once
    weights = copy.deepcopy(model.state_dict())
    opt_sd = copy.deepcopy(opt.state_dict())
    runs = []
    for state in (sd, _as_version_1(sd)):
        m2, o2, c2, l2 = _build(torch.optim.AdamW, 0.01)
        m2.load_state_dict(weights)
        o2.load_state_dict(copy.deepcopy(opt_sd))   # (load_state_dict keeps its tensors: AdamW steps them)
        c2.load_state_dict(copy.deepcopy(state))
        assert _equal(c2.state_dict(), sd)
        runs.append(_run(m2, o2, c2, l2, 4))
    assert _same(runs[0], runs[1]) and max(r[0] for r in runs[0]) >= 8
