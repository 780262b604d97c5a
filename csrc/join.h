// Lists in messages ("avx2, avx512"), written here rather than taken from c10's StringUtil, which
// is outside torch's stable ABI.
#pragma once

#include <string>
#include <vector>

namespace fused_ema {

inline std::string join(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) {
    text += (text.empty() ? "" : ", ") + name;
  }
  return text;
}

}  // namespace fused_ema
