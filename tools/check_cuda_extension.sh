#!/usr/bin/env bash
# Full CUDAExtension build check of gns_kernels without a GPU (see docs/cuda.md).
#
# Builds gns_kernels._C as setup.py's CUDA branch does (CPU sources + csrc/cuda kernels +
# the TORCH_LIBRARY_IMPL(CUDA) binding) against a CUDA build of torch in a separate venv,
# then loads the library with torch.ops.load_library and checks that every op of the
# gns_kernels namespace has a CUDA (and a CPU) kernel registered. Nothing runs on a GPU.
#
# The build happens in a temporary copy of the sources, so the repository's own (CPU)
# build of gns_kernels/_C*.so is left alone.
#
# Environment (all optional):
#   GNS_CUDA_VENV   venv holding the CUDA torch (default /work/venv-cu; created if missing:
#                   `python -m venv` + `pip install torch==$GNS_CUDA_TORCH ninja numpy`)
#   GNS_CUDA_TORCH  torch version to install there (default 2.14.1: a CUDA 13.0 build,
#                   matching nvcc 13.0; about 5.4 GB, under 2 minutes from a local cache)
#   NVCC            the nvcc to use (default: `command -v nvcc`); CUDA_HOME is derived from it
#   MAX_JOBS        parallel compile jobs (default 2)
# Exit status 0 only if the build, the load and every registration check pass.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${GNS_CUDA_VENV:-/work/venv-cu}"
TORCH_VERSION="${GNS_CUDA_TORCH:-2.14.1}"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "check_cuda_extension: nvcc not found (set NVCC or put nvcc on PATH)" >&2
  exit 2
fi
# CUDA_HOME: the toolkit nvcc really runs from (nvcc may be a wrapper script elsewhere,
# e.g. /usr/local/bin/nvcc -> /usr/local/cuda-13.0/bin/nvcc); nvcc --dryrun prints it.
if [[ -z "${CUDA_HOME:-}" ]]; then
  echo > "${TMPDIR:-/tmp}/gns_nvcc_probe.cu"
  TOP="$("$NVCC" --dryrun -c "${TMPDIR:-/tmp}/gns_nvcc_probe.cu" -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
  rm -f "${TMPDIR:-/tmp}/gns_nvcc_probe.cu"
  CUDA_HOME="$(readlink -f "${TOP:-$(dirname "$(readlink -f "$NVCC")")/..}")"
fi
export CUDA_HOME
export PATH="$CUDA_HOME/bin:$PATH"
export MAX_JOBS="${MAX_JOBS:-2}"
START=$(date +%s)

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import torch; assert torch.version.cuda" 2>/dev/null; then
  echo "== creating $VENV with torch==$TORCH_VERSION (CUDA build)"
  python -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" ninja numpy
fi
PY="$VENV/bin/python"
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
echo "nvcc: $NVCC ($("$NVCC" --version | tail -1)); CUDA_HOME=$CUDA_HOME"

# Headers the minimal toolkit lacks (cusparse.h, ...) come with torch's nvidia-* wheels.
NV_INCLUDE="$("$PY" -c "import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'include'))")"
if [[ -d "$NV_INCLUDE" ]]; then
  export CPATH="$NV_INCLUDE${CPATH:+:$CPATH}"
fi

WORK="$(mktemp -d /tmp/gns_cuda_ext.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/src/gns_kernels"
# what setup.py and pyproject.toml read: the version module, README (readme) and LICENSE
# (license-files), besides the C++/CUDA sources
cp "$REPO/setup.py" "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/LICENSE" "$WORK/src/"
cp -r "$REPO/csrc" "$WORK/src/csrc"
: > "$WORK/src/gns_kernels/__init__.py"
cp "$REPO/gns_kernels/_version.py" "$WORK/src/gns_kernels/"

echo "== building gns_kernels._C (CUDAExtension) in $WORK/src"
BUILD_START=$(date +%s)
(cd "$WORK/src" && "$PY" setup.py -q build_ext --inplace) > "$WORK/build.log" 2>&1 || {
  tail -60 "$WORK/build.log"
  echo "check_cuda_extension: BUILD FAILED" >&2
  exit 1
}
BUILD_END=$(date +%s)
SO="$(ls "$WORK"/src/gns_kernels/_C*.so)"
echo "built $(basename "$SO") in $((BUILD_END - BUILD_START)) s; device code for:" \
  $(grep -o "code=sm_[0-9a-z]*\|code=compute_[0-9a-z]*" "$WORK/build.log" | sort -u | sed 's/code=//')
if ! grep -q "nvcc" "$WORK/build.log" && ! ls "$WORK"/src/build/*/csrc/cuda/*.o >/dev/null 2>&1; then
  echo "check_cuda_extension: the build did not compile csrc/cuda (CPU-only branch taken?)" >&2
  exit 1
fi

"$PY" - "$SO" <<'PYEOF'
import sys
import torch

torch.ops.load_library(sys.argv[1])
ops = ["variance_norms", "variance_norms_multi", "square_pack", "square_pack_multi", "accumulate_sq",
       "accumulate_sq_multi"]
bad = []
for op in ops:
    name = f"gns_kernels::{op}"
    for key in ("CUDA", "CPU"):
        ok = torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
        print(f"{name:36s} {key:4s} kernel registered: {ok}")
        if not ok:
            bad.append(f"{name} ({key})")
    # The CUDA kernel is the one of csrc/cuda/binding.cpp (how tests and benches tell the
    # C++ CUDA build from a Triton registration).
    if "cuda/binding.cpp" not in torch._C._dispatch_dump(name):
        bad.append(f"{name} (CUDA kernel not from csrc/cuda/binding.cpp)")
if bad:
    sys.exit("check_cuda_extension: missing kernels: " + ", ".join(bad))
PYEOF
echo "check_cuda_extension: PASSED in $(( $(date +%s) - START )) s (build $((BUILD_END - BUILD_START)) s)"
