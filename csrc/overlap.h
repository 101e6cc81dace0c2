// Memory-overlap check shared by the CPU and CUDA bindings (header only; needs ATen only).
//
// The kernels read inputs and write outputs through __restrict__ pointers, from many
// threads (CPU) or blocks (CUDA) at once: an output that shares memory with any other
// argument of the same call (another output, or any input, also across the tensors of a
// *_multi list) is a data race. Inputs may share memory with each other (read only).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace gns {

struct Span {
  uintptr_t begin;
  uintptr_t end;  // one past the last byte
  bool output;
  size_t index;  // order of add_span calls: names the later output first in messages
  std::string name;
};

// Adds t's bytes (contiguous tensors: [data_ptr, data_ptr + numel * element_size)) to
// spans; empty tensors occupy no memory and are left out.
inline void add_span(std::vector<Span>& spans, const at::Tensor& t, std::string name, bool output) {
  if (!t.defined() || t.numel() == 0) return;
  const uintptr_t b = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t e = b + static_cast<uintptr_t>(t.numel() * t.element_size());
  spans.push_back({b, e, output, spans.size(), std::move(name)});
}

// Raises (ValueError) naming the two arguments if an output overlaps any other span.
// Sort by start, then one sweep keeping the furthest end seen so far, over all spans and
// over outputs only: O(k log k) for k tensors.
inline void check_no_overlap(std::vector<Span> spans) {
  if (spans.size() < 2) return;
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Span* far_any = nullptr;
  const Span* far_out = nullptr;
  for (const Span& s : spans) {
    const Span* other = s.output ? far_any : far_out;
    if (other != nullptr && other->end > s.begin) {
      // name the output first; of two outputs, the one listed later
      const bool s_first = s.output && (!other->output || s.index > other->index);
      const Span& first = s_first ? s : *other;
      const Span& second = s_first ? *other : s;
      TORCH_CHECK_VALUE(false, first.name, ": must not share memory with ", second.name);
    }
    if (far_any == nullptr || s.end > far_any->end) far_any = &s;
    if (s.output && (far_out == nullptr || s.end > far_out->end)) far_out = &s;
  }
}

}  // namespace gns
