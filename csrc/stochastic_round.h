// Stochastic rounding (SR) of float lerp results to bfloat16/float16, with a counter-based random
// stream shared by the host and the device: integer operations only, so the CPU and CUDA kernels
// produce the same bits. No torch headers (plain nvcc compiles it in tests).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace fused_ema::sr {

FUSED_EMA_HOST_DEVICE inline uint32_t lo32(uint64_t x) { return static_cast<uint32_t>(x); }
FUSED_EMA_HOST_DEVICE inline uint32_t hi32(uint64_t x) { return static_cast<uint32_t>(x >> 32); }

// splitmix64's output function (Steele, Lea and Flood), applied to x plus its increment.
FUSED_EMA_HOST_DEVICE inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The part of every pair key that the seed and step give, once per step.
FUSED_EMA_HOST_DEVICE inline uint64_t step_key(uint64_t seed, uint64_t step) {
  return mix64(mix64(seed) ^ step);
}

// The 64-bit key of element pairs hi * 2**32 .. hi * 2**32 + 2**32 - 1 of tensor `key` at a
// step. Full mixes, once per span (CPU) or block (CUDA), so the per-pair hash below can be cheap
// and its pair counter 32 bits wide.
FUSED_EMA_HOST_DEVICE inline uint64_t pair_key(uint64_t step_key, uint32_t key, uint32_t hi) {
  return mix64(step_key ^ (static_cast<uint64_t>(hi) << 32 | key));
}

// Wellons' lowbias32 (hash-prospector), hi32(k) of a pair key xored in between its two
// multiplies. A template so that the CPU kernels run this very code on vectors of pairs (GCC
// vector types, whose U * uint32_t and U >> int are lane-wise).
template <typename U>
FUSED_EMA_HOST_DEVICE inline U lowbias32(U x, uint32_t k1) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= (x >> 15) ^ k1;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

// Consecutive pairs' hash inputs are this far apart (a Weyl sequence): lowbias32 of plain
// counters leaves words 2**k pairs apart detectably correlated (tests/test_sr_stream_quality.py).
constexpr uint32_t kPairStep = 0x9E3779B9u;

// The 32 random bits of pair `lo` under pair_key `k`: element 2p takes the low 16, 2p + 1 the
// high 16.
FUSED_EMA_HOST_DEVICE inline uint32_t pair_bits(uint32_t lo, uint64_t k) {
  return lowbias32(lo * kPairStep + lo32(k), hi32(k));
}

// The 16 random bits of element `e` (its index in the FULL tensor: a shard's offset plus its local
// index) of tensor `key`, at `step`, under `seed`: of pair p = e / 2, bits 16 * (e % 2) and up of
// pair_bits(lo32(p), pair_key(step_key(seed, step), key, hi32(p))). A word depends on nothing
// else, so results do not depend on threads, chunking, the order of the tensor list, the device,
// or how a tensor is sharded (given each shard's offset).
FUSED_EMA_HOST_DEVICE inline uint32_t element_word(uint64_t seed, uint64_t step, uint32_t key,
                                                   uint64_t e) {
  const uint64_t p = e >> 1;
  const uint64_t k = pair_key(step_key(seed, step), key, hi32(p));
  return (pair_bits(lo32(p), k) >> (16 * (e & 1))) & 0xFFFFu;
}

// A tensor's stream at one step, with the pair key of one block of 2**32 pairs at hand (the block
// of element `first`; recomputed for elements of another).
struct TensorStream {
  uint64_t step;  // step_key(seed, step)
  uint64_t k;     // pair_key(step, key, hi)
  uint32_t key;
  uint32_t hi;

  FUSED_EMA_HOST_DEVICE TensorStream(uint64_t step_key_, uint32_t key_, uint64_t first)
      : step(step_key_),
        k(pair_key(step_key_, key_, hi32(first >> 1))),
        key(key_),
        hi(hi32(first >> 1)) {}

  FUSED_EMA_HOST_DEVICE uint32_t word(uint64_t e) const {
    const uint64_t p = e >> 1;
    const uint64_t pk = hi32(p) == hi ? k : pair_key(step, key, hi32(p));
    return (pair_bits(lo32(p), pk) >> (16 * (e & 1))) & 0xFFFFu;
  }
};

