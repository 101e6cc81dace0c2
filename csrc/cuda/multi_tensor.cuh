// Multi-tensor launch machinery (after the idea of apex's multi_tensor_apply).
//
// A list of tensors (DEPTH parallel arrays of device pointers, e.g. grad/prev/sq) is cut
// into chunks of kChunk elements; each thread block handles one chunk. The launch passes
// a table by value as a kernel argument (kept under the 4 KB classic parameter limit):
// per tensor its DEPTH pointers, its element count, and the index of its first block.
// A block finds its tensor by binary search over `block_start` (at most log2(MaxT) steps,
// uniform across the block), so one launch covers up to MaxT tensors of any size; longer
// lists take several launches. Blocks are numbered globally across launches
// (`slot_base + blockIdx.x`), which gives each block of a reduction its own output slot.
#pragma once

#include <climits>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "gns_cuda.h"

namespace gns_cuda {
namespace detail {

template <int Depth, int MaxT>
struct TensorTable {
  const void* ptr[Depth][MaxT];
  int64_t numel[MaxT];
  int block_start[MaxT + 1];  // block_start[count] == number of blocks of this launch
  int count;
};

// Tensors per launch: Depth * 8 + 8 + 4 bytes each -> 2.3 KB of arguments for Depth 3.
constexpr int kMaxTensorsPerLaunch = 64;

struct BlockWork {
  int tensor;      // index into the table
  int64_t begin;   // first element of this block's chunk within the tensor (multiple of kChunk)
  int64_t length;  // elements in the chunk (kChunk except for a tensor's last chunk)
};

// The chunk of block b of a launch: binary search for the last tensor whose first block is
// <= b. Host and device, so the host-side test (tests/cuda/planner_check.cu) runs it too.
template <int Depth, int MaxT>
__host__ __device__ __forceinline__ BlockWork locate(const TensorTable<Depth, MaxT>& tb, int b) {
  int lo = 0;
  int hi = tb.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tb.block_start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  BlockWork w;
  w.tensor = lo;
  w.begin = static_cast<int64_t>(b - tb.block_start[lo]) * kChunk;
  const int64_t left = tb.numel[lo] - w.begin;
  w.length = left < kChunk ? left : kChunk;
  return w;
}

template <int Depth, int MaxT>
__device__ __forceinline__ BlockWork locate_block(const TensorTable<Depth, MaxT>& tb) {
  return locate(tb, static_cast<int>(blockIdx.x));
}

inline int64_t chunks_of(int64_t n) { return n <= 0 ? 0 : (n + kChunk - 1) / kChunk; }

// Calls launch(table, grid_blocks, slot_base) -> cudaError_t once per batch of at most MaxT non-empty
// tensors, taking the tensors idx[0], idx[1], ... in that order. lists[d][t] is the d-th
// pointer of tensor t; lists[d] (or an entry of it) may be nullptr for an absent operand
// (e.g. no shift), and the table then holds nullptr. Empty tensors are skipped. Block slots
// are numbered from `slot_base` on. Returns the first error `launch` returns (the kernels'
// launch lambdas return cudaGetLastError()).
template <int Depth, int MaxT, typename Launch>
cudaError_t for_each_launch(const std::vector<int>& idx, const int64_t* numels,
                            const void* const* const (&lists)[Depth], int64_t slot_base,
                            Launch&& launch) {
  TensorTable<Depth, MaxT> tb;
  tb.count = 0;
  int blocks = 0;
  for (const int t : idx) {
    const int64_t c = chunks_of(numels[t]);
    if (c == 0) continue;
    if (c > INT_MAX / 2) return cudaErrorInvalidValue;
    if (tb.count == MaxT || static_cast<int64_t>(blocks) + c > INT_MAX / 2) {
      tb.block_start[tb.count] = blocks;
      const cudaError_t err = launch(tb, blocks, slot_base);
      if (err != cudaSuccess) return err;
      slot_base += blocks;
      tb.count = 0;
      blocks = 0;
    }
    for (int d = 0; d < Depth; ++d) tb.ptr[d][tb.count] = lists[d] ? lists[d][t] : nullptr;
    tb.numel[tb.count] = numels[t];
    tb.block_start[tb.count] = blocks;
    blocks += static_cast<int>(c);
    ++tb.count;
  }
  if (tb.count > 0) {
    tb.block_start[tb.count] = blocks;
    return launch(tb, blocks, slot_base);
  }
  return cudaSuccess;
}

// Tensors of a list grouped by an integer key in [0, num_keys) (e.g. the dtype combination
// a kernel instantiation handles): groups[k] lists the tensors of key k in list order.
template <typename KeyFn>
std::vector<std::vector<int>> group_by(int ntensors, int num_keys, KeyFn key) {
  std::vector<std::vector<int>> groups(static_cast<size_t>(num_keys));
  for (int t = 0; t < ntensors; ++t) groups[static_cast<size_t>(key(t))].push_back(t);
  return groups;
}

}  // namespace detail
}  // namespace gns_cuda
