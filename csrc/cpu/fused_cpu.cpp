// The CPU runner of the fused-op family (fused_op.h): the per-ISA span kernels over one flat range
// of elements that a single parallel_for splits evenly, so 20,000 small tensors cost one
// parallel region, and a thread's share may start in one tensor and end in another.
#include <c10/util/Exception.h>
#include <torch/csrc/stable/ops.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../fused_op.h"
#include "../lerp_plan.h"
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

// Calls span(p, begin, end) over the elements of items 0 .. count-1 (pairs of lerp_, rows of
// lerp_many_, tensors of bema_; item p has numel(p) of them): one flat range that a single
// parallel_for splits evenly, `grain` elements at least a thread. prefetch(p) runs `ahead`
// items before item p.
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
  torch::stable::parallel_for(0, offsets.back(), grain, [&](int64_t begin, int64_t end) {
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

// The first bytes of a pair's ema and (with_src) src: for far lists, whose data has left the
// cache, every line of the first kPrefetchBytes (a tiny tensor's data is several lines, each a
// miss when only the first was prefetched); the first line otherwise.
[[gnu::always_inline]] inline void prefetch_pair(const FlatPair& pair, bool far,
                                                 bool with_src = true) {
  if (!far) {
    __builtin_prefetch(pair.ema, 1);
    if (with_src) {
      __builtin_prefetch(pair.src);
    }
    return;
  }
  const PairInfo& info = kPairs[static_cast<int>(pair.kind)];
  const auto bytes = [&](c10::ScalarType type) {
    return std::min(static_cast<int64_t>(c10::elementSize(type)) * pair.numel, kPrefetchBytes);
  };
  prefetch_range<1>(pair.ema, bytes(info.ema));
  if (with_src) {
    prefetch_range<0>(pair.src, bytes(info.src));
  }
}

// lerp_many_: the bytes of a source that every track updates from before the next block: small
// enough to stay in L1 (32-48 KB) while each track streams its own EMA block through (4 KB of
// src; at most 8 KB of EMA, a float32 EMA of a 16-bit src: 12 KB touched between two reads of a
// src line), large enough that a span call per block and track costs nothing beside the block
// (1,024 float32 elements). Memory then sees each src byte once.
constexpr int64_t kTrackBlockBytes = 4096;

// The pairs of one src tensor: every track's, consecutive in the plan (fused_op.h).
struct TrackRow {
  const FlatPair* pairs;
  uint32_t tracks;
};

// Calls span(pair, track, begin, end) over every pair of a lerp_many_ plan, the tracks of a src
// taking turns block by block (kTrackBlockBytes of src): one flat range over the src elements,
// split by a single parallel_for.
template <typename Span>
void for_each_track_span(const DevicePlan& plan, size_t tensors, const Span& span) {
  Scratch<TrackRow, 0> rows_scratch;
  std::vector<TrackRow>& rows = rows_scratch.vec;
  const std::vector<FlatPair>& pairs = plan.pairs;
  const TrackIndex at(tensors);
  uint32_t last = UINT32_MAX;
  for (const FlatPair& pair : pairs) {
    const uint32_t tensor = at.tensor(pair.index);
    if (tensor != last) {
      rows.push_back({&pair, 0});
      last = tensor;
    }
    ++rows.back().tracks;
  }
  if (rows.empty()) {
    return;
  }
  // Every row holds a pair of each track left in the plan.
  const auto tracks = static_cast<int64_t>(pairs.size() / rows.size());
  const bool far = pairs.size() >= kPrefetchFrom;
  for_each_item_span(
      rows.size(), [&](size_t r) { return rows[r].pairs->numel; },
      std::max<int64_t>(1, kGrainSize / tracks),
      std::max<size_t>(1, kPrefetchPairs / static_cast<size_t>(tracks)),
      [&](size_t r) {
        // The tracks share the src (bar stand-ins): prefetched with the first.
        for (uint32_t k = 0; k < rows[r].tracks; ++k) {
          prefetch_pair(rows[r].pairs[k], far, k == 0);
        }
      },
      [&](size_t r, int64_t begin, int64_t end) {
        const TrackRow& row = rows[r];
        const PairInfo& info = kPairs[static_cast<int>(row.pairs->kind)];
        const int64_t block = kTrackBlockBytes / static_cast<int64_t>(c10::elementSize(info.src));
        for (int64_t lo = begin; lo < end;) {
          const int64_t hi = std::min(end, (lo / block + 1) * block);
          for (uint32_t k = 0; k < row.tracks; ++k) {
            const FlatPair& pair = row.pairs[k];
            span(pair, at.track(pair.index), lo, hi);
          }
          lo = hi;
        }
      });
}

// Each bema_ element moves up to four values (src, ema, theta0, out): a thread's least share is a
// quarter of lerp_'s.
constexpr int64_t kBemaGrain = kGrainSize / 4;

// bema_: the bema span kernels over every tensor's four views, each source element read once and
// each target written in the same pass (no temporaries). The first line of each of an item's views
// is prefetched: the data of many small tensors lies scattered.
void run_bema(const std::vector<BemaItem>& items, const SpanKernels& kernels,
              const double* weights) {
  for_each_item_span(
      items.size(), [&](size_t p) { return items[p].numel; }, kBemaGrain, kPrefetchPairs,
      [&](size_t p) {
        __builtin_prefetch(items[p].src);
        __builtin_prefetch(items[p].ema, 1);
        __builtin_prefetch(items[p].theta0, 1);
        __builtin_prefetch(items[p].out, 1);
      },
      [&](size_t p, int64_t begin, int64_t end) {
        const BemaItem& item = items[p];
        kernels.pair[static_cast<int>(item.kind)].bema(item.ema, item.theta0, item.out, item.src,
                                                       begin, end, weights);
      });
}

// One call on one plan: the driver hands a CPU plan only host weights and steps (CPU tensors are
// read there), and leaves out the pairs of a plain call's tracks whose weight is 0.
void run_fused(const DevicePlan& plan, const FusedCall& call) {
  const FusedRounding& r = call.rounding;
  TORCH_INTERNAL_ASSERT(call.weights.device_tensor == nullptr && r.step_tensor == nullptr);
  const SpanKernels& kernels = active_span_kernels();
  const double* weights = call.weights.values.data();
  const auto tensors = static_cast<uint32_t>(call.tensors);
  // Track k of a pair (k * tensors + i): lerp_'s kernel with the track's weight and stream.
  const auto lerp = [&](const FlatPair& pair, uint32_t track, int64_t begin, int64_t end) {
    const int kind = static_cast<int>(pair.kind);
    if (!call.stochastic()) {
      kernels.pair[kind].fn(pair.ema, pair.src, begin, end, pair.numel, weights[track]);
      return;
    }
    const SrStream stream{static_cast<uint64_t>(r.seeds[track]), r.step,
                          static_cast<uint64_t>(r.offsets[pair.index - track * tensors]),
                          static_cast<uint32_t>(r.keys[pair.index])};
    kernels.pair[kind].sr(pair.ema, pair.src, begin, end, pair.numel, weights[track], stream);
  };
  if (call.bema()) {
    run_bema(bema_items(plan, call.tensors), kernels, weights);
  } else if (call.weights.tracks == 1) {
    const std::vector<FlatPair>& pairs = plan.pairs;
    const bool far = pairs.size() >= kPrefetchFrom;
    for_each_item_span(
        pairs.size(), [&](size_t p) { return pairs[p].numel; }, kGrainSize, kPrefetchPairs,
        [&](size_t p) { prefetch_pair(pairs[p], far); },
        [&](size_t p, int64_t begin, int64_t end) { lerp(pairs[p], 0, begin, end); });
  } else {
    for_each_track_span(plan, call.tensors, lerp);  // lerp_many_: block by block
  }
  plan.write_back();
}

[[maybe_unused]] const bool kRegistered = register_fused_runner(c10::DeviceType::CPU, &run_fused);

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CPU, m) { register_fused_ops(m); }

}  // namespace fused_ema::cpu