constexpr uint32_t kF32SignMask = 0x80000000u;
constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;
constexpr uint32_t kF32MantissaBits = 23;
constexpr uint32_t kF32HiddenBit = 1u << kF32MantissaBits;
constexpr uint32_t kF32MantissaMask = kF32HiddenBit - 1;

constexpr uint16_t kBF16NaN = 0x7FC0;  // c10's round-to-nearest NaN

// bfloat16 bits of `bits` (a float's bits), `word` an element's 16 random bits: rounded up in
// magnitude with probability equal to the discarded fraction (adding the word carries into the
// kept half exactly that often); NaN rounds to nearest. timm 1.0.31's scheme.
FUSED_EMA_HOST_DEVICE inline uint16_t round_bf16(uint32_t bits, uint32_t word) {
  if ((bits & kF32AbsMask) > kF32Inf) {
    return kBF16NaN;
  }
  return static_cast<uint16_t>((bits + word) >> 16);
}

constexpr uint16_t kF16Inf = 0x7C00;
constexpr uint16_t kF16QuietNaN = 0x7E00;  // c10's round-to-nearest NaN (sign kept)
constexpr uint32_t kF16MantissaBits = 10;
constexpr uint32_t kF16DroppedBits = kF32MantissaBits - kF16MantissaBits;
constexpr uint32_t kF16DroppedMask = (1u << kF16DroppedBits) - 1;
// Biased float exponents: float32's bias 127 minus float16's bias 15 turns one into the other.
constexpr uint32_t kF16ExponentShift = 127 - 15;
// Float exponents of the smallest float16 normal and of 2**16 (beyond the largest finite half).
constexpr uint32_t kF16FirstNormal = kF16ExponentShift + 1;
constexpr uint32_t kF16Overflow = kF16ExponentShift + 31;
// 2**-24, the float16 subnormal step, has float exponent 103; at exponent x a float's 24-bit
// significand sits (126 - x) bits to the left of the step's units.
constexpr uint32_t kF16SubnormalShiftBase = 126;

// The float16 below |value| in magnitude (`low`, its bits) and the distance to it as a fraction
// of the step to the next float16 above, in units of 2**-32 (`frac`; truncated below that).
struct HalfBracket {
  uint32_t low;
  uint32_t frac;
};

FUSED_EMA_HOST_DEVICE inline HalfBracket half_bracket(uint32_t abs_bits) {
  const uint32_t exponent = abs_bits >> kF32MantissaBits;
  if (exponent >= kF16Overflow) {
    // |value| >= 2**16 (or inf, NaN): round to nearest gives inf (NaN stays NaN).
    return {abs_bits > kF32Inf ? kF16QuietNaN : kF16Inf, 0u};
  }
  if (exponent >= kF16FirstNormal) {
    return {(abs_bits - (kF16ExponentShift << kF32MantissaBits)) >> kF16DroppedBits,
            (abs_bits & kF16DroppedMask) << (32 - kF16DroppedBits)};
  }
  // A float16 subnormal (or zero): count in units of 2**-24. Float subnormals (exponent 0) are
  // below 2**-126 and their fraction of a step is below 2**-100: zero here.
  const uint32_t significand = (abs_bits & kF32MantissaMask) | kF32HiddenBit;
  const uint32_t shift = kF16SubnormalShiftBase - exponent;  // >= 14
  const uint32_t low = shift < 32 ? significand >> shift : 0u;
  uint32_t frac = 0;
  if (shift <= 32) {
    frac = significand << (32 - shift);
  } else if (shift < 64) {
    frac = significand >> (shift - 32);
  }
  return {low, frac};
}

// float16 bits of `bits` (a float's bits), `word` an element's 16 random bits: the float16 above
// |value| with probability equal to its distance from the one below, over the step between them,
// truncated to 2**-16 (exact for float16 normals, which drop 13 bits of a float; a float16
// subnormal may drop more), else the one below.
// Covers normals and subnormals; NaN and inf are kept, |value| >= 2**16 gives inf and values
// beyond the largest finite half may round to inf, as round-to-nearest would.
FUSED_EMA_HOST_DEVICE inline uint16_t round_f16(uint32_t bits, uint32_t word) {
  const HalfBracket b = half_bracket(bits & kF32AbsMask);
  const uint32_t up = word < (b.frac >> 16) ? 1u : 0u;
  return static_cast<uint16_t>(((bits & kF32SignMask) >> 16) | (b.low + up));
}

}  // namespace fused_ema::sr
