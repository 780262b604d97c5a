// The CPU span kernels of fused_ema::lerp_stochastic_: lerp_span.h's lerp in float, then the
// stochastic rounding of ../stochastic_round.h into a bfloat16/float16 EMA. The vector paths hash
// 8 (AVX2) or 16 (AVX-512) element pairs at once with the scalar path's own lowbias32 and round
// exactly as it does, so they match it (and the CUDA kernel) bit for bit.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../stochastic_round.h"
#include "span_kernels.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace fused_ema::cpu {
inline namespace CPU_CAPABILITY {

template <typename E>
uint16_t round_bits(uint32_t bits, uint32_t word);
template <>
inline uint16_t round_bits<c10::BFloat16>(uint32_t bits, uint32_t word) {
  return sr::round_bf16(bits, word);
}
template <>
inline uint16_t round_bits<c10::Half>(uint32_t bits, uint32_t word) {
  return sr::round_f16(bits, word);
}

// Elements [0, n) of a span whose first element has index `first` in its full tensor.
template <typename E, typename S, bool kSmallWeight>
void sr_scalar(E* ema, const S* src, int64_t n, float coeff, const sr::TensorStream& st,
               uint64_t first) {
  for (int64_t i = 0; i < n; ++i) {
    const auto e = static_cast<float>(ema[i]);
    const auto s = static_cast<float>(src[i]);
    const float r = std::fma(coeff, s - e, kSmallWeight ? e : s);
    uint32_t bits = 0;
    std::memcpy(&bits, &r, sizeof(bits));
    ema[i] = E(round_bits<E>(bits, st.word(first + static_cast<uint64_t>(i))), E::from_bits());
  }
}

#if defined(CPU_CAPABILITY_AVX512)
#define FUSED_EMA_SR_VECTORIZED 1
constexpr int kLanes = 16;
using VecU = __m512i;
using VecF = __m512;
// 32-bit lanes as a GCC vector type, so that most of the vector code is written once, in the
// scalar code's own operators.
using Lanes = uint32_t __attribute__((vector_size(sizeof(VecU))));

// The 16-bit words of 2 * kLanes elements (kLanes pairs' bits, in element order), two vectors.
inline void widen_words(Lanes bits, Lanes& lo, Lanes& hi) {
  lo = (Lanes)_mm512_cvtepu16_epi32(_mm512_castsi512_si256((VecU)bits));
  hi = (Lanes)_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64((VecU)bits, 1));
}
// Whether a lane of a is below b's, unsigned.
inline bool any_below(Lanes a, Lanes b) { return _mm512_cmplt_epu32_mask((VecU)a, (VecU)b) != 0; }
inline Lanes min_lanes(Lanes a, Lanes b) { return (Lanes)_mm512_min_epu32((VecU)a, (VecU)b); }
// 2 * kLanes 16-bit results from two vectors of 32-bit ones.
inline void store_bits(void* p, Lanes a, Lanes b) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16((VecU)a));
  _mm256_storeu_si256(static_cast<__m256i*>(p) + 1, _mm512_cvtepi32_epi16((VecU)b));
}

#elif defined(CPU_CAPABILITY_AVX2)
#define FUSED_EMA_SR_VECTORIZED 1
constexpr int kLanes = 8;
using VecU = __m256i;
using VecF = __m256;
using Lanes = uint32_t __attribute__((vector_size(sizeof(VecU))));

inline void widen_words(Lanes bits, Lanes& lo, Lanes& hi) {
  lo = (Lanes)_mm256_cvtepu16_epi32(_mm256_castsi256_si128((VecU)bits));
  hi = (Lanes)_mm256_cvtepu16_epi32(_mm256_extracti128_si256((VecU)bits, 1));
}
inline bool any_below(Lanes a, Lanes b) {
  const VecU not_below = _mm256_cmpeq_epi32(_mm256_max_epu32((VecU)a, (VecU)b), (VecU)a);
  return _mm256_movemask_epi8(not_below) != -1;
}
inline Lanes min_lanes(Lanes a, Lanes b) { return (Lanes)_mm256_min_epu32((VecU)a, (VecU)b); }
// packus works per 128-bit lane: the permute puts the halves back in order.
inline void store_bits(void* p, Lanes a, Lanes b) {
  const VecU packed = _mm256_permute4x64_epi64(_mm256_packus_epi32((VecU)a, (VecU)b), 0xD8);
  _mm256_storeu_si256(static_cast<__m256i*>(p), packed);
}
#endif

#ifdef FUSED_EMA_SR_VECTORIZED
inline Lanes splat(uint32_t x) { return Lanes{} + x; }

// The hash inputs (sr::pair_bits) of pairs lo .. lo + kLanes - 1 under pair key k.
inline Lanes pair_inputs(uint32_t lo, uint64_t k) {
  Lanes x{};
  for (int j = 0; j < kLanes; ++j) {
    x[j] = (lo + static_cast<uint32_t>(j)) * sr::kPairStep + sr::lo32(k);
  }
  return x;
}

// sr::round_bf16, lane by lane.
inline Lanes round_bf16_vec(Lanes bits, Lanes word) {
  return (bits & sr::kF32AbsMask) > sr::kF32Inf ? splat(sr::kBF16NaN) : (bits + word) >> 16;
}

