// CPU kernel of fused_ema::bema_: the per-ISA bema span kernels (bema_span.h) over every tensor's
// four views, one flat range of elements that a single at::parallel_for splits evenly, each source
// element read once and each target written in the same pass (no temporaries).
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../bema_op.h"
#include "cpu_isa.h"
#include "item_spans.h"

namespace fused_ema::cpu {
namespace {

// Each element moves up to four values (src, ema, theta0, out): a thread's least share is a
// quarter of lerp_'s.
constexpr int64_t kBemaGrain = kGrainSize / 4;

// The first line of each of an item's views: the data of many small tensors lies scattered.
[[gnu::always_inline]] inline void prefetch_item(const BemaItem& item) {
  __builtin_prefetch(item.src);
  __builtin_prefetch(item.ema, 1);
  __builtin_prefetch(item.theta0, 1);
  __builtin_prefetch(item.out, 1);
}

void run_bema_plan(const DevicePlan& plan, const std::vector<BemaItem>& items,
                   const BemaWeights& weights) {
  // bema_op.cpp hands a CPU plan only host weights (a CPU tensor is read there).
  TORCH_INTERNAL_ASSERT(weights.device_tensor == nullptr);
  if (!items.empty()) {
    const SpanKernels& kernels = active_span_kernels();
    for_each_item_span(
        items.size(), [&](size_t p) { return items[p].numel; }, kBemaGrain, kPrefetchPairs,
        [&](size_t p) { prefetch_item(items[p]); },
        [&](size_t p, int64_t begin, int64_t end) {
          const BemaItem& item = items[p];
          kernels.bema[static_cast<int>(item.kind)](item.ema, item.theta0, item.out, item.src,
                                                    begin, end, weights.values);
        });
  }
  plan.write_back();
}

[[maybe_unused]] const bool kRegistered =
    register_bema_runner(c10::DeviceType::CPU, &run_bema_plan);

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CPU, m) { m.impl("bema_", &bema_op); }

}  // namespace fused_ema::cpu
