// The CPU span kernels alone, one thread: round to nearest against stochastic rounding for float16
// and bfloat16 EMAs of same-dtype sources, in cache (a few thousand elements) or from memory
// (10**8), on weights of a given scale (0.02, ViT-like: one float16 block in 14 holds a subnormal).
// Edit a copy of csrc/ and point -I at it to time a variant. AVX2 by default; AVX-512 with
// -DSPAN_MICRO_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq added:
//   g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -Icsrc -I"$(python -c 'import torch.utils.cpp_extension
//   as c; print(c.include_paths()[0])')" benchmarks/sr_span_micro.cpp -o /tmp/sr_span_micro
//   /tmp/sr_span_micro [elements, default 2048] [scale, default 1]
#ifdef SPAN_MICRO_AVX512
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#else
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cpu/lerp_span.h"

using namespace fused_ema::cpu::CPU_CAPABILITY;

constexpr int kRounds = 15;
constexpr double kElementsPerRun = 1e7;

// The best of kRounds runs, in ns an element, of one kernel over n elements of fresh normals of
// standard deviation `scale`.
template <typename T>
double best_ns(bool stochastic, int n, float scale) {
  std::vector<T> ema(n), src(n);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  for (int i = 0; i < n; ++i) {
    src[i] = T(scale * normal(gen));
    ema[i] = T(static_cast<float>(src[i]) + 0.01f * scale * normal(gen));
  }
  fused_ema::cpu::SrStream stream{0, 0, 0, 7};
  const int calls = static_cast<int>(kElementsPerRun / n) + 1;
  double best = 1e30;
  for (int r = 0; r < kRounds; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c) {
      stream.step = static_cast<uint64_t>(c);
      if (stochastic) {
        lerp_stochastic_span<T, T>(ema.data(), src.data(), 0, n, n, 1e-4, stream);
      } else {
        lerp_span<T, T>(ema.data(), src.data(), 0, n, n, 1e-4);
      }
    }
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count() / calls / n * 1e9);
  }
  return best;
}

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2048;
  const float scale = argc > 2 ? std::strtof(argv[2], nullptr) : 1.0f;
  const double h_rn = best_ns<c10::Half>(false, n, scale);
  const double h_sr = best_ns<c10::Half>(true, n, scale);
  const double b_rn = best_ns<c10::BFloat16>(false, n, scale);
  const double b_sr = best_ns<c10::BFloat16>(true, n, scale);
  std::printf("%d elements: float16 RN %.3f SR %.3f ns (%.2fx); bfloat16 RN %.3f SR %.3f (%.2fx)\n",
              n, h_rn, h_sr, h_sr / h_rn, b_rn, b_sr, b_sr / b_rn);
}
