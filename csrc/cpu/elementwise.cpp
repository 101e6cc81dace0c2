// CPU kernels of the element-wise fused ops: square_pack(_multi), accumulate_sq(_multi).
// One pass, no temporaries; work split into the fixed blocks of cpu_common.h (each element
// is written by exactly one thread, so the results do not depend on the thread count).
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"

namespace gns_cpu {
namespace {

// ---- square_pack: out[i] = x, out[n + i] = x*x, x = grad - shift -------------------------
template <typename T, typename S, bool kShift>
GNS_CPU_CLONES void square_pack_block(const void* gv, const void* sv, float* out, int64_t n, int64_t off,
                                      int64_t len) {
  const T* __restrict__ g = static_cast<const T*>(gv) + off;
  const S* __restrict__ s = kShift ? static_cast<const S*>(sv) + off : nullptr;
  float* __restrict__ x_out = out + off;
  float* __restrict__ sq_out = out + n + off;
  for (int64_t i = 0; i < len; ++i) {
    const float x = kShift ? gns::shifted(to_f32(g[i]), to_f32(s[i]))
                           : to_f32(g[i]);
    x_out[i] = x;
    sq_out[i] = x * x;
  }
}

using SquarePackFn = void (*)(const void*, const void*, float*, int64_t, int64_t, int64_t);

struct PackTensor {
  const void* g;
  const void* s;
  float* out;
  int64_t n;
  SquarePackFn fn;
};

// Validates one (grad, out, shift) triple and adds its memory to spans (out is the output).
PackTensor make_pack_tensor(const at::Tensor& grad, const at::Tensor& out,
                            const c10::optional<at::Tensor>& shift, const std::string& suffix,
                            std::vector<gns::Span>& spans) {
  const std::string ng = "grad" + suffix, no = "out" + suffix, ns = "shift" + suffix;
  check_input(grad, ng);
  check_float32(out, no);
  const int64_t n = grad.numel();
  check_numel(out, no, 2 * n, suffix.empty() ? "2x grad" : "2x " + ng);
  const bool has_shift = shift.has_value() && shift->defined();
  if (has_shift) {
    check_input(*shift, ns);
    check_numel(*shift, ns, n, ng);
  }
  gns::add_span(spans, out, no, true);
  gns::add_span(spans, grad, ng, false);
  if (has_shift) gns::add_span(spans, *shift, ns, false);
  PackTensor t;
  t.g = grad.data_ptr();
  t.s = has_shift ? shift->data_ptr() : nullptr;
  t.out = out.data_ptr<float>();
  t.n = n;
  t.fn = nullptr;
  dispatch_float(grad.scalar_type(), [&](auto gtag) {
    using T = decltype(gtag);
    if (!has_shift) {
      t.fn = &square_pack_block<T, float, false>;
    } else {
      dispatch_float(shift->scalar_type(), [&](auto stag) { t.fn = &square_pack_block<T, decltype(stag), true>; });
    }
  });
  return t;
}

// One parallel loop over the fixed blocks of every tensor of the list.
void run_square_pack(const std::vector<PackTensor>& ts) {
  std::vector<int64_t> first;  // first[k] = index of tensor k's first block
  int64_t nb = 0;
  for (const PackTensor& t : ts) {
    first.push_back(nb);
    nb += num_blocks(t.n);
  }
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    size_t k = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (k + 1 < ts.size() && first[k + 1] <= b) ++k;
      const int64_t off = (b - first[k]) * kBlock;
      ts[k].fn(ts[k].g, ts[k].s, ts[k].out, ts[k].n, off, std::min(kBlock, ts[k].n - off));
    }
  });
}

void square_pack_cpu(const at::Tensor& grad, const at::Tensor& out, const c10::optional<at::Tensor>& shift) {
  std::vector<gns::Span> spans;
  const PackTensor t = make_pack_tensor(grad, out, shift, "", spans);
  gns::check_no_overlap(std::move(spans));
  run_square_pack({t});
}

void square_pack_multi_cpu(at::TensorList grads, at::TensorList outs,
                           const c10::List<c10::optional<at::Tensor>>& shifts) {
  const size_t n = grads.size();
  TORCH_CHECK_VALUE(outs.size() == n, "outs: expected ", n, " tensors like grads, got ", outs.size());
  TORCH_CHECK_VALUE(shifts.size() == 0 || shifts.size() == n, "shifts: expected ", n,
                    " entries like grads (or an empty list for no shift), got ", shifts.size());
  std::vector<PackTensor> ts;
  ts.reserve(n);
  std::vector<gns::Span> spans;
  spans.reserve(3 * n);
  for (size_t i = 0; i < n; ++i) {
    c10::optional<at::Tensor> s = shifts.size() == 0 ? c10::nullopt : c10::optional<at::Tensor>(shifts.get(i));
    ts.push_back(make_pack_tensor(grads[i], outs[i], s, "s[" + std::to_string(i) + "]", spans));
  }
  // across the whole list: an out must not alias any other argument
  gns::check_no_overlap(std::move(spans));
  run_square_pack(ts);
}

