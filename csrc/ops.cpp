// The ONE schema file of gns_kernels: every op of the torch.ops.gns_kernels namespace is
// declared here; backends register implementations with TORCH_LIBRARY_IMPL (csrc/cpu for
// CPU, csrc/cuda for CUDA) and gns_kernels/ops.py registers the fake (meta) kernels.
//
// Semantics: see csrc/gns_math.h and gns_kernels/ops.py (float64 oracle in
// gns_kernels/reference.py). Inputs float32 / bfloat16 / float16, contiguous, flat-viewed.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing gns_kernels._C loads this library (and so runs the registrations below).
// The module itself is empty, as in pytorch/extension-cpp.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", /* name */
      nullptr,                     /* doc */
      -1,                          /* size */
      nullptr,                     /* methods */
      nullptr,                     /* slots */
      nullptr,                     /* traverse */
      nullptr,                     /* clear */
      nullptr,                     /* free */
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(gns_kernels, m) {
  // [||s||_1, ||g||_1, sum s2, ||g||_2^2] as float32 Tensor[4];
  // s2 = max(scale*(mean_sq - mean_grad^2), 0) (NaN kept), g = mean_grad + shift.
  m.def("variance_norms(Tensor mean_grad, Tensor mean_sq, float scale, Tensor? shift=None) -> Tensor");
  // The sums of variance_norms over lists (one parallel loop). shifts: one entry per
  // tensor (None: no shift for it), or an empty list for no shift at all.
  m.def(
      "variance_norms_multi(Tensor[] mean_grads, Tensor[] mean_sqs, float scale, "
      "Tensor?[] shifts) -> Tensor");
  // out (float32, 2n): out[:n] = grad - shift, out[n:] = (grad - shift)^2.
  m.def("square_pack(Tensor grad, Tensor(a!) out, Tensor? shift=None) -> ()");
  // square_pack over lists: outs[i] (float32, 2 * grads[i].numel()) = [x_i, x_i^2] with
  // x_i = grads[i] - shifts[i]. shifts: one entry per tensor (None: no shift for it), or an
  // empty list for no shift at all.
  m.def("square_pack_multi(Tensor[] grads, Tensor(a!)[] outs, Tensor?[] shifts) -> ()");
  // d = grad - prev; sq += d*d; prev = grad   (in place).
  m.def("accumulate_sq(Tensor grad, Tensor(a!) prev, Tensor(b!) sq) -> ()");
  m.def("accumulate_sq_multi(Tensor[] grads, Tensor(a!)[] prevs, Tensor(b!)[] sqs) -> ()");
}
