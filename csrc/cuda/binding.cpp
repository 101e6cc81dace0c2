// Torch binding of the CUDA kernels: TORCH_LIBRARY_IMPL(gns_kernels, CUDA) for the schemas
// declared in csrc/ops.cpp. Compiled only by a CUDA build (setup.py's CUDA branch): it
// needs the CUDA parts of the torch headers, which the CPU torch wheel does not ship.
//
// Validates arguments (messages name the argument, as the CPU kernels do), allocates the
// float32 result and the O(number of blocks) float64 partials, and calls the plain CUDA C++
// launchers of csrc/cuda/gns_cuda.h on the current stream of the tensors' device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gns_cuda.h"
#include "gns_math.h"
#include "overlap.h"

namespace gns_cuda {
namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::Float32;
    case at::kBFloat16:
      return DType::BFloat16;
    case at::kHalf:
      return DType::Float16;
    default:
      TORCH_CHECK_TYPE(false, "unsupported dtype ", t);
  }
  return DType::Float32;
}

bool is_float_input(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A defined, contiguous CUDA tensor on `device` (the first tensor's device when nullopt).
void check_cuda(const at::Tensor& t, const std::string& name, c10::optional<at::Device> device) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(t.is_cuda(), name, ": expected a CUDA tensor, got device ", t.device());
  if (device.has_value()) {
    TORCH_CHECK_VALUE(t.device() == *device, name, ": expected device ", *device, ", got ",
                      t.device());
  }
  TORCH_CHECK_VALUE(t.is_contiguous(), name,
                    ": expected a contiguous tensor (call .contiguous() first)");
}

void check_input(const at::Tensor& t, const std::string& name,
                 c10::optional<at::Device> device) {
  check_cuda(t, name, device);
  TORCH_CHECK_TYPE(is_float_input(t.scalar_type()), name,
                   ": expected dtype float32, bfloat16 or float16; got ", t.scalar_type());
}

void check_float32(const at::Tensor& t, const std::string& name,
                   c10::optional<at::Device> device) {
  check_cuda(t, name, device);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected dtype float32; got ",
                   t.scalar_type());
}

void check_numel(const at::Tensor& t, const std::string& name, int64_t want,
                 const std::string& like) {
  TORCH_CHECK_VALUE(t.numel() == want, name, ": expected ", want, " elements (like ", like,
                    "), got ", t.numel());
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "gns_kernels::", op, ": CUDA launch failed: ",
              cudaGetErrorString(err));
}

// ----------------------------------------------------------------------------------------
// variance_norms
// ----------------------------------------------------------------------------------------
struct VnList {
  std::vector<int64_t> numels;
  std::vector<const void*> d, q, s;
  std::vector<DType> dt, st;
  bool any_shift = false;
};

void add_vn(VnList& l, const at::Tensor& d, const at::Tensor& q,
            const c10::optional<at::Tensor>& s, const std::string& suffix,
            c10::optional<at::Device> device) {
  const std::string nd = "mean_grad" + suffix, nq = "mean_sq" + suffix, ns = "shift" + suffix;
  check_input(d, nd, device);
  check_input(q, nq, d.device());
  TORCH_CHECK_TYPE(q.scalar_type() == d.scalar_type(), nq, ": expected dtype ", d.scalar_type(),
                   " like ", nd, ", got ", q.scalar_type());
  check_numel(q, nq, d.numel(), nd);
  const bool has_shift = s.has_value() && s->defined();
  if (has_shift) {
    check_input(*s, ns, d.device());
    check_numel(*s, ns, d.numel(), nd);
  }
  l.numels.push_back(d.numel());
  l.d.push_back(d.data_ptr());
  l.q.push_back(q.data_ptr());
  l.s.push_back(has_shift ? s->data_ptr() : nullptr);
  l.dt.push_back(to_dtype(d.scalar_type()));
  l.st.push_back(has_shift ? to_dtype(s->scalar_type()) : DType::Float32);
  l.any_shift = l.any_shift || has_shift;
}

at::Tensor run_vn(const VnList& l, double scale, const at::Device& device) {
  TORCH_CHECK_VALUE(gns::valid_scale(scale), "scale: expected a positive finite number (B/(R-1), "
                    "at most 3.4e38: the kernels compute in float32), got ", scale);
  const c10::cuda::CUDAGuard guard(device);
  const int n = static_cast<int>(l.numels.size());
  const int64_t nb = num_blocks(n, l.numels.data());
  const auto opts = at::TensorOptions().device(device);
  at::Tensor out = at::empty({4}, opts.dtype(at::kFloat));
  at::Tensor slots = at::empty({4 * nb}, opts.dtype(at::kDouble));
  check_launch(variance_norms(n, l.numels.data(), l.d.data(), l.q.data(),
                              l.any_shift ? l.s.data() : nullptr, l.dt.data(), l.st.data(),
                              static_cast<float>(scale), slots.data_ptr<double>(),
                              out.data_ptr<float>(), at::cuda::getCurrentCUDAStream().stream()),
               "variance_norms");
  return out;
}

at::Tensor variance_norms_cuda(const at::Tensor& mean_grad, const at::Tensor& mean_sq,
                               double scale, const c10::optional<at::Tensor>& shift) {
  VnList l;
  add_vn(l, mean_grad, mean_sq, shift, "", c10::nullopt);
  return run_vn(l, scale, mean_grad.device());
}

at::Tensor variance_norms_multi_cuda(at::TensorList mean_grads, at::TensorList mean_sqs,
                                     double scale,
                                     const c10::List<c10::optional<at::Tensor>>& shifts) {
  const size_t n = mean_grads.size();
  TORCH_CHECK_VALUE(mean_sqs.size() == n, "mean_sqs: expected ", n,
                    " tensors like mean_grads, got ", mean_sqs.size());
  TORCH_CHECK_VALUE(shifts.size() == 0 || shifts.size() == n, "shifts: expected ", n,
                    " entries like mean_grads (or an empty list for no shift), got ",
                    shifts.size());
  TORCH_CHECK_VALUE(n > 0, "mean_grads: expected at least one CUDA tensor, got an empty list");
  const at::Device device = mean_grads[0].device();
  VnList l;
  for (size_t i = 0; i < n; ++i) {
    const c10::optional<at::Tensor> s =
        shifts.size() == 0 ? c10::nullopt : c10::optional<at::Tensor>(shifts.get(i));
    add_vn(l, mean_grads[i], mean_sqs[i], s, "s[" + std::to_string(i) + "]", device);
  }
  return run_vn(l, scale, device);
}

// ----------------------------------------------------------------------------------------
// square_pack
// ----------------------------------------------------------------------------------------
void square_pack_cuda(const at::Tensor& grad, const at::Tensor& out,
                      const c10::optional<at::Tensor>& shift) {
  check_input(grad, "grad", c10::nullopt);
  check_float32(out, "out", grad.device());
  check_numel(out, "out", 2 * grad.numel(), "grad (2x)");
  const bool has_shift = shift.has_value() && shift->defined();
  if (has_shift) {
    check_input(*shift, "shift", grad.device());
    check_numel(*shift, "shift", grad.numel(), "grad");
  }
  std::vector<gns::Span> spans;
  gns::add_span(spans, out, "out", true);
  gns::add_span(spans, grad, "grad", false);
  if (has_shift) gns::add_span(spans, *shift, "shift", false);
  gns::check_no_overlap(std::move(spans));
  const c10::cuda::CUDAGuard guard(grad.device());
  check_launch(square_pack(grad.numel(), grad.data_ptr(), has_shift ? shift->data_ptr() : nullptr,
                           to_dtype(grad.scalar_type()),
                           has_shift ? to_dtype(shift->scalar_type()) : DType::Float32,
                           out.data_ptr<float>(), at::cuda::getCurrentCUDAStream().stream()),
               "square_pack");
}

void square_pack_multi_cuda(at::TensorList grads, at::TensorList outs,
                            const c10::List<c10::optional<at::Tensor>>& shifts) {
  const size_t n = grads.size();
  TORCH_CHECK_VALUE(outs.size() == n, "outs: expected ", n, " tensors like grads, got ",
                    outs.size());
  TORCH_CHECK_VALUE(shifts.size() == 0 || shifts.size() == n, "shifts: expected ", n,
                    " entries like grads (or an empty list for no shift), got ", shifts.size());
  if (n == 0) return;
  const at::Device device = grads[0].device();
  std::vector<int64_t> numels;
  std::vector<const void*> g, s;
  std::vector<float*> o;
  std::vector<DType> gt, st;
  std::vector<gns::Span> spans;
  bool any_shift = false;
  for (size_t i = 0; i < n; ++i) {
    const std::string suffix = "s[" + std::to_string(i) + "]";
    const std::string ng = "grad" + suffix, no = "out" + suffix, ns = "shift" + suffix;
    const at::Tensor& grad = grads[i];
    check_input(grad, ng, device);
    check_float32(outs[i], no, device);
    check_numel(outs[i], no, 2 * grad.numel(), ng + " (2x)");
    c10::optional<at::Tensor> sh =
        shifts.size() == 0 ? c10::nullopt : c10::optional<at::Tensor>(shifts.get(i));
    const bool has_shift = sh.has_value() && sh->defined();
    if (has_shift) {
      check_input(*sh, ns, device);
      check_numel(*sh, ns, grad.numel(), ng);
    }
    gns::add_span(spans, outs[i], no, true);
    gns::add_span(spans, grad, ng, false);
    if (has_shift) gns::add_span(spans, *sh, ns, false);
    numels.push_back(grad.numel());
    g.push_back(grad.data_ptr());
    s.push_back(has_shift ? sh->data_ptr() : nullptr);
    o.push_back(outs[i].data_ptr<float>());
    gt.push_back(to_dtype(grad.scalar_type()));
    st.push_back(has_shift ? to_dtype(sh->scalar_type()) : DType::Float32);
    any_shift = any_shift || has_shift;
  }
  // across the whole list: an out must not alias any other argument
  gns::check_no_overlap(std::move(spans));
  const c10::cuda::CUDAGuard guard(device);
  check_launch(square_pack_multi(static_cast<int>(n), numels.data(), g.data(),
                                 any_shift ? s.data() : nullptr, gt.data(), st.data(), o.data(),
                                 at::cuda::getCurrentCUDAStream().stream()),
               "square_pack_multi");
}

