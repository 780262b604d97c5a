// The CPU span kernels of fused_ema::lerp_stochastic_: lerp_span.h's lerp in float, then the
// stochastic rounding of ../stochastic_round.h into a bfloat16/float16 EMA. The vector paths run
// 8 (AVX2) or 16 (AVX-512) Philox streams side by side, one per 4 elements, in integer
// instructions only, so they match the scalar path (and the CUDA kernel) bit for bit.
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
void sr_scalar(E* ema, const S* src, int64_t n, float coeff, const SrStream& st, uint64_t first) {
  int64_t i = 0;
  while (i < n) {
    const uint64_t element = first + static_cast<uint64_t>(i);
    const sr::Words words = sr::group_words(st.seed, st.step, st.key, element / sr::kWordsPerCall);
    for (auto lane = static_cast<int64_t>(element % sr::kWordsPerCall);
         lane < sr::kWordsPerCall && i < n; ++lane, ++i) {
      const auto e = static_cast<float>(ema[i]);
      const auto s = static_cast<float>(src[i]);
      const float r = std::fma(coeff, s - e, kSmallWeight ? e : s);
      uint32_t bits = 0;
      std::memcpy(&bits, &r, sizeof(bits));
      ema[i] = E(round_bits<E>(bits, words.w[lane]), E::from_bits());
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
#define FUSED_EMA_SR_VECTORIZED 1
using VecU = __m512i;
using VecF = __m512;
constexpr int kLanes = 16;

inline VecU splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline VecU vxor(VecU a, VecU b) { return _mm512_xor_si512(a, b); }
// Lane m = 4q + k of a block holds the Philox stream of group 4k + q: after the in-lane 4x4
// transposes of transpose_words, vector k then holds groups 4k .. 4k+3 in element order.
inline VecU lane_groups() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
inline void mulhilo(VecU a, VecU m, VecU& hi, VecU& lo) {
  const VecU even = _mm512_mul_epu32(a, m);
  const VecU odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  constexpr __mmask16 kOddLanes = 0xAAAA;
  lo = _mm512_mask_blend_epi32(kOddLanes, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(kOddLanes, _mm512_srli_epi64(even, 32), odd);
}
inline VecU unpacklo32(VecU a, VecU b) { return _mm512_unpacklo_epi32(a, b); }
inline VecU unpackhi32(VecU a, VecU b) { return _mm512_unpackhi_epi32(a, b); }
inline VecU unpacklo64(VecU a, VecU b) { return _mm512_unpacklo_epi64(a, b); }
inline VecU unpackhi64(VecU a, VecU b) { return _mm512_unpackhi_epi64(a, b); }

inline VecU round_bf16_vec(VecF r, VecU word) {
  const VecU bits = _mm512_castps_si512(r);
  const VecU out = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_and_si512(word, splat(sr::kBF16DroppedMask))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(out, nan, splat(sr::kBF16NaN));
}

inline VecU round_f16_vec(VecF r, VecU word) {
  const VecU bits = _mm512_castps_si512(r);
  const VecU abs = _mm512_and_si512(bits, splat(sr::kF32AbsMask));
  const VecU sign = _mm512_and_si512(_mm512_srli_epi32(bits, 16), splat(sr::kF32SignMask >> 16));
  const VecU exponent = _mm512_srli_epi32(abs, sr::kF32MantissaBits);
  const VecU low_normal =
      _mm512_srli_epi32(_mm512_sub_epi32(abs, splat(sr::kF16ExponentShift << sr::kF32MantissaBits)),
                        sr::kF16DroppedBits);
  const VecU frac_normal = _mm512_slli_epi32(_mm512_and_si512(abs, splat(sr::kF16DroppedMask)),
                                             32 - sr::kF16DroppedBits);
  const VecU significand =
      _mm512_or_si512(_mm512_and_si512(abs, splat(sr::kF32MantissaMask)), splat(sr::kF32HiddenBit));
  const VecU shift = _mm512_sub_epi32(splat(sr::kF16SubnormalShiftBase), exponent);
  // Variable shifts by 32 or more (or by a "negative" count) give 0.
  const VecU low_sub = _mm512_srlv_epi32(significand, shift);
  const VecU frac_sub =
      _mm512_or_si512(_mm512_sllv_epi32(significand, _mm512_sub_epi32(splat(32), shift)),
                      _mm512_srlv_epi32(significand, _mm512_sub_epi32(shift, splat(32))));
  const __mmask16 normal = _mm512_cmpge_epu32_mask(exponent, splat(sr::kF16FirstNormal));
  const __mmask16 over = _mm512_cmpge_epu32_mask(exponent, splat(sr::kF16Overflow));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, splat(sr::kF32Inf));
  const VecU low_over = _mm512_mask_mov_epi32(splat(sr::kF16Inf), nan, splat(sr::kF16QuietNaN));
  VecU low = _mm512_mask_mov_epi32(low_sub, normal, low_normal);
  low = _mm512_mask_mov_epi32(low, over, low_over);
  const VecU frac = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~over),
                                           _mm512_mask_mov_epi32(frac_sub, normal, frac_normal));
  const __mmask16 up = _mm512_cmplt_epu32_mask(word, frac);
  return _mm512_or_si512(sign, _mm512_mask_add_epi32(low, up, low, splat(1)));
}

// 2 * kLanes 16-bit results from two vectors of 32-bit ones.
inline void store_bits(void* p, VecU a, VecU b) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a));
  _mm256_storeu_si256(static_cast<__m256i*>(p) + 1, _mm512_cvtepi32_epi16(b));
}

