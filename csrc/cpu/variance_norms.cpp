// CPU kernels of variance_norms and variance_norms_multi: one pass over every element,
// [||s||_1, ||g||_1, sum s2, ||g||_2^2] (float32 result, accumulated in float32 lanes per
// 512-element chunk and in double per block; see cpu_common.h for the fixed partition).
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu/cpu_common.h"

namespace gns_cpu {
namespace {

// Partial sums of one block [off, off + len) of one tensor into out[0..3].
using VnBlockFn = void (*)(const void* d, const void* q, const void* s, float scale, int64_t off,
                           int64_t len, double* out);

template <typename T, typename S, bool kShift>
GNS_CPU_CLONES void vn_block(const void* dv, const void* qv, const void* sv, float scale, int64_t off,
                             int64_t len, double* out) {
  const T* __restrict__ d = static_cast<const T*>(dv) + off;
  const T* __restrict__ q = static_cast<const T*>(qv) + off;
  const S* __restrict__ s = kShift ? static_cast<const S*>(sv) + off : nullptr;
  double acc0 = 0.0, acc1 = 0.0, acc2 = 0.0, acc3 = 0.0;
  for (int64_t i0 = 0; i0 < len; i0 += kChunk) {
    const int64_t m = (len - i0) < kChunk ? (len - i0) : kChunk;
    float a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= m; c += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const int64_t i = i0 + c + j;
        const gns::VarianceTerms t =
            kShift ? gns::variance_terms(to_f32(d[i]), to_f32(q[i]),
                                         to_f32(s[i]), scale)
                   : gns::variance_terms_noshift(to_f32(d[i]), to_f32(q[i]), scale);
        a0[j] += t.s;
        a1[j] += t.g_abs;
        a2[j] += t.s2;
        a3[j] += t.g_sq;
      }
    }
    for (int j = 0; c + j < m; ++j) {  // tail of the block (< kLanes elements)
      const int64_t i = i0 + c + j;
      const gns::VarianceTerms t =
          kShift ? gns::variance_terms(to_f32(d[i]), to_f32(q[i]),
                                       to_f32(s[i]), scale)
                 : gns::variance_terms_noshift(to_f32(d[i]), to_f32(q[i]), scale);
      a0[j] += t.s;
      a1[j] += t.g_abs;
      a2[j] += t.s2;
      a3[j] += t.g_sq;
    }
    for (int j = 0; j < kLanes; ++j) {  // fixed order: lane 0, 1, ..., kLanes-1
      acc0 += static_cast<double>(a0[j]);
      acc1 += static_cast<double>(a1[j]);
      acc2 += static_cast<double>(a2[j]);
      acc3 += static_cast<double>(a3[j]);
    }
  }
  out[0] = acc0;
  out[1] = acc1;
  out[2] = acc2;
  out[3] = acc3;
}

// Plain switches returning the pointer (assigning it through a by-reference lambda capture
// trips a GCC 12 -Wdangling-pointer false positive on target_clones functions).
template <typename T>
VnBlockFn pick_vn_block_for(c10::optional<at::ScalarType> st) {
  if (!st.has_value()) return &vn_block<T, float, false>;
  switch (*st) {
    case at::kFloat:
      return &vn_block<T, float, true>;
    case at::kBFloat16:
      return &vn_block<T, c10::BFloat16, true>;
    case at::kHalf:
      return &vn_block<T, c10::Half, true>;
    default:
      TORCH_CHECK_TYPE(false, "unsupported dtype ", *st);
  }
}

VnBlockFn pick_vn_block(at::ScalarType t, c10::optional<at::ScalarType> st) {
  switch (t) {
    case at::kFloat:
      return pick_vn_block_for<float>(st);
    case at::kBFloat16:
      return pick_vn_block_for<c10::BFloat16>(st);
    case at::kHalf:
      return pick_vn_block_for<c10::Half>(st);
    default:
      TORCH_CHECK_TYPE(false, "unsupported dtype ", t);
  }
}

struct VnTensor {
  const void* d;
  const void* q;
  const void* s;
  int64_t n;
  VnBlockFn fn;
};

struct Block {
  int32_t tensor;
  int64_t off;
  int64_t len;
};

