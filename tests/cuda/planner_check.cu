// Host-only check of the multi-tensor launch planner (csrc/cuda/multi_tensor.cuh): runs
// for_each_launch on random tensor lists with a launch callback that, instead of starting
// a kernel, walks every block of the grid through `locate` (the same function the kernels
// call on the device) and records what it would process. Checks that every element of
// every tensor is covered exactly once, that reduction slots are distinct and dense, that
// table pointers match the lists (nullptr operands kept), and that no launch exceeds the
// table. Needs nvcc to compile, no GPU to run (no CUDA API call is made).
// Used by tests/cuda/test_planner.py. Prints "planner_check: OK ..." and exits 0 on success.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "cuda/multi_tensor.cuh"

using gns_cuda::kChunk;
using gns_cuda::detail::BlockWork;
using gns_cuda::detail::for_each_launch;
using gns_cuda::detail::group_by;
using gns_cuda::detail::kMaxTensorsPerLaunch;
using gns_cuda::detail::locate;
using gns_cuda::detail::TensorTable;

namespace {

int failures = 0;

void expect(bool ok, const char* what, long long a = 0, long long b = 0) {
  if (!ok) {
    ++failures;
    if (failures < 20) std::printf("FAIL: %s (%lld, %lld)\n", what, a, b);
  }
}

const void* fake_ptr(int depth, int t) {
  return reinterpret_cast<const void*>(static_cast<uintptr_t>((depth + 1) * 0x10000000ull + 0x100ull * t));
}

void check_case(const std::vector<int64_t>& numels, const std::vector<int>& idx, bool null_shift_list,
                int64_t slot_base0) {
  const int n = static_cast<int>(numels.size());
  std::vector<const void*> l0(n), l1(n), l2(n);
  for (int t = 0; t < n; ++t) {
    l0[t] = fake_ptr(0, t);
    l1[t] = fake_ptr(1, t);
    l2[t] = (t % 3 == 0) ? nullptr : fake_ptr(2, t);  // some absent operands
  }
  const void* const* const lists[3] = {l0.data(), l1.data(), null_shift_list ? nullptr : l2.data()};
  // tensor -> list of (begin, length); slot -> hit count
  std::vector<std::vector<std::pair<int64_t, int64_t>>> cover(n);
  int64_t expected_blocks = 0;
  for (int t : idx) expected_blocks += gns_cuda::detail::chunks_of(numels[t]);
  std::vector<int> slot_hits(static_cast<size_t>(expected_blocks), 0);
  int64_t next_base = slot_base0;
  int launches = 0;
  const cudaError_t err = for_each_launch<3, kMaxTensorsPerLaunch>(
      idx, numels.data(), lists, slot_base0,
      [&](const TensorTable<3, kMaxTensorsPerLaunch>& tb, int grid, int64_t base) {
        ++launches;
        expect(tb.count >= 1 && tb.count <= kMaxTensorsPerLaunch, "table count", tb.count);
        expect(grid == tb.block_start[tb.count], "grid == block_start[count]", grid, tb.block_start[tb.count]);
        expect(base == next_base, "slot bases contiguous across launches", base, next_base);
        next_base += grid;
        for (int b = 0; b < grid; ++b) {
          const BlockWork w = locate(tb, b);
          expect(w.tensor >= 0 && w.tensor < tb.count, "tensor index", w.tensor);
          // Which list entry is this? Identify by pointer.
          const uintptr_t p0 = reinterpret_cast<uintptr_t>(tb.ptr[0][w.tensor]);
          const int t = static_cast<int>((p0 - 0x10000000ull) / 0x100ull);
          expect(t >= 0 && t < n, "pointer decodes to a tensor", t);
          if (t < 0 || t >= n) continue;
          expect(tb.ptr[1][w.tensor] == l1[t], "operand 1 pointer", t);
          const void* want2 = null_shift_list ? nullptr : l2[t];
          expect(tb.ptr[2][w.tensor] == want2, "operand 2 pointer (nullptr kept)", t);
          expect(tb.numel[w.tensor] == numels[t], "numel", tb.numel[w.tensor], numels[t]);
          expect(w.length > 0 && w.length <= kChunk, "chunk length", w.length);
          expect(w.begin % kChunk == 0, "chunk begin aligned to kChunk", w.begin);
          cover[t].push_back({w.begin, w.length});
          const int64_t slot = base + b - slot_base0;
          expect(slot >= 0 && slot < expected_blocks, "slot in range", slot, expected_blocks);
          if (slot >= 0 && slot < expected_blocks) ++slot_hits[static_cast<size_t>(slot)];
        }
        return cudaSuccess;
      });
  expect(err == cudaSuccess, "for_each_launch status", static_cast<long long>(err));
  expect(next_base - slot_base0 == expected_blocks, "total blocks", next_base - slot_base0, expected_blocks);
  for (int h : slot_hits) expect(h == 1, "each slot written exactly once", h);
  std::vector<char> in_idx(n, 0);
  for (int t : idx) in_idx[t] = 1;
  for (int t = 0; t < n; ++t) {
    auto& c = cover[t];
    std::sort(c.begin(), c.end());
    int64_t pos = 0;
    for (const auto& [b, len] : c) {
      expect(b == pos, "chunks tile the tensor without gaps or overlaps", b, pos);
      pos = b + len;
    }
    expect(pos == (in_idx[t] ? numels[t] : 0), "whole tensor covered (only listed ones)", pos, numels[t]);
  }
  int nonempty = 0;
  for (int t : idx) nonempty += numels[t] > 0;
  expect(launches == (nonempty + kMaxTensorsPerLaunch - 1) / kMaxTensorsPerLaunch, "launch count",
         launches, nonempty);
}

}  // namespace

int main() {
  std::mt19937_64 rng(12345);
  int cases = 0;
  const int64_t edge[] = {0, 1, 3, 4, 7, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk, 3 * kChunk + 5};
  for (int rep = 0; rep < 300; ++rep) {
    const int n = static_cast<int>(rng() % 200);
    std::vector<int64_t> numels(n);
    for (auto& x : numels) {
      const int kind = static_cast<int>(rng() % 4);
      x = kind == 0 ? edge[rng() % 10] : kind == 1 ? static_cast<int64_t>(rng() % 5000)
                                                   : static_cast<int64_t>(rng() % (5 * kChunk));
    }
    // All tensors in order, and a random subset (as a dtype group would be).
    std::vector<int> all(n);
    for (int t = 0; t < n; ++t) all[t] = t;
    const auto groups = group_by(n, 3, [&](int t) { return (t * 7 + rep) % 3; });
    int listed = 0;
    for (const auto& g : groups) {
      expect(std::is_sorted(g.begin(), g.end()), "group keeps list order");
      listed += static_cast<int>(g.size());
    }
    expect(listed == n, "groups partition the list", listed, n);
    check_case(numels, all, rep % 2 == 0, rep % 5 == 0 ? 0 : static_cast<int64_t>(rng() % 1000));
    check_case(numels, groups[rep % 3], rep % 3 == 0, 17);
    cases += 2;
  }
  // A single large tensor: many blocks in one launch.
  check_case({int64_t{1} << 30}, {0}, true, 0);
  ++cases;
  if (failures) {
    std::printf("planner_check: %d failures\n", failures);
    return 1;
  }
  std::printf("planner_check: OK (%d cases)\n", cases);
  return 0;
}