// sr::round_f16 of float16 subnormals and zeros (`abs`, other lanes 0), lane by lane, in float
// arithmetic that is exact: |r| * 2**24 counts the subnormal steps below |r|, its integer part is
// the half below (half_bracket's low) and 16 bits of the rest its frac >> 16, the chance of
// rounding up (a true comparison is all ones: subtracting it adds 1).
[[gnu::always_inline]] inline Lanes round_f16_subnormal(Lanes abs, Lanes word) {
  using Floats = float __attribute__((vector_size(sizeof(VecU))));
  using Ints = int32_t __attribute__((vector_size(sizeof(VecU))));
  const Floats steps = (Floats)abs * 0x1p24f;
  const Ints low = __builtin_convertvector(steps, Ints);
  const Floats rest = (steps - __builtin_convertvector(low, Floats)) * 0x1p16f;
  const auto chance = (Lanes) __builtin_convertvector(rest, Ints);
  return (Lanes)low - (Lanes)(word < chance);
}

// sr::round_f16, lane by lane: normals by the hardware's conversion toward zero (word < 8 *
// dropped, its rule, exactly when the 13 dropped bits plus 0x1FFF - word / 8 carry into the kept
// ones), subnormals by round_f16_subnormal.
[[gnu::always_inline]] inline Lanes round_f16_vec(Lanes bits, Lanes word) {
  constexpr uint32_t kFirstNormal = sr::kF16FirstNormal << sr::kF32MantissaBits;
  constexpr uint32_t kOverflow = sr::kF16Overflow << sr::kF32MantissaBits;
  constexpr uint32_t kRebias = sr::kF16ExponentShift << sr::kF32MantissaBits;
  const Lanes abs = bits & sr::kF32AbsMask;
  const Lanes nudged = abs + ((word >> 3) ^ sr::kF16DroppedMask);
  // From 2**16 up (nudged >= kOverflow) the truncation is at least infinity's bits: a minimum.
  static_assert(((kOverflow - kRebias) >> sr::kF16DroppedBits) == sr::kF16Inf);
  Lanes half = min_lanes((nudged - kRebias) >> sr::kF16DroppedBits, splat(sr::kF16Inf));
  if (any_below(abs, splat(kFirstNormal))) {  // rare at weight scale: cheaper than always
    const Lanes subnormal = (Lanes)(abs < kFirstNormal);
    half = subnormal ? round_f16_subnormal(abs & subnormal, word) : half;
  }
  half = abs > sr::kF32Inf ? splat(sr::kF16QuietNaN) : half;
  return ((bits >> 16) & (sr::kF32SignMask >> 16)) | half;
}

template <typename E>
[[gnu::always_inline]] inline Lanes round_vec(Lanes bits, Lanes word) {
  if constexpr (std::is_same_v<E, c10::BFloat16>) {
    return round_bf16_vec(bits, word);
  } else {
    return round_f16_vec(bits, word);
  }
}
#endif

// Elements [0, n) of a span, `first` its first element's index, within one block of 2**32 pairs.
template <typename E, typename S, bool kSmallWeight>
void sr_range(E* ema, const S* src, int64_t n, float coeff, const sr::TensorStream& st,
              uint64_t first) {
  int64_t i = 0;
#ifdef FUSED_EMA_SR_VECTORIZED
  using Vec = at::vec::Vectorized<float>;
  static_assert(Vec::size() == kLanes);
  // kLanes pairs a block, from an even element on.
  i = std::min<int64_t>(n, static_cast<int64_t>(first & 1));
  sr_scalar<E, S, kSmallWeight>(ema, src, i, coeff, st, first);
  const Vec vcoeff(coeff);
  const uint32_t k1 = sr::hi32(st.k);
  Lanes x = pair_inputs(sr::lo32((first + static_cast<uint64_t>(i)) >> 1), st.k);
  for (; i + 2 * kLanes <= n; i += 2 * kLanes, x += kLanes * sr::kPairStep) {
    Lanes w0, w1;
    widen_words(sr::lowbias32(x, k1), w0, w1);
    Vec e0, e1, s0, s1;
    load2(ema + i, e0, e1);
    load2(src + i, s0, s1);
    const Vec r0 = at::vec::fmadd(vcoeff, s0 - e0, kSmallWeight ? e0 : s0);
    const Vec r1 = at::vec::fmadd(vcoeff, s1 - e1, kSmallWeight ? e1 : s1);
    store_bits(ema + i, round_vec<E>((Lanes) static_cast<VecF>(r0), w0),
               round_vec<E>((Lanes) static_cast<VecF>(r1), w1));
  }
#endif
  sr_scalar<E, S, kSmallWeight>(ema + i, src + i, n - i, coeff, st, first + i);
}

// Updates ema[begin:end] of one dense pair: stochastic rounding for 16-bit EMAs, the plain lerp
// (lerp_span.h) for float32/float64 ones.
template <typename E, typename S>
void lerp_stochastic_span(void* ema, const void* src, int64_t begin, int64_t end, double weight,
                          const SrStream& st) {
  if constexpr (std::is_same_v<E, c10::BFloat16> || std::is_same_v<E, c10::Half>) {
    const auto w = static_cast<float>(weight);
    E* e = static_cast<E*>(ema) + begin;
    const S* s = static_cast<const S*>(src) + begin;
    const bool small = std::abs(w) < 0.5f;
    const uint64_t step_key = sr::step_key(st.seed, st.step);
    // One pair key per 2**32 pairs (2**33 elements): a span crossing into the next is split.
    for (int64_t i = 0, n = end - begin; i < n;) {
      const uint64_t first = st.offset + static_cast<uint64_t>(begin + i);
      const uint64_t room = (((first >> 33) + 1) << 33) - first;
      const auto len = static_cast<int64_t>(std::min<uint64_t>(n - i, room));
      const sr::TensorStream stream(step_key, st.key, first);
      if (small) {
        sr_range<E, S, true>(e + i, s + i, len, w, stream, first);
      } else {
        sr_range<E, S, false>(e + i, s + i, len, w - 1.0f, stream, first);
      }
      i += len;
    }
  } else {
    lerp_span<E, S>(ema, src, begin, end, weight);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu
