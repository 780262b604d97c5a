// The CUDA runner of the fused-op family (fused_op.h): the torch glue around multi_tensor_apply. A
// device's pairs are grouped by dtype pair (lerp_many_'s also by rounds of tracks, bema_'s as one
// item per source) and each group goes out in as few launches as the kernel-parameter metadata
// allows, on the current stream of that device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "../fused_op.h"
#include "bema_functor.cuh"
#include "lerp_functor.cuh"
#include "lerp_many_functor.cuh"
#include "pair_types.cuh"
#include "stochastic_functor.cuh"

namespace fused_ema::cuda {
namespace {

// The launchers of one dtype pair: lerp_, lerp_stochastic_, lerp_many_ (K > 1), its stochastic
// rounding and bema_.
struct Launchers {
  PairKind kind;
  decltype(&launch_lerp<float, float>) lerp;
  decltype(&launch_lerp_stochastic<float, float>) stochastic;
  decltype(&launch_lerp_many<float, float>) tracks;
  decltype(&launch_lerp_many_stochastic<float, float>) stochastic_tracks;
  decltype(&launch_bema<float, float>) bema;
};

template <typename E, typename S>
constexpr Launchers launchers_of(PairKind kind) {
  return {kind,
          &launch_lerp<E, S>,
          &launch_lerp_stochastic<E, S>,
          &launch_lerp_many<E, S>,
          &launch_lerp_many_stochastic<E, S>,
          &launch_bema<E, S>};
}

#define FUSED_EMA_LAUNCHERS(kind, ema, src, ema_tag, src_tag) \
  launchers_of<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>(PairKind::kind),
constexpr Launchers kLaunchers[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_LAUNCHERS)};
#undef FUSED_EMA_LAUNCHERS
static_assert(in_pair_kind_order(kLaunchers), "kLaunchers must follow PairKind order");

// A device tensor of weights as the kernels read it (null pointers for host values).
struct DeviceWeights {
  const float* f32 = nullptr;
  const double* f64 = nullptr;
};

DeviceWeights device_weights(const FusedWeights& weights) {
  const at::Tensor* t = weights.device_tensor;
  if (t == nullptr) {
    return {};
  }
  if (t->scalar_type() == at::kFloat) {
    return {t->const_data_ptr<float>(), nullptr};
  }
  return {nullptr, t->const_data_ptr<double>()};
}

// lerp_ and lerp_stochastic_ (any call of one track): a launch per dtype pair.
cudaError_t launch_one_track(const DevicePlan& plan, const FusedCall& call, StepArg step,
                             cudaStream_t stream) {
  const FusedRounding& r = call.rounding;
  std::array<std::vector<TensorRef>, kNumPairKinds> groups;
  std::array<std::vector<SrTensor>, kNumPairKinds> extras;
  for (const FlatPair& pair : plan.pairs) {
    const auto kind = static_cast<size_t>(pair.kind);
    groups[kind].push_back({pair.ema, pair.src, pair.numel});
    if (call.stochastic()) {
      extras[kind].push_back({static_cast<uint64_t>(r.offsets[pair.index]),
                              static_cast<uint32_t>(r.keys[pair.index])});
    }
  }
  const DeviceWeights d = device_weights(call.weights);
  const WeightArg weight{call.weights.values.empty() ? 0.0 : call.weights.values[0], d.f32, d.f64};
  for (size_t kind = 0; kind < groups.size(); ++kind) {
    const auto count = static_cast<int64_t>(groups[kind].size());
    if (count == 0) {
      continue;
    }
    const cudaError_t err =
        call.stochastic()
            ? kLaunchers[kind].stochastic(groups[kind].data(), extras[kind].data(), count, weight,
                                          step, static_cast<uint64_t>(r.seeds[0]), stream)
            : kLaunchers[kind].lerp(groups[kind].data(), count, weight, stream);
    if (err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

// lerp_many_ and its stochastic rounding: rounds of up to kMaxTracks tracks, a launch per dtype
// pair and round.
cudaError_t launch_tracks(const DevicePlan& plan, const FusedCall& call, StepArg step,
                          cudaStream_t stream) {
  const FusedWeights& w = call.weights;
  const FusedRounding& r = call.rounding;
  const size_t tensors = call.tensors;
  const DeviceWeights d = device_weights(w);
  const auto weights_from = [&](size_t first) {
    return round_weights(w.values.data(), w.values.size(), d.f32, d.f64, w.stride, first);
  };
  if (!call.stochastic()) {
    return for_each_track_launch<TrackEmas>(
        plan.pairs.data(), plan.pairs.size(), tensors, w.tracks,
        [](TrackEmas& extra, int slot, const FlatPair& pair) { extra.ema[slot] = pair.ema; },
        [&](int kind, size_t first, const TensorRef* refs, const TrackEmas* extras, int64_t n) {
          return kLaunchers[kind].tracks(refs, extras, n, weights_from(first), stream);
        });
  }
  return for_each_track_launch<SrTrackEmas>(
      plan.pairs.data(), plan.pairs.size(), tensors, w.tracks,
      [&](SrTrackEmas& extra, int slot, const FlatPair& pair) {
        extra.emas.ema[slot] = pair.ema;
        extra.key[slot] = static_cast<uint32_t>(r.keys[pair.index]);
        extra.offset = static_cast<uint64_t>(r.offsets[pair.index % tensors]);
      },
      [&](int kind, size_t first, const TensorRef* refs, const SrTrackEmas* extras, int64_t n) {
        const auto seeds = round_seeds(r.seeds.data(), w.tracks, first);
        return kLaunchers[kind].stochastic_tracks(refs, extras, n, weights_from(first), step,
                                                  seeds.data(), stream);
      });
}

// bema_: one item per source, theta0 and out as its per-tensor data.
cudaError_t launch_bema_items(const DevicePlan& plan, const FusedCall& call, cudaStream_t stream) {
  const FusedWeights& w = call.weights;
  const DeviceWeights d = device_weights(w);
  BemaWeightArgs args{{0.0, 0.0, 0.0}, d.f32, d.f64, w.stride};
  std::copy(w.values.begin(), w.values.end(), args.value);
  const BemaLaunch launch(args);
  std::array<std::vector<TensorRef>, kNumPairKinds> refs;
  std::array<std::vector<BemaTensors>, kNumPairKinds> extras;
  for (const BemaItem& item : bema_items(plan, call.tensors)) {
    const auto kind = static_cast<size_t>(item.kind);
    launch.add(item.ema, item.theta0, item.out, item.src, item.numel, refs[kind], extras[kind]);
  }
  for (size_t kind = 0; kind < refs.size(); ++kind) {
    if (refs[kind].empty()) {
      continue;
    }
    const cudaError_t err =
        kLaunchers[kind].bema(refs[kind].data(), extras[kind].data(),
                              static_cast<int64_t>(refs[kind].size()), launch.weights, stream);
    if (err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

void run_fused(const DevicePlan& plan, const FusedCall& call) {
  const c10::cuda::CUDAGuard guard(plan.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  const FusedRounding& r = call.rounding;
  const StepArg step{r.step,
                     r.step_tensor != nullptr ? r.step_tensor->const_data_ptr<int64_t>() : nullptr};
  if (call.bema()) {
    C10_CUDA_CHECK(launch_bema_items(plan, call, stream));
  } else if (call.weights.tracks == 1) {
    C10_CUDA_CHECK(launch_one_track(plan, call, step, stream));
  } else {
    C10_CUDA_CHECK(launch_tracks(plan, call, step, stream));
  }
  plan.write_back();
}

[[maybe_unused]] const bool kRegistered = register_fused_runner(c10::DeviceType::CUDA, &run_fused);

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

TORCH_LIBRARY_IMPL(fused_ema, CUDA, m) { register_fused_ops(m); }

}  // namespace fused_ema::cuda
