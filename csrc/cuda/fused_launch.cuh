// The host side of the fused-op family on CUDA, shared by fused_cuda.cu and the tests' emulation:
// a call's pairs grouped by dtype pair (lerp_many_'s also in rounds of kMaxTracks tracks, bema_'s
// one item per source), each group handed with its op to `launch(op, refs, count, extras)`:
// StreamLaunch on a GPU. No torch headers, so that tests can compile it with plain nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include "../dtype_pair_list.h"
#include "../track_index.h"
#include "bema_op.cuh"
#include "lerp_op.cuh"

namespace fused_ema::cuda {

// The CUDA types of the dtype-pair list's type tags (dtype_pair_list.h).
using CudaTypes = BackendTypes<float, double, __nv_bfloat16, __half>;

// The groups of a launch round: each dtype pair's tensors.
using PairGroups = std::array<std::vector<TensorRef>, kNumPairKinds>;

// fn(E{}, S{}, kind) for each dtype pair with tensors in `groups`, E and S its CUDA types; stops at
// the first error.
template <typename Fn>
cudaError_t for_each_group(const PairGroups& groups, const Fn& fn) {
  for (size_t kind = 0; kind < groups.size(); ++kind) {
    if (groups[kind].empty()) {
      continue;
    }
    cudaError_t err = cudaErrorInvalidValue;
    switch (kind) {
#define FUSED_EMA_DISPATCH(kind_, ema, src, ema_tag, src_tag)   \
  case static_cast<size_t>(PairKind::kind_):                    \
    err = fn(CudaTypes::ema_tag{}, CudaTypes::src_tag{}, kind); \
    break;
      FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_DISPATCH)
#undef FUSED_EMA_DISPATCH
    }
    if (err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

// A call's weights: `count` host values, or a device array of float32/float64 elements `stride`
// apart that the kernels read.
struct CallWeights {
  const double* values;
  size_t count;
  const float* f32;
  const double* f64;
  int64_t stride;

  // Those of tracks [first, first + K).
  template <int K>
  TrackWeights<K> from(size_t first) const {
    const auto offset = static_cast<int64_t>(first) * stride;
    TrackWeights<K> w{{},
                      f32 != nullptr ? f32 + offset : nullptr,
                      f64 != nullptr ? f64 + offset : nullptr,
                      stride};
    for (size_t k = 0; k < K && first + k < count; ++k) {
      w.value[k] = values[first + k];
    }
    return w;
  }
};

// A lerp_ or lerp_many_ call (stochastic rounding: track k's tensor i rounds with seeds[k], key
// keys[k * tensors + i] and offset offsets[i]).
struct LerpCall {
  size_t tensors;
  size_t tracks;
  CallWeights weights;
  bool stochastic;
  StepArg step;
  const int64_t* seeds;
  const int64_t* keys;
  const int64_t* offsets;
};

// One dtype pair's group of a launch round: stochastic rounding for 16-bit EMAs; float32/float64
// EMAs take the plain lerp, whose per-tensor data leaves the keys out (more tensors a launch).
template <typename E, typename S, int K, bool kStochastic, typename Extra, typename Launch>
cudaError_t launch_lerp(const Launch& launch, const std::vector<TensorRef>& refs,
                        const std::vector<Extra>& extras, const TrackWeights<K>& weights,
                        const SrArgs<K>& sr) {
  const auto count = static_cast<int64_t>(refs.size());
  if constexpr (!kStochastic) {
    return launch(LerpOp<E, S, K>{weights, {}}, refs.data(), count, extras.data());
  } else if constexpr (kRoundsStochastically<E>) {
    return launch(LerpOp<E, S, K, true>{weights, sr}, refs.data(), count, extras.data());
  } else {
    const std::vector<TrackEmas<K>> emas(extras.begin(), extras.end());
    return launch(LerpOp<E, S, K>{weights, {}}, refs.data(), count, emas.data());
  }
}

// The launches of lerp_ (K = 1) or lerp_many_ (K = kMaxTracks) over `pairs` (as FlatPair: ema,
// src, numel, kind and index = track * tensors + tensor, a tensor's pairs one after another), in
// rounds of tracks [first, first + K): per round and dtype pair one entry per source with its
// tracks' EMAs. Stops at the first error.
template <int K, bool kStochastic, typename Pair, typename Launch>
cudaError_t launch_lerp_rounds(const Pair* pairs, size_t count, const LerpCall& call,
                               const Launch& launch) {
  using Extra = std::conditional_t<kStochastic, SrTracks<K>, TrackEmas<K>>;
  for (size_t first = 0; first < call.tracks; first += K) {
    PairGroups refs;
    std::array<std::vector<Extra>, kNumPairKinds> extras;
    if constexpr (K == 1) {  // an entry per pair
      for (size_t row = 0; row < count; ++row) {
        const Pair& pair = pairs[row];
        const auto kind = static_cast<size_t>(pair.kind);
        refs[kind].push_back({pair.ema, pair.src, pair.numel});
        if constexpr (kStochastic) {
          extras[kind].push_back({{},
                                  {static_cast<uint32_t>(call.keys[pair.index])},
                                  static_cast<uint64_t>(call.offsets[pair.index])});
        }
      }
    } else {  // an entry per source: one per dtype pair (and stand-in source) of a tensor
      const TrackIndex at(call.tensors);
      for (size_t row = 0; row < count;) {
        struct Entry {
          size_t kind;
          const void* src;
          size_t slot;
        };
        Entry entries[K];
        int used = 0;
        const uint32_t tensor = at.tensor(pairs[row].index);
        for (; row < count && at.tensor(pairs[row].index) == tensor; ++row) {
          const Pair& pair = pairs[row];
          const uint32_t track = at.track(pair.index);
          if (track < first || track >= first + K) {
            continue;
          }
          const auto kind = static_cast<size_t>(pair.kind);
          Entry* entry = std::find_if(entries, entries + used, [&](const Entry& e) {
            return e.kind == kind && e.src == pair.src;
          });
          if (entry == entries + used) {
            *entry = {kind, pair.src, refs[kind].size()};
            ++used;
            refs[kind].push_back({pair.ema, pair.src, pair.numel});
            extras[kind].push_back(Extra{});
          }
          Extra& extra = extras[kind][entry->slot];
          extra.ema[track - first] = pair.ema;
          if constexpr (kStochastic) {
            extra.key[track - first] = static_cast<uint32_t>(call.keys[pair.index]);
            extra.offset = static_cast<uint64_t>(call.offsets[tensor]);
          }
        }
      }
    }
    const TrackWeights<K> weights = call.weights.from<K>(first);
    SrArgs<K> sr{call.step, {}};
    for (size_t k = 0; kStochastic && k < K && first + k < call.tracks; ++k) {
      sr.seed[k] = static_cast<uint64_t>(call.seeds[first + k]);
    }
    const cudaError_t err = for_each_group(refs, [&](auto e, auto s, size_t kind) {
      return launch_lerp<decltype(e), decltype(s), K, kStochastic>(launch, refs[kind], extras[kind],
                                                                   weights, sr);
    });
    if (err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

template <typename Pair, typename Launch>
cudaError_t launch_lerp_call(const Pair* pairs, size_t count, const LerpCall& call,
                             const Launch& launch) {
  if (call.tracks == 1) {
    return call.stochastic ? launch_lerp_rounds<1, true>(pairs, count, call, launch)
                           : launch_lerp_rounds<1, false>(pairs, count, call, launch);
  }
  return call.stochastic ? launch_lerp_rounds<kMaxTracks, true>(pairs, count, call, launch)
                         : launch_lerp_rounds<kMaxTracks, false>(pairs, count, call, launch);
}

// bema_'s launches over `items` (as BemaItem: ema, theta0, out, src, numel, kind; one per source),
// (ema, src) as the TensorRef and (theta0, out) as its data. Host weights that leave only theta0
// to update (beta = alpha = 0) put theta0 in the EMA's place with w0 as its weight (the same
// lerp, so the same bits), and no EMA is read.
template <typename Item, typename Launch>
cudaError_t launch_bema_call(const Item* items, size_t count, const CallWeights& w,
                             const Launch& launch) {
  TrackWeights<3> weights = w.from<3>(0);
  const bool theta0_only = weights.f32 == nullptr && weights.f64 == nullptr &&
                           weights.value[0] == 0.0 && weights.value[2] == 0.0;
  if (theta0_only) {
    weights = {{weights.value[1], 0.0, 0.0}, nullptr, nullptr, 0};
  }
  PairGroups refs;
  std::array<std::vector<BemaTensors>, kNumPairKinds> extras;
  for (size_t i = 0; i < count; ++i) {
    const Item& item = items[i];
    const auto kind = static_cast<size_t>(item.kind);
    refs[kind].push_back({theta0_only ? item.theta0 : item.ema, item.src, item.numel});
    // theta0 only: its data is never touched (the weights of theta0 and out are 0)
    extras[kind].push_back({item.theta0, theta0_only ? item.theta0 : item.out});
  }
  return for_each_group(refs, [&](auto e, auto s, size_t kind) {
    return launch(BemaOp<decltype(e), decltype(s)>{weights}, refs[kind].data(),
                  static_cast<int64_t>(refs[kind].size()), extras[kind].data());
  });
}

}  // namespace fused_ema::cuda
