// The (ema dtype, src dtype) pairs that fused_ema::lerp_ supports (dtype_pair_list.h) as torch
// scalar types, and the dtype names users know. Mixed pairs feed a float32 EMA from
// bfloat16/float16 weights without a temporary copy.
#pragma once

#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

#include "dtype_pair_list.h"

namespace fused_ema {

struct PairInfo {
  PairKind kind;
  c10::ScalarType ema;
  c10::ScalarType src;
};

#define FUSED_EMA_PAIR_INFO(kind, ema, src, ...) \
  {PairKind::kind, c10::ScalarType::ema, c10::ScalarType::src},
constexpr PairInfo kPairs[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_PAIR_INFO)};
#undef FUSED_EMA_PAIR_INFO

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
