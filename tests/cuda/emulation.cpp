// A test-only torch extension that runs fused_ema's CUDA device code on the CPU, compiled by a
// plain C++ compiler (test_cuda_emulation.py builds it): torch.ops.fused_ema_emulation.lerp_,
// lerp_stochastic_, lerp_many_, lerp_many_stochastic_, bema_ (the kernels, packed as for the 4 KB
// or the 32 KB layout, every block and thread run) and schedule_ (the schedule kernel's body).
// Arguments reach the kernels as fused_cuda.cu and schedule_cuda.cu pass them (lerp_many_'s
// through the same for_each_track_launch); tensor weights and steps are read through pointers.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cuda/bema_functor.cuh"
#include "cuda/lerp_functor.cuh"
#include "cuda/lerp_many_functor.cuh"
#include "cuda/pair_types.cuh"
#include "cuda/schedule_step.cuh"
#include "cuda/stochastic_functor.cuh"
#include "dtype_pairs.h"
#include "emulated_launch.h"

namespace fused_ema::cuda::emulation {
namespace {

using Counts = std::vector<int64_t>;  // launches, blocks

Counts counts_of(cudaError_t err, const LaunchCounts& counts) {
  TORCH_CHECK(err == cudaSuccess, "emulated launch failed: error ", static_cast<int>(err));
  return {counts.launches, counts.blocks};
}

template <typename E, typename S>
Counts lerp(const std::vector<TensorRef>& refs, WeightArg weight, bool large) {
  LaunchCounts counts;
  const cudaError_t err = multi_tensor_apply(refs.data(), static_cast<int64_t>(refs.size()),
                                             LerpOp<E, S>{weight}, large, counts);
  return counts_of(err, counts);
}

// launch_lerp_stochastic's choice: stochastic rounding for 16-bit EMAs, else the plain lerp.
template <typename E, typename S>
Counts lerp_stochastic(const std::vector<TensorRef>& refs, const std::vector<SrTensor>& extras,
                       WeightArg weight, StepArg step, uint64_t seed, bool large) {
  if constexpr (kRoundsStochastically<E>) {
    LaunchCounts counts;
    const cudaError_t err = multi_tensor_apply(refs.data(), static_cast<int64_t>(refs.size()),
                                               LerpStochasticOp<E, S>{weight, step, seed}, large,
                                               counts, extras.data());
    return counts_of(err, counts);
  } else {
    return lerp<E, S>(refs, weight, large);
  }
}

using LerpFn = Counts (*)(const std::vector<TensorRef>&, WeightArg, bool);
using StochasticFn = Counts (*)(const std::vector<TensorRef>&, const std::vector<SrTensor>&,
                                WeightArg, StepArg, uint64_t, bool);

#define FUSED_EMA_EMULATED(kind, ema, src, ema_tag, src_tag) \
  &lerp<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>,
constexpr LerpFn kLerp[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_EMULATED)};
#undef FUSED_EMA_EMULATED
#define FUSED_EMA_EMULATED(kind, ema, src, ema_tag, src_tag) \
  &lerp_stochastic<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>,
constexpr StochasticFn kStochastic[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_EMULATED)};
#undef FUSED_EMA_EMULATED

// The lists' one dtype pair, and each pair as a dense TensorRef.
PairKind dense_refs(at::TensorList ema, at::TensorList src, std::vector<TensorRef>& refs) {
  TORCH_CHECK(!ema.empty() && ema.size() == src.size(), "ema and src: equal, non-empty lists");
  const std::optional<PairKind> kind = pair_kind(ema[0].scalar_type(), src[0].scalar_type());
  TORCH_CHECK(kind.has_value(), "unsupported dtype pair");
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK(ema[i].scalar_type() == ema[0].scalar_type() &&
                    src[i].scalar_type() == src[0].scalar_type(),
                "one dtype pair per call");
    TORCH_CHECK(ema[i].is_cpu() && src[i].is_cpu() && ema[i].is_contiguous() &&
                    src[i].is_contiguous() && ema[i].numel() == src[i].numel(),
                "pair ", i, ": contiguous CPU tensors of one size");
    refs.push_back({ema[i].data_ptr(), src[i].const_data_ptr(), ema[i].numel()});
  }
  return *kind;
}

