// CUDA square_pack (single and multi-tensor): x = grad - shift (grad when no shift); out[i] = x_i, out[n + i] = x_i^2,
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

// Elements per pack: 4, whatever the gradient dtype, so that each thread writes one 16-byte
// st.global.v4 per half and a warp's store covers 512 contiguous bytes. (With one 16-byte
// load of a 2-byte dtype per thread, 8 elements, each thread wrote 32 contiguous bytes per
// half as two v4 stores: every warp store instruction then covered half of each 32-byte
// sector it touched. bf16 square_pack ran at 1.59x its copy floor on an H100, fp32 with
// 4-element packs at 1.09x.) Loads are then 16 bytes for float32 inputs and 8 bytes
// (ld.global.v2.b32, still fully coalesced) for bf16/fp16.
constexpr int kPackVec = 4;
// Packs per thread per loop step: their loads are issued before any store, so that several
// independent loads are in flight per thread.
constexpr int kPackUnroll = 4;

// tb.ptr: [0] grad (T), [1] shift (TS, or nullptr), [2] out (float, 2 * numel elements).
template <typename T, typename TS, bool HasShift>
__global__ void __launch_bounds__(kBlockThreads) square_pack_kernel(Table3 tb) {
  constexpr int VEC = kPackVec;
  constexpr int U = kPackUnroll;
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
    const int64_t stride = blockDim.x;
    int64_t v = threadIdx.x;
    // U packs per step (v, v + stride, ...: each a coalesced warp access), loads first
    for (; v + (U - 1) * stride < nvec; v += U * stride) {
      float x[U][VEC], s[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) load_pack<T, VEC>(grad, v + u * stride, x[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (HasShift) {
          load_pack<TS, VEC>(sh, v + u * stride, s[u]);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) s[u][j] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float x2[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          x[u][j] = gns::shifted(x[u][j], s[u][j]);
          x2[j] = x[u][j] * x[u][j];
        }
        store_floats<VEC>(lo, v + u * stride, x[u]);
        if (hi_aligned) {
          store_floats<VEC>(hi, v + u * stride, x2);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) hi[(v + u * stride) * VEC + j] = x2[j];
        }
      }
    }
    // the last < U packs of this thread
    for (; v < nvec; v += stride) {
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
cudaError_t launch_typed(const std::vector<int>& idx, const int64_t* numels,
                         const void* const* const (&lists)[3], cudaStream_t stream) {
  return for_each_launch<3, kMaxTensorsPerLaunch>(
      idx, numels, lists, 0, [&](const Table3& tb, int grid, int64_t /*slot_base*/) {
        square_pack_kernel<T, TS, HasShift><<<grid, kBlockThreads, 0, stream>>>(tb);
        return cudaGetLastError();
      });
}

// One launch group per (grad dtype, shift dtype or no shift): key = 4 * dtype + shift key,
// shift key 0..2 = the shift's dtype, 3 = no shift.
constexpr int kNumKeys = 12;

bool valid(DType t) {
  return t == DType::Float32 || t == DType::BFloat16 || t == DType::Float16;
}

template <typename T>
cudaError_t launch_shift(const std::vector<int>& idx, const int64_t* numels,
                         const void* const* const (&lists)[3], int shift_key,
                         cudaStream_t stream) {
  switch (shift_key) {
    case 3:
      return launch_typed<T, T, false>(idx, numels, lists, stream);
    case static_cast<int>(DType::Float32):
      return launch_typed<T, float, true>(idx, numels, lists, stream);
    case static_cast<int>(DType::BFloat16):
      return launch_typed<T, __nv_bfloat16, true>(idx, numels, lists, stream);
    case static_cast<int>(DType::Float16):
      return launch_typed<T, __half, true>(idx, numels, lists, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace detail

cudaError_t square_pack_multi(int ntensors, const int64_t* numels, const void* const* grads,
                              const void* const* shifts, const DType* dtypes,
                              const DType* shift_dtypes, float* const* outs,
                              cudaStream_t stream) {
  for (int t = 0; t < ntensors; ++t) {
    const bool has_shift = shifts != nullptr && shifts[t] != nullptr;
    if (!detail::valid(dtypes[t]) || (has_shift && !detail::valid(shift_dtypes[t]))) {
      return cudaErrorInvalidValue;
    }
  }
  const void* const* const lists[3] = {grads, shifts,
                                       reinterpret_cast<const void* const*>(outs)};
  const auto groups = detail::group_by(ntensors, detail::kNumKeys, [&](int t) {
    const bool has_shift = shifts != nullptr && shifts[t] != nullptr;
    return 4 * static_cast<int>(dtypes[t]) + (has_shift ? static_cast<int>(shift_dtypes[t]) : 3);
  });
  for (int key = 0; key < detail::kNumKeys; ++key) {
    const std::vector<int>& idx = groups[static_cast<size_t>(key)];
    if (idx.empty()) continue;
    cudaError_t err = cudaErrorInvalidValue;
    switch (static_cast<DType>(key / 4)) {
      case DType::Float32:
        err = detail::launch_shift<float>(idx, numels, lists, key % 4, stream);
        break;
      case DType::BFloat16:
        err = detail::launch_shift<__nv_bfloat16>(idx, numels, lists, key % 4, stream);
        break;
      case DType::Float16:
        err = detail::launch_shift<__half>(idx, numels, lists, key % 4, stream);
        break;
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t square_pack(int64_t n, const void* grad, const void* shift, DType dtype,
                        DType shift_dtype, float* out, cudaStream_t stream) {
  const void* const grads[1] = {grad};
  const void* const shifts[1] = {shift};
  float* const outs[1] = {out};
  return square_pack_multi(1, &n, grads, shift ? shifts : nullptr, &dtype, &shift_dtype, outs,
                           stream);
}

}  // namespace gns_cuda