// Sums over all tensors: one parallel loop over the fixed blocks of all tensors, then a
// serial combination of the per-block partials in block order.
at::Tensor run_variance_norms(const std::vector<VnTensor>& ts, double scale) {
  TORCH_CHECK_VALUE(gns::valid_scale(scale), "scale: expected a positive finite number (B/(R-1), "
                    "at most 3.4e38: the kernels compute in float32), got ", scale);
  std::vector<Block> blocks;
  for (size_t k = 0; k < ts.size(); ++k) {
    for (int64_t off = 0; off < ts[k].n; off += kBlock) {
      blocks.push_back({static_cast<int32_t>(k), off, std::min(kBlock, ts[k].n - off)});
    }
  }
  const int64_t nb = static_cast<int64_t>(blocks.size());
  at::Tensor partials = at::empty({nb, 4}, at::TensorOptions().dtype(at::kDouble));
  double* p = partials.data_ptr<double>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const Block& blk = blocks[b];
      const VnTensor& t = ts[blk.tensor];
      t.fn(t.d, t.q, t.s, fscale, blk.off, blk.len, p + 4 * b);
    }
  });
  double tot[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t b = 0; b < nb; ++b) {
    for (int k = 0; k < 4; ++k) tot[k] += p[4 * b + k];
  }
  at::Tensor out = at::empty({4}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int k = 0; k < 4; ++k) o[k] = static_cast<float>(tot[k]);
  return out;
}

VnTensor make_vn_tensor(const at::Tensor& d, const at::Tensor& q, const c10::optional<at::Tensor>& s,
                        const std::string& suffix) {
  const std::string nd = "mean_grad" + suffix, nq = "mean_sq" + suffix, ns = "shift" + suffix;
  check_input(d, nd);
  check_input(q, nq);
  TORCH_CHECK_TYPE(q.scalar_type() == d.scalar_type(), nq, ": expected dtype ", d.scalar_type(), " like ",
                   nd, ", got ", q.scalar_type());
  check_numel(q, nq, d.numel(), nd);
  const bool has_shift = s.has_value() && s->defined();
  if (has_shift) {
    check_input(*s, ns);
    check_numel(*s, ns, d.numel(), nd);
  }
  VnTensor t;
  t.d = d.data_ptr();
  t.q = q.data_ptr();
  t.s = has_shift ? s->data_ptr() : nullptr;
  t.n = d.numel();
  t.fn = pick_vn_block(d.scalar_type(),
                       has_shift ? c10::optional<at::ScalarType>(s->scalar_type()) : c10::nullopt);
  return t;
}

at::Tensor variance_norms_cpu(const at::Tensor& mean_grad, const at::Tensor& mean_sq, double scale,
                              const c10::optional<at::Tensor>& shift) {
  return run_variance_norms({make_vn_tensor(mean_grad, mean_sq, shift, "")}, scale);
}

at::Tensor variance_norms_multi_cpu(at::TensorList mean_grads, at::TensorList mean_sqs, double scale,
                                    const c10::List<c10::optional<at::Tensor>>& shifts) {
  const size_t n = mean_grads.size();
  TORCH_CHECK_VALUE(mean_sqs.size() == n, "mean_sqs: expected ", n, " tensors like mean_grads, got ",
                    mean_sqs.size());
  TORCH_CHECK_VALUE(shifts.size() == 0 || shifts.size() == n, "shifts: expected ", n,
                    " entries like mean_grads (or an empty list for no shift), got ", shifts.size());
  std::vector<VnTensor> ts;
  ts.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string suffix = "s[" + std::to_string(i) + "]";
    c10::optional<at::Tensor> s = shifts.size() == 0 ? c10::nullopt : c10::optional<at::Tensor>(shifts.get(i));
    ts.push_back(make_vn_tensor(mean_grads[i], mean_sqs[i], s, suffix));
  }
  return run_variance_norms(ts, scale);
}

}  // namespace
}  // namespace gns_cpu

TORCH_LIBRARY_IMPL(gns_kernels, CPU, m) {
  m.impl("variance_norms", &gns_cpu::variance_norms_cpu);
  m.impl("variance_norms_multi", &gns_cpu::variance_norms_multi_cpu);
}
