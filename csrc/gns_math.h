// Per-element math of the fused gradient-noise ops, shared by the C++ CPU kernels
// (csrc/cpu) and the CUDA kernels (csrc/cuda), so the logic CI runs on the CPU is the
// logic the GPU runs. Plain C++ (<cmath>/<cstdint> only, no torch headers): the CUDA
// kernels include it from plain CUDA C++.
//
// Contract (float32 arithmetic; inputs are converted to float before these are called):
//   d = mean_grad_i, q = mean_sq_i, S = shift_i (0 without shift)
//   s2 = max(scale * (q - d*d), 0)   NaN stays NaN   (per-coordinate variance)
//   g  = d + S                                       (unshifted mean gradient)
//   variance_norms sums over i:   [ sqrt(s2), |g|, s2, g*g ]
//   square_pack:     x = grad - S;  out[i] = x, out[n + i] = x*x
//   accumulate_sq:   d = grad - prev;  sq += d*d;  prev = grad
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define GNS_HD __host__ __device__ __forceinline__
#else
#define GNS_HD inline
#endif

namespace gns {

// The scale argument of variance_norms (B/(R-1)) is valid when it is positive and finite
// in float32, the precision the kernels use: 0 < scale <= FLT_MAX (NaN fails). A negative
// scale would flip every variance's sign and the clamp would turn the noise into 0; the
// Python wrappers check the same rule first (gns_kernels/_validation.py:check_scale).
inline bool valid_scale(double scale) { return scale > 0.0 && scale <= 3.4028234663852886e38; }

// max(x, 0) that keeps NaN: `NaN < 0` is false, so NaN passes through. (fmaxf(NaN, 0),
// std::max(NaN, 0) with some argument orders and vector max instructions return 0, which
// would turn a non-finite gradient into a silent finite GNS.) -0.0 stays -0.0 (harmless).
GNS_HD float clamp_nonneg_keep_nan(float x) { return x < 0.0f ? 0.0f : x; }

// Per-coordinate variance estimate: s2 = max(scale * (q - d^2), 0), NaN-preserving.
GNS_HD float coord_variance(float d, float q, float scale) {
  return clamp_nonneg_keep_nan(scale * (q - d * d));
}

// The four per-element terms of variance_norms.
struct VarianceTerms {
  float s;      // sqrt(s2)            -> ||s||_1
  float g_abs;  // |g|                 -> ||g||_1
  float s2;     // s2                  -> sum s2
  float g_sq;   // g^2                 -> ||g||_2^2
};

GNS_HD VarianceTerms variance_terms(float d, float q, float shift, float scale) {
  const float s2 = coord_variance(d, q, scale);
  const float g = d + shift;
  VarianceTerms t;
  t.s = sqrtf(s2);
  t.g_abs = fabsf(g);
  t.s2 = s2;
  t.g_sq = g * g;
  return t;
}

// The same without a shift (g = d; avoids the -0.0 + 0.0 add).
GNS_HD VarianceTerms variance_terms_noshift(float d, float q, float scale) {
  const float s2 = coord_variance(d, q, scale);
  VarianceTerms t;
  t.s = sqrtf(s2);
  t.g_abs = fabsf(d);
  t.s2 = s2;
  t.g_sq = d * d;
  return t;
}

// square_pack: the shifted value and its square.
GNS_HD float shifted(float grad, float shift) { return grad - shift; }

// accumulate_sq: the new running sum of squared micro-batch differences.
GNS_HD float accumulate_sq_value(float grad, float prev, float sq) {
  const float d = grad - prev;
  return sq + d * d;
}

}  // namespace gns
