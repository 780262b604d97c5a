// ModelEma.swapped(): the EMA's values and the model's exchanged in place, in one call
// (fused_ema/_model/swap.py prepares it). Every check comes before the first write, and `state`
// records which way the values lie, so that a call repeated after an interrupt does nothing.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace fused_ema {
namespace {

constexpr const char* kOp = "fused_ema.swap_values_: ";

// The scratch buffer of a's dtype and device (Python allocates one per pair of them).
const at::Tensor& scratch_for(at::TensorList scratch, const at::Tensor& a, size_t i) {
  for (const at::Tensor& s : scratch) {
    if (s.scalar_type() == a.scalar_type() && s.device() == a.device()) {
      return s;
    }
  }
  TORCH_CHECK_VALUE(false, kOp, "no scratch buffer of ", a.scalar_type(), " on ", a.device(),
                    " for pair ", i);
}

// How many leading-dimension rows (flat elements, when both are contiguous) one exchange through
// `scratch` moves.
int64_t piece_length(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scratch,
                     size_t i) {
  if (a.is_contiguous() && b.is_contiguous()) {
    return scratch.numel();
  }
  if (a.dim() == 0 || a.size(0) == 0) {
    return 1;
  }
  const int64_t row = a.numel() / a.size(0);
  TORCH_CHECK_VALUE(row <= scratch.numel(), kOp, "pair ", i, ": a row of ", row,
                    " elements does not fit the scratch buffer's ", scratch.numel());
  return scratch.numel() / std::max<int64_t>(row, 1);
}

void check_pair(const at::Tensor& a, const at::Tensor& b, size_t i) {
  TORCH_CHECK_VALUE(a.defined() && b.defined(), kOp, "pair ", i, " holds an undefined tensor");
  TORCH_CHECK_VALUE(
      a.scalar_type() == b.scalar_type() && a.device() == b.device() && a.sizes() == b.sizes(), kOp,
      "pair ", i, ": ", a.scalar_type(), a.sizes(), " on ", a.device(),
      " cannot exchange values with ", b.scalar_type(), b.sizes(), " on ", b.device());
  if (a.numel() > 0 && a.data_ptr() != b.data_ptr()) {
    const auto span = [](const at::Tensor& t) {
      const auto* first = static_cast<const char*>(t.data_ptr());
      return std::make_pair(first, first + t.numel() * t.element_size());
    };
    const auto [a0, a1] = span(a);
    const auto [b0, b1] = span(b);
    TORCH_CHECK_VALUE(!a.is_contiguous() || !b.is_contiguous() || a1 <= b0 || b1 <= a0, kOp,
                      "pair ", i, ": the two tensors overlap in memory");
  }
}

void swap_values(at::TensorList a, at::TensorList b, at::TensorList scratch,
                 const at::Tensor& state, int64_t into) {
  TORCH_CHECK_VALUE(a.size() == b.size(), kOp, a.size(), " tensors cannot pair with ", b.size());
  TORCH_CHECK_VALUE(state.is_cpu() && state.scalar_type() == at::kLong && state.numel() == 1, kOp,
                    "state must be one CPU int64 element");
  TORCH_CHECK_VALUE(into == 0 || into == 1, kOp, "into must be 0 or 1, got ", into);
  if (state.item<int64_t>() == into) {
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
    const at::Tensor& buffer = scratch_for(scratch, a[i], i);
    const bool flat = a[i].is_contiguous() && b[i].is_contiguous();
    const at::Tensor x = flat ? a[i].view(-1) : a[i].dim() == 0 ? a[i].view(1) : a[i];
    const at::Tensor y = flat ? b[i].view(-1) : b[i].dim() == 0 ? b[i].view(1) : b[i];
    for (int64_t start = 0; start < x.size(0); start += lengths[i]) {
      const int64_t n = std::min(lengths[i], x.size(0) - start);
      const at::Tensor xs = x.narrow(0, start, n), ys = y.narrow(0, start, n);
      at::Tensor held = buffer.narrow(0, 0, xs.numel()).view(xs.sizes());
      held.copy_(xs);
      xs.copy_(ys);
      ys.copy_(held);
    }
  }
  state.fill_(into);
}

}  // namespace
}  // namespace fused_ema

TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) {
  m.impl("swap_values_", &fused_ema::swap_values);
}
