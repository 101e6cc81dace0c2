#!/usr/bin/env bash
# The GPU window: one command that turns one call on a lent GPU machine (H100 / H200, no
# network, 10 minutes per command, torch 2.11) into the GPU checks and figures the project
# needs, correctness first, then the figures, most valuable first; it ends with one summary
# table to paste into bench/RESULTS.md ("GPU window runs").
#
#   OUT=/some/folder bash bench/gpu_window.sh            # on the GPU machine
#   bash bench/gpu_window.sh --dry-run                   # every phase on CPU at toy sizes (CI)
#
# Phases and their budgets in seconds (sum 445 of the 465-second deadline; each runs in
# its own process under `timeout`, its log written to $OUT as it goes):
#   preflight  20  build.log   tools (setuptools, ninja, nvcc, CXX, jobs, sm), the torch
#                              version, and every torch API the package names resolved in
#                              this torch (bench/gpu_preflight.py)
#   build     120  build.log   the extension for this GPU's sm only, in a copy of the sources
#                              (setup.py build_ext; any setuptools), ninja with `nproc --all`
#                              jobs, CXX=/usr/bin/g++ (GPU_WINDOW_CXX overrides); skipped with one line
#                              when a piece is missing (S1, Table 9 and Triton need none).
#                              --dry-run: a CPU-only build (GNS_KERNELS_CUDA=0) in a copy
#   smoke      15  build.log   import, one op of each kind against reference.py
#   tests      45  tests.log   the tests marked cuda, one pytest process per file (a
#                              collection error costs one file), 40 s per test
#   hooks      45  hooks.log   the hooks as users run them, on CUDA tensors
#                              (bench/gpu_hooks.py): NCCL, one process: DDP with MicroBatchGNS
#                              vs float64, AdaptiveBatching growing B + a checkpoint round
#                              trip; 2 processes over gloo: DDP and FSDP2, l1 and nuclear
#                              with the pool, against the CPU run of the same seeds
#   s1         85  s1.log      S1 per rank through the real DDP hook, 160M shapes, R = 8,
#                              12 buckets, pool on: GPU time (CUDA events), host time, peak
#                              memory, printed first; then each solver route the hooks
#                              accept, pool off, the share alone (bench/gpu_window.py s1)
#   table9     55  table9.log  the paper's Table 9 on one GPU (bench/table9_gpu.py): whole
#                              steps, and the hooks' own time by CUDA events
#   fused      35  fused.log   the fused kernels against the copy floor; Triton's and the
#                              kernels' first call (compile) timed apart
#   accuracy   20  s1.log      S1 against float64 on steep spectra: the hooks' shared solve,
#                              the DDP hook, method="newton-tf32" of gk.sqrt_trace /
#                              gk.nuclear_stats (bench/gpu_window.py accuracy)
#   summary     5              summary.md
# A phase may also use the seconds the phases before it left unused (it stops when its
# work is done), never past the deadline. 8 files in $OUT: the 6 logs, window.log and
# summary.md.
#
# Deadline: GPU_WINDOW_DEADLINE seconds after the start (default 465: the call gets a
# 560-600 s limit; a machine's start and the transfers come on top). A phase that cannot
# get its minimum is skipped with a line. The script always ends with the summary and exit
# status 0 (a failed phase is a row of the summary, not an error of the window); 2 for a
# bad option. Other variables: OUT (default: a new temporary folder, printed), PYTHON
# (default: the python3 or python that imports torch), GPU_WINDOW_CXX (default /usr/bin/g++
# where it exists; the environment's CXX is not used: the GPU image's, a wrapper that links
# libstdc++ statically, gave an extension that crashed at the first C++ exception), MAX_JOBS
# (default `nproc --all`); for a rerun of a few phases after a fix, GPU_WINDOW_PHASES (names,
# space-separated; the others are skipped with a line) and GPU_WINDOW_TESTS (test files).
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
BANK=0      # seconds the earlier phases left unused
export GPU_WINDOW_END=$END PYTHONUNBUFFERED=1
# the checkout's package (the build phase puts the extension into it; the Triton and
# eager paths need none)
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

