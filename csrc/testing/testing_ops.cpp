// Test-only operators, in a library of their own (torch.ops.fused_ema_testing) so that neither
// fused_ema._C nor torch.ops.fused_ema carries them; fused_ema/_ext/testing.py wraps them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#ifndef FUSED_EMA_WITH_CUDA
#define FUSED_EMA_WITH_CUDA 0
#endif

#if FUSED_EMA_WITH_CUDA
namespace fused_ema::cuda {
bool small_params(int set);  // set < 0: read only; returns the previous setting
}  // namespace fused_ema::cuda
#endif

namespace fused_ema::testing {
// stochastic_round_testing.cpp
at::Tensor sr_words(int64_t seed, int64_t step, int64_t key, int64_t offset, int64_t n);
at::Tensor stochastic_round(const at::Tensor& values, const std::string& dtype, int64_t seed,
                            int64_t step, int64_t key, int64_t offset);

namespace {

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

TORCH_LIBRARY(fused_ema_testing, m) {
  m.def("sr_words(int seed, int step, int key, int offset, int n) -> Tensor",
        &fused_ema::testing::sr_words);
  m.def(
      "stochastic_round(Tensor values, str dtype, int seed, int step, int key, int offset) -> "
      "Tensor",
      &fused_ema::testing::stochastic_round);
  m.def("cuda_small_params(int set=-1) -> bool", &fused_ema::testing::cuda_small_params);
}
