// The (ema dtype, src dtype) pairs of fused_ema::lerp_, listed once: PairKind, kPairs, the CPU
// span kernels, the CUDA launchers and _C.DTYPE_PAIRS are all derived from this list. No torch
// headers, so that plain nvcc can compile the CUDA device code that includes it.
#pragma once

#include <cstdint>

// X(PairKind, ema c10::ScalarType, src c10::ScalarType, ema type tag, src type tag). A tag names
// a member of BackendTypes, each backend's own C++ type (c10::BFloat16 on the CPU, __nv_bfloat16
// on CUDA, ...).
#define FUSED_EMA_FOR_EACH_DTYPE_PAIR(X)       \
  X(kF32F32, Float, Float, f32, f32)           \
  X(kF32BF16, Float, BFloat16, f32, bf16)      \
  X(kF32F16, Float, Half, f32, f16)            \
  X(kBF16BF16, BFloat16, BFloat16, bf16, bf16) \
  X(kF16F16, Half, Half, f16, f16)             \
  X(kF64F64, Double, Double, f64, f64)         \
  X(kBF16F32, BFloat16, Float, bf16, f32)      \
  X(kF16F32, Half, Float, f16, f32)

namespace fused_ema {

// A backend's C++ types by the list's type tags: Types::bf16 is its bfloat16.
template <typename F32, typename F64, typename BF16, typename F16>
struct BackendTypes {
  using f32 = F32;
  using f64 = F64;
  using bf16 = BF16;
  using f16 = F16;
};

// Tables derived from the list follow PairKind's order by construction, so a kind indexes them.
#define FUSED_EMA_PAIR_KIND(kind, ...) kind,
enum class PairKind : uint8_t { FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_PAIR_KIND) };
#undef FUSED_EMA_PAIR_KIND

#define FUSED_EMA_PAIR_COUNT(...) +1
constexpr int kNumPairKinds = 0 FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_PAIR_COUNT);
#undef FUSED_EMA_PAIR_COUNT
}  // namespace fused_ema
