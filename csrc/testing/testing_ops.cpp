// Test-only operators, in a library of their own (torch.ops.fused_ema_testing) so that neither
// fused_ema._C nor torch.ops.fused_ema carries them; fused_ema/_ext/testing.py wraps them.
// sr_words and stochastic_round let tests compare stochastic_round.h's random stream and rounding
// bit for bit with a Python reference. On torch's stable ABI, built for torch 2.11.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 11) << 48))

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "../refuse.h"
#include "../stochastic_round.h"

#ifndef FUSED_EMA_WITH_CUDA
#define FUSED_EMA_WITH_CUDA 0
#endif

#if FUSED_EMA_WITH_CUDA
namespace fused_ema::cuda {
bool small_params(int set);  // set < 0: read only; returns the previous setting
}  // namespace fused_ema::cuda
#endif

namespace fused_ema::testing {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// sr_words(seed, step, key, offset, n) -> int32 tensor: the 16 random bits of elements offset ..
// offset + n - 1 of tensor `key` at (seed, step). seed, step and offset are taken modulo 2**64
// (two's complement), key modulo 2**32.
Tensor sr_words(int64_t seed, int64_t step, int64_t key, int64_t offset, int64_t n) {
  if (n < 0) {
    refuse("n must be >= 0, got ", n);
  }
  const int64_t size[] = {n};
  Tensor out = torch::stable::empty(size, ScalarType::Int);
  int32_t* words = out.mutable_data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    words[i] = static_cast<int32_t>(
        sr::element_word(static_cast<uint64_t>(seed), static_cast<uint64_t>(step),
                         static_cast<uint32_t>(key), static_cast<uint64_t>(offset + i)));
  }
  return out;
}

// stochastic_round(values: float32 CPU tensor, "bfloat16" | "float16", seed, step, key, offset)
// -> tensor: element i rounded with the word of element offset + i. seed, step and offset are
// taken modulo 2**64 (two's complement), key modulo 2**32.
Tensor stochastic_round(Tensor values_in, std::string dtype, int64_t seed, int64_t step,
                        int64_t key, int64_t offset) {
  if (values_in.scalar_type() != ScalarType::Float || !values_in.is_cpu()) {
    refuse("values must be a float32 CPU tensor");
  }
  const Tensor values = torch::stable::contiguous(values_in);
  const bool bf16 = dtype == "bfloat16";
  if (!bf16 && dtype != "float16") {
    refuse("dtype must be 'bfloat16' or 'float16', got ", dtype);
  }
  Tensor out = torch::stable::new_empty(values, values.sizes(),
                                        bf16 ? ScalarType::BFloat16 : ScalarType::Half);
  const float* in = values.const_data_ptr<float>();
  auto* bits = static_cast<uint16_t*>(out.mutable_data_ptr());
  const auto offset_u = static_cast<uint64_t>(offset);
  for (int64_t i = 0; i < values.numel(); ++i) {
    uint32_t x = 0;
    std::memcpy(&x, in + i, sizeof(x));
    const uint32_t word = sr::element_word(static_cast<uint64_t>(seed), static_cast<uint64_t>(step),
                                           static_cast<uint32_t>(key), offset_u + i);
    bits[i] = bf16 ? sr::round_bf16(x, word) : sr::round_f16(x, word);
  }
  return out;
}

// Keeps CUDA launches at 4 KB of parameters (set = 1) or lets them take 32 KB where the device
// allows (set = 0) and returns the previous setting; set < 0 only reads it.
bool cuda_small_params(int64_t set) {
#if FUSED_EMA_WITH_CUDA
  return fused_ema::cuda::small_params(set < 0 ? -1 : static_cast<int>(set != 0));
#else
  (void)set;
  return false;
#endif
}

}  // namespace
}  // namespace fused_ema::testing

STABLE_TORCH_LIBRARY(fused_ema_testing, m) {
  m.def("sr_words(int seed, int step, int key, int offset, int n) -> Tensor");
  m.def(
      "stochastic_round(Tensor values, str dtype, int seed, int step, int key, int offset) -> "
      "Tensor");
  m.def("cuda_small_params(int set=-1) -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(fused_ema_testing, CompositeExplicitAutograd, m) {
  m.impl("sr_words", TORCH_BOX(&fused_ema::testing::sr_words));
  m.impl("stochastic_round", TORCH_BOX(&fused_ema::testing::stochastic_round));
  m.impl("cuda_small_params", TORCH_BOX(&fused_ema::testing::cuda_small_params));
}
