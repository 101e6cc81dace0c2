// Shared helpers of the CPU kernels: the fixed work partition, dtype dispatch,
// argument checks with messages naming the argument, and the SIMD clone attribute.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "gns_math.h"
#include "overlap.h"

// Hot loops are compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time
// (GCC function multiversioning), so one build is both fast and portable. The loops are
// written with a fixed number of float lanes (kLanes), so every clone adds the same
// numbers in the same order: results are bit-identical across clones (fp-contract=off,
// see setup.py, keeps FMA contraction from changing roundings).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && (__GNUC__ >= 11) && \
    defined(__linux__)
#define GNS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define GNS_CPU_CLONES
#endif

namespace gns_cpu {

// FIXED partition of every tensor into blocks of kBlock elements (the last one shorter),
// independent of the thread count: each block's partial sums are computed by one thread,
// in double, and the partials are combined serially in block order. No atomics.
constexpr int64_t kBlock = int64_t{1} << 15;
// Inside a block: float32 accumulators in kLanes lanes over chunks of kChunk elements
// (kChunk / kLanes = 32 additions per lane), flushed into double after every chunk.
constexpr int64_t kChunk = 512;
constexpr int kLanes = 16;

inline int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Loads as float32, written so that GCC vectorizes them inside the SIMD clones (c10's own
// Half conversion takes a scalar path in an extension built without CPU_CAPABILITY flags).
inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) {  // bfloat16 = the upper 16 bits of a float32
  uint16_t h;
  std::memcpy(&h, &x, sizeof(h));
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
// IEEE half -> float32 with integer ops and selects only (vectorizes; exact for every
// input, subnormals included, NaN payloads kept; no subnormal float arithmetic involved).
inline float to_f32(c10::Half x) {
  uint16_t h;
  std::memcpy(&h, &x, sizeof(h));
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;                        // exponent and mantissa
  const uint32_t normal = (em << 13) + ((127u - 15u) << 23);  // rebias the exponent
  const uint32_t infnan = (em << 13) | 0x7f800000u;
  const float sub = static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f;  // zero / subnormal: m * 2^-24
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub_bits));
  // branch-free select (masks), so the loops stay free of control flow and vectorize
  const uint32_t is_sub = 0u - static_cast<uint32_t>(em < 0x0400u);
  const uint32_t is_infnan = 0u - static_cast<uint32_t>(em >= 0x7c00u);
  const uint32_t bits =
      (sub_bits & is_sub) | (infnan & is_infnan) | (normal & ~(is_sub | is_infnan)) | sign;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Calls f(tag) with a value of the C++ type of dtype t (float, c10::BFloat16, c10::Half).
template <typename F>
inline void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK_TYPE(false, "unsupported dtype ", t);
  }
}

inline bool is_float_input(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A float32 / bfloat16 / float16, contiguous, CPU tensor.
inline void check_input(const at::Tensor& t, const std::string& name) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
  TORCH_CHECK_TYPE(is_float_input(t.scalar_type()), name,
                   ": expected dtype float32, bfloat16 or float16; got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor (call .contiguous() first)");
}

inline void check_float32(const at::Tensor& t, const std::string& name) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected dtype float32; got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor (call .contiguous() first)");
}

inline void check_numel(const at::Tensor& t, const std::string& name, int64_t want,
                        const std::string& like) {
  TORCH_CHECK_VALUE(t.numel() == want, name, ": expected ", want, " elements (like ", like, "), got ",
                    t.numel());
}

}  // namespace gns_cpu
