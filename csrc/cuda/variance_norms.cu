// CUDA variance_norms (single and multi-tensor): one read of mean_grad, mean_sq (and shift),
// per-block partial sums in one slot per block, then one cleanup block that sums the slots
// in a fixed order. Per-element math: gns::variance_terms[_noshift] from csrc/gns_math.h,
// the same functions the CPU kernels call. See gns_cuda.h for the contract.
#include <cstdint>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gns_math.h"
#include "cuda/gns_cuda.h"
#include "cuda/multi_tensor.cuh"
#include "cuda/reduce.cuh"
#include "cuda/vec.cuh"

namespace gns_cuda {
namespace detail {
namespace {

using Table3 = TensorTable<3, kMaxTensorsPerLaunch>;

__device__ __forceinline__ void add_terms(const gns::VarianceTerms& t, float (&acc)[4]) {
  acc[0] += t.s;
  acc[1] += t.g_abs;
  acc[2] += t.s2;
  acc[3] += t.g_sq;
}

// One block per chunk of kChunk elements. Each thread sums the VEC elements of one vector
// load in float32 and adds that to float64 running sums (kChunk / kBlockThreads / VEC = 32
// or 64 additions), then the block sums the threads' float64 values in a fixed tree and
// writes its 4 slots: slots[k * num_slots + slot_base + blockIdx.x].
// tb.ptr: [0] mean_grad (T), [1] mean_sq (T), [2] shift (TS; unused when !HasShift).
template <typename T, typename TS, bool HasShift>
__global__ void __launch_bounds__(kBlockThreads)
    variance_norms_kernel(Table3 tb, float scale, double* __restrict__ slots, int64_t slot_base,
                          int64_t num_slots) {
  constexpr int VEC = VecWidth<T>::value;
  const BlockWork w = locate_block(tb);
  const T* __restrict__ dg = static_cast<const T*>(tb.ptr[0][w.tensor]) + w.begin;
  const T* __restrict__ sq = static_cast<const T*>(tb.ptr[1][w.tensor]) + w.begin;
  const TS* __restrict__ sh =
      HasShift ? static_cast<const TS*>(tb.ptr[2][w.tensor]) + w.begin : nullptr;

  double tot[4] = {0.0, 0.0, 0.0, 0.0};
  const bool aligned = is_aligned<T, VEC>(dg) && is_aligned<T, VEC>(sq) &&
                       (!HasShift || is_aligned<TS, VEC>(sh));
  int64_t done = 0;
  if (aligned) {
    const int64_t nvec = w.length / VEC;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      float d[VEC], q[VEC];
      load_pack<T, VEC>(dg, v, d);
      load_pack<T, VEC>(sq, v, q);
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (HasShift) {
        float s[VEC];
        load_pack<TS, VEC>(sh, v, s);
#pragma unroll
        for (int j = 0; j < VEC; ++j) add_terms(gns::variance_terms(d[j], q[j], s[j], scale), acc);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) add_terms(gns::variance_terms_noshift(d[j], q[j], scale), acc);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) tot[k] += static_cast<double>(acc[k]);
    }
    done = nvec * VEC;
  }
  // Scalar path: the whole chunk when a pointer is misaligned, else the tail (< VEC elements).
  for (int64_t i = done + threadIdx.x; i < w.length; i += blockDim.x) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (HasShift) {
      add_terms(gns::variance_terms(to_float(dg[i]), to_float(sq[i]), to_float(sh[i]), scale), acc);
    } else {
      add_terms(gns::variance_terms_noshift(to_float(dg[i]), to_float(sq[i]), scale), acc);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) tot[k] += static_cast<double>(acc[k]);
  }

  block_reduce<4>(tot);
  if (threadIdx.x == 0) {
    const int64_t slot = slot_base + blockIdx.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) slots[k * num_slots + slot] = tot[k];
  }
}

// One block: out[k] = float(sum_i slots[k * num_slots + i]), thread j summing i = j, j + 512,
// ... in order, then the fixed block tree. Writes zeros when num_slots == 0.
__global__ void __launch_bounds__(kCleanupThreads)
    variance_norms_cleanup(const double* __restrict__ slots, int64_t num_slots,
                           float* __restrict__ out) {
  double tot[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t i = threadIdx.x; i < num_slots; i += blockDim.x) {
#pragma unroll
    for (int k = 0; k < 4; ++k) tot[k] += slots[k * num_slots + i];
  }
  block_reduce<4>(tot);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = static_cast<float>(tot[k]);
  }
}

