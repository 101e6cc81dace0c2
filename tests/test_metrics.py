"""Metrics writers: CSV (header once, append on resume, empty cells for nan/None) from
which the controller's decisions can be recomputed; TensorBoard scalars; the optional
tensorboard dependency's error."""
from __future__ import annotations

import csv
import math
import sys

import pytest
import torch

from gns_kernels.adaptive import AdaptiveBatching
from gns_kernels.distributed import GNSHookState
from gns_kernels.stats import GNSEstimate
from gns_kernels.metrics import CSVWriter, tensorboard_writer, to_tensorboard


def _est(noise, signal):
    return GNSEstimate(gns=noise / signal, noise=noise, signal=signal, valid=True,
                       signal_unbiased=None, geometry="l1", num_samples=2, batch_size=8.0,
                       bias_corrected=True)


def _read(path):
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def test_csv_header_once_and_cells(tmp_path):
    path = tmp_path / "sub" / "m.csv"
    w = CSVWriter(path)
    w.write({"step": 0, "gns": 1.25, "valid": True, "noise": float("nan"), "ema": None})
    w.write({"step": 1, "gns": 1 / 3, "valid": False, "noise": 2.0})
    rows = _read(path)
    assert rows == [["step", "gns", "valid", "noise", "ema"],
                    ["0", "1.25", "1", "", ""],
                    ["1", "0.3333333333333333", "0", "2.0", ""]]
    with pytest.raises(ValueError, match="'extra'.*columns="):
        w.write({"step": 2, "extra": 1})
    # a resumed run appends under the existing header, in its column order
    w2 = CSVWriter(path)
    w2.write({"gns": 5.0, "step": 2})
    assert _read(path)[1:][-1] == ["2", "5.0", "", "", ""] and len(_read(path)) == 4
    with pytest.raises(ValueError, match="has columns"):
        CSVWriter(path, columns=["a", "b"])
    off = CSVWriter(tmp_path / "other.csv", write_rows=False)
    off.write({"step": 0})
    assert not (tmp_path / "other.csv").exists()


def test_decisions_can_be_recomputed_from_the_csv(tmp_path):
    """Rebuild N_k, M_k and B_{k+1} from the CSV's noise/signal columns with the rule as
    documented (EMAs from the first valid measurement, ceil, round up to R*b, cap)."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = GNSHookState(geometry="l1", every=3, batch_size=8)
    theta, beta, m, cap = 0.6, 0.9, 8, 400
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2,
                             theta=theta, beta_noise=beta, beta_signal=beta, max_batch_size=cap)
    w = CSVWriter(tmp_path / "metrics.csv")
    g = torch.Generator().manual_seed(0)
    for k in range(30):
        if k % 3 == 0:
            n = float(torch.rand((), generator=g)) * 40 + 1.0
            s = float(torch.rand((), generator=g)) + 0.2
            state.estimate, state.estimate_step = _est(n, s), k
        state.advance_step()
        opt.step()
        coord.step()
        w.write(coord.metrics())
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    N = M = None
    B = 8
    grew = False
    for r in rows:
        assert int(r["batch_size"]) == B
        if r["measured"] == "1":
            n, s = float(r["noise"]), float(r["signal"])
            N, M = (n, s) if N is None else (beta * N + (1 - beta) * n, beta * M + (1 - beta) * s)
            assert float(r["noise_ema"]) == pytest.approx(N, rel=1e-8)
            target = N / (theta ** 2 * M)
            new = min(max(math.ceil(target - 1e-6), B), cap)
            new = -(-new // m) * m
            grew |= new > B
            B = min(max(new, B), cap)
        else:
            assert r["noise"] == "" and r["gns"] == ""
        assert int(r["next_batch_size"]) == B
        assert float(r["lr_multiplier"]) == pytest.approx(math.sqrt(B / 8), rel=1e-9)
    assert grew


class _FakeWriter:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append((tag, value, step))


def test_to_tensorboard_writes_finite_numbers():
    fw = _FakeWriter()
    n = to_tensorboard(fw, {"step": 7, "gns": 2.5, "valid": True, "noise": float("nan"),
                            "ema": None, "name": "x", "batch_size": 64})
    assert n == 3
    assert fw.calls == [("gns/gns", 2.5, 7), ("gns/valid", 1.0, 7), ("gns/batch_size", 64.0, 7)]
    fw2 = _FakeWriter()
    to_tensorboard(fw2, {"step": 7, "gns": 1.0}, step=100, prefix="")
    assert fw2.calls == [("gns", 1.0, 100)]
    with pytest.raises(TypeError, match="add_scalar"):
        to_tensorboard(object(), {"gns": 1.0})


def test_coordinator_to_tensorboard_in_adaptdl_style():
    state = GNSHookState(geometry="l1", every=1, batch_size=8)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2)
    state.estimate, state.estimate_step = _est(3.0, 1.0), 0
    state.advance_step()
    opt.step()
    coord.step()
    fw = _FakeWriter()
    coord.to_tensorboard(fw)
    tags = {t: (v, s) for t, v, s in fw.calls}
    assert tags["gns/gns"] == (3.0, 0) and tags["gns/noise_ema"] == (3.0, 0)
    assert tags["gns/next_batch_size"] == (coord.batch_size, 0)


def test_tensorboard_missing_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ImportError, match="pip install tensorboard"):
        tensorboard_writer("runs/x")


def test_valid_is_none_on_steps_that_do_not_measure():
    """valid=0 on every step that did not measure looked like failed measurements in
    TensorBoard; now those steps carry None (skipped by the writers)."""
    state = GNSHookState(geometry="l1", every=2, batch_size=8)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    coord = AdaptiveBatching(state, opt, micro_batch_size=4, initial_batch_size=8, world_size=2)
    state.estimate, state.estimate_step = _est(3.0, 1.0), 0
    state.advance_step()
    opt.step(); coord.step()
    assert coord.metrics()["valid"] is True
    state.advance_step()
    opt.step(); coord.step()
    m = coord.metrics()
    assert m["measuring_step"] is False and m["valid"] is None
    fw = _FakeWriter()
    to_tensorboard(fw, m)
    assert "gns/valid" not in [c[0] for c in fw.calls]
