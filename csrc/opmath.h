// The type the lerp computes in: float for float32/bfloat16/float16 EMAs, double for float64.
// Shared by the CPU and CUDA kernels (no torch headers, so nvcc-only tests can include it).
#pragma once

namespace fused_ema {

template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

}  // namespace fused_ema