// ---- accumulate_sq: d = grad - prev; sq += d*d; prev = grad ------------------------------
template <typename G, typename P>
GNS_CPU_CLONES void accumulate_sq_block(const void* gv, void* pv, float* sqv, int64_t off, int64_t len) {
  const G* __restrict__ g = static_cast<const G*>(gv) + off;
  P* __restrict__ p = static_cast<P*>(pv) + off;
  float* __restrict__ sq = sqv + off;
  for (int64_t i = 0; i < len; ++i) {
    const G gi = g[i];
    sq[i] = gns::accumulate_sq_value(to_f32(gi), to_f32(p[i]), sq[i]);
    if constexpr (std::is_same<P, G>::value) {
      p[i] = gi;  // bit copy
    } else {
      p[i] = to_f32(gi);  // P is float32: exact
    }
  }
}

using AccFn = void (*)(const void*, void*, float*, int64_t, int64_t);

struct AccTensor {
  const void* g;
  void* p;
  float* sq;
  int64_t n;
  AccFn fn;
};

// Validates one (grad, prev, sq) triple and adds its memory to spans (prev and sq are
// outputs); the caller checks the spans of the whole call for overlap.
AccTensor make_acc_tensor(const at::Tensor& grad, const at::Tensor& prev, const at::Tensor& sq,
                          const std::string& suffix, std::vector<gns::Span>& spans) {
  const std::string ng = "grad" + suffix, np = "prev" + suffix, ns = "sq" + suffix;
  check_input(grad, ng);
  check_input(prev, np);
  TORCH_CHECK_TYPE(prev.scalar_type() == grad.scalar_type() || prev.scalar_type() == at::kFloat, np,
                   ": expected dtype ", grad.scalar_type(), " (like ", ng, ") or float32, got ",
                   prev.scalar_type());
  check_float32(sq, ns);
  check_numel(prev, np, grad.numel(), ng);
  check_numel(sq, ns, grad.numel(), ng);
  gns::add_span(spans, grad, ng, false);
  gns::add_span(spans, prev, np, true);
  gns::add_span(spans, sq, ns, true);
  AccTensor t;
  t.g = grad.data_ptr();
  t.p = prev.data_ptr();
  t.sq = sq.data_ptr<float>();
  t.n = grad.numel();
  t.fn = nullptr;
  dispatch_float(grad.scalar_type(), [&](auto gtag) {
    using G = decltype(gtag);
    if (prev.scalar_type() == grad.scalar_type()) {
      t.fn = &accumulate_sq_block<G, G>;
    } else {
      t.fn = &accumulate_sq_block<G, float>;
    }
  });
  return t;
}

void run_accumulate_sq(const std::vector<AccTensor>& ts) {
  std::vector<int64_t> first;  // first[k] = index of tensor k's first block
  int64_t nb = 0;
  for (const AccTensor& t : ts) {
    first.push_back(nb);
    nb += num_blocks(t.n);
  }
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    size_t k = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (k + 1 < ts.size() && first[k + 1] <= b) ++k;
      const int64_t off = (b - first[k]) * kBlock;
      ts[k].fn(ts[k].g, ts[k].p, ts[k].sq, off, std::min(kBlock, ts[k].n - off));
    }
  });
}

void accumulate_sq_cpu(const at::Tensor& grad, const at::Tensor& prev, const at::Tensor& sq) {
  std::vector<gns::Span> spans;
  const AccTensor t = make_acc_tensor(grad, prev, sq, "", spans);
  gns::check_no_overlap(std::move(spans));
  run_accumulate_sq({t});
}

void accumulate_sq_multi_cpu(at::TensorList grads, at::TensorList prevs, at::TensorList sqs) {
  const size_t n = grads.size();
  TORCH_CHECK_VALUE(prevs.size() == n, "prevs: expected ", n, " tensors like grads, got ", prevs.size());
  TORCH_CHECK_VALUE(sqs.size() == n, "sqs: expected ", n, " tensors like grads, got ", sqs.size());
  std::vector<AccTensor> ts;
  ts.reserve(n);
  std::vector<gns::Span> spans;
  spans.reserve(3 * n);
  for (size_t i = 0; i < n; ++i) {
    ts.push_back(make_acc_tensor(grads[i], prevs[i], sqs[i], "s[" + std::to_string(i) + "]", spans));
  }
  // across the whole list: a prev or sq of one triple must not alias any other argument
  gns::check_no_overlap(std::move(spans));
  run_accumulate_sq(ts);
}

}  // namespace
}  // namespace gns_cpu

TORCH_LIBRARY_IMPL(gns_kernels, CPU, m) {
  m.impl("square_pack", &gns_cpu::square_pack_cpu);
  m.impl("square_pack_multi", &gns_cpu::square_pack_multi_cpu);
  m.impl("accumulate_sq", &gns_cpu::accumulate_sq_cpu);
  m.impl("accumulate_sq_multi", &gns_cpu::accumulate_sq_multi_cpu);
}
