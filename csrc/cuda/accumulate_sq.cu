// CUDA accumulate_sq (single and multi-tensor), in place: d = grad - prev; sq += d*d;
// prev = grad. One pass, each element read once (grad, prev, sq) and written once (prev, sq).
// Per-element math: gns::accumulate_sq_value from csrc/gns_math.h (shared with the CPU).
#include <cstdint>
#include <type_traits>
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

// New value of prev: the gradient itself (bit copy) when the types agree, else rounded.
template <typename TP, typename T>
__device__ __forceinline__ TP prev_value(T g) {
  if constexpr (std::is_same<TP, T>::value) {
    return g;
  } else {
    return from_float<TP>(to_float(g));
  }
}

template <typename T, typename TP>
__global__ void __launch_bounds__(kBlockThreads) accumulate_sq_kernel(Table3 tb) {
  constexpr int VEC = VecWidth<T>::value;
  const BlockWork w = locate_block(tb);
  const T* __restrict__ grad = static_cast<const T*>(tb.ptr[0][w.tensor]) + w.begin;
  TP* __restrict__ prev = const_cast<TP*>(static_cast<const TP*>(tb.ptr[1][w.tensor])) + w.begin;
  float* __restrict__ sq =
      const_cast<float*>(static_cast<const float*>(tb.ptr[2][w.tensor])) + w.begin;

  const bool aligned =
      is_aligned<T, VEC>(grad) && is_aligned<TP, VEC>(prev) && is_aligned<float, VEC>(sq);
  int64_t done = 0;
  if (aligned) {
    const int64_t nvec = w.length / VEC;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      const Pack<T, VEC> g = load_raw<T, VEC>(grad, v);
      const Pack<TP, VEC> p = load_raw<TP, VEC>(prev, v);
      float s[VEC];
      load_pack<float, VEC>(sq, v, s);
      Pack<TP, VEC> np;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        s[j] = gns::accumulate_sq_value(to_float(g.v[j]), to_float(p.v[j]), s[j]);
        np.v[j] = prev_value<TP>(g.v[j]);
      }
      store_floats<VEC>(sq, v, s);
      store_raw<TP, VEC>(prev, v, np);
    }
    done = nvec * VEC;
  }
  // Scalar path: the whole chunk when a pointer is misaligned, else the tail (< VEC elements).
  for (int64_t i = done + threadIdx.x; i < w.length; i += blockDim.x) {
    const T g = grad[i];
    sq[i] = gns::accumulate_sq_value(to_float(g), to_float(prev[i]), sq[i]);
    prev[i] = prev_value<TP>(g);
  }
}

template <typename T, typename TP>
cudaError_t launch_group(const std::vector<int>& idx, const int64_t* numels,
                         const void* const* const (&lists)[3], cudaStream_t stream) {
  return for_each_launch<3, kMaxTensorsPerLaunch>(
      idx, numels, lists, 0, [&](const Table3& tb, int grid, int64_t /*slot_base*/) {
        accumulate_sq_kernel<T, TP><<<grid, kBlockThreads, 0, stream>>>(tb);
        return cudaGetLastError();
      });
}

// Group key: 2 * dtype + (prev is float32 while grad is not).
constexpr int kNumKeys = 6;

bool valid(DType t) {
  return t == DType::Float32 || t == DType::BFloat16 || t == DType::Float16;
}

}  // namespace
}  // namespace detail

cudaError_t accumulate_sq(int ntensors, const int64_t* numels, const void* const* grads,
                          void* const* prevs, float* const* sqs, const DType* dtypes,
                          const DType* prev_dtypes, cudaStream_t stream) {
  for (int t = 0; t < ntensors; ++t) {
    if (!detail::valid(dtypes[t]) ||
        (prev_dtypes[t] != dtypes[t] && prev_dtypes[t] != DType::Float32)) {
      return cudaErrorInvalidValue;
    }
  }
  const void* const* const lists[3] = {grads, const_cast<const void* const*>(prevs),
                                       reinterpret_cast<const void* const*>(sqs)};
  const auto groups = detail::group_by(ntensors, detail::kNumKeys, [&](int t) {
    return 2 * static_cast<int>(dtypes[t]) + (prev_dtypes[t] != dtypes[t] ? 1 : 0);
  });
  for (int key = 0; key < detail::kNumKeys; ++key) {
    const std::vector<int>& idx = groups[static_cast<size_t>(key)];
    if (idx.empty()) continue;
    cudaError_t err = cudaErrorInvalidValue;
    const bool prev_f32 = key % 2 == 1;
    switch (static_cast<DType>(key / 2)) {
      case DType::Float32:
        err = detail::launch_group<float, float>(idx, numels, lists, stream);
        break;
      case DType::BFloat16:
        err = prev_f32 ? detail::launch_group<__nv_bfloat16, float>(idx, numels, lists, stream)
                       : detail::launch_group<__nv_bfloat16, __nv_bfloat16>(idx, numels, lists,
                                                                            stream);
        break;
      case DType::Float16:
        err = prev_f32 ? detail::launch_group<__half, float>(idx, numels, lists, stream)
                       : detail::launch_group<__half, __half>(idx, numels, lists, stream);
        break;
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace gns_cuda
