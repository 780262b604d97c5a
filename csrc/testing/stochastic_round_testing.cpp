// Test-only entry points to stochastic_round.h, so that tests can compare its Philox stream and
// rounding bit for bit with a Python reference: torch.ops.fused_ema_testing.philox and
// stochastic_round (registered in testing_ops.cpp; fused_ema/_ext/testing.py wraps them).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../stochastic_round.h"

namespace fused_ema::testing {

// philox([c0, c1, c2, c3], [k0, k1]) -> [w0, w1, w2, w3]; each word taken modulo 2**32.
std::vector<int64_t> philox(c10::IntArrayRef counter, c10::IntArrayRef key) {
  TORCH_CHECK_VALUE(counter.size() == 4 && key.size() == 2,
                    "philox takes 4 counter words and 2 key words, got ", counter.size(), " and ",
                    key.size());
  sr::Words ctr{};
  for (size_t i = 0; i < 4; ++i) {
    ctr.w[i] = static_cast<uint32_t>(counter[i]);
  }
  const sr::Words out =
      sr::philox4x32_10(ctr, static_cast<uint32_t>(key[0]), static_cast<uint32_t>(key[1]));
  return {out.w[0], out.w[1], out.w[2], out.w[3]};
}

// stochastic_round(values: float32 CPU tensor, "bfloat16" | "float16", seed, step, key, offset)
// -> tensor: element i rounded with the word of element offset + i. seed, step and offset are
// taken modulo 2**64 (two's complement), key modulo 2**32.
at::Tensor stochastic_round(const at::Tensor& values_in, const std::string& dtype, int64_t seed,
                            int64_t step, int64_t key, int64_t offset) {
  const at::Tensor values = values_in.contiguous();
  TORCH_CHECK_VALUE(values.scalar_type() == at::kFloat && values.is_cpu(),
                    "values must be a float32 CPU tensor");
  const bool bf16 = dtype == "bfloat16";
  TORCH_CHECK_VALUE(bf16 || dtype == "float16", "dtype must be 'bfloat16' or 'float16', got ",
                    dtype);
  at::Tensor out =
      at::empty(values.sizes(), values.options().dtype(bf16 ? at::kBFloat16 : at::kHalf));
  const float* in = values.const_data_ptr<float>();
  auto* bits = static_cast<uint16_t*>(out.mutable_data_ptr());
  const auto seed_u = static_cast<uint64_t>(seed);
  const auto step_u = static_cast<uint64_t>(step);
  const auto key_u = static_cast<uint32_t>(key);
  const auto offset_u = static_cast<uint64_t>(offset);
  for (int64_t i = 0; i < values.numel(); ++i) {
    uint32_t x = 0;
    std::memcpy(&x, in + i, sizeof(x));
    const uint32_t word =
        sr::element_word(seed_u, step_u, key_u, offset_u + static_cast<uint64_t>(i));
    bits[i] = bf16 ? sr::round_bf16(x, word) : sr::round_f16(x, word);
  }
  return out;
}

}  // namespace fused_ema::testing
