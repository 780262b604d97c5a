// The functors of fused_ema::lerp_many_ for multi_track_kernel, and how a plan's pairs become
// their launches. Each track binds lerp_'s own functor (LerpOp, LerpStochasticOp) with its own
// weight, so its bits are lerp_'s. No torch headers (nvcc-only tests); the host compiles it too.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "../dtype_pair_list.h"
#include "lerp_functor.cuh"
#include "multi_track_kernel.cuh"
#include "stochastic_functor.cuh"

namespace fused_ema::cuda {

// Tracks one launch updates from each read of a source. Each costs 8 bytes of kernel parameters
// per tensor (41 tensors a 4 KB launch, 349 in 32 KB; 28 and 244 with stochastic rounding) and
// an unrolled copy of the loop body. More tracks go out in rounds of up to kMaxTracks (tracks
// 0-7, 8-15, ...), each reading the sources once.
constexpr int kMaxTracks = 8;

// Per tensor: the EMA of each track of the launch; null where a track has none in this launch (a
// weight of 0 known on the host, or an EMA of another dtype pair, or of a stand-in source, which
// goes out in another launch).
struct TrackEmas {
  void* ema[kMaxTracks];
};

// lerp_many_stochastic_'s: also each track's stream key and the tensor's offset (shared).
struct SrTrackEmas {
  TrackEmas emas;
  uint32_t key[kMaxTracks];
  uint64_t offset;
};

// Every EMA of a tensor must share the first one's alignment for the tensor to take the aligned
// body (pack_launches finds the head from the first); else it takes the element-wise path.
inline bool aligned_like(const TrackEmas& tracks, const void* first) {
  const auto residue = reinterpret_cast<uintptr_t>(first) % 16;
  for (void* ema : tracks.ema) {
    if (ema != nullptr && reinterpret_cast<uintptr_t>(ema) % 16 != residue) {
      return false;
    }
  }
  return true;
}
inline bool aligned_like(const SrTrackEmas& tracks, const void* first) {
  return aligned_like(tracks.emas, first);
}

// The weights of a launch's tracks: host values, or a device pointer to the first of them (K
// float32 or float64 elements, `stride` apart) that the kernel reads.
struct TrackWeightArgs {
  double value[kMaxTracks];
  const float* f32;
  const double* f64;
  int64_t stride;

  FUSED_EMA_HOST_DEVICE WeightArg operator[](int k) const {
    return {value[k], f32 != nullptr ? f32 + k * stride : nullptr,
            f64 != nullptr ? f64 + k * stride : nullptr};
  }
};

// Without __grid_constant__ (a build for pre-Volta targets too) the kernel copies the op to local
// memory for its run-time track index, which costs registers: one resident block per SM lets them
// grow past 64 instead of spilling.
#if defined(FUSED_EMA_PRE_VOLTA_BUILD)
constexpr int kTrackMinBlocksPerSM = 1;
#else
constexpr int kTrackMinBlocksPerSM = kMinBlocksPerSM;
#endif

// The weights of tracks [first, first + kMaxTracks): `count` host values, or the device array of
// all K (f32 or f64, `stride` elements apart).
inline TrackWeightArgs round_weights(const double* values, size_t count, const float* f32,
                                     const double* f64, int64_t stride, size_t first) {
  TrackWeightArgs arg{};
  arg.stride = stride;
  const auto offset = static_cast<int64_t>(first) * stride;
  arg.f32 = f32 != nullptr ? f32 + offset : nullptr;
  arg.f64 = f64 != nullptr ? f64 + offset : nullptr;
  for (size_t k = 0; k < kMaxTracks && first + k < count; ++k) {
    arg.value[k] = values[first + k];
  }
  return arg;
}

template <typename E, typename S>
struct LerpManyOp {
  using Track = LerpOp<E, S>;
  using ema_t = E;
  using src_t = S;
  using extra_t = TrackEmas;
  static constexpr int kTracks = kMaxTracks;
  static constexpr int kMinBlocksPerSM = kTrackMinBlocksPerSM;
  static constexpr int kPack = Track::kPack;
  // The source packs stay live through every track's: for 16-bit pairs (8 conversions a pack
  // each way) four in flight spilled within 64 registers on sm_80; two do not.
  static constexpr int kIlp = sizeof(E) == 2 && sizeof(S) == 2 ? 2 : Track::kIlp;

  TrackWeightArgs weights;

  FUSED_EMA_HOST_DEVICE static void* ema(const TrackEmas& tracks, int k) { return tracks.ema[k]; }
  FUSED_EMA_HOST_DEVICE typename Track::Bound bind(const TrackEmas&, int k) const {
    return Track{weights[k]}.bind();
  }
};

template <typename E, typename S>
struct LerpManyStochasticOp {
  using Track = LerpStochasticOp<E, S>;
  using ema_t = E;
  using src_t = S;
  using extra_t = SrTrackEmas;
  static constexpr int kTracks = kMaxTracks;
  static constexpr int kMinBlocksPerSM = kTrackMinBlocksPerSM;
  static constexpr int kPack = Track::kPack;
  static constexpr int kIlp = Track::kIlp;

