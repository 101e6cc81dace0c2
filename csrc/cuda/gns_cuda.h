// Plain C++ interface of the CUDA kernels of gns_kernels (no torch types).
//
// The kernels and their launchers live in csrc/cuda/*.cu and include only the CUDA
// runtime; the torch binding (csrc/cuda/binding.cpp, compiled only in a CUDA build)
// validates tensors, allocates outputs and the O(number of blocks) partials buffer, and
// calls these launchers on the current stream.
//
// Tensor lists: the _multi ops take `ntensors` tensors, given as parallel host arrays of
// device pointers and element counts (numels[t] elements each, contiguous). The single
// tensor forms are lists of length one. Every launcher is asynchronous on `stream` and
// returns cudaGetLastError() after its launches (cudaSuccess when nothing was launched).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace gns_cuda {

// Element type of an input array. Accumulation is float32 per thread and float64 across
// threads and blocks, whatever the input type.
enum class DType : int { Float32 = 0, BFloat16 = 1, Float16 = 2 };

// Launch configuration. The defaults are the tuned values; the macros exist so that the
// CPU emulation in tests/cuda (no GPU) can build the same kernels with small chunks and
// blocks, crossing many chunk boundaries with small tensors. Block sizes: multiples of 32.
#ifndef GNS_CUDA_CHUNK
#define GNS_CUDA_CHUNK 65536
#endif
#ifndef GNS_CUDA_BLOCK_THREADS
#define GNS_CUDA_BLOCK_THREADS 256
#endif
#ifndef GNS_CUDA_CLEANUP_THREADS
#define GNS_CUDA_CLEANUP_THREADS 512
#endif
// Elements handled by one thread block (one output slot per block for the reductions).
constexpr int64_t kChunk = GNS_CUDA_CHUNK;
// Threads per block of the element-wise and reduction kernels.
constexpr int kBlockThreads = GNS_CUDA_BLOCK_THREADS;
// Threads of the single-block cleanup kernel that reduces the slots in a fixed order.
constexpr int kCleanupThreads = GNS_CUDA_CLEANUP_THREADS;

// Number of thread blocks (= reduction slots) the list needs: sum_t ceil(numels[t] / kChunk).
int64_t num_blocks(int ntensors, const int64_t* numels);

// variance_norms over a tensor list, written to out[0..3] (float32, device):
//   d = mean_grads[t][i], q = mean_sqs[t][i], g = d + shifts[t][i] (d where there is no shift),
//   s2 = max(scale * (q - d*d), 0) with NaN kept (gns::coord_variance),
//   out = [sum sqrt(s2), sum |g|, sum s2, sum g*g] over all tensors and elements.
// mean_grads[t] and mean_sqs[t] have type dtypes[t]; shifts may be nullptr (no shifts) or
// hold nullptr entries (no shift for that tensor); shifts[t] has type shift_dtypes[t]
// (shift_dtypes may be nullptr when shifts is). Tensors may differ in size and type: the
// list is processed in groups of one type combination, one kernel instantiation each.
// `slots` is a device buffer of at least 4 * num_blocks(ntensors, numels) doubles; every
// block writes its own 4 slots and one cleanup block sums them in a fixed order (no atomics),
// so the result is bit-identical run to run. out is written even when there are no elements.
cudaError_t variance_norms(int ntensors, const int64_t* numels, const void* const* mean_grads,
                           const void* const* mean_sqs, const void* const* shifts,
                           const DType* dtypes, const DType* shift_dtypes, float scale,
                           double* slots, float* out, cudaStream_t stream);

// square_pack of one tensor of n elements: x = grad - shift (grad when shift == nullptr),
// out[i] = x_i and out[n + i] = x_i * x_i, out float32 with 2n elements.
cudaError_t square_pack(int64_t n, const void* grad, const void* shift, DType dtype,
                        DType shift_dtype, float* out, cudaStream_t stream);

// square_pack over a tensor list: for each tensor t, x = grads[t] - shifts[t] (grads[t] where
// shifts is nullptr or shifts[t] is nullptr), outs[t][i] = x_i and outs[t][numels[t] + i] =
// x_i * x_i (outs[t] float32 with 2 * numels[t] elements). grads[t] has type dtypes[t],
// shifts[t] type shift_dtypes[t] (shift_dtypes may be nullptr when shifts is). One launch per
// (dtype, shift dtype or none) group of up to kMaxTensorsPerLaunch tensors; an invalid dtype
// gives cudaErrorInvalidValue before anything is launched.
cudaError_t square_pack_multi(int ntensors, const int64_t* numels, const void* const* grads,
                              const void* const* shifts, const DType* dtypes,
                              const DType* shift_dtypes, float* const* outs,
                              cudaStream_t stream);

// accumulate_sq over a tensor list, in place: d = grad - prev; sq += d*d; prev = grad.
// grads[t] has type dtypes[t]; prevs[t] has type prev_dtypes[t], which must be dtypes[t] or
// Float32 (else cudaErrorInvalidValue and nothing is launched); sqs are float32.
cudaError_t accumulate_sq(int ntensors, const int64_t* numels, const void* const* grads,
                          void* const* prevs, float* const* sqs, const DType* dtypes,
                          const DType* prev_dtypes, cudaStream_t stream);

}  // namespace gns_cuda
