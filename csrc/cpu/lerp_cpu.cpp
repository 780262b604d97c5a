// CPU kernel of fused_ema::lerp_ and lerp_many_. All pairs form one flat range of elements and a
// single at::parallel_for splits it evenly, so 20,000 small tensors cost one parallel region, and
// a thread's share may start in one tensor and end in another.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../lerp_many.h"
#include "../lerp_op.h"
#include "cpu_isa.h"
#include "item_spans.h"

namespace fused_ema::cpu {
namespace {

// Every line of the first kPrefetchBytes of a pair's ema and src (a tiny tensor's data is several
// lines, each a miss when only the first was prefetched).
[[gnu::always_inline]] inline void prefetch_data(const FlatPair& pair) {
  const PairInfo& info = kPairs[static_cast<int>(pair.kind)];
  const auto ema_bytes = static_cast<int64_t>(c10::elementSize(info.ema)) * pair.numel;
  const auto src_bytes = static_cast<int64_t>(c10::elementSize(info.src)) * pair.numel;
  prefetch_range<1>(pair.ema, std::min(ema_bytes, kPrefetchBytes));
  prefetch_range<0>(pair.src, std::min(src_bytes, kPrefetchBytes));
}

// The first bytes of a pair's data (all of kPrefetchBytes for far lists, whose data has left the
// cache; the first line otherwise).
[[gnu::always_inline]] inline void prefetch_pair(const FlatPair& pair, bool far) {
  if (far) {
    prefetch_data(pair);
  } else {
    __builtin_prefetch(pair.ema, 1);
    __builtin_prefetch(pair.src);
  }
}

// Calls span(pair, begin, end) over every pair's elements: one flat range that a single
// at::parallel_for splits evenly.
template <typename Span>
void for_each_span(const std::vector<FlatPair>& pairs, const Span& span) {
  const bool far = pairs.size() >= kPrefetchFrom;
  for_each_item_span(
      pairs.size(), [&](size_t p) { return pairs[p].numel; }, kGrainSize, kPrefetchPairs,
      [&](size_t p) { prefetch_pair(pairs[p], far); },
      [&](size_t p, int64_t begin, int64_t end) { span(pairs[p], begin, end); });
}

// lerp_many_: the bytes of a source that every track updates from before the next block: small
// enough to stay in L1 (32-48 KB) while each track streams its own EMA block through (4 KB of
// src; at most 8 KB of EMA, a float32 EMA of a 16-bit src: 12 KB touched between two reads of a
// src line), large enough that a span call per block and track costs nothing beside the block
// (1,024 float32 elements). Memory then sees each src byte once.
constexpr int64_t kTrackBlockBytes = 4096;

// The pairs of one src tensor: every track's, consecutive in the plan (lerp_many.h).
struct TrackRow {
  const FlatPair* pairs;
  uint32_t tracks;
};

// Calls span(pair, track, begin, end) over every pair of a lerp_many_ plan, the tracks of a src
// taking turns block by block (kTrackBlockBytes of src): one flat range over the src elements,
// split by a single at::parallel_for.
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
        prefetch_pair(rows[r].pairs[0], far);
        for (uint32_t k = 1; k < rows[r].tracks; ++k) {
          const FlatPair& pair = rows[r].pairs[k];
          if (far) {
            const auto bytes = static_cast<int64_t>(
                c10::elementSize(kPairs[static_cast<int>(pair.kind)].ema) * pair.numel);
            prefetch_range<1>(pair.ema, std::min(bytes, kPrefetchBytes));
          } else {
            __builtin_prefetch(pair.ema, 1);
          }
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

// lerp_many_: lerp_'s span kernels, each track with its own weight, block by block.
void run_tracks_plan(const DevicePlan& plan, size_t tensors, const TrackWeights& weights) {
  TORCH_INTERNAL_ASSERT(weights.device_tensor == nullptr);
  const SpanKernels& kernels = active_span_kernels();
  for_each_track_span(plan, tensors,
                      [&](const FlatPair& pair, uint32_t track, int64_t begin, int64_t end) {
                        kernels.fn[static_cast<int>(pair.kind)](pair.ema, pair.src, begin, end,
                                                                weights.values[track]);
                      });
  plan.write_back();
}

void run_stochastic_tracks_plan(const DevicePlan& plan, size_t tensors, const TrackWeights& weights,
                                const TrackRounding& rounding) {
  TORCH_INTERNAL_ASSERT(weights.device_tensor == nullptr && rounding.step_tensor == nullptr);
  const SpanKernels& kernels = active_span_kernels();
  const auto tensor_count = static_cast<uint32_t>(tensors);
  for_each_track_span(
      plan, tensors, [&](const FlatPair& pair, uint32_t track, int64_t begin, int64_t end) {
        const SrStream stream{
            static_cast<uint64_t>(rounding.seeds[track]), rounding.step,
            static_cast<uint64_t>(rounding.offsets[pair.index - track * tensor_count]),
            static_cast<uint32_t>(rounding.keys[pair.index])};
        kernels.sr[static_cast<int>(pair.kind)](pair.ema, pair.src, begin, end,
                                                weights.values[track], stream);
      });
  plan.write_back();
}

[[maybe_unused]] const bool kRegistered = register_device_runner(c10::DeviceType::CPU, &run_plan);
[[maybe_unused]] const bool kStochasticRegistered =
    register_stochastic_runner(c10::DeviceType::CPU, &run_stochastic_plan);
[[maybe_unused]] const bool kTracksRegistered =
    register_tracks_runner(c10::DeviceType::CPU, &run_tracks_plan);
[[maybe_unused]] const bool kStochasticTracksRegistered =
    register_stochastic_tracks_runner(c10::DeviceType::CPU, &run_stochastic_tracks_plan);

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CPU, m) {
  m.impl("lerp_", &lerp_op);
  m.impl("lerp_.Tensor", &lerp_op_tensor_weight);
  m.impl("lerp_stochastic_", &lerp_stochastic_op);
  m.impl("lerp_many_", &lerp_many_op);
  m.impl("lerp_many_stochastic_", &lerp_many_stochastic_op);
}

}  // namespace fused_ema::cpu
