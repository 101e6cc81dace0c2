"""The GPU window (bench/gpu_window.sh) stays runnable without a GPU.

- ``bash bench/gpu_window.sh --dry-run`` runs every phase on CPU at toy sizes: exit 0,
  every phase ran (or says why not), at most 8 files in $OUT, the summary table printed
  and written (docs/cuda.md, "GPU window");
- with a deadline too short for the later phases, those are skipped with a line and the
  window still ends with its summary and exit 0;
- every ``python bench/<script>.py ...`` command quoted in bench/RESULTS.md still parses
  its arguments (argparse run up to parse_args, nothing measured);
- the Table 9 arithmetic (amortized overhead, intervals).
No timing is asserted.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_window.sh"
PHASES = ("preflight", "build", "smoke", "tests", "hooks", "s1", "table9", "fused", "accuracy")
LOGS = ("build.log", "tests.log", "hooks.log", "s1.log", "table9.log", "fused.log")


def _window(tmp_path, *args, deadline=None, timeout=400):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("GPU_WINDOW_END", None)
    env.pop("GPU_WINDOW_PHASE_END", None)
    if deadline is not None:
        env["GPU_WINDOW_DEADLINE"] = str(deadline)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _phase_lines(text):
    """phase -> its final status line ("ran ...", "skipped: ...", ...)."""
    out = {}
    for ln in text.splitlines():
        m = re.match(r"phase (\w+): (.*)", ln)
        if m and not m.group(2).startswith("start"):
            out[m.group(1)] = m.group(2)
    return out


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("window")
    return _window(out, "--dry-run"), out


def test_dry_run_runs_every_phase(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    status = _phase_lines(proc.stdout)
    assert set(status) == set(PHASES), status
    for phase, line in status.items():
        assert line.startswith("ran"), (phase, line, (out / "window.log").read_text())


def test_dry_run_files_and_summary(dry_run):
    proc, out = dry_run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 8, files
    names = {p.name for p in files}
    assert {"summary.md", "window.log", *LOGS} <= names
    summary = (out / "summary.md").read_text()
    assert summary in proc.stdout  # printed last, to paste
    assert "| phase | measurement | value | target / paper |" in summary
    assert "torch " in summary and "triton " in summary  # the device line
    for phase in ("preflight", "build", "tests", "hooks", "S1", "Table 9", "fused"):
        assert re.search(rf"^\| {phase} \|", summary, re.M), (phase, summary)
    # nothing failed, and on CPU nothing is skipped (so a renamed name the window calls
    # fails here, in CI, rather than on the GPU)
    for log in LOGS:
        text = (out / log).read_text()
        assert "FAILED" not in text and "MISMATCH" not in text, (log, text[-3000:])
    # the preflight: this torch resolves every name the package uses unguarded
    build = (out / "build.log").read_text()
    assert "| preflight | torch APIs the package names" in build and "UNGUARDED" not in build
    assert "env BUILD_SKIP=" in build
    # the build path ran for real (CPU-only, in a copy; the checkout keeps its extension)
    assert re.search(r"^built: _C.*\.so", build, re.M), build[-3000:]
    assert not re.search(r"^installed into gns_kernels/", build, re.M)
    tests = (out / "tests.log").read_text()
    assert re.findall(r"^@@ \| tests \| tests/", tests, re.M), tests[-2000:]
    hooks = (out / "hooks.log").read_text()
    for part in ("+ MicroBatchGNS, l1", "+ MicroBatchGNS, nuclear", "AdaptiveBatching on DDP",
                 "DDP over gloo, 2 ranks", "FSDP2 over gloo, 2 ranks"):
        assert f"| {part}" in hooks or part in hooks, part
    assert hooks.count("| ok: ") == 6 and "B grew" in hooks and "resume repeats" in hooks, hooks[-3000:]
    s1 = (out / "s1.log").read_text()
    skipped = [ln for ln in s1.splitlines() if ln.startswith("skipped:")]
    assert not skipped, skipped
    for part in ("DDP hook per rank, R = 8", "pool on, method auto", "pool on, method newton",
                 "pool off, method auto", "kernels of the busiest rank", "share alone per rank",
                 "accuracy vs float64, steep spectra", "accuracy vs float64 through the DDP hook",
                 "gk.sqrt_trace(method='newton-tf32')", "gk.nuclear_stats(method='newton-tf32')"):
        assert f"| {part}" in s1 or part in s1, part
    assert "(12 buckets)" in s1 and "@@S1RANK " in s1
    # the key figure is the first figure of the phase
    first = next(ln for ln in s1.splitlines() if ln.startswith("@@ | S1 |"))
    assert "pool on, method auto" in first, first
    fused = (out / "fused.log").read_text()
    for backend in ("CPU C++", "Triton (interpreter)"):
        for dtype in ("float32", "bfloat16"):
            assert f"| fused | {backend}, {dtype}: ratio to floor" in fused, (backend, dtype)
            assert f"| fused | {backend}, {dtype}: first call of the 6 ops" in fused, (backend, dtype)
    # Table 9's rows: both geometries, whole steps and the hooks' own time, both F, the
    # one-rank note and the 8-rank prediction
    t9 = (out / "table9.log").read_text()
    for geo in ("l1", "S1"):
        assert f"+{geo} amortized, whole steps" in t9 and f"+{geo} amortized, the hooks' own time" in t9
    assert "(one rank solves all" in t9 and "F=100:" in t9 and "F=10:" in t9 and "PREDICTION" in t9
    assert "dry run on CPU" in summary


def test_deadline_skips_later_phases(tmp_path):
    proc = _window(tmp_path, "--dry-run", deadline=14, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    status = _phase_lines(proc.stdout)
    assert set(status) == set(PHASES), status
    skipped = [p for p, s in status.items() if s.startswith("skipped: deadline")]
    assert "accuracy" in skipped and "table9" in skipped, status
    summary = (tmp_path / "summary.md").read_text()
    assert "| window | phase accuracy | skipped: deadline" in summary
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8


def test_options(tmp_path):
    bad = _window(tmp_path, "--bogus", timeout=60)
    assert bad.returncode == 2 and "unknown option" in bad.stderr
    helped = _window(tmp_path, "--help", timeout=60)
    assert helped.returncode == 0 and "--dry-run" in helped.stdout


def _results_commands():
    """(script, args) of every `python bench/<script>.py ...` in bench/RESULTS.md."""
    text = (REPO / "bench" / "RESULTS.md").read_text()
    cmds = set()
    for m in re.finditer(r"python (bench/[\w]+\.py)([^`|\n]*)", text):
        args = m.group(2).split("#", 1)[0].rstrip().rstrip("\\").strip()
        cmds.add((m.group(1), args))
    return sorted(cmds)


def test_results_commands_parse():
    cmds = _results_commands()
    assert any(s == "bench/bench_share_gpu.py" for s, _ in cmds)
    code = textwrap.dedent("""
        import argparse, json, runpy, shlex, sys
        class Parsed(Exception):
            pass
        orig = argparse.ArgumentParser.parse_args
        def parse_args(self, args=None, namespace=None):
            orig(self, args, namespace)
            raise Parsed
        argparse.ArgumentParser.parse_args = parse_args
        bad = []
        for script, args in json.loads(sys.argv[1]):
            src = open(script).read()
            if "argparse" not in src:  # a script without options: it must compile
                compile(src, script, "exec")
                continue
            sys.argv = [script] + shlex.split(args)
            try:
                runpy.run_path(script, run_name="__main__")
                bad.append((script, args, "ran past parse_args"))
            except Parsed:
                pass
            except SystemExit as exc:
                bad.append((script, args, f"exit {exc.code}"))
        print(json.dumps(bad))
    """)
    import json

    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cmds)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], proc.stdout + proc.stderr[-2000:]


def test_table9_arithmetic():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import table9_gpu as t9
    finally:
        sys.path.pop(0)
    base, f1, hook = [1.0] * 5, [2.0] * 5, [1.01] * 5
    # (2 + 99 * 1.01) / 100 / 1 - 1 = 0.0199
    assert t9.amortized(base, f1, hook, 100) == pytest.approx(0.0199)
    est, lo, hi = t9.amortized_ci(base, f1, hook, 10)
    assert est == pytest.approx((2 + 9 * 1.01) / 10 - 1) and lo == pytest.approx(est) and hi == pytest.approx(est)
    m, h = t9.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 * 1.0 / 3 ** 0.5)
    # the hooks' own time: (own_F1 + (F - 1) own_hook) / F / base
    assert t9.direct([2.0] * 4, [0.5] * 4, [0.01] * 4, 10) == pytest.approx((0.5 + 9 * 0.01) / 10 / 2.0)
    est, lo, hi = t9.direct_ci([2.0] * 4, [0.5] * 4, [0.01] * 4, 100)
    assert lo == pytest.approx(est) and hi == pytest.approx(est)


def _preflight():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_preflight
    finally:
        sys.path.pop(0)
    return gpu_preflight


def test_preflight_finds_missing_torch_apis(tmp_path):
    """The preflight's scan names what this torch lacks, guarded or not, and resolves what it
    has (a name the package takes from torch that a GPU machine's older torch lacks fails
    there, not here: the scan is what would have told)."""
    pf = _preflight()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from torch.nn import NoSuchLayer

        def f(x):
            dist.all_reduce(x)
            dist.no_such_collective(x)
            torch.linalg.eigvalsh(x)
            fn = getattr(dist, "no_such_guarded", None)
            try:
                torch.no_such_in_try(x)
            except AttributeError:
                pass
            return dist.ReduceOp.SUM, dist.ReduceOp.NO_SUCH_OP
    """))
    missing = {name: uses for name, uses in pf.missing_torch_apis(pkg)}
    assert set(missing) == {"torch.nn.NoSuchLayer", "torch.distributed.no_such_collective",
                            "torch.distributed.no_such_guarded", "torch.no_such_in_try",
                            "torch.distributed.ReduceOp.NO_SUCH_OP"}, missing
    guarded = {n for n, uses in missing.items() if all(g for _, _, g in uses)}
    assert guarded == {"torch.distributed.no_such_guarded", "torch.no_such_in_try"}
    assert missing["torch.distributed.no_such_collective"][0][1] == 9  # its line
    # the package itself: every name it takes from this torch without a guard resolves
    real = [(n, u) for n, u in pf.missing_torch_apis() if not all(g for _, _, g in u)]
    assert real == [], real