# run_phase NAME LOG BUDGET MIN CMD...: CMD under timeout (its budget plus the bank, at most
# what is left before the deadline), output appended to $OUT/LOG
run_phase() {
  local name=$1 log=$2 budget=$3 need=$4
  shift 4
  local now left t t0 rc dt
  if [ -n "${GPU_WINDOW_PHASES:-}" ] && ! [[ " $GPU_WINDOW_PHASES " == *" $name "* ]]; then
    say "phase $name: skipped: not in GPU_WINDOW_PHASES"
    row window "phase $name" "skipped: not in GPU_WINDOW_PHASES" ""
    return 0
  fi
  now=$(date +%s)
  left=$((END - now - RESERVE))
  if [ "$left" -lt "$need" ]; then
    say "phase $name: skipped: deadline ($left s left, needs $need s)"
    echo "skipped: phase $name: deadline ($left s left, needs $need s)" >> "$OUT/$log"
    row window "phase $name" "skipped: deadline ($left s left, needs $need s)" ""
    return 0
  fi
  t=$((budget + BANK))
  [ "$left" -lt "$t" ] && t=$left
  say "phase $name: start (limit $t s = budget $budget + $BANK unused before; $left s before the deadline)"
  echo "== phase $name ($(date -u +%H:%M:%S), limit $t s): $*" >> "$OUT/$log"
  t0=$(date +%s)
  GPU_WINDOW_PHASE_END=$((t0 + t - 3)) timeout --signal=TERM --kill-after=5 "$t" "$@" >> "$OUT/$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  BANK=$((t - dt))
  [ "$BANK" -lt 0 ] && BANK=0
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

# skip_phase NAME LOG WHY: a phase that cannot run here, one line
skip_phase() {
  say "phase $1: skipped: $3"
  echo "skipped: phase $1: $3" >> "$OUT/$2"
  row window "phase $1" "skipped: $3" ""
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
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
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
NCPU=$(nproc --all 2>/dev/null || getconf _NPROCESSORS_ONLN)
DEVLINE="GPU: $GPU (name, driver, memory); ${VERS:-torch not importable}; $NCPU CPUs; commit $REV"
say "GPU window, $MODE; $(date -u '+%Y-%m-%d %H:%M UTC'); deadline $DEADLINE s; OUT=$OUT"
say "$DEVLINE"
if [ "$DRY" -eq 0 ] && [ "$GPU" = none ]; then
  say "warning: nvidia-smi found no GPU; the phases will fail or skip (use --dry-run on a CPU machine)"
fi

# ------------------------------------------------------------------ preflight and build
run_phase preflight build.log 20 5 "$PY" bench/gpu_preflight.py --build-env
benv() { grep -h "^env $1=" "$OUT/build.log" 2>/dev/null | tail -n 1 | cut -d= -f2-; }
# what the preflight found (defaults of its own where the preflight did not finish)
B_CXX=${GPU_WINDOW_CXX:-$(benv CXX)}
[ -n "$B_CXX" ] || { [ -x /usr/bin/g++ ] && B_CXX=/usr/bin/g++ || B_CXX=${CXX:-c++}; }
B_CC=gcc
[ -x /usr/bin/gcc ] && [ "$B_CXX" = /usr/bin/g++ ] && B_CC=/usr/bin/gcc
B_JOBS=${MAX_JOBS:-$(benv JOBS)}
[ -n "$B_JOBS" ] || B_JOBS=$NCPU
B_ARCH=$(benv ARCH)
[ "$B_ARCH" = none ] && B_ARCH=
B_NINJA_DIR=$(benv NINJA_DIR)
B_SKIP=$(benv BUILD_SKIP)

# build_ext in a copy of what setup.py reads (no pyproject.toml there, so any setuptools
# runs it), then the built library copied into the checkout's package (GPU) or only
# checked (dry run: the checkout keeps the extension it was installed with)
BUILD='set -e
src=$(mktemp -d "${TMPDIR:-/tmp}/gns_build.XXXXXX")
cp -r setup.py csrc "$src"/
mkdir -p "$src/gns_kernels" && cp gns_kernels/_version.py "$src/gns_kernels/"
echo "CXX=$CXX MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} GNS_KERNELS_CUDA=${GNS_KERNELS_CUDA:-auto} in $src"
(cd "$src" && "$PY" setup.py -q build_ext --inplace)
so=$(ls "$src"/gns_kernels/_C*.so | head -n 1)
echo "built: $(basename "$so") ($(du -k "$so" | cut -f1) KiB)"
if command -v readelf >/dev/null 2>&1 && ! readelf -d "$so" | grep -i "libstdc++"; then
  echo "not installed: no libstdc++ among the NEEDED entries (linked statically, the extension"
  echo "crashes at the first C++ exception); build with GPU_WINDOW_CXX=/usr/bin/g++"
  rm -rf "$src"
  exit 1
fi
if [ "$INSTALL" = 1 ]; then cp "$so" gns_kernels/ && echo "installed into gns_kernels/"; fi
rm -rf "$src"'
if [ "$DRY" -eq 1 ]; then
  run_phase build build.log 120 30 env PY="$PY" INSTALL=0 GNS_KERNELS_CUDA=0 CXX="$B_CXX" CC="$B_CC" \
    MAX_JOBS="$B_JOBS" PATH="${B_NINJA_DIR:+$B_NINJA_DIR:}$PATH" bash -c "$BUILD"
elif [ -n "$B_SKIP" ]; then
  skip_phase build build.log "$B_SKIP"
else
  run_phase build build.log 120 30 env PY="$PY" INSTALL=1 CXX="$B_CXX" CC="$B_CC" MAX_JOBS="$B_JOBS" \
    ${B_ARCH:+TORCH_CUDA_ARCH_LIST="$B_ARCH"} PATH="${B_NINJA_DIR:+$B_NINJA_DIR:}$PATH" bash -c "$BUILD"
fi
run_phase smoke build.log 15 5 "$PY" bench/gpu_window.py smoke --device "$DEV"

# ------------------------------------------------------------------ correctness
# the test files that hold tests marked cuda, one pytest process each
TESTS=${GPU_WINDOW_TESTS:-$(grep -rlE "mark\.cuda\b" tests --include='test_*.py' | sort | tr '\n' ' ')}
PT_TIMEOUT=
"$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && PT_TIMEOUT="--timeout=40"
run_phase tests tests.log 45 10 env PY="$PY" PT_TIMEOUT="$PT_TIMEOUT" TESTS="$TESTS" bash -c '
  rc=0
  for f in $TESTS; do
    left=$(( ${GPU_WINDOW_PHASE_END:-0} - $(date +%s) ))
    if [ "$left" -lt 5 ]; then echo "@@ | tests | $f | skipped: deadline | all pass |"; continue; fi
    echo "== $f"
    timeout "$left" "$PY" -m pytest -m cuda -q -p no:cacheprovider $PT_TIMEOUT "$f" > .tests_one.log 2>&1
    r=$?
    cat .tests_one.log
    last=$(grep -E "(passed|failed|skipped|error|no tests ran|deselected).* in [0-9.]+s" .tests_one.log | tail -n 1 | sed "s/=//g; s/^ *//; s/ *$//")
    [ "$r" -eq 124 ] && last="timed out after $left s${last:+ ($last)}"
    [ -n "$last" ] || last="exit $r (no pytest summary: see tests.log)"
    echo "@@ | tests | $f | $last | all pass (on the dry run: all skipped) |"
    [ "$r" -eq 0 ] || [ "$r" -eq 5 ] || rc=1
  done
  rm -f .tests_one.log
  exit $rc'
run_phase hooks hooks.log 45 10 "$PY" bench/gpu_hooks.py --device "$DEV"

# ------------------------------------------------------------------ figures
run_phase s1 s1.log 85 20 "$PY" bench/gpu_window.py s1 --device "$DEV" $TINY
RANK_MS=$(grep -h '^@@S1RANK ' "$OUT/s1.log" 2>/dev/null | tail -n 1 | awk '{print $2}')
run_phase table9 table9.log 55 25 "$PY" bench/table9_gpu.py --device "$DEV" $TINY ${RANK_MS:+--rank-share-ms "$RANK_MS"}
if [ "$DRY" -eq 1 ]; then
  run_phase fused fused.log 35 10 env TRITON_INTERPRET=1 "$PY" bench/gpu_window.py fused --device cpu --tiny
else
  run_phase fused fused.log 35 15 "$PY" bench/gpu_window.py fused --device cuda
fi
run_phase accuracy s1.log 20 8 "$PY" bench/gpu_window.py accuracy --device "$DEV" $TINY

# ------------------------------------------------------------------ summary
SUM="$OUT/summary.md"
{
  echo "### GPU window, $(date -u '+%Y-%m-%d'): $MODE"
  echo
  echo "$DEVLINE"
  echo
  echo "| phase | measurement | value | target / paper |"
  echo "|---|---|---|---|"
  cat "$ROWS"
  for log in build.log tests.log hooks.log s1.log table9.log fused.log; do
    grep -h '^@@ ' "$OUT/$log" 2>/dev/null | sed 's/^@@ //'
  done
  echo
  echo "(bash bench/gpu_window.sh$([ "$DRY" -eq 1 ] && echo ' --dry-run'), $(( $(date +%s) - START )) s; logs: build.log tests.log hooks.log s1.log table9.log fused.log window.log)"
} > "$SUM"
rm -f "$ROWS"
say "window done in $(( $(date +%s) - START )) s; summary ($SUM):"
echo
cat "$SUM"
exit 0