#elif defined(CPU_CAPABILITY_AVX2)
#define FUSED_EMA_SR_VECTORIZED 1
using VecU = __m256i;
using VecF = __m256;
constexpr int kLanes = 8;

inline VecU splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline VecU vxor(VecU a, VecU b) { return _mm256_xor_si256(a, b); }
// Lane m = 4q + k holds the stream of group 2k + q (see the AVX-512 lane_groups).
inline VecU lane_groups() { return _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); }
inline void mulhilo(VecU a, VecU m, VecU& hi, VecU& lo) {
  const VecU even = _mm256_mul_epu32(a, m);
  const VecU odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  constexpr int kOddLanes = 0xAA;
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), kOddLanes);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, kOddLanes);
}
inline VecU unpacklo32(VecU a, VecU b) { return _mm256_unpacklo_epi32(a, b); }
inline VecU unpackhi32(VecU a, VecU b) { return _mm256_unpackhi_epi32(a, b); }
inline VecU unpacklo64(VecU a, VecU b) { return _mm256_unpacklo_epi64(a, b); }
inline VecU unpackhi64(VecU a, VecU b) { return _mm256_unpackhi_epi64(a, b); }

inline VecU select(VecU mask, VecU if_false, VecU if_true) {
  return _mm256_blendv_epi8(if_false, if_true, mask);
}

inline VecU round_bf16_vec(VecF r, VecU word) {
  const VecU bits = _mm256_castps_si256(r);
  const VecU out = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_and_si256(word, splat(sr::kBF16DroppedMask))), 16);
  const VecU nan = _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q));
  return select(nan, out, splat(sr::kBF16NaN));
}

inline VecU round_f16_vec(VecF r, VecU word) {
  const VecU bits = _mm256_castps_si256(r);
  const VecU abs = _mm256_and_si256(bits, splat(sr::kF32AbsMask));
  const VecU sign = _mm256_and_si256(_mm256_srli_epi32(bits, 16), splat(sr::kF32SignMask >> 16));
  const VecU exponent = _mm256_srli_epi32(abs, sr::kF32MantissaBits);
  const VecU low_normal =
      _mm256_srli_epi32(_mm256_sub_epi32(abs, splat(sr::kF16ExponentShift << sr::kF32MantissaBits)),
                        sr::kF16DroppedBits);
  const VecU frac_normal = _mm256_slli_epi32(_mm256_and_si256(abs, splat(sr::kF16DroppedMask)),
                                             32 - sr::kF16DroppedBits);
  const VecU significand =
      _mm256_or_si256(_mm256_and_si256(abs, splat(sr::kF32MantissaMask)), splat(sr::kF32HiddenBit));
  const VecU shift = _mm256_sub_epi32(splat(sr::kF16SubnormalShiftBase), exponent);
  // Variable shifts by 32 or more (or by a "negative" count) give 0.
  const VecU low_sub = _mm256_srlv_epi32(significand, shift);
  const VecU frac_sub =
      _mm256_or_si256(_mm256_sllv_epi32(significand, _mm256_sub_epi32(splat(32), shift)),
                      _mm256_srlv_epi32(significand, _mm256_sub_epi32(shift, splat(32))));
  // Exponents and magnitudes are below 2**31: signed comparisons order them correctly.
  const VecU normal = _mm256_cmpgt_epi32(exponent, splat(sr::kF16FirstNormal - 1));
  const VecU over = _mm256_cmpgt_epi32(exponent, splat(sr::kF16Overflow - 1));
  const VecU nan = _mm256_cmpgt_epi32(abs, splat(sr::kF32Inf));
  const VecU low_over = select(nan, splat(sr::kF16Inf), splat(sr::kF16QuietNaN));
  const VecU low = select(over, select(normal, low_sub, low_normal), low_over);
  const VecU frac = _mm256_andnot_si256(over, select(normal, frac_sub, frac_normal));
  // word < frac, unsigned: max(word, frac) differs from word. The all-ones mask is -1.
  const VecU not_up = _mm256_cmpeq_epi32(_mm256_max_epu32(word, frac), word);
  const VecU up = _mm256_xor_si256(not_up, splat(0xFFFFFFFFu));
  return _mm256_or_si256(sign, _mm256_sub_epi32(low, up));
}