// A device-side weight: WeightArg's pointer, as fused_cuda.cu passes a tensor on the EMA's device.
WeightArg weight_arg(double weight, const std::optional<at::Tensor>& tensor) {
  if (!tensor.has_value()) {
    return {weight, nullptr, nullptr};
  }
  TORCH_CHECK(tensor->numel() == 1 &&
                  (tensor->scalar_type() == at::kFloat || tensor->scalar_type() == at::kDouble),
              "a tensor weight is one float32/float64 element");
  if (tensor->scalar_type() == at::kFloat) {
    return {0.0, tensor->const_data_ptr<float>(), nullptr};
  }
  return {0.0, nullptr, tensor->const_data_ptr<double>()};
}

Counts lerp_op(at::TensorList ema, at::TensorList src, double weight,
               const std::optional<at::Tensor>& weight_tensor, bool large) {
  std::vector<TensorRef> refs;
  const PairKind kind = dense_refs(ema, src, refs);
  return kLerp[static_cast<size_t>(kind)](refs, weight_arg(weight, weight_tensor), large);
}

Counts lerp_stochastic_op(at::TensorList ema, at::TensorList src, double weight,
                          const std::optional<at::Tensor>& weight_tensor, int64_t seed,
                          int64_t step, const std::optional<at::Tensor>& step_tensor,
                          at::IntArrayRef keys, at::IntArrayRef offsets, bool large) {
  std::vector<TensorRef> refs;
  const PairKind kind = dense_refs(ema, src, refs);
  TORCH_CHECK(keys.size() == ema.size() && offsets.size() == ema.size(),
              "a key and an offset per tensor");
  std::vector<SrTensor> extras;
  for (size_t i = 0; i < ema.size(); ++i) {
    extras.push_back({static_cast<uint64_t>(offsets[i]), static_cast<uint32_t>(keys[i])});
  }
  StepArg step_arg{static_cast<uint64_t>(step), nullptr};
  if (step_tensor.has_value()) {
    TORCH_CHECK(step_tensor->numel() == 1 && step_tensor->scalar_type() == at::kLong,
                "a tensor step is one int64 element");
    step_arg = {0, step_tensor->const_data_ptr<int64_t>()};
  }
  return kStochastic[static_cast<size_t>(kind)](refs, extras, weight_arg(weight, weight_tensor),
                                                step_arg, static_cast<uint64_t>(seed), large);
}

// lerp_many_'s launches of one dtype pair, with launch_lerp_many_stochastic's choice.
template <typename E, typename S>
cudaError_t lerp_many(const TensorRef* refs, const TrackEmas* extras, int64_t count,
                      const TrackWeightArgs& weights, bool large, LaunchCounts& counts) {
  return multi_tensor_apply(refs, count, LerpManyOp<E, S>{weights}, large, counts, extras);
}

template <typename E, typename S>
cudaError_t lerp_many_stochastic(const TensorRef* refs, const SrTrackEmas* extras, int64_t count,
                                 const TrackWeightArgs& weights, StepArg step,
                                 const uint64_t* seeds, bool large, LaunchCounts& counts) {
  if constexpr (kRoundsStochastically<E>) {
    LerpManyStochasticOp<E, S> op{weights, step, {}};
    std::copy(seeds, seeds + kMaxTracks, op.seed);
    return multi_tensor_apply(refs, count, op, large, counts, extras);
  } else {
    const std::vector<TrackEmas> emas = emas_of(extras, count);
    return lerp_many<E, S>(refs, emas.data(), count, weights, large, counts);
  }
}

using ManyFn = cudaError_t (*)(const TensorRef*, const TrackEmas*, int64_t, const TrackWeightArgs&,
                               bool, LaunchCounts&);
using ManyStochasticFn = cudaError_t (*)(const TensorRef*, const SrTrackEmas*, int64_t,
                                         const TrackWeightArgs&, StepArg, const uint64_t*, bool,
                                         LaunchCounts&);

#define FUSED_EMA_EMULATED(kind, ema, src, ema_tag, src_tag) \
  &lerp_many<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>,
constexpr ManyFn kMany[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_EMULATED)};
#undef FUSED_EMA_EMULATED
#define FUSED_EMA_EMULATED(kind, ema, src, ema_tag, src_tag) \
  &lerp_many_stochastic<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>,
