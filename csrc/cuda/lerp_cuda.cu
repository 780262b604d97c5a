// CUDA kernels of fused_ema::lerp_ and lerp_many_: the torch glue around multi_tensor_apply. A
// device's pairs are grouped by dtype pair (lerp_many_'s also by rounds of tracks) and each group
// goes out in as few launches as the kernel-parameter metadata allows, on the current stream of
// that device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "../lerp_many.h"
#include "../lerp_op.h"
#include "lerp_functor.cuh"
#include "lerp_many_functor.cuh"
#include "pair_types.cuh"
#include "stochastic_functor.cuh"

namespace fused_ema::cuda {
namespace {

using Launcher = cudaError_t (*)(const TensorRef*, int64_t, WeightArg, cudaStream_t);

struct LauncherEntry {
  PairKind kind;
  Launcher launch;
};

#define FUSED_EMA_LAUNCHER(kind, ema, src, ema_tag, src_tag) \
  {PairKind::kind, &launch_lerp<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>},
constexpr LauncherEntry kLaunchers[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_LAUNCHER)};
#undef FUSED_EMA_LAUNCHER
static_assert(in_pair_kind_order(kLaunchers), "kLaunchers must follow PairKind order");

using StochasticLauncher = cudaError_t (*)(const TensorRef*, const SrTensor*, int64_t, WeightArg,
                                           StepArg, uint64_t, cudaStream_t);

struct StochasticLauncherEntry {
  PairKind kind;
  StochasticLauncher launch;
};

#define FUSED_EMA_SR_LAUNCHER(kind, ema, src, ema_tag, src_tag) \
  {PairKind::kind, &launch_lerp_stochastic<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>},
constexpr StochasticLauncherEntry kStochasticLaunchers[] = {
    FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_SR_LAUNCHER)};
#undef FUSED_EMA_SR_LAUNCHER
static_assert(in_pair_kind_order(kStochasticLaunchers),
              "kStochasticLaunchers must follow PairKind order");

using TracksLauncher = cudaError_t (*)(const TensorRef*, const TrackEmas*, int64_t,
                                       const TrackWeightArgs&, cudaStream_t);

struct TracksLauncherEntry {
  PairKind kind;
  TracksLauncher launch;
};

#define FUSED_EMA_TRACKS_LAUNCHER(kind, ema, src, ema_tag, src_tag) \
  {PairKind::kind, &launch_lerp_many<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>},
constexpr TracksLauncherEntry kTracksLaunchers[] = {
    FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_TRACKS_LAUNCHER)};
#undef FUSED_EMA_TRACKS_LAUNCHER
static_assert(in_pair_kind_order(kTracksLaunchers), "kTracksLaunchers must follow PairKind order");

using StochasticTracksLauncher = cudaError_t (*)(const TensorRef*, const SrTrackEmas*, int64_t,
                                                 const TrackWeightArgs&, StepArg, const uint64_t*,
                                                 cudaStream_t);

struct StochasticTracksLauncherEntry {
  PairKind kind;
  StochasticTracksLauncher launch;
};

#define FUSED_EMA_SR_TRACKS_LAUNCHER(kind, ema, src, ema_tag, src_tag) \
  {PairKind::kind, &launch_lerp_many_stochastic<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>},
constexpr StochasticTracksLauncherEntry kStochasticTracksLaunchers[] = {
    FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_SR_TRACKS_LAUNCHER)};
#undef FUSED_EMA_SR_TRACKS_LAUNCHER
static_assert(in_pair_kind_order(kStochasticTracksLaunchers),
              "kStochasticTracksLaunchers must follow PairKind order");

WeightArg weight_arg(const LerpWeight& weight) {
  WeightArg arg{weight.value, nullptr, nullptr};
  if (const at::Tensor* t = weight.device_tensor) {
    if (t->scalar_type() == at::kFloat) {
      arg.f32 = t->const_data_ptr<float>();
    } else {
      arg.f64 = t->const_data_ptr<double>();
    }
  }
  return arg;
}

