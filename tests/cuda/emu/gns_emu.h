// A small CPU emulator of the CUDA execution model, just enough to run the kernels of
// csrc/cuda on the host in tests (tests/cuda/test_emulated_kernels.py) where no GPU exists.
//
// The test compiles the .cu files with the host C++ compiler after rewriting every
// `kernel<<<grid, threads, smem, stream>>>(args);` into `gns_emu::launch(grid, threads,
// [&] { kernel(args); });`. launch() runs the blocks one after another; the `threads` CUDA
// threads of a block are host threads (a persistent pool), so __syncthreads is a real
// barrier and
// __shfl_down_sync a real exchange between the 32 threads of a warp. __shared__ variables
// become function statics: one copy, which is right because only one block runs at a time.
// What this checks: indexing, vector/scalar paths, tails, tensor tables, slots, the
// reduction trees and the launchers' host logic, with the real kernel source. What it does
// not: timing, the GPU memory model, alignment faults, register limits (nvcc checks those).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <barrier>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

// Execution-space and launch qualifiers: nothing on the host.
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static

namespace gns_emu {

struct Idx {
  unsigned int x = 0, y = 0, z = 0;
};

inline thread_local Idx tl_thread, tl_block, tl_block_dim, tl_grid_dim;
inline thread_local std::barrier<>* tl_block_barrier = nullptr;
inline thread_local std::barrier<>* tl_warp_barrier = nullptr;
inline thread_local double* tl_warp_buf = nullptr;
inline cudaError_t last_error = cudaSuccess;

// Persistent worker threads (created on first use, grown on demand, never joined: they
// sleep on a condition variable and end with the process). run(T, f) calls f(i) on
// workers 0..T-1 concurrently and returns when all have finished.
class Pool {
 public:
  void run(int nthreads, std::function<void(int)> f) {
    std::unique_lock<std::mutex> lock(m_);
    while (static_cast<int>(size_) < nthreads) {
      const int id = static_cast<int>(size_++);
      std::thread([this, id] { loop(id); }).detach();
    }
    job_ = std::move(f);
    active_ = nthreads;
    remaining_ = nthreads;
    ++generation_;
    wake_.notify_all();
    done_.wait(lock, [this] { return remaining_ == 0; });
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (id >= active_) continue;
      std::function<void(int)> job = job_;
      lock.unlock();
      job(id);
      lock.lock();
      if (--remaining_ == 0) done_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::function<void(int)> job_;
  uint64_t generation_ = 0;
  size_t size_ = 0;
  int active_ = 0;
  int remaining_ = 0;
};

inline Pool& pool() {
  static Pool* p = new Pool();  // intentionally leaked: its threads outlive static destruction
  return *p;
}

// Runs the grid on `threads` pool threads, each looping over the blocks in order; a block
// barrier after each block keeps blocks from overlapping (shared statics are reused).
template <typename F>
void launch(int grid, int threads, F&& body) {
  if (grid < 0 || threads <= 0 || threads % 32 != 0 || threads > 1024) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (grid == 0) return;
  std::barrier<> block_barrier(threads);
  const int nwarps = threads / 32;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  for (int w = 0; w < nwarps; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
  std::vector<double> warp_bufs(static_cast<size_t>(threads), 0.0);
  pool().run(threads, [&](int t) {
    tl_thread = Idx{static_cast<unsigned>(t), 0, 0};
    tl_block_dim = Idx{static_cast<unsigned>(threads), 1, 1};
    tl_grid_dim = Idx{static_cast<unsigned>(grid), 1, 1};
    tl_block_barrier = &block_barrier;
    tl_warp_barrier = warp_barriers[static_cast<size_t>(t / 32)].get();
    tl_warp_buf = warp_bufs.data() + (t / 32) * 32;
    for (int b = 0; b < grid; ++b) {
      tl_block = Idx{static_cast<unsigned>(b), 0, 0};
      body();
      block_barrier.arrive_and_wait();
    }
  });
}

inline cudaError_t get_last_error() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

inline void syncthreads() { tl_block_barrier->arrive_and_wait(); }

// Every lane of the warp must call it (as the kernels do: full-mask shuffles).
inline double shfl_down(double v, int offset) {
  const int lane = static_cast<int>(tl_thread.x) & 31;
  tl_warp_buf[lane] = v;
  tl_warp_barrier->arrive_and_wait();
  const double out = lane + offset < 32 ? tl_warp_buf[lane + offset] : v;
  tl_warp_barrier->arrive_and_wait();
  return out;
}

}  // namespace gns_emu

#undef threadIdx
#define threadIdx (::gns_emu::tl_thread)
#undef blockIdx
#define blockIdx (::gns_emu::tl_block)
#undef blockDim
#define blockDim (::gns_emu::tl_block_dim)
#undef gridDim
#define gridDim (::gns_emu::tl_grid_dim)
#define __syncthreads() ::gns_emu::syncthreads()
#define __shfl_down_sync(mask, v, offset) ::gns_emu::shfl_down((v), (offset))
#define cudaGetLastError() ::gns_emu::get_last_error()