constexpr ManyStochasticFn kManyStochastic[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_EMULATED)};
#undef FUSED_EMA_EMULATED

// A pair of lerp_many_ as a device plan holds it (lerp_plan.h's FlatPair).
struct TrackPair {
  void* ema;
  const void* src;
  int64_t numel;
  PairKind kind;
  uint32_t index;  // track * tensors + tensor
};

// The pairs of K tracks (emas flattened track by track) as lerp_many's driver hands them to a
// runner: tensor by tensor, tracks in order, empty tensors and tracks of a host weight 0 left out.
std::vector<TrackPair> track_pairs(at::TensorList emas, at::TensorList src,
                                   c10::ArrayRef<double> host_weights, size_t tracks) {
  const size_t n = src.size();
  TORCH_CHECK(tracks >= 1 && emas.size() == tracks * n, "K tracks of len(src) tensors");
  std::vector<TrackPair> pairs;
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < tracks; ++k) {
      const at::Tensor& e = emas[k * n + i];
      const std::optional<PairKind> kind = pair_kind(e.scalar_type(), src[i].scalar_type());
      TORCH_CHECK(kind.has_value(), "unsupported dtype pair");
      TORCH_CHECK(e.is_cpu() && src[i].is_cpu() && e.is_contiguous() && src[i].is_contiguous() &&
                      e.numel() == src[i].numel(),
                  "pair ", k * n + i, ": contiguous CPU tensors of one size");
      if (e.numel() > 0 && (host_weights.empty() || host_weights[k] != 0.0)) {
        pairs.push_back({e.data_ptr(), src[i].const_data_ptr(), e.numel(), *kind,
                         static_cast<uint32_t>(k * n + i)});
      }
    }
  }
  return pairs;
}

// Tracks [first, first + kMaxTracks)'s weights: host values, or a 1-D tensor's elements.
TrackWeightArgs track_weights(c10::ArrayRef<double> values, const std::optional<at::Tensor>& tensor,
                              size_t first) {
  if (!tensor.has_value()) {
    return round_weights(values.data(), values.size(), nullptr, nullptr, 0, first);
  }
  TORCH_CHECK(tensor->dim() == 1 &&
                  (tensor->scalar_type() == at::kFloat || tensor->scalar_type() == at::kDouble),
              "tensor weights: 1-D float32/float64");
  const bool f32 = tensor->scalar_type() == at::kFloat;
  return round_weights(nullptr, 0, f32 ? tensor->const_data_ptr<float>() : nullptr,
                       f32 ? nullptr : tensor->const_data_ptr<double>(), tensor->stride(0), first);
}

size_t tracks_of(c10::ArrayRef<double> values, const std::optional<at::Tensor>& tensor) {
  return tensor.has_value() ? static_cast<size_t>(tensor->numel()) : values.size();
}

Counts lerp_many_op(at::TensorList emas, at::TensorList src, c10::ArrayRef<double> weights,
                    const std::optional<at::Tensor>& weight_tensor, bool large) {
  const size_t tracks = tracks_of(weights, weight_tensor);
  const std::vector<TrackPair> pairs =
      track_pairs(emas, src, weight_tensor.has_value() ? c10::ArrayRef<double>() : weights, tracks);
  LaunchCounts counts;
  const cudaError_t err = for_each_track_launch<TrackEmas>(
      pairs.data(), pairs.size(), src.size(), tracks,
      [](TrackEmas& extra, int slot, const TrackPair& pair) { extra.ema[slot] = pair.ema; },
      [&](int kind, size_t first, const TensorRef* refs, const TrackEmas* extras, int64_t count) {
        return kMany[kind](refs, extras, count, track_weights(weights, weight_tensor, first), large,
                           counts);
      });
  return counts_of(err, counts);
}