  TrackWeightArgs weights;
  StepArg step;
  uint64_t seed[kMaxTracks];

  FUSED_EMA_HOST_DEVICE static void* ema(const SrTrackEmas& tracks, int k) {
    return tracks.emas.ema[k];
  }
  FUSED_EMA_HOST_DEVICE typename Track::Bound bind(const SrTrackEmas& tracks, int k) const {
    return Track{weights[k], step, seed[k]}.bind(SrTensor{tracks.offset, tracks.key[k]});
  }
};

// The launches of lerp_many_'s pairs (fused_op.h: grouped by tensor; FlatPair::index = track *
// tensors + tensor): in rounds of up to kMaxTracks tracks, and per round
// and dtype pair one entry per source with its tracks' EMAs (`fill(extra, slot, pair)` sets a
// track's fields). Calls launch(kind, first_track, refs, extras, count) per non-empty group,
// stopping at the first error. Host only; tests drive it with the emulated launch.
template <typename Extra, typename Pair, typename Fill, typename Launch>
cudaError_t for_each_track_launch(const Pair* pairs, size_t count, size_t tensors, size_t tracks,
                                  const Fill& fill, const Launch& launch) {
  struct Entry {
    int kind;
    const void* src;
    size_t slot;
  };
  for (size_t first = 0; first < tracks; first += kMaxTracks) {
    std::array<std::vector<TensorRef>, kNumPairKinds> refs;
    std::array<std::vector<Extra>, kNumPairKinds> extras;
    for (size_t row = 0; row < count;) {
      const size_t tensor = pairs[row].index % tensors;
      Entry entries[kMaxTracks];
      int used = 0;
      size_t p = row;
      for (; p < count && pairs[p].index % tensors == tensor; ++p) {
        const Pair& pair = pairs[p];
        const size_t track = pair.index / tensors;
        if (track < first || track >= first + kMaxTracks) {
          continue;
        }
        const int kind = static_cast<int>(pair.kind);
        Entry* entry = std::find_if(entries, entries + used, [&](const Entry& e) {
          return e.kind == kind && e.src == pair.src;
        });
        if (entry == entries + used) {
          *entry = {kind, pair.src, refs[kind].size()};
          ++used;
          refs[kind].push_back({pair.ema, pair.src, pair.numel});
          extras[kind].push_back(Extra{});
        }
        fill(extras[kind][entry->slot], static_cast<int>(track - first), pair);
      }
      row = p;
    }
    for (int kind = 0; kind < kNumPairKinds; ++kind) {
      if (refs[kind].empty()) {
        continue;
      }
      const cudaError_t err = launch(kind, first, refs[kind].data(), extras[kind].data(),
                                     static_cast<int64_t>(refs[kind].size()));
      if (err != cudaSuccess) {
        return err;
      }
    }
  }
  return cudaSuccess;
}

// The seeds of tracks [first, first + kMaxTracks) of `count`.
inline std::array<uint64_t, kMaxTracks> round_seeds(const int64_t* seeds, size_t count,
                                                    size_t first) {
  std::array<uint64_t, kMaxTracks> out{};
  for (size_t k = 0; k < kMaxTracks && first + k < count; ++k) {
    out[k] = static_cast<uint64_t>(seeds[first + k]);
  }
  return out;
}

// The EMAs of stochastic rounding's per-tensor data, for the float32/float64 EMAs that take the
// plain lerp.
inline std::vector<TrackEmas> emas_of(const SrTrackEmas* extras, int64_t count) {
  std::vector<TrackEmas> emas(static_cast<size_t>(count));
  for (size_t i = 0; i < emas.size(); ++i) {
    emas[i] = extras[i].emas;
  }
  return emas;
}

#if defined(__CUDACC__)
template <typename E, typename S>
cudaError_t launch_lerp_many(const TensorRef* refs, const TrackEmas* extras, int64_t count,
                             const TrackWeightArgs& weights, cudaStream_t stream) {
  return multi_tensor_apply(refs, count, LerpManyOp<E, S>{weights}, stream, extras);
}

// Stochastic rounding for 16-bit EMAs; float32/float64 EMAs get the plain lerp.
template <typename E, typename S>
cudaError_t launch_lerp_many_stochastic(const TensorRef* refs, const SrTrackEmas* extras,
                                        int64_t count, const TrackWeightArgs& weights, StepArg step,
                                        const uint64_t* seeds, cudaStream_t stream) {
  if constexpr (kRoundsStochastically<E>) {
    LerpManyStochasticOp<E, S> op{weights, step, {}};
    std::copy(seeds, seeds + kMaxTracks, op.seed);
    return multi_tensor_apply(refs, count, op, stream, extras);
  } else {
    const std::vector<TrackEmas> emas = emas_of(extras, count);
    return launch_lerp_many<E, S>(refs, emas.data(), count, weights, stream);
  }
}
#endif

}  // namespace fused_ema::cuda
