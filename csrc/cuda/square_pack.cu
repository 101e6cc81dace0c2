// CUDA square_pack: x = grad - shift (grad when no shift); out[i] = x_i, out[n + i] = x_i^2,
// out float32 of 2n elements, so one collective carries both halves. One pass.
// Per-element math: gns::shifted from csrc/gns_math.h (shared with the CPU kernels).
#include <cstdint>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gns_math.h"
#include "cuda/gns_cuda.h"
#include "cuda/multi_tensor.cuh"
#include "cuda/vec.cuh"

namespace gns_cuda {
namespace detail {
namespace {

using Table3 = TensorTable<3, kMaxTensorsPerLaunch>;

// tb.ptr: [0] grad (T), [1] shift (TS, or nullptr), [2] out (float, 2 * numel elements).
template <typename T, typename TS, bool HasShift>
__global__ void __launch_bounds__(kBlockThreads) square_pack_kernel(Table3 tb) {
  constexpr int VEC = VecWidth<T>::value;
  const BlockWork w = locate_block(tb);
  const int64_t n = tb.numel[w.tensor];
  const T* __restrict__ grad = static_cast<const T*>(tb.ptr[0][w.tensor]) + w.begin;
  const TS* __restrict__ sh =
      HasShift ? static_cast<const TS*>(tb.ptr[1][w.tensor]) + w.begin : nullptr;
  float* const out = const_cast<float*>(static_cast<const float*>(tb.ptr[2][w.tensor]));
  float* __restrict__ lo = out + w.begin;
  float* __restrict__ hi = out + n + w.begin;

  // The upper half starts at out + n: 16-byte aligned only when n is a multiple of 4, so it
  // gets its own check and falls back to scalar stores while loads stay vectorized.
  const bool aligned = is_aligned<T, VEC>(grad) && (!HasShift || is_aligned<TS, VEC>(sh)) &&
                       is_aligned<float, VEC>(lo);
  const bool hi_aligned = is_aligned<float, VEC>(hi);
  int64_t done = 0;
  if (aligned) {
    const int64_t nvec = w.length / VEC;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      float x[VEC], s[VEC], x2[VEC];
      load_pack<T, VEC>(grad, v, x);
      if (HasShift) {
        load_pack<TS, VEC>(sh, v, s);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        x[j] = gns::shifted(x[j], s[j]);
        x2[j] = x[j] * x[j];
      }
      store_floats<VEC>(lo, v, x);
      if (hi_aligned) {
        store_floats<VEC>(hi, v, x2);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) hi[v * VEC + j] = x2[j];
      }
    }
    done = nvec * VEC;
  }
  // Scalar path: the whole chunk when an input or out is misaligned, else the tail.
  for (int64_t i = done + threadIdx.x; i < w.length; i += blockDim.x) {
    const float s = HasShift ? to_float(sh[i]) : 0.0f;
    const float x = gns::shifted(to_float(grad[i]), s);
    lo[i] = x;
    hi[i] = x * x;
  }
}

template <typename T, typename TS, bool HasShift>
cudaError_t launch_typed(int64_t n, const void* const* const (&lists)[3], cudaStream_t stream) {
  return for_each_launch<3, kMaxTensorsPerLaunch>(
      std::vector<int>{0}, &n, lists, 0, [&](const Table3& tb, int grid, int64_t /*slot_base*/) {
        square_pack_kernel<T, TS, HasShift><<<grid, kBlockThreads, 0, stream>>>(tb);
        return cudaGetLastError();
      });
}

template <typename T>
cudaError_t launch_shift(int64_t n, const void* const* const (&lists)[3], DType shift_dtype,
                         cudaStream_t stream) {
  if (lists[1] == nullptr) return launch_typed<T, T, false>(n, lists, stream);
  switch (shift_dtype) {
    case DType::Float32:
      return launch_typed<T, float, true>(n, lists, stream);
    case DType::BFloat16:
      return launch_typed<T, __nv_bfloat16, true>(n, lists, stream);
    case DType::Float16:
      return launch_typed<T, __half, true>(n, lists, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace detail

cudaError_t square_pack(int64_t n, const void* grad, const void* shift, DType dtype,
                        DType shift_dtype, float* out, cudaStream_t stream) {
  const void* const grads[1] = {grad};
  const void* const shifts[1] = {shift};
  const void* const outs[1] = {out};
  const void* const* const lists[3] = {grads, shift ? shifts : nullptr, outs};
  switch (dtype) {
    case DType::Float32:
      return detail::launch_shift<float>(n, lists, shift_dtype, stream);
    case DType::BFloat16:
      return detail::launch_shift<__nv_bfloat16>(n, lists, shift_dtype, stream);
    case DType::Float16:
      return detail::launch_shift<__half>(n, lists, shift_dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace gns_cuda
