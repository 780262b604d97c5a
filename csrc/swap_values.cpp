// ModelEma.swapped(): the EMA's values and the model's exchanged in place, in one call
// (fused_ema/_model/swap.py prepares it). Every check comes before the first write, and `state`
// records which way the values lie, so that a call repeated after an interrupt does nothing.
// The extension's first op on torch's stable ABI, built for torch 2.11 (docs/internals.md); its
// refusals are std::invalid_argument (refuse.h): ValueError under torch 2.11-2.13, RuntimeError
// under 2.15.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 11) << 48))

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "refuse.h"

namespace fused_ema {
namespace {

using torch::stable::Tensor;
using TensorList = std::vector<Tensor>;

constexpr const char* kOp = "fused_ema.swap_values_: ";

// "cpu", "cuda:0", as torch prints a device.
std::string device_name(const Tensor& t) {
  const torch::stable::Device device = t.device();
  if (device.is_cpu()) {
    return "cpu";
  }
  if (device.is_cuda()) {
    return "cuda:" + std::to_string(device.index());
  }
  return "device type " + std::to_string(static_cast<int>(device.type()));
}

// "Float[7, 5] on cpu", as torch prints a tensor's dtype, shape and device.
std::string describe(const Tensor& t) {
  std::ostringstream out;
  out << torch::headeronly::toString(t.scalar_type()) << '[';
  const auto sizes = t.sizes();
  for (size_t d = 0; d < sizes.size(); ++d) {
    out << (d > 0 ? ", " : "") << sizes[d];
  }
  out << "] on " << device_name(t);
  return out.str();
}

bool same_place(const Tensor& a, const Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.device() == b.device();
}

// The scratch buffer of a's dtype and device (Python allocates one per pair of them).
const Tensor& scratch_for(const TensorList& scratch, const Tensor& a, size_t i) {
  for (const Tensor& s : scratch) {
    if (same_place(s, a)) {
      return s;
    }
  }
  refuse(kOp, "no scratch buffer of ", torch::headeronly::toString(a.scalar_type()), " on ",
         device_name(a), " for pair ", i);
}

// How many leading-dimension rows (flat elements, when both are contiguous) one exchange through
// `scratch` moves.
int64_t piece_length(const Tensor& a, const Tensor& b, const Tensor& scratch, size_t i) {
  if (a.is_contiguous() && b.is_contiguous()) {
    return scratch.numel();
  }
  if (a.dim() == 0 || a.size(0) == 0) {
    return 1;
  }
  const int64_t row = a.numel() / a.size(0);
  if (row > scratch.numel()) {
    refuse(kOp, "pair ", i, ": a row of ", row, " elements does not fit the scratch buffer's ",
           scratch.numel());
  }
  return scratch.numel() / std::max<int64_t>(row, 1);
}

void check_pair(const Tensor& a, const Tensor& b, size_t i) {
  if (!a.defined() || !b.defined()) {
    refuse(kOp, "pair ", i, " holds an undefined tensor");
  }
  if (!same_place(a, b) || !a.sizes().equals(b.sizes())) {
    refuse(kOp, "pair ", i, ": ", describe(a), " cannot exchange values with ", describe(b));
  }
  if (a.numel() > 0 && a.data_ptr() != b.data_ptr() && a.is_contiguous() && b.is_contiguous()) {
    const auto span = [](const Tensor& t) {
      const auto* first = static_cast<const char*>(t.data_ptr());
      return std::make_pair(first, first + t.numel() * static_cast<int64_t>(t.element_size()));
    };
    const auto [a0, a1] = span(a);
    const auto [b0, b1] = span(b);
    if (a1 > b0 && b1 > a0) {
      refuse(kOp, "pair ", i, ": the two tensors overlap in memory");
    }
  }
}

// A flat (contiguous) or at least one-dimensional view of t, to cut into rows.
Tensor rows_of(const Tensor& t, bool flat) {
  if (flat || t.dim() == 0) {
    const int64_t all[] = {-1};
    return torch::stable::view(t, all);
  }
  return t;
}

void swap_values(TensorList a, TensorList b, TensorList scratch, Tensor state, int64_t into) {
  if (a.size() != b.size()) {
    refuse(kOp, a.size(), " tensors cannot pair with ", b.size());
  }
  if (!state.is_cpu() || state.scalar_type() != torch::headeronly::ScalarType::Long ||
      state.numel() != 1) {
    refuse(kOp, "state must be one CPU int64 element");
  }
  if (into != 0 && into != 1) {
    refuse(kOp, "into must be 0 or 1, got ", into);
  }
  if (*state.const_data_ptr<int64_t>() == into) {
    return;  // done already: a retry after an interrupt
  }
  std::vector<int64_t> lengths(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    check_pair(a[i], b[i], i);
    if (a[i].numel() > 0 && a[i].data_ptr() != b[i].data_ptr()) {
      lengths[i] = piece_length(a[i], b[i], scratch_for(scratch, a[i], i), i);
    }
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (lengths[i] == 0) {
      continue;  // nothing to move, or a pair that is one tensor
    }
    Tensor buffer = scratch_for(scratch, a[i], i);
    const bool flat = a[i].is_contiguous() && b[i].is_contiguous();
    Tensor x = rows_of(a[i], flat);
    Tensor y = rows_of(b[i], flat);
    for (int64_t start = 0; start < x.size(0); start += lengths[i]) {
      const int64_t n = std::min(lengths[i], x.size(0) - start);
      Tensor xs = torch::stable::narrow(x, 0, start, n);
      Tensor ys = torch::stable::narrow(y, 0, start, n);
      Tensor held =
          torch::stable::view(torch::stable::narrow(buffer, 0, 0, xs.numel()), xs.sizes());
      torch::stable::copy_(held, xs);
      torch::stable::copy_(xs, ys);
      torch::stable::copy_(ys, held);
    }
  }
  torch::stable::fill_(state, static_cast<double>(into));
}

}  // namespace
}  // namespace fused_ema

STABLE_TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) {
  m.impl("swap_values_", TORCH_BOX(&fused_ema::swap_values));
}
