// CPU kernel of fused_ema::lerp_. All pairs form one flat range of elements and a single
// at::parallel_for splits it evenly, so 20,000 small tensors cost one parallel region, and a
// thread's share may start in one tensor and end in another.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../lerp_op.h"
#include "cpu_isa.h"

namespace fused_ema::cpu {
namespace {

// Elements under which the update stays on the calling thread (ATen's GRAIN_SIZE).
constexpr int64_t kGrainSize = 32768;

// Pairs ahead whose first bytes are prefetched: the data of many small tensors lies scattered
// over the heap, and after a long list has been checked none of it is in the cache.
constexpr size_t kPrefetchPairs = 32;

// Bytes of a pair's data prefetched by hand; past them the hardware prefetcher follows the stream.
constexpr int64_t kPrefetchBytes = 512;

// Every line of [p, p + bytes), for bytes > 0.
template <int kWrite>
[[gnu::always_inline]] inline void prefetch_range(const void* p, int64_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto last = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes) - 1;
  for (uintptr_t line = first; line <= last; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), kWrite);
  }
}

// Every line of the first kPrefetchBytes of a pair's ema and src (a tiny tensor's data is several
// lines, each a miss when only the first was prefetched).
[[gnu::always_inline]] inline void prefetch_data(const FlatPair& pair) {
  const PairInfo& info = kPairs[static_cast<int>(pair.kind)];
  const auto ema_bytes = static_cast<int64_t>(c10::elementSize(info.ema)) * pair.numel;
  const auto src_bytes = static_cast<int64_t>(c10::elementSize(info.src)) * pair.numel;
  prefetch_range<1>(pair.ema, std::min(ema_bytes, kPrefetchBytes));
  prefetch_range<0>(pair.src, std::min(src_bytes, kPrefetchBytes));
}

// Calls span(pair, begin, end) over every pair's elements: one flat range that a single
// at::parallel_for splits evenly.
template <typename Span>
void for_each_span(const std::vector<FlatPair>& pairs, const Span& span) {
  Scratch<int64_t, 0> offsets_scratch;
  std::vector<int64_t>& offsets = offsets_scratch.vec;
  offsets.resize(pairs.size() + 1);
  offsets[0] = 0;
  for (size_t p = 0; p < pairs.size(); ++p) {
    offsets[p + 1] = offsets[p] + pairs[p].numel;
  }
  const bool far = pairs.size() >= kPrefetchFrom;
  at::parallel_for(0, offsets.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    auto p = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) -
                                 offsets.begin() - 1);
    for (int64_t pos = begin; pos < end; ++p) {
      if (p + kPrefetchPairs < pairs.size()) {
        if (far) {
          prefetch_data(pairs[p + kPrefetchPairs]);
        } else {
          __builtin_prefetch(pairs[p + kPrefetchPairs].ema, 1);
          __builtin_prefetch(pairs[p + kPrefetchPairs].src);
        }
      }
      const int64_t stop = std::min(end, offsets[p + 1]);
      span(pairs[p], pos - offsets[p], stop - offsets[p]);
      pos = stop;
    }
  });
}

void run_plan(const DevicePlan& plan, const LerpWeight& weight) {
  // lerp_op.cpp hands a CPU plan only host weights (a CPU tensor weight is read there).
  TORCH_INTERNAL_ASSERT(weight.device_tensor == nullptr);
  // A zero weight leaves every EMA value as it is (ModelEma's skipped steps): touch no memory.
  if (!plan.pairs.empty() && weight.value != 0.0) {
    const SpanKernels& kernels = active_span_kernels();
    for_each_span(plan.pairs, [&](const FlatPair& pair, int64_t begin, int64_t end) {
      kernels.fn[static_cast<int>(pair.kind)](pair.ema, pair.src, begin, end, weight.value);
    });
  }
  plan.write_back();
}

void run_stochastic_plan(const DevicePlan& plan, const LerpWeight& weight,
                         const StochasticRounding& rounding) {
  TORCH_INTERNAL_ASSERT(weight.device_tensor == nullptr && rounding.step_tensor == nullptr);
  if (!plan.pairs.empty() && weight.value != 0.0) {
    const SpanKernels& kernels = active_span_kernels();
    for_each_span(plan.pairs, [&](const FlatPair& pair, int64_t begin, int64_t end) {
      const SrStream stream{rounding.seed, rounding.step,
                            static_cast<uint64_t>(rounding.offsets[pair.index]),
                            static_cast<uint32_t>(rounding.keys[pair.index])};
      kernels.sr[static_cast<int>(pair.kind)](pair.ema, pair.src, begin, end, weight.value, stream);
    });
  }
  plan.write_back();
}

[[maybe_unused]] const bool kRegistered = register_device_runner(c10::DeviceType::CPU, &run_plan);
[[maybe_unused]] const bool kStochasticRegistered =
    register_stochastic_runner(c10::DeviceType::CPU, &run_stochastic_plan);

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CPU, m) {
  m.impl("lerp_", &lerp_op);
  m.impl("lerp_.Tensor", &lerp_op_tensor_weight);
  m.impl("lerp_stochastic_", &lerp_stochastic_op);
}

}  // namespace fused_ema::cpu