// 2 * kLanes 16-bit results from two vectors of 32-bit ones (packus works per 128-bit lane).
inline void store_bits(void* p, VecU a, VecU b) {
  const VecU packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  _mm256_storeu_si256(static_cast<__m256i*>(p), packed);
}
#endif

#ifdef FUSED_EMA_SR_VECTORIZED
// The words of kLanes groups from `group` on: words[k] holds those of elements
// 4 * group + k * kLanes .. + kLanes - 1, in order.
inline void block_words(VecU words[4], uint64_t group, const SrStream& st) {
#if defined(CPU_CAPABILITY_AVX512)
  VecU c0 = _mm512_add_epi32(splat(sr::lo32(group)), lane_groups());
#else
  VecU c0 = _mm256_add_epi32(splat(sr::lo32(group)), lane_groups());
#endif
  VecU c1 = splat(sr::hi32(group));
  VecU c2 = splat(st.key);
  VecU c3 = splat(sr::lo32(st.step));
  uint32_t k0 = sr::lo32(st.seed) ^ sr::hi32(st.step);
  uint32_t k1 = sr::hi32(st.seed);
  const VecU m0 = splat(sr::kPhiloxM0);
  const VecU m1 = splat(sr::kPhiloxM1);
  for (int round = 0; round < sr::kPhiloxRounds; ++round) {
    VecU hi0, lo0, hi1, lo1;
    mulhilo(c0, m0, hi0, lo0);
    mulhilo(c2, m1, hi1, lo1);
    c0 = vxor(vxor(hi1, c1), splat(k0));
    c1 = lo1;
    c2 = vxor(vxor(hi0, c3), splat(k1));
    c3 = lo0;
    k0 += sr::kPhiloxW0;
    k1 += sr::kPhiloxW1;
  }
  // In-lane 4x4 transposes: vector k gets, per 128-bit lane, one group's 4 words in order.
  const VecU t0 = unpacklo32(c0, c1);
  const VecU t1 = unpackhi32(c0, c1);
  const VecU t2 = unpacklo32(c2, c3);
  const VecU t3 = unpackhi32(c2, c3);
  words[0] = unpacklo64(t0, t2);
  words[1] = unpackhi64(t0, t2);
  words[2] = unpacklo64(t1, t3);
  words[3] = unpackhi64(t1, t3);
}

template <typename E>
VecU round_vec(VecF r, VecU word) {
  if constexpr (std::is_same_v<E, c10::BFloat16>) {
    return round_bf16_vec(r, word);
  } else {
    return round_f16_vec(r, word);
  }
}
#endif

template <typename E, typename S, bool kSmallWeight>
void sr_range(E* ema, const S* src, int64_t n, float coeff, const SrStream& st, uint64_t first) {
  int64_t i = 0;
#ifdef FUSED_EMA_SR_VECTORIZED
  using Vec = at::vec::Vectorized<float>;
  static_assert(Vec::size() == kLanes);
  constexpr int64_t kBlock = sr::kWordsPerCall * kLanes;
  const auto head = std::min<int64_t>(
      n, static_cast<int64_t>((sr::kWordsPerCall - first % sr::kWordsPerCall) % sr::kWordsPerCall));
  sr_scalar<E, S, kSmallWeight>(ema, src, head, coeff, st, first);
  i = head;
  const Vec vcoeff(coeff);
  for (; i + kBlock <= n; i += kBlock) {
    const uint64_t group = (first + static_cast<uint64_t>(i)) / sr::kWordsPerCall;
    if (sr::lo32(group) > UINT32_MAX - kLanes) {
      // The block's group counters carry into their high word: rare, and left to the scalar path.
      sr_scalar<E, S, kSmallWeight>(ema + i, src + i, kBlock, coeff, st, first + i);
      continue;
    }
    VecU words[4];
    block_words(words, group, st);
    Vec e[4], s[4];
    load2(ema + i, e[0], e[1]);
    load2(ema + i + 2 * kLanes, e[2], e[3]);
    load2(src + i, s[0], s[1]);
    load2(src + i + 2 * kLanes, s[2], s[3]);
    VecU out[4];
    for (int k = 0; k < 4; ++k) {
      const Vec r = at::vec::fmadd(vcoeff, s[k] - e[k], kSmallWeight ? e[k] : s[k]);
      out[k] = round_vec<E>(static_cast<VecF>(r), words[k]);
    }
    store_bits(ema + i, out[0], out[1]);
    store_bits(ema + i + 2 * kLanes, out[2], out[3]);
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
    const uint64_t first = st.offset + static_cast<uint64_t>(begin);
    if (std::abs(w) < 0.5f) {
      sr_range<E, S, true>(e, s, end - begin, w, st, first);
    } else {
      sr_range<E, S, false>(e, s, end - begin, w - 1.0f, st, first);
    }
  } else {
    lerp_span<E, S>(ema, src, begin, end, weight);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu
