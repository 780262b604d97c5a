// The CPU span kernel of fused_ema::bema_, compiled per instruction set with lerp_span.h (simd.h
// its vectors). ema and theta0 take lerp_span's formula, so they match lerp_ bit for
// bit; out follows the one order every backend uses (below), vector body and scalar tail alike.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../opmath.h"
#include "simd.h"
#include "span_kernels.h"

namespace fused_ema::cpu {
inline namespace CPU_CAPABILITY {

#ifdef FUSED_EMA_VECTORIZED
template <typename V>
inline V lerp_vec(const V& e, const V& s, const V& coeff, bool small) {
  return fmadd(coeff, s - e, small ? e : s);
}

// theta' is only written by the pass: a plain store first reads each line it writes (4 more
// bytes a parameter on top of the 20 the pass needs), a streaming store does not (measured here:
// 14-20% off a GPT-2-sized pass). Float32 only, on spans long enough that leaving them out of
// the cache costs nothing, and aligned as the stores need (both vectors of a step share a line
// set: out + i stays 64-byte aligned).
constexpr int64_t kStreamMinElements = int64_t{1} << 16;

template <typename E>
inline bool streams(const E* out, int64_t n) {
  if constexpr (std::is_same_v<E, float>) {
    return n >= kStreamMinElements && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  }
  return false;
}

inline void stream2(float* p, const VecF& a, const VecF& b) {
  stream_store(p, a);
  stream_store(p + kLanes, b);
}
#endif

// The evaluation order of out, shared by every backend (CPU scalar and vector, CUDA, the
// emulation): with x = src, e = the new ema and t = the new theta0 as stored (rounded to the EMA
// dtype, read back in opmath), d = x - t rounded once, then out = fma(alpha, d, e) rounded once
// (an explicit fused multiply-add, so no compiler contraction can change it), then rounded to the
// EMA dtype.
//
// kWrites: which lists are written (weight not 0), bit 0 ema, 1 theta0, 2 out. ema is read for
// out even when it keeps its values, theta0 likewise.
template <typename E, typename S, int kWrites>
void bema_range(E* ema, E* theta0, E* out, const S* src, int64_t n,
                LerpCoeff<typename OpMath<E>::type> beta, LerpCoeff<typename OpMath<E>::type> w0,
                typename OpMath<E>::type alpha) {
  using opmath_t = typename OpMath<E>::type;
  constexpr bool kEma = (kWrites & 1) != 0;
  constexpr bool kTheta = (kWrites & 2) != 0;
  constexpr bool kOut = (kWrites & 4) != 0;
  int64_t i = 0;
#ifdef FUSED_EMA_VECTORIZED
  using Vec = decltype(splat(alpha));
  constexpr int64_t kStep = 2 * sizeof(Vec) / sizeof(opmath_t);
  const Vec vbeta = splat(beta.coeff);
  const Vec vw0 = splat(w0.coeff);
  const Vec valpha = splat(alpha);
  const bool stream = kOut && streams(out, n);
  for (; i + kStep <= n; i += kStep) {
    if constexpr ((kEma || kOut) && (kTheta || kOut)) {
      prefetch_ahead<kStep>(i, n, src, ema, theta0);
    } else if constexpr (kEma || kOut) {
      prefetch_ahead<kStep>(i, n, src, ema);
    } else {
      prefetch_ahead<kStep>(i, n, src, theta0);
    }
    Vec s0, s1, e0, e1, t0, t1;
    load2(src + i, s0, s1);
    if constexpr (kEma || kOut) {
      load2(ema + i, e0, e1);
      if constexpr (kEma) {
        e0 = lerp_vec(e0, s0, vbeta, beta.small);
        e1 = lerp_vec(e1, s1, vbeta, beta.small);
        store2_rounded(ema + i, e0, e1);
      }
    }
    if constexpr (kTheta || kOut) {
      load2(theta0 + i, t0, t1);
      if constexpr (kTheta) {
        t0 = lerp_vec(t0, s0, vw0, w0.small);
        t1 = lerp_vec(t1, s1, vw0, w0.small);
        store2_rounded(theta0 + i, t0, t1);
      }
    }
    if constexpr (kOut) {
      const Vec o0 = fmadd(valpha, s0 - t0, e0);
      const Vec o1 = fmadd(valpha, s1 - t1, e1);
      if constexpr (std::is_same_v<E, float>) {
        if (stream) {
          stream2(out + i, o0, o1);
          continue;
        }
      }
      store2(out + i, o0, o1);
    }
  }
  if (stream) {
    _mm_sfence();  // streaming stores are weakly ordered: visible before the span returns
  }
#endif
  for (; i < n; ++i) {
    const auto x = static_cast<opmath_t>(src[i]);
    opmath_t e{};
    opmath_t t{};
    if constexpr (kEma || kOut) {
      e = static_cast<opmath_t>(ema[i]);
      if constexpr (kEma) {
        const auto stored = narrow<E>(std::fma(beta.coeff, x - e, beta.small ? e : x));
        ema[i] = stored;
        e = static_cast<opmath_t>(stored);
      }
    }
    if constexpr (kTheta || kOut) {
      t = static_cast<opmath_t>(theta0[i]);
      if constexpr (kTheta) {
        const auto stored = narrow<E>(std::fma(w0.coeff, x - t, w0.small ? t : x));
        theta0[i] = stored;
        t = static_cast<opmath_t>(stored);
      }
    }
    if constexpr (kOut) {
      out[i] = narrow<E>(std::fma(alpha, x - t, e));
    }
  }
}

// A weight that rounds to 0 in opmath leaves its list untouched.
template <typename E, typename S>
void bema_span(void* ema, void* theta0, void* out, const void* src, int64_t begin, int64_t end,
               const double* weights) {
  using opmath_t = typename OpMath<E>::type;
  const auto beta = static_cast<opmath_t>(weights[0]);
  const auto w0 = static_cast<opmath_t>(weights[1]);
  const auto alpha = static_cast<opmath_t>(weights[2]);
  E* e = static_cast<E*>(ema) + begin;
  E* t = static_cast<E*>(theta0) + begin;
  E* o = static_cast<E*>(out) + begin;
  const S* s = static_cast<const S*>(src) + begin;
  const int64_t n = end - begin;
  const LerpCoeff<opmath_t> cb = lerp_coeff(beta);
  const LerpCoeff<opmath_t> c0 = lerp_coeff(w0);
  const int writes = (beta != 0 ? 1 : 0) | (w0 != 0 ? 2 : 0) | (alpha != 0 ? 4 : 0);
  // bema_range of every kWrites but 0 (which writes nothing), indexed by kWrites - 1.
  static constexpr decltype(&bema_range<E, S, 1>) kRanges[] = {
      &bema_range<E, S, 1>, &bema_range<E, S, 2>, &bema_range<E, S, 3>, &bema_range<E, S, 4>,
      &bema_range<E, S, 5>, &bema_range<E, S, 6>, &bema_range<E, S, 7>};
  if (writes != 0) {
    kRanges[writes - 1](e, t, o, s, n, cb, c0, alpha);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu
