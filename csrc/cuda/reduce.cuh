// Deterministic block reduction of K doubles (fixed shuffle tree, then a fixed tree over
// warps). The result is only valid in thread 0. Same inputs -> same bits, always: no atomics,
// no dependence on scheduling.
#pragma once

#include <cuda_runtime.h>

namespace gns_cuda {
namespace detail {

template <int K>
__device__ __forceinline__ void warp_reduce(double (&v)[K]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_down_sync(0xffffffffu, v[k], offset);
  }
}

// blockDim.x must be a multiple of 32 and at most 1024. Thread 0 ends with the block totals.
template <int K>
__device__ __forceinline__ void block_reduce(double (&v)[K]) {
  __shared__ double warp_sums[32][K];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int nwarps = static_cast<int>(blockDim.x) >> 5;
  warp_reduce<K>(v);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) warp_sums[warp][k] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = lane < nwarps ? warp_sums[lane][k] : 0.0;
    warp_reduce<K>(v);
  }
}

}  // namespace detail
}  // namespace gns_cuda
