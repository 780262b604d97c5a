// The lerp functor for multi_tensor_apply: PyTorch's formula in float (double for float64) for
// each (ema, src) dtype pair, 16-bit sources converted in registers (no temporary copy).
// Needs no torch headers, so tests can compile it with plain nvcc; the host compiles it too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../host_device.h"
#include "../opmath.h"
#include "multi_tensor_apply.cuh"

namespace fused_ema::cuda {

// A host-known weight, or a device pointer the kernel reads (no sync, CUDA-graph capturable).
struct WeightArg {
  double value;
  const float* f32;
  const double* f64;

  FUSED_EMA_HOST_DEVICE double read() const {
    return f64 != nullptr ? *f64 : f32 != nullptr ? *f32 : value;
  }
};

FUSED_EMA_HOST_DEVICE inline float to_opmath(float x) { return x; }
FUSED_EMA_HOST_DEVICE inline double to_opmath(double x) { return x; }
// A bfloat16 is the high half of a float: widening is a shift, exact on every target. (sm_90's
// conversion intrinsic costs registers enough to spill at two blocks per SM.)
FUSED_EMA_HOST_DEVICE inline float to_opmath(__nv_bfloat16 x) {
  return uint_as_float(static_cast<unsigned>(__bfloat16_as_ushort(x)) << 16);
}
FUSED_EMA_HOST_DEVICE inline float to_opmath(__half x) { return __half2float(x); }

template <typename T>
FUSED_EMA_HOST_DEVICE T from_opmath(typename OpMath<T>::type x);
template <>
FUSED_EMA_HOST_DEVICE inline float from_opmath<float>(float x) {
  return x;
}
template <>
FUSED_EMA_HOST_DEVICE inline double from_opmath<double>(double x) {
  return x;
}
template <>
FUSED_EMA_HOST_DEVICE inline __nv_bfloat16 from_opmath<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
FUSED_EMA_HOST_DEVICE inline __half from_opmath<__half>(float x) {
  return __float2half_rn(x);
}

template <typename E, typename S>
struct LerpOp {
  using ema_t = E;
  using src_t = S;
  using opmath_t = typename OpMath<E>::type;
  static constexpr int kPack = 16 / (sizeof(E) < sizeof(S) ? sizeof(E) : sizeof(S));
  // A 16-bit EMA of a float32 model reads 32-byte source packs: two in flight fit the registers.
  static constexpr int kIlp = sizeof(S) > sizeof(E) ? 2 : kILP;

  WeightArg weight;

  // coeff = w and base = ema for |w| < 0.5, else coeff = w - 1 and base = src: PyTorch's
  // choice, exact at both ends of [0, 1].
  using extra_t = void;

  struct Bound {
    static constexpr bool kIndexed = false;
    opmath_t coeff;
    bool small;
    bool skip;  // weight 0 leaves every value as it is: ModelEma's skipped steps touch no memory
    FUSED_EMA_HOST_DEVICE E operator()(E e_in, S s_in) const {
      const opmath_t e = to_opmath(e_in);
      const opmath_t s = to_opmath(s_in);
      return from_opmath<E>(fma_once(coeff, s - e, small ? e : s));
    }
  };

  FUSED_EMA_HOST_DEVICE Bound bind() const {
    const auto w = static_cast<opmath_t>(weight.read());
    const bool small = fabs(w) < opmath_t(0.5);
    return {small ? w : w - opmath_t(1), small, w == opmath_t(0)};
  }
};

#if defined(__CUDACC__)
template <typename E, typename S>
cudaError_t launch_lerp(const TensorRef* refs, int64_t count, WeightArg weight,
                        cudaStream_t stream) {
  return multi_tensor_apply(refs, count, LerpOp<E, S>{weight}, stream);
}
#endif

}  // namespace fused_ema::cuda