// ----------------------------------------------------------------------------------------
// accumulate_sq
// ----------------------------------------------------------------------------------------
struct AccList {
  std::vector<int64_t> numels;
  std::vector<const void*> g;
  std::vector<void*> p;
  std::vector<float*> sq;
  std::vector<DType> gt, pt;
  std::vector<gns::Span> spans;  // memory of every argument (prev, sq: outputs)
};

void add_acc(AccList& l, const at::Tensor& grad, const at::Tensor& prev, const at::Tensor& sq,
             const std::string& suffix, c10::optional<at::Device> device) {
  const std::string ng = "grad" + suffix, np = "prev" + suffix, ns = "sq" + suffix;
  check_input(grad, ng, device);
  check_input(prev, np, grad.device());
  TORCH_CHECK_TYPE(prev.scalar_type() == grad.scalar_type() || prev.scalar_type() == at::kFloat,
                   np, ": expected dtype ", grad.scalar_type(), " (like ", ng,
                   ") or float32, got ", prev.scalar_type());
  check_float32(sq, ns, grad.device());
  check_numel(prev, np, grad.numel(), ng);
  check_numel(sq, ns, grad.numel(), ng);
  gns::add_span(l.spans, grad, ng, false);
  gns::add_span(l.spans, prev, np, true);
  gns::add_span(l.spans, sq, ns, true);
  l.numels.push_back(grad.numel());
  l.g.push_back(grad.data_ptr());
  l.p.push_back(prev.data_ptr());
  l.sq.push_back(sq.data_ptr<float>());
  l.gt.push_back(to_dtype(grad.scalar_type()));
  l.pt.push_back(to_dtype(prev.scalar_type()));
}

void run_acc(const AccList& l, const at::Device& device) {
  // across the whole list: a prev or sq of one triple must not alias any other argument
  gns::check_no_overlap(l.spans);
  const c10::cuda::CUDAGuard guard(device);
  check_launch(accumulate_sq(static_cast<int>(l.numels.size()), l.numels.data(), l.g.data(),
                             l.p.data(), l.sq.data(), l.gt.data(), l.pt.data(),
                             at::cuda::getCurrentCUDAStream().stream()),
               "accumulate_sq");
}

void accumulate_sq_cuda(const at::Tensor& grad, const at::Tensor& prev, const at::Tensor& sq) {
  AccList l;
  add_acc(l, grad, prev, sq, "", c10::nullopt);
  run_acc(l, grad.device());
}

void accumulate_sq_multi_cuda(at::TensorList grads, at::TensorList prevs, at::TensorList sqs) {
  const size_t n = grads.size();
  TORCH_CHECK_VALUE(prevs.size() == n, "prevs: expected ", n, " tensors like grads, got ",
                    prevs.size());
  TORCH_CHECK_VALUE(sqs.size() == n, "sqs: expected ", n, " tensors like grads, got ",
                    sqs.size());
  if (n == 0) return;
  const at::Device device = grads[0].device();
  AccList l;
  for (size_t i = 0; i < n; ++i) {
    add_acc(l, grads[i], prevs[i], sqs[i], "s[" + std::to_string(i) + "]", device);
  }
  run_acc(l, device);
}

}  // namespace
}  // namespace gns_cuda

TORCH_LIBRARY_IMPL(gns_kernels, CUDA, m) {
  m.impl("variance_norms", &gns_cuda::variance_norms_cuda);
  m.impl("variance_norms_multi", &gns_cuda::variance_norms_multi_cuda);
  m.impl("square_pack", &gns_cuda::square_pack_cuda);
  m.impl("square_pack_multi", &gns_cuda::square_pack_multi_cuda);
  m.impl("accumulate_sq", &gns_cuda::accumulate_sq_cuda);
  m.impl("accumulate_sq_multi", &gns_cuda::accumulate_sq_multi_cuda);
}
