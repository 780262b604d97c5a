// The (ema dtype, src dtype) pairs that fused_ema::lerp_ supports, shared by every backend.
// Mixed pairs feed a float32 EMA from bfloat16/float16 weights without a temporary copy.
#pragma once

#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace fused_ema {

enum class PairKind : uint8_t { kF32F32, kF32BF16, kF32F16, kBF16BF16, kF16F16, kF64F64 };

constexpr int kNumPairKinds = 6;

struct PairInfo {
  PairKind kind;
  c10::ScalarType ema;
  c10::ScalarType src;
};

constexpr std::array<PairInfo, kNumPairKinds> kPairs = {{
    {PairKind::kF32F32, c10::ScalarType::Float, c10::ScalarType::Float},
    {PairKind::kF32BF16, c10::ScalarType::Float, c10::ScalarType::BFloat16},
    {PairKind::kF32F16, c10::ScalarType::Float, c10::ScalarType::Half},
    {PairKind::kBF16BF16, c10::ScalarType::BFloat16, c10::ScalarType::BFloat16},
    {PairKind::kF16F16, c10::ScalarType::Half, c10::ScalarType::Half},
    {PairKind::kF64F64, c10::ScalarType::Double, c10::ScalarType::Double},
}};

inline std::optional<PairKind> pair_kind(c10::ScalarType ema, c10::ScalarType src) {
  for (const auto& pair : kPairs) {
    if (pair.ema == ema && pair.src == src) {
      return pair.kind;
    }
  }
  return std::nullopt;
}

// The name Python users know a dtype by (torch.float32 rather than c10's "Float").
inline std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return "float32";
    case c10::ScalarType::Double:
      return "float64";
    case c10::ScalarType::Half:
      return "float16";
    case c10::ScalarType::BFloat16:
      return "bfloat16";
    case c10::ScalarType::Long:
      return "int64";
    case c10::ScalarType::Int:
      return "int32";
    case c10::ScalarType::Short:
      return "int16";
    case c10::ScalarType::Char:
      return "int8";
    case c10::ScalarType::Byte:
      return "uint8";
    case c10::ScalarType::Bool:
      return "bool";
    case c10::ScalarType::ComplexFloat:
      return "complex64";
    case c10::ScalarType::ComplexDouble:
      return "complex128";
    default:
      return c10::toString(type);
  }
}

// "(float32, float32), (float32, bfloat16), ..." for error messages.
inline std::string supported_pairs_text() {
  std::string text;
  for (const auto& pair : kPairs) {
    if (!text.empty()) {
      text += ", ";
    }
    text += "(" + dtype_name(pair.ema) + ", " + dtype_name(pair.src) + ")";
  }
  return text;
}

}  // namespace fused_ema
