// The type the lerp computes in: float for float32/bfloat16/float16 EMAs, double for float64.
// Shared by the CPU and CUDA kernels (no torch headers, so nvcc-only tests can include it).
#pragma once

#include <cmath>
#include <limits>

namespace fused_ema {

// Whether a finite weight known on the host is finite as a float too, the type the kernels of
// 32- and 16-bit EMAs compute in (a weight of 1e39 would make every entry infinite there).
inline bool fits_float(double weight) {
  return std::fabs(weight) <= std::numeric_limits<float>::max();
}

template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

}  // namespace fused_ema
