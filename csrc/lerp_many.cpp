// The driver behind every entry to fused_ema::lerp_many_ (see lerp_many.h): the checks of the
// weights and rounding arguments of K tracks, the planning of their K * N pairs, and one runner
// call per device.
#include "lerp_many.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include "lerp_op.h"
#include "opmath.h"
#include "weight_vector.h"

namespace fused_ema {
namespace {

constexpr const char* kOp = "fused_ema.lerp_many_: ";
constexpr auto kNumDeviceTypes =
    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

std::array<TracksRunner, kNumDeviceTypes>& runners() {
  static std::array<TracksRunner, kNumDeviceTypes> table{};
  return table;
}

std::array<StochasticTracksRunner, kNumDeviceTypes>& stochastic_runners() {
  static std::array<StochasticTracksRunner, kNumDeviceTypes> table{};
  return table;
}

// The number of tracks K (one weight each), and the flattened emas checked against it.
size_t track_count(TensorRefs emas, TensorRefs src, const at::Tensor& weights) {
  TORCH_CHECK_VALUE(weights.defined(), kOp, "weights is an undefined tensor");
  TORCH_CHECK_VALUE(weights.dim() == 1 && weights.numel() >= 1, kOp,
                    "weights must be a 1-D tensor of one weight per track (at least one), got "
                    "shape ",
                    weights.sizes());
  const auto tracks = static_cast<size_t>(weights.numel());
  TORCH_CHECK_VALUE(emas.size() == tracks * src.size(), kOp, "emas has ", emas.size(),
                    " tensors but ", tracks, " weights of ", src.size(), " src tensors need ",
                    tracks * src.size(), " (track k's tensor i at k * len(src) + i)");
  return tracks;
}

template <typename Runner>
void check_runner(Runner runner, const DevicePlan& plan, const TrackWeights& weights) {
  check_has_kernel(runner != nullptr, plan.device, kOp);
  const at::Tensor* t = weights.device_tensor;
  TORCH_CHECK(t == nullptr || t->device() == plan.device, kOp, "weights is on ", t->device(),
              " but EMA tensors are on ", plan.device,
              "; pass the weights on the EMAs' device, on the CPU, or as floats");
}

// Groups the pairs by tensor (the planner added them track by track), each tensor's in the order
// they had.
void group_by_tensor(DevicePlan& plan, size_t tensors, size_t tracks) {
  std::vector<FlatPair>& pairs = plan.pairs;
  if (tracks < 2 || pairs.size() < 2) {
    return;
  }
  const TrackIndex at(tensors);
  Scratch<uint32_t, 0> starts_scratch;
  std::vector<uint32_t>& starts = starts_scratch.vec;
  starts.assign(tensors + 1, 0);
  for (const FlatPair& pair : pairs) {
    ++starts[at.tensor(pair.index) + 1];
  }
  for (size_t i = 0; i < tensors; ++i) {
    starts[i + 1] += starts[i];
  }
  Scratch<FlatPair, 0> grouped;
  grouped.vec.resize(pairs.size());
  for (const FlatPair& pair : pairs) {
    grouped.vec[starts[at.tensor(pair.index)]++] = pair;
  }
  pairs.swap(grouped.vec);
}

// The plan without the pairs of tracks whose host weight is 0: they would leave every value as it
// is, and lerp_ touches no memory for them either (nor for NaN or infinite sources).
DevicePlan without_zero_tracks(const DevicePlan& plan, size_t tensors,
                               const std::vector<double>& values) {
  DevicePlan kept(plan.device);
  const TrackIndex at(tensors);
  std::copy_if(plan.pairs.begin(), plan.pairs.end(), std::back_inserter(kept.pairs),
               [&](const FlatPair& p) { return values[at.track(p.index)] != 0.0; });
  kept.write_backs = plan.write_backs;  // a stand-in left alone holds what its EMA held
  return kept;
}

}  // namespace

bool register_tracks_runner(c10::DeviceType type, TracksRunner runner) {
  runners()[static_cast<size_t>(type)] = runner;
  return true;
}

bool register_stochastic_tracks_runner(c10::DeviceType type, StochasticTracksRunner runner) {
  stochastic_runners()[static_cast<size_t>(type)] = runner;
  return true;
}

// A CPU tensor's weights are read here; a device's are left to its kernel.
TrackWeights checked_track_weights(const at::Tensor& weights, size_t tracks) {
  auto values =
      weight_vector(weights, tracks, kOp, c10::str("one weight per track (", tracks, ")"));
  if (!values) {
    return {{}, &weights};
  }
  return checked_track_weights(std::move(*values));
}

TrackWeights checked_track_weights(std::vector<double> values) {
  for (size_t k = 0; k < values.size(); ++k) {
    TORCH_CHECK_VALUE(std::isfinite(values[k]), kOp, "weights[", k, "] must be finite, got ",
                      values[k]);
    TORCH_CHECK_VALUE(fits_float(values[k]), kOp, "weights[", k, "] must fit a float32, got ",
                      values[k]);
  }
  return {std::move(values), nullptr};
}

void check_tracks_runnable(const DevicePlan& plan, const TrackWeights& weights) {
  check_runner(runners()[static_cast<size_t>(plan.device.type())], plan, weights);
}

TrackRounding checked_track_rounding(size_t tracks, TensorRefs src, const at::Tensor& step,
                                     c10::ArrayRef<int64_t> seeds, c10::ArrayRef<int64_t> keys,
                                     c10::ArrayRef<int64_t> offsets) {
  const size_t tensors = src.size();
  const CheckedStep step_arg = checked_step(step, kOp);
  TORCH_CHECK_VALUE(seeds.size() == tracks, kOp, "seeds has ", seeds.size(),
                    " entries but there are ", tracks, " tracks (one seed per track)");
  TORCH_CHECK_VALUE(keys.size() == tracks * tensors, kOp, "keys has ", keys.size(),
                    " entries but emas has ", tracks * tensors,
                    " tensors (one key per EMA tensor, track k's tensor i at k * len(src) + i)");
  TORCH_CHECK_VALUE(offsets.size() == tensors, kOp, "offsets has ", offsets.size(),
                    " entries but src has ", tensors, " tensors");
  for (size_t j = 0; j < keys.size(); ++j) {
    TORCH_CHECK_VALUE(keys[j] >= 0 && keys[j] <= kMaxKey, kOp, "keys[", j / tensors, "][",
                      j % tensors, "] is ", keys[j], "; keys are 32-bit: 0 <= key <= ", kMaxKey);
  }
  for (size_t i = 0; i < tensors; ++i) {
    TORCH_CHECK_VALUE(src[i]->defined(), kOp, "src[", i, "] is an undefined tensor");
    TORCH_CHECK_VALUE(offsets[i] >= 0, kOp, "offsets[", i, "] is ", offsets[i],
                      "; an offset is the index of the tensor's first element, >= 0");
    TORCH_CHECK_VALUE(offsets[i] <= INT64_MAX - src[i]->numel(), kOp, "offsets[", i, "] + src[", i,
                      "].numel() overflows int64");
  }
  return {seeds, step_arg.value, step_arg.tensor, keys, offsets};
}

std::vector<DevicePlan> plan_tracks_call(TensorRefs emas, TensorRefs src,
                                         const TrackWeights& weights,
                                         const TrackRounding* rounding) {
  std::vector<DevicePlan> plans =
      plan_lerp_many(emas, src, /*row_major=*/rounding != nullptr, [&](const DevicePlan& plan) {
        if (rounding == nullptr) {
          check_tracks_runnable(plan, weights);
          return;
        }
        check_runner(stochastic_runners()[static_cast<size_t>(plan.device.type())], plan, weights);
        const at::Tensor* t = rounding->step_tensor;
        TORCH_CHECK(t == nullptr || t->device() == plan.device, kOp, "step is on ", t->device(),
                    " but EMA tensors are on ", plan.device,
                    "; pass the step on the EMAs' device, on the CPU, or as an int");
      });
  for (DevicePlan& plan : plans) {
    group_by_tensor(plan, src.size(), weights.tracks());
  }
  return plans;
}

void run_tracks_call(const std::vector<DevicePlan>& plans, size_t tensors,
                     const TrackWeights& weights, const TrackRounding* rounding) {
  RECORD_FUNCTION(
      rounding == nullptr ? "fused_ema::lerp_many_" : "fused_ema::lerp_many_stochastic_",
      std::vector<c10::IValue>());
  const std::vector<double>& values = weights.values;
  const bool some_zero = std::find(values.begin(), values.end(), 0.0) != values.end();
  for (const DevicePlan& whole : plans) {
    const DevicePlan kept =
        some_zero ? without_zero_tracks(whole, tensors, values) : DevicePlan(whole.device);
    const DevicePlan& plan = some_zero ? kept : whole;
    const auto type = static_cast<size_t>(plan.device.type());
    if (rounding == nullptr) {
      runners()[type](plan, tensors, weights);
    } else {
      stochastic_runners()[type](plan, tensors, weights, *rounding);
    }
  }
}

void lerp_many(TensorRefs emas, TensorRefs src, const at::Tensor& weights) {
  const TrackWeights checked = checked_track_weights(weights, track_count(emas, src, weights));
  run_tracks_call(plan_tracks_call(emas, src, checked, nullptr), src.size(), checked, nullptr);
}

void lerp_many_stochastic(TensorRefs emas, TensorRefs src, const at::Tensor& weights,
                          const at::Tensor& step, c10::ArrayRef<int64_t> seeds,
                          c10::ArrayRef<int64_t> keys, c10::ArrayRef<int64_t> offsets) {
  const size_t tracks = track_count(emas, src, weights);
  const TrackWeights checked = checked_track_weights(weights, tracks);
  const TrackRounding rounding = checked_track_rounding(tracks, src, step, seeds, keys, offsets);
  run_tracks_call(plan_tracks_call(emas, src, checked, &rounding), src.size(), checked, &rounding);
}

void lerp_many_op(at::TensorList emas, at::TensorList src, const at::Tensor& weights) {
  lerp_many(tensor_refs(emas), tensor_refs(src), weights);
}

void lerp_many_stochastic_op(at::TensorList emas, at::TensorList src, const at::Tensor& weights,
                             const at::Tensor& step, at::IntArrayRef seeds, at::IntArrayRef keys,
                             at::IntArrayRef offsets) {
  lerp_many_stochastic(tensor_refs(emas), tensor_refs(src), weights, step, seeds, keys, offsets);
}

}  // namespace fused_ema

// As lerp_op.cpp's: empty lists and devices without a fused_ema kernel.
TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) {
  m.impl("lerp_many_", &fused_ema::lerp_many_op);
  m.impl("lerp_many_stochastic_", &fused_ema::lerp_many_stochastic_op);
}