Counts lerp_many_stochastic_op(at::TensorList emas, at::TensorList src,
                               c10::ArrayRef<double> weights,
                               const std::optional<at::Tensor>& weight_tensor,
                               at::IntArrayRef seeds, int64_t step,
                               const std::optional<at::Tensor>& step_tensor, at::IntArrayRef keys,
                               at::IntArrayRef offsets, bool large) {
  const size_t tracks = tracks_of(weights, weight_tensor);
  const size_t n = src.size();
  TORCH_CHECK(seeds.size() == tracks && keys.size() == tracks * n && offsets.size() == n,
              "a seed per track, a key per EMA tensor, an offset per src tensor");
  const std::vector<TrackPair> pairs =
      track_pairs(emas, src, weight_tensor.has_value() ? c10::ArrayRef<double>() : weights, tracks);
  StepArg step_arg{static_cast<uint64_t>(step), nullptr};
  if (step_tensor.has_value()) {
    step_arg = {0, step_tensor->const_data_ptr<int64_t>()};
  }
  LaunchCounts counts;
  const cudaError_t err = for_each_track_launch<SrTrackEmas>(
      pairs.data(), pairs.size(), n, tracks,
      [&](SrTrackEmas& extra, int slot, const TrackPair& pair) {
        extra.emas.ema[slot] = pair.ema;
        extra.key[slot] = static_cast<uint32_t>(keys[pair.index]);
        extra.offset = static_cast<uint64_t>(offsets[pair.index % n]);
      },
      [&](int kind, size_t first, const TensorRef* refs, const SrTrackEmas* extras, int64_t count) {
        const auto round = round_seeds(seeds.data(), tracks, first);
        return kManyStochastic[kind](refs, extras, count,
                                     track_weights(weights, weight_tensor, first), step_arg,
                                     round.data(), large, counts);
      });
  return counts_of(err, counts);
}

// bema_'s launches of one dtype pair, as fused_cuda.cu makes them (theta0 and out as per-tensor
// data, weights as host values or a device pointer).
template <typename E, typename S>
cudaError_t bema(const std::vector<TensorRef>& refs, const std::vector<BemaTensors>& extras,
                 const BemaWeightArgs& weights, bool large, LaunchCounts& counts) {
  return multi_tensor_apply(refs.data(), static_cast<int64_t>(refs.size()), BemaOp<E, S>{weights},
                            large, counts, extras.data());
}

using BemaFn = cudaError_t (*)(const std::vector<TensorRef>&, const std::vector<BemaTensors>&,
                               const BemaWeightArgs&, bool, LaunchCounts&);
#define FUSED_EMA_EMULATED(kind, ema, src, ema_tag, src_tag) \
  &bema<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>,
constexpr BemaFn kBema[] = {FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_EMULATED)};
#undef FUSED_EMA_EMULATED

Counts bema_op(at::TensorList ema, at::TensorList theta0, at::TensorList out, at::TensorList src,
               c10::ArrayRef<double> weights, const std::optional<at::Tensor>& weight_tensor,
               bool large) {
  std::vector<TensorRef> dense;
  const PairKind kind = dense_refs(ema, src, dense);
  TORCH_CHECK(theta0.size() == ema.size() && out.size() == ema.size(), "equal lists");
  BemaWeightArgs args{{0.0, 0.0, 0.0}, nullptr, nullptr, 0};
  if (weight_tensor.has_value()) {
    TORCH_CHECK(weight_tensor->dim() == 1 && weight_tensor->numel() == 3 &&
                    (weight_tensor->scalar_type() == at::kFloat ||
                     weight_tensor->scalar_type() == at::kDouble),
                "tensor weights: 1-D, 3 float32/float64 elements");
    args.stride = weight_tensor->stride(0);
    if (weight_tensor->scalar_type() == at::kFloat) {
      args.f32 = weight_tensor->const_data_ptr<float>();
    } else {
      args.f64 = weight_tensor->const_data_ptr<double>();
    }
  } else {
    TORCH_CHECK(weights.size() == 3, "3 host weights");
    std::copy(weights.begin(), weights.end(), args.value);
    if (weights[0] == 0.0 && weights[1] == 0.0 && weights[2] == 0.0) {
      return {0, 0};  // fused_op.cpp launches nothing
    }
  }
  // As fused_cuda.cu passes them (BemaLaunch: theta0 in the EMA's place where only it changes).
  const BemaLaunch launch(args);
  std::vector<TensorRef> refs;
  std::vector<BemaTensors> extras;
  for (size_t i = 0; i < ema.size(); ++i) {
    for (const at::Tensor& t : {theta0[i], out[i]}) {
      TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.scalar_type() == ema[i].scalar_type() &&
                      t.numel() == ema[i].numel(),
                  "theta0 and out: contiguous CPU tensors as ema");
    }
    launch.add(dense[i].ema, theta0[i].data_ptr(), out[i].data_ptr(), dense[i].src, dense[i].numel,
               refs, extras);
  }
  LaunchCounts counts;
  return counts_of(kBema[static_cast<size_t>(kind)](refs, extras, launch.weights, large, counts),
                   counts);
}

