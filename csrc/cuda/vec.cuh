// Element types, conversions and 128-bit vector loads/stores for the gns_kernels CUDA kernels.
//
// Inputs are float32, bfloat16 or float16; every kernel converts to float32 on load.
// A Pack<T, N> is N consecutive elements moved with the widest aligned accesses: 16 bytes
// (one ld.global.v4 / st.global.v4) for N * sizeof(T) >= 16, e.g. 4 floats or 8 halves.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gns_cuda.h"

namespace gns_cuda {
namespace detail {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Round-to-nearest-even conversion from float32 (used to store prev = grad when prev's type
// differs from grad's; identical types are copied bit for bit by the kernels).
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Elements per thread per step: one 128-bit load of the leading input type.
template <typename T>
struct VecWidth {
  static constexpr int value = static_cast<int>(16 / sizeof(T));
};

constexpr int pack_align(int bytes) { return bytes >= 16 ? 16 : bytes; }

template <typename T, int N>
struct alignas(pack_align(static_cast<int>(sizeof(T)) * N)) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ bool is_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(Pack<T, N>) == 0;
}

// Loads elements [N*k, N*k + N) of p (aligned to alignof(Pack<T, N>)) as floats.
template <typename T, int N>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, int64_t k, float (&out)[N]) {
  const Pack<T, N> pk = reinterpret_cast<const Pack<T, N>*>(p)[k];
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = to_float(pk.v[j]);
}

// Copies elements [N*k, N*k + N) of p into raw (same type, no conversion).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_raw(const T* __restrict__ p, int64_t k) {
  return reinterpret_cast<const Pack<T, N>*>(p)[k];
}

template <typename T, int N>
__device__ __forceinline__ void store_raw(T* __restrict__ p, int64_t k, const Pack<T, N>& v) {
  reinterpret_cast<Pack<T, N>*>(p)[k] = v;
}

template <int N>
__device__ __forceinline__ void store_floats(float* __restrict__ p, int64_t k,
                                             const float (&v)[N]) {
  Pack<float, N> pk;
#pragma unroll
  for (int j = 0; j < N; ++j) pk.v[j] = v[j];
  reinterpret_cast<Pack<float, N>*>(p)[k] = pk;
}

}  // namespace detail
}  // namespace gns_cuda
