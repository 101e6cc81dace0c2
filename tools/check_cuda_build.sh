#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu with nvcc for sm_80 and sm_90, warnings as errors, and print
# ptxas resource usage (registers, stack, spills, shared/constant memory) per kernel.
# No torch needed: the kernels are plain CUDA C++ (see docs/cuda.md). Used by
# tests/test_cuda_build.py (marker nvcc) and for bench/RESULTS.md.
#
# One nvcc call per file builds both architectures; files compile in parallel (2 jobs).
# Environment (optional): NVCC (default `command -v nvcc`), GNS_CUDA_ARCHS (default "80 90"),
# GNS_PTX_DIR (if set, the PTX nvcc generated is kept there as <file>.sm_<arch>.ptx).
# Exit status: 0 if every file compiled for every arch, else 1 (compiler output shown).
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "check_cuda_build: nvcc not found" >&2
  exit 2
fi
ARCHS="${GNS_CUDA_ARCHS:-80 90}"
GENCODE=()
for arch in $ARCHS; do GENCODE+=(-gencode "arch=compute_$arch,code=sm_$arch"); done
# The same code-generation flags as setup.py's CUDA branch (-O3 --fmad=false), plus
# host-compiler and nvcc/ptxas warnings as errors.
FLAGS=(-std=c++17 -O3 --fmad=false -I"$REPO/csrc"
       -Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings -Xptxas -v)
OUT="$(mktemp -d /tmp/gns_cuda_build.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT

compile() {  # $1 = .cu path; writes $OUT/<name>.log and $OUT/<name>.rc
  local name
  name="$(basename "$1" .cu)"
  mkdir -p "$OUT/keep_$name"
  "$NVCC" "${FLAGS[@]}" "${GENCODE[@]}" --keep --keep-dir "$OUT/keep_$name" -c "$1" \
    -o "$OUT/$name.o" > "$OUT/$name.log" 2>&1
  echo $? > "$OUT/$name.rc"
}

echo "nvcc: $("$NVCC" --version | tail -1)"
echo "flags: ${FLAGS[*]} ${GENCODE[*]}"
running=0
for cu in "$REPO"/csrc/cuda/*.cu; do
  compile "$cu" &
  running=$((running + 1))
  if [[ $running -ge 2 ]]; then wait -n; running=$((running - 1)); fi
done
wait

status=0
for cu in "$REPO"/csrc/cuda/*.cu; do
  name="$(basename "$cu" .cu)"
  if [[ "$(cat "$OUT/$name.rc")" != "0" ]]; then
    cat "$OUT/$name.log"
    echo "FAILED: $name.cu"
    status=1
    continue
  fi
  for arch in $ARCHS; do
    echo "== $name.cu sm_$arch"
    # One entry per kernel: its name, then registers, barriers, memory, stack and spills.
    awk -v want="sm_$arch" '
      /Compiling entry function/ {
        match($0, /'\''[^'\'']*'\''/); fn = substr($0, RSTART + 1, RLENGTH - 2)
        cur = ($0 ~ ("for '\''" want "'\''")) ? fn : ""; next }
      /bytes stack frame/ && cur != "" { frame = $0; sub(/^ +/, "", frame); next }
      /ptxas info *: Used/ && cur != "" { sub(/.*: Used/, "Used"); print "  " cur; print "    " $0 "; " frame; cur = "" }
    ' "$OUT/$name.log" | c++filt
    if [[ -n "${GNS_PTX_DIR:-}" ]]; then
      cp "$OUT/keep_$name/$name.compute_$arch.ptx" "$GNS_PTX_DIR/$name.sm_$arch.ptx" ||
        { echo "FAILED: no PTX for $name.cu sm_$arch"; status=1; }
    fi
  done
done
if [[ $status -eq 0 ]]; then echo "check_cuda_build: all .cu compiled (sm_${ARCHS// /, sm_}), warnings as errors"; fi
exit $status
