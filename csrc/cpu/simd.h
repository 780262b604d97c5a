// The vectors of the CPU span kernels, for the instruction set lerp_span_*.cpp compiles them for:
// float and double vectors (GCC vector types, so the kernels use the scalar code's operators),
// and 16-bit floats loaded and stored through them. Rounding to nearest even, NaN included, as
// c10's scalar conversions, so a vector body and its scalar tail agree bit for bit.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../prefetch.h"
#include "../stochastic_round.h"

namespace fused_ema::cpu {
inline namespace CPU_CAPABILITY {

// static_cast<E>(v) for the scalar tails, NaN as the baseline build writes it: c10::Half converts
// with F16C where the build has it, which keeps the top of a NaN's payload.
template <typename E, typename T>
inline E narrow(T v) {
  if constexpr (std::is_same_v<E, c10::Half>) {
    if (std::isnan(v)) {
      return E((std::signbit(v) ? 0x8000 : 0) | sr::kF16QuietNaN, E::from_bits());
    }
  }
  return static_cast<E>(v);
}

// How far ahead of a span's vector loop its data is prefetched, in bytes of the EMA (the same
// elements of the source). The hardware prefetcher alone keeps one thread's loop well short
// of the memory's bandwidth, and a branch on data still in flight (stochastic rounding's float16
// subnormals) then stalls it: one thread, 10**8 float16 elements, round to nearest 0.33 -> 0.22 ns
// an element (benchmarks/sr_span_micro.cpp); two threads, 16-bit lists 20-30% faster, float32 ones
// within noise (benchmarks/results/prefetch-ab_*).
constexpr int64_t kPrefetchAheadBytes = 4096;

// Prefetches elements [i, i + kCount) of `read` and of the `written` arrays, kPrefetchAheadBytes
// of E ahead, when they lie before `reach` (the tensor's end: past it are other tensors', if
// anything).
template <int64_t kCount, typename S, typename E, typename... Es>
[[gnu::always_inline]] inline void prefetch_ahead(int64_t i, int64_t reach, const S* read,
                                                  const E* written, const Es*... more_written) {
  constexpr auto kAhead = kPrefetchAheadBytes / static_cast<int64_t>(sizeof(E));
  if (i + kAhead + kCount > reach) {
    return;
  }
  prefetch_object<kCount * sizeof(S)>(read + i + kAhead);
  prefetch_object<kCount * sizeof(E), 1>(written + i + kAhead);
  (prefetch_object<kCount * sizeof(Es), 1>(more_written + i + kAhead), ...);
}

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define FUSED_EMA_VECTORIZED 1
#include <immintrin.h>

namespace fused_ema::cpu {
inline namespace CPU_CAPABILITY {

constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

#if defined(CPU_CAPABILITY_AVX512)
using VecF = __m512;
using VecD = __m512d;
using VecU = __m512i;
using HalfVec = __m256i;  // one VecF's worth of 16-bit values

inline VecF splat(float x) { return _mm512_set1_ps(x); }
inline VecD splat(double x) { return _mm512_set1_pd(x); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecD fmadd(VecD a, VecD b, VecD c) { return _mm512_fmadd_pd(a, b, c); }
inline HalfVec load_halves(const void* p) {
  return _mm256_loadu_si256(static_cast<const HalfVec*>(p));
}
inline VecU widen_halves(HalfVec h) { return _mm512_cvtepu16_epi32(h); }
inline VecF half_to_float(HalfVec h) { return _mm512_cvtph_ps(h); }
inline HalfVec float_to_half(VecF a) { return _mm512_cvtps_ph(a, kRoundNearest); }
// The 16-bit words of 2 * kLanes elements' bits (pairs of them in each 32-bit lane, in in-lane
// order), zero-extended into two vectors in element order: stochastic rounding's hash words.
inline void widen_words(VecU bits, VecU& lo, VecU& hi) {
  lo = _mm512_unpacklo_epi16(bits, _mm512_setzero_si512());
  hi = _mm512_unpackhi_epi16(bits, _mm512_setzero_si512());
}
// 2 * kLanes 16-bit results, from two vectors of 32-bit lanes below 2**16. packus works per
// 128-bit lane, the permute puts the lanes back in order: 2 shuffles where 2 vpmovdw take 4.
inline void store_bits(void* p, VecU a, VecU b) {
  const VecU order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
  _mm512_storeu_si512(p, _mm512_permutexvar_epi64(order, _mm512_packus_epi32(a, b)));
}
inline void stream_store(float* p, VecF a) { _mm512_stream_ps(p, a); }
// Whether a or b holds a NaN: one unordered compare checks both.
inline bool any_nan(VecF a, VecF b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0; }

#else  // AVX2
using VecF = __m256;
using VecD = __m256d;
using VecU = __m256i;
using HalfVec = __m128i;

inline VecF splat(float x) { return _mm256_set1_ps(x); }
inline VecD splat(double x) { return _mm256_set1_pd(x); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecD fmadd(VecD a, VecD b, VecD c) { return _mm256_fmadd_pd(a, b, c); }
inline HalfVec load_halves(const void* p) {
  return _mm_loadu_si128(static_cast<const HalfVec*>(p));
}
inline VecU widen_halves(HalfVec h) { return _mm256_cvtepu16_epi32(h); }
inline VecF half_to_float(HalfVec h) { return _mm256_cvtph_ps(h); }
inline HalfVec float_to_half(VecF a) { return _mm256_cvtps_ph(a, kRoundNearest); }
inline void widen_words(VecU bits, VecU& lo, VecU& hi) {
  lo = _mm256_unpacklo_epi16(bits, _mm256_setzero_si256());
  hi = _mm256_unpackhi_epi16(bits, _mm256_setzero_si256());
}
// packus works per 128-bit lane: the permute puts the halves back in order.
inline void store_bits(void* p, VecU a, VecU b) {
  _mm256_storeu_si256(static_cast<VecU*>(p),
                      _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
}
inline void stream_store(float* p, VecF a) { _mm256_stream_ps(p, a); }
inline bool any_nan(VecF a, VecF b) {
  return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0;
}
#endif

constexpr int kLanes = sizeof(VecF) / sizeof(float);
// 32-bit and 16-bit lanes of a vector register, as GCC vector types.
using Lanes = uint32_t __attribute__((vector_size(sizeof(VecU))));
using Words = uint16_t __attribute__((vector_size(sizeof(VecU))));

inline Lanes splat_lanes(uint32_t x) { return Lanes{} + x; }
inline void widen_words(Lanes bits, Lanes& lo, Lanes& hi) {
  VecU l, h;
  widen_words((VecU)bits, l, h);
  lo = (Lanes)l;
  hi = (Lanes)h;
}
inline void store_bits(void* p, Lanes a, Lanes b) { store_bits(p, (VecU)a, (VecU)b); }

// NaN checked once per two vectors (it is rare), so that 16-bit results hold NaN as c10's scalar
// conversions write it, not as the hardware would (which keeps the top of a NaN's payload): the
// lane-wise choice below runs only where `nan` says a vector pair holds one.
inline bool maybe_nan(VecF a, VecF b) { return __builtin_expect(any_nan(a, b), 0); }
inline Lanes nan_lanes(Lanes bits) { return (Lanes)((bits & sr::kF32AbsMask) > sr::kF32Inf); }

// c10::BFloat16's round to nearest even, lane by lane (NaN: 0x7FC0, sign dropped).
inline Lanes round_bf16_nearest(VecF a, bool nan) {
  const Lanes bits = (Lanes)a;
  const Lanes rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return nan ? (nan_lanes(bits) ? splat_lanes(sr::kBF16NaN) : rounded) : rounded;
}

// c10::Half's round to nearest even (NaN: sign | 0x7E00).
inline HalfVec float_to_half_c10(VecF a, bool nan) {
  if (!nan) {
    return float_to_half(a);
  }
  const Lanes bits = (Lanes)a;
  return float_to_half((VecF)(nan_lanes(bits) ? (bits & sr::kF32SignMask) | 0x7FC00000u : bits));
}

// Two vectors' worth of elements, converted from/to 16-bit floats on the way: float and double
// as they are, bfloat16 and float16 to and from float vectors.
template <typename T, typename V>
inline void load2(const T* p, V& a, V& b) {
  std::memcpy(&a, p, sizeof(V));
  std::memcpy(&b, p + sizeof(V) / sizeof(T), sizeof(V));
}
inline void load2(const c10::BFloat16* p, VecF& a, VecF& b) {
  a = (VecF)((Lanes)widen_halves(load_halves(p)) << 16);
  b = (VecF)((Lanes)widen_halves(load_halves(p + kLanes)) << 16);
}
inline void load2(const c10::Half* p, VecF& a, VecF& b) {
  a = half_to_float(load_halves(p));
  b = half_to_float(load_halves(p + kLanes));
}

template <typename T, typename V>
inline void store2(T* p, const V& a, const V& b) {
  std::memcpy(p, &a, sizeof(V));
  std::memcpy(p + sizeof(V) / sizeof(T), &b, sizeof(V));
}

// store2, then a and b become the values stored, read back (16-bit EMAs round).
template <typename T, typename V>
inline void store2_rounded(T* p, V& a, V& b) {
  store2(p, a, b);
}
inline void store2_rounded(c10::BFloat16* p, VecF& a, VecF& b) {
  const bool nan = maybe_nan(a, b);
  const Lanes lo = round_bf16_nearest(a, nan);
  const Lanes hi = round_bf16_nearest(b, nan);
  store_bits(p, lo, hi);
  a = (VecF)(lo << 16);
  b = (VecF)(hi << 16);
}
inline void store2_rounded(c10::Half* p, VecF& a, VecF& b) {
  const bool nan = maybe_nan(a, b);
  const HalfVec lo = float_to_half_c10(a, nan);
  const HalfVec hi = float_to_half_c10(b, nan);
  std::memcpy(p, &lo, sizeof(lo));
  std::memcpy(p + kLanes, &hi, sizeof(hi));
  a = half_to_float(lo);
  b = half_to_float(hi);
}

// The 16-bit stores are store2_rounded's, the values read back unused (so not computed).
inline void store2(c10::BFloat16* p, VecF a, VecF b) { store2_rounded(p, a, b); }
inline void store2(c10::Half* p, VecF a, VecF b) { store2_rounded(p, a, b); }

}  // namespace CPU_CAPABILITY
}  // namespace fused_ema::cpu
#endif
