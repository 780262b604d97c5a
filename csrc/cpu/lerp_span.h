// The CPU span kernels, written once and compiled per instruction set by lerp_span_*.cpp. Every
// path computes PyTorch's lerp, fma(coeff, src - ema, base), in float (double for float64), so
// the vector body, the scalar tail and every instruction set agree bit for bit.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>

#include "../opmath.h"
#include "simd.h"
#include "span_kernels.h"

namespace fused_ema::cpu {
inline namespace CPU_CAPABILITY {

// lerp_'s coefficient for a weight w rounded to opmath: coeff = w with base ema for |w| < 0.5,
// else coeff = w - 1 with base src: PyTorch's choice, exact at both ends of [0, 1].
template <typename T>
struct LerpCoeff {
  T coeff;
  bool small;
};

template <typename T>
inline LerpCoeff<T> lerp_coeff(T w) {
  const bool small = std::abs(w) < T(0.5);
  return {small ? w : w - T(1), small};
}

// kSmallWeight: LerpCoeff::small, as a template argument. Elements [0, n) are updated, those
// before `reach` (>= n, the tensor's end) prefetched.
template <typename E, typename S, bool kSmallWeight>
void lerp_range(E* ema, const S* src, int64_t n, int64_t reach, typename OpMath<E>::type coeff) {
  using opmath_t = typename OpMath<E>::type;
  int64_t i = 0;
#ifdef FUSED_EMA_VECTORIZED
  using Vec = decltype(splat(coeff));
  constexpr int64_t kStep = 2 * sizeof(Vec) / sizeof(opmath_t);
  const Vec vcoeff = splat(coeff);
  for (; i + kStep <= n; i += kStep) {
    prefetch_ahead<kStep>(i, reach, src, ema);
    Vec e0, e1, s0, s1;
    load2(ema + i, e0, e1);
    load2(src + i, s0, s1);
    const Vec r0 = fmadd(vcoeff, s0 - e0, kSmallWeight ? e0 : s0);
    const Vec r1 = fmadd(vcoeff, s1 - e1, kSmallWeight ? e1 : s1);
    store2(ema + i, r0, r1);
  }
#endif
  for (; i < n; ++i) {
    const opmath_t e = static_cast<opmath_t>(ema[i]);
    const opmath_t s = static_cast<opmath_t>(src[i]);
    ema[i] = narrow<E>(std::fma(coeff, s - e, kSmallWeight ? e : s));
  }
}

template <typename E, typename S>
void lerp_span(void* ema, const void* src, int64_t begin, int64_t end, int64_t numel,
               double weight) {
  const auto c = lerp_coeff(static_cast<typename OpMath<E>::type>(weight));
  (c.small ? &lerp_range<E, S, true> : &lerp_range<E, S, false>)(static_cast<E*>(ema) + begin,
                                                                 static_cast<const S*>(src) + begin,
                                                                 end - begin, numel - begin,
                                                                 c.coeff);
}

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu

#include "bema_span.h"
#include "stochastic_span.h"

namespace fused_ema::cpu {
inline namespace CPU_CAPABILITY {

using CpuTypes = BackendTypes<float, double, c10::BFloat16, c10::Half>;

#define FUSED_EMA_SPAN_ENTRY(kind, ema, src, ema_tag, src_tag)  \
  {&lerp_span<CpuTypes::ema_tag, CpuTypes::src_tag>,            \
   &lerp_stochastic_span<CpuTypes::ema_tag, CpuTypes::src_tag>, \
   &bema_span<CpuTypes::ema_tag, CpuTypes::src_tag>},
// This instruction set's table (lerp_span_*.cpp hands out its address).
constexpr SpanKernels kSpanKernels = {{FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_SPAN_ENTRY)}};
#undef FUSED_EMA_SPAN_ENTRY

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu
