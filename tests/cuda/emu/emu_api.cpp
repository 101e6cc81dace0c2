// extern "C" entry points over the CUDA launchers (csrc/cuda/gns_cuda.h) for ctypes, used
// by tests/cuda/test_emulated_kernels.py when the kernels are compiled for the CPU
// emulator (gns_emu.h). Streams are ignored there (nullptr); dtypes are gns_cuda::DType codes.
#include <cstdint>
#include <vector>

#include "cuda/gns_cuda.h"

namespace {
std::vector<gns_cuda::DType> dtypes_of(int n, const int* codes) {
  std::vector<gns_cuda::DType> out(static_cast<size_t>(n > 0 ? n : 0));
  for (int i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<gns_cuda::DType>(codes[i]);
  return out;
}
}  // namespace

extern "C" {

int64_t emu_num_blocks(int n, const int64_t* numels) { return gns_cuda::num_blocks(n, numels); }

int emu_variance_norms(int n, const int64_t* numels, const void* const* d, const void* const* q,
                       const void* const* s, const int* dt, const int* st, float scale,
                       double* slots, float* out) {
  const auto dts = dtypes_of(n, dt);
  const auto sts = dtypes_of(n, st);
  return static_cast<int>(gns_cuda::variance_norms(n, numels, d, q, s, dts.data(), sts.data(),
                                                   scale, slots, out, nullptr));
}

int emu_square_pack(int64_t n, const void* grad, const void* shift, int dt, int st, float* out) {
  return static_cast<int>(gns_cuda::square_pack(n, grad, shift, static_cast<gns_cuda::DType>(dt),
                                                static_cast<gns_cuda::DType>(st), out, nullptr));
}

int emu_square_pack_multi(int n, const int64_t* numels, const void* const* g, const void* const* s,
                          const int* dt, const int* st, float* const* out) {
  const auto dts = dtypes_of(n, dt);
  const auto sts = st ? dtypes_of(n, st) : std::vector<gns_cuda::DType>{};
  return static_cast<int>(gns_cuda::square_pack_multi(n, numels, g, s, dts.data(),
                                                      st ? sts.data() : nullptr, out, nullptr));
}

int emu_accumulate_sq(int n, const int64_t* numels, const void* const* g, void* const* p,
                      float* const* sq, const int* dt, const int* pt) {
  const auto dts = dtypes_of(n, dt);
  const auto pts = dtypes_of(n, pt);
  return static_cast<int>(
      gns_cuda::accumulate_sq(n, numels, g, p, sq, dts.data(), pts.data(), nullptr));
}

}  // extern "C"
