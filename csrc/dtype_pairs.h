// The (ema dtype, src dtype) pairs that fused_ema::lerp_ supports (dtype_pair_list.h) as torch
// scalar types, and the dtype names users know. Mixed pairs feed a float32 EMA from
// bfloat16/float16 weights without a temporary copy.
#pragma once

#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

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
  using c10::ScalarType;
  constexpr std::pair<ScalarType, const char*> kNames[] = {
      {ScalarType::Float, "float32"},
      {ScalarType::Double, "float64"},
      {ScalarType::Half, "float16"},
      {ScalarType::BFloat16, "bfloat16"},
      {ScalarType::Long, "int64"},
      {ScalarType::Int, "int32"},
      {ScalarType::Short, "int16"},
      {ScalarType::Char, "int8"},
      {ScalarType::Byte, "uint8"},
      {ScalarType::Bool, "bool"},
      {ScalarType::ComplexFloat, "complex64"},
      {ScalarType::ComplexDouble, "complex128"}};
  for (const auto& [known, name] : kNames) {
    if (known == type) {
      return name;
    }
  }
  return c10::toString(type);
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
