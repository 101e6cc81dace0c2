#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu with nvcc for sm_80 and sm_90, warnings as errors, and print
# ptxas resource usage (registers, stack, spills, shared/constant memory) per kernel.
# No torch needed: the kernels are plain CUDA C++ (see docs/cuda.md). Used by
# tests/test_cuda_build.py (marker nvcc) and for bench/RESULTS.md.
#
# Environment (optional): NVCC (default `command -v nvcc`), GNS_CUDA_ARCHS (default "80 90"),
# GNS_PTX_DIR (if set, also writes <file>.sm_<arch>.ptx there for inspection).
# Exit status: 0 if every file compiled for every arch, else 1 (compiler output shown).
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "check_cuda_build: nvcc not found" >&2
  exit 2
fi
ARCHS="${GNS_CUDA_ARCHS:-80 90}"
# The same code-generation flags as setup.py's CUDA branch (-O3 --fmad=false), plus
# host-compiler and nvcc/ptxas warnings as errors.
FLAGS=(-std=c++17 -O3 --fmad=false -I"$REPO/csrc"
       -Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings)
OUT="$(mktemp -d /tmp/gns_cuda_build.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT

echo "nvcc: $("$NVCC" --version | tail -1)"
status=0
for cu in "$REPO"/csrc/cuda/*.cu; do
  name="$(basename "$cu" .cu)"
  for arch in $ARCHS; do
    echo "== $name.cu sm_$arch"
    log="$OUT/$name.$arch.log"
    if "$NVCC" "${FLAGS[@]}" -Xptxas -v -gencode "arch=compute_$arch,code=sm_$arch" -c "$cu" \
        -o "$OUT/$name.$arch.o" > "$log" 2>&1; then
      # One line per kernel: demangled-ish name, then its resources.
      awk '
        /Compiling entry function/ { match($0, /'\''[^'\'']*'\''/); fn = substr($0, RSTART + 1, RLENGTH - 2); next }
        /bytes stack frame/ { frame = $0; sub(/^ +/, "", frame); next }
        /ptxas info *: Used/ && fn != "" { sub(/.*: Used/, "Used"); print "  " fn; print "    " $0 "; " frame; fn = "" }
      ' "$log" | c++filt
    else
      cat "$log"
      echo "FAILED: $name.cu sm_$arch"
      status=1
    fi
    if [[ -n "${GNS_PTX_DIR:-}" ]]; then
      "$NVCC" "${FLAGS[@]}" -arch "sm_$arch" -ptx "$cu" -o "$GNS_PTX_DIR/$name.sm_$arch.ptx" \
        > /dev/null 2>&1 || { echo "FAILED: ptx of $name.cu sm_$arch"; status=1; }
    fi
  done
done
if [[ $status -eq 0 ]]; then echo "check_cuda_build: all .cu compiled (sm_${ARCHS// /, sm_}), warnings as errors"; fi
exit $status