struct Args {
  const int64_t* numels;
  const void* const* const (&lists)[3];
  float scale;
  double* slots;
  int64_t num_slots;
  cudaStream_t stream;
};

template <typename T, typename TS, bool HasShift>
cudaError_t launch_group(const Args& a, const std::vector<int>& idx, int64_t* slot_base) {
  const cudaError_t err = for_each_launch<3, kMaxTensorsPerLaunch>(
      idx, a.numels, a.lists, *slot_base, [&](const Table3& tb, int grid, int64_t base) {
        variance_norms_kernel<T, TS, HasShift>
            <<<grid, kBlockThreads, 0, a.stream>>>(tb, a.scale, a.slots, base, a.num_slots);
        return cudaGetLastError();
      });
  for (const int t : idx) *slot_base += chunks_of(a.numels[t]);
  return err;
}

// Group key: 4 * dtype + shift kind (0 none, 1 + shift dtype).
constexpr int kNumKeys = 12;

template <typename T>
cudaError_t launch_shift_kind(const Args& a, int kind, const std::vector<int>& idx,
                              int64_t* slot_base) {
  switch (kind) {
    case 0:
      return launch_group<T, T, false>(a, idx, slot_base);
    case 1 + static_cast<int>(DType::Float32):
      return launch_group<T, float, true>(a, idx, slot_base);
    case 1 + static_cast<int>(DType::BFloat16):
      return launch_group<T, __nv_bfloat16, true>(a, idx, slot_base);
    case 1 + static_cast<int>(DType::Float16):
      return launch_group<T, __half, true>(a, idx, slot_base);
    default:
      return cudaErrorInvalidValue;
  }
}

bool valid(DType t) {
  return t == DType::Float32 || t == DType::BFloat16 || t == DType::Float16;
}

}  // namespace
}  // namespace detail

int64_t num_blocks(int ntensors, const int64_t* numels) {
  int64_t total = 0;
  for (int t = 0; t < ntensors; ++t) total += detail::chunks_of(numels[t]);
  return total;
}

cudaError_t variance_norms(int ntensors, const int64_t* numels, const void* const* mean_grads,
                           const void* const* mean_sqs, const void* const* shifts,
                           const DType* dtypes, const DType* shift_dtypes, float scale,
                           double* slots, float* out, cudaStream_t stream) {
  for (int t = 0; t < ntensors; ++t) {
    const bool shifted = shifts != nullptr && shifts[t] != nullptr;
    if (!detail::valid(dtypes[t]) || (shifted && !detail::valid(shift_dtypes[t]))) {
      return cudaErrorInvalidValue;
    }
  }
  const void* const* const lists[3] = {mean_grads, mean_sqs, shifts};
  const detail::Args a{numels, lists, scale, slots, num_blocks(ntensors, numels), stream};
  const auto groups = detail::group_by(ntensors, detail::kNumKeys, [&](int t) {
    const bool shifted = shifts != nullptr && shifts[t] != nullptr;
    const int kind = shifted ? 1 + static_cast<int>(shift_dtypes[t]) : 0;
    return 4 * static_cast<int>(dtypes[t]) + kind;
  });
  int64_t slot_base = 0;
  for (int key = 0; key < detail::kNumKeys; ++key) {
    const std::vector<int>& idx = groups[static_cast<size_t>(key)];
    if (idx.empty()) continue;
    cudaError_t err = cudaErrorInvalidValue;
    switch (static_cast<DType>(key / 4)) {
      case DType::Float32:
        err = detail::launch_shift_kind<float>(a, key % 4, idx, &slot_base);
        break;
      case DType::BFloat16:
        err = detail::launch_shift_kind<__nv_bfloat16>(a, key % 4, idx, &slot_base);
        break;
      case DType::Float16:
        err = detail::launch_shift_kind<__half>(a, key % 4, idx, &slot_base);
        break;
    }
    if (err != cudaSuccess) return err;
  }
  detail::variance_norms_cleanup<<<1, kCleanupThreads, 0, stream>>>(slots, a.num_slots, out);
  return cudaGetLastError();
}

}  // namespace gns_cuda