void run_plan(const DevicePlan& plan, const LerpWeight& weight) {
  const c10::cuda::CUDAGuard guard(plan.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  std::array<std::vector<TensorRef>, kNumPairKinds> groups;
  for (const FlatPair& pair : plan.pairs) {
    groups[static_cast<size_t>(pair.kind)].push_back({pair.ema, pair.src, pair.numel});
  }
  const WeightArg arg = weight_arg(weight);
  for (size_t kind = 0; kind < groups.size(); ++kind) {
    if (!groups[kind].empty()) {
      C10_CUDA_CHECK(kLaunchers[kind].launch(
          groups[kind].data(), static_cast<int64_t>(groups[kind].size()), arg, stream));
    }
  }
  plan.write_back();
}

void run_stochastic_plan(const DevicePlan& plan, const LerpWeight& weight,
                         const StochasticRounding& rounding) {
  const c10::cuda::CUDAGuard guard(plan.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  std::array<std::vector<TensorRef>, kNumPairKinds> groups;
  std::array<std::vector<SrTensor>, kNumPairKinds> extras;
  for (const FlatPair& pair : plan.pairs) {
    const auto kind = static_cast<size_t>(pair.kind);
    groups[kind].push_back({pair.ema, pair.src, pair.numel});
    extras[kind].push_back({static_cast<uint64_t>(rounding.offsets[pair.index]),
                            static_cast<uint32_t>(rounding.keys[pair.index])});
  }
  const WeightArg arg = weight_arg(weight);
  const StepArg step{rounding.step, rounding.step_tensor != nullptr
                                        ? rounding.step_tensor->const_data_ptr<int64_t>()
                                        : nullptr};
  for (size_t kind = 0; kind < groups.size(); ++kind) {
    if (!groups[kind].empty()) {
      C10_CUDA_CHECK(kStochasticLaunchers[kind].launch(groups[kind].data(), extras[kind].data(),
                                                       static_cast<int64_t>(groups[kind].size()),
                                                       arg, step, rounding.seed, stream));
    }
  }
  plan.write_back();
}

// The weights of tracks [first, first + kMaxTracks).
TrackWeightArgs track_weight_args(const TrackWeights& weights, size_t first) {
  const at::Tensor* t = weights.device_tensor;
  if (t == nullptr) {
    return round_weights(weights.values.data(), weights.values.size(), nullptr, nullptr, 0, first);
  }
  const bool f32 = t->scalar_type() == at::kFloat;
  return round_weights(nullptr, 0, f32 ? t->const_data_ptr<float>() : nullptr,
                       f32 ? nullptr : t->const_data_ptr<double>(), t->stride(0), first);
}

void run_tracks_plan(const DevicePlan& plan, size_t tensors, const TrackWeights& weights) {
  const c10::cuda::CUDAGuard guard(plan.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  C10_CUDA_CHECK(for_each_track_launch<TrackEmas>(
      plan.pairs.data(), plan.pairs.size(), tensors, weights.tracks(),
      [](TrackEmas& extra, int slot, const FlatPair& pair) { extra.ema[slot] = pair.ema; },
      [&](int kind, size_t first, const TensorRef* refs, const TrackEmas* extras, int64_t count) {
        return kTracksLaunchers[kind].launch(refs, extras, count, track_weight_args(weights, first),
                                             stream);
      }));
  plan.write_back();
}

void run_stochastic_tracks_plan(const DevicePlan& plan, size_t tensors, const TrackWeights& weights,
                                const TrackRounding& rounding) {
  const c10::cuda::CUDAGuard guard(plan.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  const StepArg step{rounding.step, rounding.step_tensor != nullptr
                                        ? rounding.step_tensor->const_data_ptr<int64_t>()
                                        : nullptr};
  const size_t tracks = weights.tracks();
  C10_CUDA_CHECK(for_each_track_launch<SrTrackEmas>(
      plan.pairs.data(), plan.pairs.size(), tensors, tracks,
      [&](SrTrackEmas& extra, int slot, const FlatPair& pair) {
        extra.emas.ema[slot] = pair.ema;
        extra.key[slot] = static_cast<uint32_t>(rounding.keys[pair.index]);
        extra.offset = static_cast<uint64_t>(rounding.offsets[pair.index % tensors]);
      },
      [&](int kind, size_t first, const TensorRef* refs, const SrTrackEmas* extras, int64_t count) {
        const auto seeds = round_seeds(rounding.seeds.data(), tracks, first);
        return kStochasticTracksLaunchers[kind].launch(
            refs, extras, count, track_weight_args(weights, first), step, seeds.data(), stream);
      }));
  plan.write_back();
}

[[maybe_unused]] const bool kRegistered = register_device_runner(c10::DeviceType::CUDA, &run_plan);
[[maybe_unused]] const bool kStochasticRegistered =
    register_stochastic_runner(c10::DeviceType::CUDA, &run_stochastic_plan);
[[maybe_unused]] const bool kTracksRegistered =
    register_tracks_runner(c10::DeviceType::CUDA, &run_tracks_plan);
[[maybe_unused]] const bool kStochasticTracksRegistered =
    register_stochastic_tracks_runner(c10::DeviceType::CUDA, &run_stochastic_tracks_plan);

}  // namespace

// The architectures this file was compiled for, as nvcc lists them (800, 900, ...).
std::vector<int> compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  return {__CUDA_ARCH_LIST__};
#else
  return {};
#endif
}

int cuda_version_built() { return CUDART_VERSION; }

// Whether launches are kept at 4 KB; `set` >= 0 changes it and the previous setting is returned.
bool small_params(int set) {
  return set < 0 ? force_small_params().load() : force_small_params().exchange(set != 0);
}

TORCH_LIBRARY_IMPL(fused_ema, CUDA, m) {
  m.impl("lerp_", &lerp_op);
  m.impl("lerp_.Tensor", &lerp_op_tensor_weight);
  m.impl("lerp_stochastic_", &lerp_stochastic_op);
  m.impl("lerp_many_", &lerp_many_op);
  m.impl("lerp_many_stochastic_", &lerp_many_stochastic_op);
}

}  // namespace fused_ema::cuda
