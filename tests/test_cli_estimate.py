"""`gns-kernels estimate` through gns_kernels.cli.main: the printed numbers are consistent."""
from __future__ import annotations

import math
import re

import pytest
import torch

from gns_kernels import cli
from gns_kernels.demo import synthetic as sy

ARGS = ["estimate", "--draws", "40", "--batch-size", "256", "--examples", "1024",
        "--ranks", "2", "8", "--seed", "3"]


def _parse(out: str) -> dict[tuple[str, str, int], dict[str, str]]:
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("model"))
    header = re.split(r"\s{2,}", lines[head].strip())
    rows = {}
    for line in lines[head + 2:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(header), line
        row = dict(zip(header, cells))
        rows[(row["model"], row["geometry"], int(row["R"]))] = row
    return rows


def _pm(cell: str) -> tuple[float, float]:
    mean, se = cell.split("+-")
    return float(mean), float(se)


@pytest.fixture(scope="module")
def table():
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    threads = torch.get_num_threads()
    with redirect_stdout(buf):
        rc = cli.main(ARGS)
    assert rc == 0
    assert torch.get_num_threads() == threads        # the command restores the thread count
    return _parse(buf.getvalue())


def test_all_rows_present(table):
    keys = {(m, g, r) for m in ("mlp", "attention") for g in ("l2", "l1", "nuclear") for r in (2, 8)}
    assert set(table) == keys


def test_exact_l2_and_l1_gns_match_independent_formula(table):
    for kind in ("mlp", "attention"):
        model = sy.make_model(kind, seed=3)
        X, Y = sy.make_data(kind, 1024, seed=4)
        pe = sy.per_example_grads(model, X, Y)
        flat = torch.cat([g.reshape(g.shape[0], -1) for g in pe.values()], dim=1).double()
        mu = flat.mean(0)
        var = flat.var(0, unbiased=False)
        l2 = float(var.sum() / (mu * mu).sum())
        l1 = float(var.sqrt().sum() ** 2 / mu.abs().sum() ** 2)
        for R in (2, 8):
            assert float(table[(kind, "l2", R)]["GNS exact"]) == pytest.approx(l2, abs=0.006)
            assert float(table[(kind, "l1", R)]["GNS exact"]) == pytest.approx(l1, abs=0.006)


def test_l2_needs_no_correction(table):
    for (model, geo, R), row in table.items():
        if geo == "l2":
            assert row["noise raw/exact"] == row["noise corr/exact"]
            assert row["GNS raw"] == row["GNS corr"]
            assert row["GNS l2-debiased"] != "-"
        else:
            assert row["GNS l2-debiased"] == "-"


def test_corrected_l1_closer_to_exact_than_raw(table):
    for model in ("mlp", "attention"):
        raw, se_r = _pm(table[(model, "l1", 2)]["noise raw/exact"])
        cor, se_c = _pm(table[(model, "l1", 2)]["noise corr/exact"])
        se = math.hypot(se_r, se_c)
        # raw l1 noise at R = 2 is biased low (about 2/pi); the correction removes it
        assert abs(raw - 1) - abs(cor - 1) > 4 * se, (raw, cor, se)
        assert abs(cor - 1) < 0.03 + 4 * se_c
        g_raw, s1 = _pm(table[(model, "l1", 2)]["GNS raw"])
        g_cor, s2 = _pm(table[(model, "l1", 2)]["GNS corr"])
        assert g_cor - g_raw > 4 * math.hypot(s1, s2)


def test_bias_shrinks_with_ranks(table):
    for model in ("mlp", "attention"):
        r2, s2 = _pm(table[(model, "l1", 2)]["noise raw/exact"])
        r8, s8 = _pm(table[(model, "l1", 8)]["noise raw/exact"])
        assert r8 - r2 > 4 * math.hypot(s2, s8)


def test_signal_leak_is_positive(table):
    # E||g||_2^2 = ||mu||^2 + tr(Sigma)/B > ||mu||^2: l2 signal/exact = 1 + GNS/B on average
    for model in ("mlp", "attention"):
        for R in (2, 8):
            ratio, se = _pm(table[(model, "l2", R)]["signal/exact"])
            expected = 1 + float(table[(model, "l2", R)]["GNS exact"]) / 256
            assert abs(ratio - expected) < 4 * se + 1e-3


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--ranks", "1"], "--ranks"),
        (["--batch-size", "100", "--ranks", "8"], "--batch-size"),
        (["--draws", "1"], "--draws"),
        (["--examples", "1"], "--examples"),
        (["--models", "resnet"], "--models"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_arguments(extra, needle, capsys):
    rc = cli.main(["estimate", *extra])
    assert rc != 0
    err = capsys.readouterr().err
    assert needle in err and "error" in err


def test_unparsable_argument_exits_nonzero(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["estimate", "--draws", "many"])
    assert exc.value.code != 0
    assert "--draws" in capsys.readouterr().err