// Tensors a bema_ launch carries: 4 KB, 32 KB.
Counts bema_capacities() {
  using Op = BemaOp<float, float>;
  return {op_capacity<Op, kSmallParamBytes>(), op_capacity<Op, kLargeParamBytes>()};
}

void schedule_op(const at::Tensor& step, const at::Tensor& out, const at::Tensor& config,
                 bool advance) {
  TORCH_CHECK(step.scalar_type() == at::kLong && step.numel() == 1 &&
                  out.scalar_type() == at::kDouble && out.numel() == 2 && out.is_contiguous() &&
                  config.scalar_type() == at::kDouble && config.numel() == kNumConfigFields &&
                  config.is_contiguous(),
              "step: one int64; out: 2 float64; config: 8 float64");
  schedule_step(step.mutable_data_ptr<int64_t>(), out.mutable_data_ptr<double>(),
                config.const_data_ptr<double>(), advance);
}

// Tensors a launch carries: lerp_ 4 KB, 32 KB; lerp_stochastic_ (16-bit EMAs) 4 KB, 32 KB;
// lerp_many_ 4 KB, 32 KB; lerp_many_stochastic_ (16-bit EMAs) 4 KB, 32 KB; tracks a launch.
Counts capacities() {
  using Sr = LerpStochasticOp<__nv_bfloat16, float>;
  using Plain = LerpOp<float, float>;
  using Many = LerpManyOp<float, float>;
  using ManySr = LerpManyStochasticOp<__nv_bfloat16, float>;
  return {op_capacity<Plain, kSmallParamBytes>(),
          op_capacity<Plain, kLargeParamBytes>(),
          op_capacity<Sr, kSmallParamBytes>(),
          op_capacity<Sr, kLargeParamBytes>(),
          op_capacity<Many, kSmallParamBytes>(),
          op_capacity<Many, kLargeParamBytes>(),
          op_capacity<ManySr, kSmallParamBytes>(),
          op_capacity<ManySr, kLargeParamBytes>(),
          kMaxTracks};
}

}  // namespace
}  // namespace fused_ema::cuda::emulation

namespace emu = fused_ema::cuda::emulation;

TORCH_LIBRARY(fused_ema_emulation, m) {
  m.def(
      "lerp_(Tensor(a!)[] ema, Tensor[] src, float weight, Tensor? weight_tensor, bool large)"
      " -> int[]",
      &emu::lerp_op);
  m.def(
      "lerp_stochastic_(Tensor(a!)[] ema, Tensor[] src, float weight, Tensor? weight_tensor, "
      "int seed, int step, Tensor? step_tensor, int[] keys, int[] offsets, bool large) -> int[]",
      &emu::lerp_stochastic_op);
  m.def(
      "lerp_many_(Tensor(a!)[] emas, Tensor[] src, float[] weights, Tensor? weight_tensor, "
      "bool large) -> int[]",
      &emu::lerp_many_op);
  m.def(
      "lerp_many_stochastic_(Tensor(a!)[] emas, Tensor[] src, float[] weights, "
      "Tensor? weight_tensor, int[] seeds, int step, Tensor? step_tensor, int[] keys, "
      "int[] offsets, bool large) -> int[]",
      &emu::lerp_many_stochastic_op);
  m.def("schedule_(Tensor(a!) step, Tensor(b!) out, Tensor config, bool advance) -> ()",
        &emu::schedule_op);
  m.def("capacities() -> int[]", &emu::capacities);
  m.def(
      "bema_(Tensor(a!)[] ema, Tensor(b!)[] theta0, Tensor(c!)[] out, Tensor[] src, "
      "float[] weights, Tensor? weight_tensor, bool large) -> int[]",
      &emu::bema_op);
  m.def("bema_capacities() -> int[]", &emu::bema_capacities);
}
