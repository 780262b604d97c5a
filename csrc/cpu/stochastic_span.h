// The CPU span kernels of fused_ema::lerp_stochastic_: lerp_span.h's lerp in float, then the
// stochastic rounding of ../stochastic_round.h into a bfloat16/float16 EMA. The vector paths hash
// 8 (AVX2) or 16 (AVX-512) element pairs at once with the scalar path's own lowbias32 and round
// exactly as it does, so they match it (and the CUDA kernel) bit for bit.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../stochastic_round.h"
#include "simd.h"
#include "span_kernels.h"

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
inline Lanes min_lanes(Lanes a, Lanes b) { return (Lanes)_mm512_min_epu32((VecU)a, (VecU)b); }
// The float16 bits of two vectors of floats (as bits), converted toward zero, in element order.
inline Words to_half_toward_zero(Lanes a, Lanes b) {
  constexpr int kTowardZero = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;
  const __m256i lo = _mm512_cvt_roundps_ph((VecF)a, kTowardZero);
  const __m256i hi = _mm512_cvt_roundps_ph((VecF)b, kTowardZero);
  return (Words)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
// Whether a lane of a lies outside [lo, lo + span], unsigned.
inline bool any_outside(Words a, uint16_t lo, uint16_t span) {
  const Words shifted = a - lo;
  return _mm512_cmpgt_epu16_mask((VecU)shifted, _mm512_set1_epi16(static_cast<int16_t>(span))) != 0;
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Lanes min_lanes(Lanes a, Lanes b) { return (Lanes)_mm256_min_epu32((VecU)a, (VecU)b); }
inline Words to_half_toward_zero(Lanes a, Lanes b) {
  const __m128i lo = _mm256_cvtps_ph((VecF)a, _MM_FROUND_TO_ZERO);
  const __m128i hi = _mm256_cvtps_ph((VecF)b, _MM_FROUND_TO_ZERO);
  return (Words)_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}
// No unsigned 16-bit comparison: a - lo with its top bit flipped, a + (0x8000 - lo), is compared
// signed (one add for both).
inline bool any_outside(Words a, uint16_t lo, uint16_t span) {
  constexpr uint16_t kFlip = 0x8000;
  const Words biased = a + static_cast<uint16_t>(kFlip - lo);
  const VecU above = _mm256_cmpgt_epi16((VecU)biased, _mm256_set1_epi16(span ^ kFlip));
  return _mm256_movemask_epi8(above) != 0;
}
#endif

#ifdef FUSED_EMA_VECTORIZED
// The pair that lane j of a hash vector takes, of kLanes consecutive ones: widen_words unpacks
// the low (high) 4 words of each 128-bit lane, 2 pairs', into the first (second) result vector.
constexpr uint32_t pair_lane(int j) {
  const int lane = j / 4;
  const int m = j % 4;
  return static_cast<uint32_t>(m < 2 ? 2 * lane + m : kLanes / 2 + 2 * lane + m - 2);
}

// The hash inputs (sr::pair_bits) of pairs lo .. lo + kLanes - 1 under pair key k, in pair_lane
// order.
inline Lanes pair_inputs(uint32_t lo, uint64_t k) {
  Lanes x{};
  for (int j = 0; j < kLanes; ++j) {
    x[j] = (lo + pair_lane(j)) * sr::kPairStep + sr::lo32(k);
  }
  return x;
}

// sr::round_bf16, lane by lane.
inline Lanes round_bf16_vec(Lanes bits, Lanes word) {
  return nan_lanes(bits) ? splat_lanes(sr::kBF16NaN) : (bits + word) >> 16;
}

// sr::round_f16, lane by lane, in integer arithmetic, `nudge` each element's 0x1FFF - word / 8
// and `rest` its 0xFFFF - word. A normal rounds up (word < 8 * dropped, the reference's rule)
// exactly when its 13 dropped bits plus the nudge carry into the kept ones. A float16 subnormal
// or zero, below 2**-14: floor(|r| * 2**40) is exact (a power of two times a float, below 2**26)
// and holds the half below times 2**16 plus 16 bits of the rest, whose sum with 0xFFFF - word
// carries into the half exactly when word is below those 16 bits.
[[gnu::always_inline]] inline Lanes round_f16_vec(Lanes bits, Lanes nudge, Lanes rest) {
  using Floats = float __attribute__((vector_size(sizeof(VecU))));
  using Ints = int32_t __attribute__((vector_size(sizeof(VecU))));
  constexpr uint32_t kFirstNormal = sr::kF16FirstNormal << sr::kF32MantissaBits;
  constexpr uint32_t kOverflow = sr::kF16Overflow << sr::kF32MantissaBits;
  constexpr uint32_t kRebias = sr::kF16ExponentShift << sr::kF32MantissaBits;
  const Lanes abs = bits & sr::kF32AbsMask;
  // From 2**16 up (abs + nudge >= kOverflow) the truncation is at least infinity's bits: a minimum.
  static_assert(((kOverflow - kRebias) >> sr::kF16DroppedBits) == sr::kF16Inf);
  Lanes half = min_lanes((abs + nudge - kRebias) >> sr::kF16DroppedBits, splat_lanes(sr::kF16Inf));
  const auto subnormal = (Lanes)(abs < kFirstNormal);
  const Floats steps = (Floats)(abs & subnormal) * 0x1p40f;
  half = subnormal ? ((Lanes) __builtin_convertvector(steps, Ints) + rest) >> 16 : half;
  half = abs > sr::kF32Inf ? splat_lanes(sr::kF16QuietNaN) : half;
  return ((bits >> 16) & (sr::kF32SignMask >> 16)) | half;
}

// Rounds 2 * kLanes elements (floats' bits lo, hi; their pairs' hash words in pair_lane order) to
// bfloat16/float16 at p. float16: the float bits plus each element's nudge (round_f16_vec),
// converted toward zero by the hardware, truncate as the integer path does, sign included, for
// every result from the first normal half, 2**-14, up to the largest finite one: half the vector
// instructions. Blocks holding anything else (float16 subnormals and zeros, overflows, infinity,
// NaN; one block in 14 of ViT-B/16's initial weights) take the integer path. The two differ only
// where the conversion's result is at most 0x0400 (subnormal or zero inputs, and normals a nudge
// carries there), at least 0x7BFF (where toward zero stops short of infinity), or where the float
// bits plus the nudge left NaN's range (its magnitude wraps to below 2**-126).
template <typename E>
[[gnu::always_inline]] inline void round_store(E* p, Lanes lo, Lanes hi, Lanes words) {
  if constexpr (std::is_same_v<E, c10::BFloat16>) {
    Lanes w0, w1;
    widen_words(words, w0, w1);
    if (maybe_nan((VecF)lo, (VecF)hi)) {  // the lane-wise NaN choice only then
      store_bits(p, round_bf16_vec(lo, w0), round_bf16_vec(hi, w1));
    } else {
      store_bits(p, (lo + w0) >> 16, (hi + w1) >> 16);
    }
  } else {
    const Lanes rest = ~words;  // 0xFFFF - word in each 16-bit half
    Lanes n0, n1;
    widen_words((Lanes)((Words)rest >> 3), n0, n1);
    const Words fast = to_half_toward_zero(lo + n0, hi + n1);
    // Magnitudes 0x0401 .. 0x7BFE, doubled (dropping the sign), minus 0x0802: 0 .. 0xEFFA.
    const Words doubled = fast + fast;
    if (__builtin_expect(any_outside(doubled, 0x0802, 0xEFFA), 0)) {
      Lanes r0, r1;
      widen_words(rest, r0, r1);
      store_bits(p, round_f16_vec(lo, n0, r0), round_f16_vec(hi, n1, r1));
    } else {
      std::memcpy(p, &fast, sizeof(fast));
    }
  }
}
#endif

// Elements [0, n) of a span, `first` its first element's index, within one block of 2**32 pairs;
// those before `reach` (>= n) prefetched.
template <typename E, typename S, bool kSmallWeight>
void sr_range(E* ema, const S* src, int64_t n, int64_t reach, float coeff,
              const sr::TensorStream& st, uint64_t first) {
  int64_t i = 0;
#ifdef FUSED_EMA_VECTORIZED
  // kLanes pairs a block, from an even element on.
  i = std::min<int64_t>(n, static_cast<int64_t>(first & 1));
  sr_scalar<E, S, kSmallWeight>(ema, src, i, coeff, st, first);
  const VecF vcoeff = splat(coeff);
  const uint32_t k1 = sr::hi32(st.k);
  Lanes x = pair_inputs(sr::lo32((first + static_cast<uint64_t>(i)) >> 1), st.k);
  for (; i + 2 * kLanes <= n; i += 2 * kLanes, x += kLanes * sr::kPairStep) {
    prefetch_ahead<2 * kLanes>(i, reach, src, ema);
    const Lanes words = sr::lowbias32(x, k1);
    VecF e0, e1, s0, s1;
    load2(ema + i, e0, e1);
    load2(src + i, s0, s1);
    const VecF r0 = fmadd(vcoeff, s0 - e0, kSmallWeight ? e0 : s0);
    const VecF r1 = fmadd(vcoeff, s1 - e1, kSmallWeight ? e1 : s1);
    round_store(ema + i, (Lanes)r0, (Lanes)r1, words);
  }
#endif
  sr_scalar<E, S, kSmallWeight>(ema + i, src + i, n - i, coeff, st, first + i);
}

// Updates ema[begin:end] of one dense pair: stochastic rounding for 16-bit EMAs, the plain lerp
// (lerp_span.h) for float32/float64 ones.
template <typename E, typename S>
void lerp_stochastic_span(void* ema, const void* src, int64_t begin, int64_t end, int64_t numel,
                          double weight, const SrStream& st) {
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
      const int64_t reach = numel - begin - i;
      if (small) {
        sr_range<E, S, true>(e + i, s + i, len, reach, w, stream, first);
      } else {
        sr_range<E, S, false>(e + i, s + i, len, reach, w - 1.0f, stream, first);
      }
      i += len;
    }
  } else {
    lerp_span<E, S>(ema, src, begin, end, numel, weight);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu
