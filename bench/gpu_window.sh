#!/usr/bin/env bash
# The GPU window: one command that turns one call on a lent GPU machine (H100 / H200, no
# network, 10 minutes per command) into every GPU figure the project needs, then prints
# one summary table to paste into bench/RESULTS.md.
#
#   OUT=/some/folder bash bench/gpu_window.sh            # on the GPU machine
#   bash bench/gpu_window.sh --dry-run                   # every phase on CPU at toy sizes (CI)
#
# Phases, in order of value (each in its own process under `timeout`, its log written to
# $OUT as it goes):
#   build   (build.log)   CXX=/usr/bin/g++ pip install --no-build-isolation --no-deps -e .
#                         (--dry-run: checks the installed extension instead), then import
#                         and one op of each kind against reference.py
#   s1      (s1.log)      S1 per rank: accuracy against float64 on steep spectra, the real
#                         DDP hook per rank (about 12 buckets), the share alone; pool on and
#                         off; fp32 and TF32 (bench/gpu_window.py s1)
#   table9  (table9.log)  the paper's Table 9 on one GPU (bench/table9_gpu.py)
#   fused   (fused.log)   the fused kernels against the copy floor, fp32 and bf16, single
#                         and multi-tensor, CUDA C++ and Triton (bench/gpu_window.py fused)
#   pytest  (pytest.log)  python -m pytest -m cuda (the sync-free tests included)
# plus window.log (this script's own lines) and summary.md: 7 files in $OUT.
#
# Deadline: GPU_WINDOW_DEADLINE seconds after the start (default 465: the call limit is
# 600 s, the window must end within 8 minutes). A phase gets at most its own cap and what
# is left before the deadline; one that cannot get its minimum is skipped with a line. The
# script always ends with the summary and exit status 0 (a failed phase is a row of the
# summary, not an error of the window); 2 for a bad option.
# Other variables: OUT (default: a new temporary folder, printed), PYTHON (default: the
# python3 or python that imports torch), MAX_JOBS (build; default: the CPU count).
set -u
cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_window.sh: unknown option $arg (expected --dry-run or --help)" >&2; exit 2 ;;
  esac
done

START=$(date +%s)
DEADLINE=${GPU_WINDOW_DEADLINE:-465}
END=$((START + DEADLINE))
RESERVE=5   # seconds kept for the summary
export GPU_WINDOW_END=$END PYTHONUNBUFFERED=1
# the checkout's package even where the build phase failed (the Triton and eager paths
# need no extension); the editable install points here anyway
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_window.XXXXXX")
  echo "OUT was not set: the logs go to $OUT"
fi
mkdir -p "$OUT"
WLOG="$OUT/window.log"
ROWS="$OUT/.rows"   # removed before the end (the files that stay: at most 8)
: > "$WLOG"
: > "$ROWS"

if [ -z "${PYTHON:-}" ]; then
  for c in python3 python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then PYTHON=$c; break; fi
  done
fi
PY=${PYTHON:-python3}

say() { echo "$*" | tee -a "$WLOG"; }
row() { echo "| $1 | $2 | $3 | $4 |" >> "$ROWS"; }

# run_phase NAME LOG CAP MIN CMD...: CMD under timeout, output appended to $OUT/LOG
run_phase() {
  local name=$1 log=$2 cap=$3 need=$4
  shift 4
  local now left t t0 rc dt
  now=$(date +%s)
  left=$((END - now - RESERVE))
  if [ "$left" -lt "$need" ]; then
    say "phase $name: skipped: deadline ($left s left, needs $need s)"
    echo "skipped: phase $name: deadline ($left s left, needs $need s)" >> "$OUT/$log"
    row window "phase $name" "skipped: deadline ($left s left, needs $need s)" ""
    return 0
  fi
  t=$cap
  [ "$left" -lt "$t" ] && t=$left
  say "phase $name: start (limit $t s; $left s before the deadline)"
  echo "== phase $name ($(date -u +%H:%M:%S), limit $t s): $*" >> "$OUT/$log"
  t0=$(date +%s)
  GPU_WINDOW_PHASE_END=$((t0 + t - 3)) timeout --signal=TERM --kill-after=5 "$t" "$@" >> "$OUT/$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "phase $name: timed out after $t s (its rows so far are kept; $log)"
    row window "phase $name" "timed out after $t s" ""
  elif [ "$rc" -eq 0 ]; then
    say "phase $name: ran ($dt s)"
    row window "phase $name" "ran ($dt s)" ""
  else
    say "phase $name: failed (exit $rc, $dt s); last lines of $log:"
    tail -n 5 "$OUT/$log" | sed 's/^/    /' | tee -a "$WLOG"
    row window "phase $name" "failed (exit $rc, $dt s; see $log)" ""
  fi
  return 0
}

# ------------------------------------------------------------------ device line
if [ "$DRY" -eq 1 ]; then
  MODE="dry run on CPU at toy sizes (no figure below is a GPU measurement)"
  DEV=cpu
  TINY=--tiny
  # toy sizes gain nothing from threads, and OpenMP threads spinning beside other work on
  # a small machine slowed the toy steps up to 20x
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  MODE="GPU"
  DEV=cuda
  TINY=
fi
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
[ -n "$GPU" ] || GPU="none"
VERS=$("$PY" - <<'EOF' 2>/dev/null
import platform, torch
try:
    import triton
    tv = triton.__version__
except Exception:
    tv = "absent"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, python {platform.python_version()}")
EOF
)
REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$REV" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  REV="$REV + uncommitted changes"
fi
DEVLINE="GPU: $GPU (name, driver); ${VERS:-torch not importable}; $(nproc) CPUs; commit $REV"
say "GPU window, $MODE; $(date -u '+%Y-%m-%d %H:%M UTC'); deadline $DEADLINE s; OUT=$OUT"
say "$DEVLINE"
if [ "$DRY" -eq 0 ] && [ "$GPU" = none ]; then
  say "warning: nvidia-smi found no GPU; the phases will fail or skip (use --dry-run on a CPU machine)"
fi

# ------------------------------------------------------------------ phases
# the built extension and its libstdc++ (docs/cuda.md: a compiler wrapper once linked it
# statically, and C++ errors then crashed)
CHECK_SO='so=$(ls gns_kernels/_C*.so 2>/dev/null | head -n 1)
if [ -z "$so" ]; then
  echo "no built extension in gns_kernels/"
elif ! command -v readelf >/dev/null 2>&1; then
  echo "extension: $so (readelf not found: libstdc++ check skipped)"
else
  echo "extension: $so"
  readelf -d "$so" | grep -i "libstdc++" || echo "warning: no libstdc++ among the NEEDED entries of $so (docs/cuda.md: build with CXX=/usr/bin/g++)"
fi'
if [ "$DRY" -eq 1 ]; then
  run_phase build build.log 60 5 bash -c '
    set -e
    '"$PY"' -c "import gns_kernels, gns_kernels.ops as o; print(\"installed:\", gns_kernels.__file__); print(\"C++ extension:\", o.cpp_available())"
    echo "(dry run: nothing rebuilt)"
    '"$CHECK_SO"
else
  run_phase build build.log 240 60 bash -c '
    set -e
    nvcc --version | tail -n 1 || true
    CXX=/usr/bin/g++ CC=/usr/bin/gcc MAX_JOBS=${MAX_JOBS:-$(nproc)} '"$PY"' -m pip install --no-index --no-build-isolation --no-deps -e .
    '"$CHECK_SO"
fi
run_phase smoke build.log 60 10 "$PY" bench/gpu_window.py smoke --device "$DEV"
run_phase s1 s1.log 110 20 "$PY" bench/gpu_window.py s1 --device "$DEV" $TINY
RANK_MS=$(grep -h '^@@S1RANK ' "$OUT/s1.log" 2>/dev/null | tail -n 1 | awk '{print $2}')
run_phase table9 table9.log 110 30 "$PY" bench/table9_gpu.py --device "$DEV" $TINY ${RANK_MS:+--rank-share-ms "$RANK_MS"}
if [ "$DRY" -eq 1 ]; then
  run_phase fused fused.log 60 10 env TRITON_INTERPRET=1 "$PY" bench/gpu_window.py fused --device cpu --tiny
else
  run_phase fused fused.log 70 20 "$PY" bench/gpu_window.py fused --device cuda
fi
# the tests marked cuda: all of tests/ on the GPU; on the dry run only the files that hold
# such tests (collecting the whole suite costs more than running these skips)
if [ "$DRY" -eq 1 ]; then
  TESTS=$(grep -rlE "mark\.cuda|pytest\.mark\.cuda" tests --include='*.py' | sort | tr '\n' ' ')
else
  TESTS=tests
fi
PT_TIMEOUT=
"$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && PT_TIMEOUT="--timeout=120"
run_phase pytest pytest.log 150 20 "$PY" -m pytest -m cuda -q -p no:cacheprovider $PT_TIMEOUT $TESTS

# ------------------------------------------------------------------ summary
PT_LAST=$(grep -E "(passed|failed|skipped|error|no tests ran|deselected).* in [0-9.]+s" "$OUT/pytest.log" 2>/dev/null | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
SUM="$OUT/summary.md"
{
  echo "### GPU window, $(date -u '+%Y-%m-%d'): $MODE"
  echo
  echo "$DEVLINE"
  echo
  echo "| phase | measurement | value | target / paper |"
  echo "|---|---|---|---|"
  cat "$ROWS"
  grep -h '^@@ ' "$OUT/build.log" "$OUT/s1.log" "$OUT/table9.log" "$OUT/fused.log" 2>/dev/null | sed 's/^@@ //'
  [ -n "$PT_LAST" ] && echo "| pytest | python -m pytest -m cuda | $PT_LAST | all pass (on the dry run: all skipped) |"
  echo
  echo "(bash bench/gpu_window.sh$([ "$DRY" -eq 1 ] && echo ' --dry-run'), $(( $(date +%s) - START )) s; logs: build.log s1.log table9.log fused.log pytest.log window.log)"
} > "$SUM"
rm -f "$ROWS"
say "window done in $(( $(date +%s) - START )) s; summary ($SUM):"
echo
cat "$SUM"
exit 0
