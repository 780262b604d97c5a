// The device-independent driver of fused_ema::lerp_many_: K tracks of EMAs of one list of
// sources, track k updated bit for bit as lerp_ (lerp_stochastic_) would update it with its own
// weight, each source read once. The K * N pairs go through lerp_'s planner (its checks, with
// emas[k][i] in the messages); each device's pairs then go to the runner its kernel registered.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "lerp_plan.h"

namespace fused_ema {

// The tracks' weights as a runner receives them: known on the host (then the pairs of a track
// whose weight is 0 are left out of the plan), or K float32/float64 elements on the plan's
// device that the kernel reads (no host sync; capturable in a CUDA graph).
struct TrackWeights {
  std::vector<double> values;
  const at::Tensor* device_tensor = nullptr;

  size_t tracks() const {
    return device_tensor != nullptr ? static_cast<size_t>(device_tensor->numel()) : values.size();
  }
};

// lerp_many_stochastic_'s rounding arguments: track k's tensor i rounds as lerp_stochastic_ with
// seed seeds[k], key keys[k * tensors + i] and offset offsets[i].
struct TrackRounding {
  c10::ArrayRef<int64_t> seeds;
  uint64_t step = 0;                        // when the step is known on the host
  const at::Tensor* step_tensor = nullptr;  // else an int64 tensor on the plan's device
  c10::ArrayRef<int64_t> keys;
  c10::ArrayRef<int64_t> offsets;
};

// The track k and tensor i of a pair's FlatPair::index, k * tensors + i, by a multiply and a shift
// (Lemire's fastdiv for 32-bit values): a division per pair and use showed in the profile of
// 20,000 small tensors.
class TrackIndex {
 public:
  explicit TrackIndex(size_t tensors)
      : tensors_(static_cast<uint32_t>(tensors)),
        magic_(tensors > 1 ? UINT64_MAX / tensors + 1 : 0) {}

  uint32_t track(uint32_t index) const {
    return tensors_ > 1 ? static_cast<uint32_t>((static_cast<__uint128_t>(magic_) * index) >> 64)
                        : index;
  }
  uint32_t tensor(uint32_t index) const { return index - track(index) * tensors_; }

 private:
  uint32_t tensors_;
  uint64_t magic_;
};

// A runner receives one device's pairs, track k's tensor i as FlatPair::index k * tensors + i,
// grouped by tensor: the pairs of tensor i follow each other.
using TracksRunner = void (*)(const DevicePlan& plan, size_t tensors, const TrackWeights& weights);
using StochasticTracksRunner = void (*)(const DevicePlan& plan, size_t tensors,
                                        const TrackWeights& weights, const TrackRounding& rounding);

// Called from static initialisers of cpu/ and cuda/; return true so they can initialise a flag.
bool register_tracks_runner(c10::DeviceType type, TracksRunner runner);
bool register_stochastic_tracks_runner(c10::DeviceType type, StochasticTracksRunner runner);

// The checks of the weights of `tracks` tracks (a 1-D float32/float64 tensor, read here from the
// CPU; host values finite), and of each device's plan against them.
TrackWeights checked_track_weights(const at::Tensor& weights, size_t tracks);
TrackWeights checked_track_weights(std::vector<double> values);
void check_tracks_runnable(const DevicePlan& plan, const TrackWeights& weights);

// lerp_many_stochastic_'s step, seeds, keys and offsets checked for `tracks` tracks of `src`.
TrackRounding checked_track_rounding(size_t tracks, TensorRefs src, const at::Tensor& step,
                                     c10::ArrayRef<int64_t> seeds, c10::ArrayRef<int64_t> keys,
                                     c10::ArrayRef<int64_t> offsets);

// lerp_many_ (rounding null) or lerp_many_stochastic_ in two halves: every check and the plans
// (grouped by tensor), then the runs, which leave out the tracks whose host weight is 0. A prepared
// update (prepared_update.h) keeps the plans and runs them again.
std::vector<DevicePlan> plan_tracks_call(TensorRefs emas, TensorRefs src,
                                         const TrackWeights& weights,
                                         const TrackRounding* rounding);
void run_tracks_call(const std::vector<DevicePlan>& plans, size_t tensors,
                     const TrackWeights& weights, const TrackRounding* rounding);

// `emas` holds the K tracks one after another (track k's tensor i at k * src.size() + i);
// `weights` is a 1-D tensor of K float32/float64 elements on the EMAs' device or the CPU.
void lerp_many(TensorRefs emas, TensorRefs src, const at::Tensor& weights);
void lerp_many_stochastic(TensorRefs emas, TensorRefs src, const at::Tensor& weights,
                          const at::Tensor& step, c10::ArrayRef<int64_t> seeds,
                          c10::ArrayRef<int64_t> keys, c10::ArrayRef<int64_t> offsets);

// The signatures the dispatcher calls (schema in fused_ema.cpp).
void lerp_many_op(at::TensorList emas, at::TensorList src, const at::Tensor& weights);
void lerp_many_stochastic_op(at::TensorList emas, at::TensorList src, const at::Tensor& weights,
                             const at::Tensor& step, at::IntArrayRef seeds, at::IntArrayRef keys,
                             at::IntArrayRef offsets);

}  // namespace fused_ema
