// A refused argument as std::invalid_argument, its message the parts streamed one after another:
// what code off c10 throws (torch's stable ABI has no typed errors). set_python_error, and torch
// 2.11-2.13 for a stable kernel, raise it as ValueError.
#pragma once

#include <sstream>
#include <stdexcept>

namespace fused_ema {

template <typename... Parts>
[[noreturn]] void refuse(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

}  // namespace fused_ema
