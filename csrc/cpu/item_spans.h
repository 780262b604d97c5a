// The CPU kernels' walk over many items (pairs of lerp_, rows of lerp_many_, tensors of bema_):
// one flat range of elements that a single at::parallel_for splits evenly, with hand prefetching
// of the items ahead. Shared by lerp_cpu.cpp and bema_cpu.cpp.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../lerp_plan.h"

namespace fused_ema::cpu {

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

// Calls span(p, begin, end) over the elements of items 0 .. count-1 (item p has numel(p) of
// them): one flat range that a single at::parallel_for splits evenly, `grain` elements at least a
// thread. prefetch(p) runs `ahead` items before item p.
template <typename Numel, typename Prefetch, typename Span>
void for_each_item_span(size_t count, const Numel& numel, int64_t grain, size_t ahead,
                        const Prefetch& prefetch, const Span& span) {
  Scratch<int64_t, 0> offsets_scratch;
  std::vector<int64_t>& offsets = offsets_scratch.vec;
  offsets.resize(count + 1);
  offsets[0] = 0;
  for (size_t p = 0; p < count; ++p) {
    offsets[p + 1] = offsets[p] + numel(p);
  }
  at::parallel_for(0, offsets.back(), grain, [&](int64_t begin, int64_t end) {
    auto p = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) -
                                 offsets.begin() - 1);
    for (int64_t pos = begin; pos < end; ++p) {
      if (p + ahead < count) {
        prefetch(p + ahead);
      }
      const int64_t stop = std::min(end, offsets[p + 1]);
      span(p, pos - offsets[p], stop - offsets[p]);
      pos = stop;
    }
  });
}

}  // namespace fused_ema::cpu
