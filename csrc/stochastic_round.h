// Stochastic rounding (SR) of float lerp results to bfloat16/float16, with a counter-based random
// stream (Philox4x32-10) shared by the host and the device: integer operations only, so the CPU
// and CUDA kernels produce the same bits. No torch headers (plain nvcc compiles it in tests).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace fused_ema::sr {

// Philox4x32-10 as in Random123, curand and PyTorch.
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;
// One Philox call yields a word for each of this many consecutive elements.
constexpr int64_t kWordsPerCall = 4;

struct Words {
  uint32_t w[kWordsPerCall];
};

FUSED_EMA_HOST_DEVICE inline uint32_t lo32(uint64_t x) { return static_cast<uint32_t>(x); }
FUSED_EMA_HOST_DEVICE inline uint32_t hi32(uint64_t x) { return static_cast<uint32_t>(x >> 32); }

FUSED_EMA_HOST_DEVICE inline Words philox4x32_10(Words ctr, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * ctr.w[0];
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * ctr.w[2];
    ctr = {{hi32(p1) ^ ctr.w[1] ^ k0, lo32(p1), hi32(p0) ^ ctr.w[3] ^ k1, lo32(p0)}};
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return ctr;
}

// The random words of elements 4g .. 4g+3 of a tensor with key `key`, at step `step`, under
// `seed`. Element e (its index in the FULL tensor: a shard's offset plus its local index) gets
//   Philox4x32-10(counter = (lo32(e/4), hi32(e/4), key, lo32(step)),
//                 key = (lo32(seed) ^ hi32(step), hi32(seed)))[e % 4].
// A word depends on nothing else, so results do not depend on threads, chunking, the order of
// the tensor list, the device, or how a tensor is sharded (given each shard's offset).
FUSED_EMA_HOST_DEVICE inline Words group_words(uint64_t seed, uint64_t step, uint32_t key,
                                               uint64_t group) {
  return philox4x32_10({{lo32(group), hi32(group), key, lo32(step)}}, lo32(seed) ^ hi32(step),
                       hi32(seed));
}

// Word `lane` of a group, by selects: an indexed load would put the words in GPU local memory.
FUSED_EMA_HOST_DEVICE inline uint32_t word_at(const Words& words, int lane) {
  uint32_t out = words.w[0];
  for (int j = 1; j < kWordsPerCall; ++j) {
    out = lane == j ? words.w[j] : out;
  }
  return out;
}

FUSED_EMA_HOST_DEVICE inline uint32_t element_word(uint64_t seed, uint64_t step, uint32_t key,
                                                   uint64_t element) {
  return word_at(group_words(seed, step, key, element / kWordsPerCall),
                 static_cast<int>(element % kWordsPerCall));
}

constexpr uint32_t kF32SignMask = 0x80000000u;
constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;
constexpr uint32_t kF32MantissaBits = 23;
constexpr uint32_t kF32HiddenBit = 1u << kF32MantissaBits;
constexpr uint32_t kF32MantissaMask = kF32HiddenBit - 1;

constexpr uint16_t kBF16NaN = 0x7FC0;  // c10's round-to-nearest NaN
constexpr uint32_t kBF16DroppedMask = 0xFFFF;

// bfloat16 bits of `bits` (a float's bits): rounded up in magnitude with probability equal to
// the discarded fraction (adding 16 random bits carries into the kept half exactly that often);
// NaN rounds to nearest. timm 1.0.31's scheme.
FUSED_EMA_HOST_DEVICE inline uint16_t round_bf16(uint32_t bits, uint32_t word) {
  if ((bits & kF32AbsMask) > kF32Inf) {
    return kBF16NaN;
  }
  return static_cast<uint16_t>((bits + (word & kBF16DroppedMask)) >> 16);
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

// float16 bits of `bits` (a float's bits): the float16 above |value| with probability equal to
// its distance from the one below, over the step between them (to 2**-32), else the one below.
// Covers normals and subnormals; NaN and inf are kept, |value| >= 2**16 gives inf and values
// beyond the largest finite half may round to inf, as round-to-nearest would.
FUSED_EMA_HOST_DEVICE inline uint16_t round_f16(uint32_t bits, uint32_t word) {
  const HalfBracket b = half_bracket(bits & kF32AbsMask);
  const uint32_t up = word < b.frac ? 1u : 0u;
  return static_cast<uint16_t>(((bits & kF32SignMask) >> 16) | (b.low + up));
}

}  // namespace fused_ema::sr
