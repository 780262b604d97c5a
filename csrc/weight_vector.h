// The checks a tensor of per-list weights gets (lerp_many_'s K weights, bema_'s 3), and its
// values read on the host when it is a CPU tensor; a device tensor is left to its kernel, which
// reads it there (no host sync).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <vector>

#include "dtype_pairs.h"

namespace fused_ema {

// `what` says what the n elements are, for the shape error. nullopt for a device tensor.
inline std::optional<std::vector<double>> weight_vector(const at::Tensor& weights, size_t n,
                                                        const char* op, const std::string& what) {
  TORCH_CHECK_VALUE(weights.defined(), op, "weights is an undefined tensor");
  TORCH_CHECK_VALUE(weights.dim() == 1 && static_cast<size_t>(weights.numel()) == n, op,
                    "weights must be a 1-D tensor of ", what, ", got shape ", weights.sizes());
  const auto type = weights.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kDouble, op,
                    "weights must be float32 or float64, got ", dtype_name(type));
  TORCH_CHECK(!(weights.requires_grad() && c10::GradMode::is_enabled()), op,
              "weights requires grad; the EMA update is not differentiable");
  if (!weights.is_cpu()) {
    return std::nullopt;
  }
  std::vector<double> values(n);
  const int64_t stride = weights.stride(0);
  for (size_t k = 0; k < n; ++k) {
    const auto j = static_cast<int64_t>(k) * stride;
    values[k] = type == at::kFloat ? static_cast<double>(weights.const_data_ptr<float>()[j])
                                   : weights.const_data_ptr<double>()[j];
  }
  return values;
}

}  // namespace fused_ema
