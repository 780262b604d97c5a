// A test-only torch extension that runs fused_ema's CUDA device code on the CPU, compiled by a
// plain C++ compiler (test_cuda_emulation.py builds it): torch.ops.fused_ema_emulation.lerp_,
// lerp_stochastic_, lerp_many_, lerp_many_stochastic_, bema_ (the kernels, packed as for the 4 KB
// or the 32 KB layout, every block and thread run) and schedule_ (the schedule kernel's body).
// Arguments reach the kernels through fused_cuda.cu's own launch_lerp_call and launch_bema_call,
// and schedule_cuda.cu's body; tensor weights and steps are read through pointers.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cuda/fused_launch.cuh"
#include "dtype_pairs.h"
#include "emulated_launch.h"
#include "fused_op.h"
#include "schedule_formula.h"

namespace fused_ema::cuda::emulation {
namespace {

using Counts = std::vector<int64_t>;  // launches, blocks

Counts counts_of(cudaError_t err, const LaunchCounts& counts) {
  TORCH_CHECK(err == cudaSuccess, "emulated launch failed: error ", static_cast<int>(err));
  return {counts.launches, counts.blocks};
}

// The pairs of K tracks (emas flattened track by track, FlatPair::index = track * tensors +
// tensor) as the driver hands them to a runner:
// tensor by tensor, tracks in order, empty tensors left out, and the tracks of a host weight 0
// where `drop_zero` (fused_op.cpp drops them; lerp_'s emulation keeps them, to run the kernel's
// skip).
std::vector<FlatPair> track_pairs(at::TensorList emas, at::TensorList src,
                                  c10::ArrayRef<double> host_weights, size_t tracks,
                                  bool drop_zero) {
  const size_t n = src.size();
  TORCH_CHECK(tracks >= 1 && emas.size() == tracks * n, "K tracks of len(src) tensors");
  std::vector<FlatPair> pairs;
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < tracks; ++k) {
      const at::Tensor& e = emas[k * n + i];
      const std::optional<PairKind> kind = pair_kind(e.scalar_type(), src[i].scalar_type());
      TORCH_CHECK(kind.has_value(), "unsupported dtype pair");
      TORCH_CHECK(e.is_cpu() && src[i].is_cpu() && e.is_contiguous() && src[i].is_contiguous() &&
                      e.numel() == src[i].numel(),
                  "pair ", k * n + i, ": contiguous CPU tensors of one size");
      if (e.numel() > 0 && !(drop_zero && host_weights[k] == 0.0)) {
        pairs.push_back({e.data_ptr(), src[i].const_data_ptr(), e.numel(), *kind,
                         static_cast<uint32_t>(k * n + i)});
      }
    }
  }
  return pairs;
}

// Host values, or a tensor's float32/float64 elements read through a pointer as fused_cuda.cu
// passes a tensor on the EMA's device (0-dim: lerp_'s one weight).
CallWeights call_weights(c10::ArrayRef<double> values, const std::optional<at::Tensor>& tensor) {
  if (!tensor.has_value()) {
    return {values.data(), values.size(), nullptr, nullptr, 0};
  }
  TORCH_CHECK(tensor->dim() <= 1 &&
                  (tensor->scalar_type() == at::kFloat || tensor->scalar_type() == at::kDouble),
              "tensor weights: 0-dim or 1-D float32/float64");
  const bool f32 = tensor->scalar_type() == at::kFloat;
  return {nullptr, 0, f32 ? tensor->const_data_ptr<float>() : nullptr,
          f32 ? nullptr : tensor->const_data_ptr<double>(),
          tensor->dim() == 1 ? tensor->stride(0) : 0};
}

// lerp_ (one track) and lerp_many_ (K), rounding to nearest or stochastically, through the
// runner's own launch_lerp_call.
Counts run_lerp(at::TensorList emas, at::TensorList src, c10::ArrayRef<double> weights,
                const std::optional<at::Tensor>& weight_tensor, bool drop_zero, bool stochastic,
                at::IntArrayRef seeds, int64_t step, const std::optional<at::Tensor>& step_tensor,
                at::IntArrayRef keys, at::IntArrayRef offsets, bool large) {
  const size_t tracks =
      weight_tensor.has_value() ? static_cast<size_t>(weight_tensor->numel()) : weights.size();
  const size_t n = src.size();
  StepArg step_arg{static_cast<uint64_t>(step), nullptr};
  if (stochastic) {
    TORCH_CHECK(seeds.size() == tracks && keys.size() == tracks * n && offsets.size() == n,
                "a seed per track, a key per EMA tensor, an offset per src tensor");
    if (step_tensor.has_value()) {
      TORCH_CHECK(step_tensor->numel() == 1 && step_tensor->scalar_type() == at::kLong,
                  "a tensor step is one int64 element");
      step_arg = {0, step_tensor->const_data_ptr<int64_t>()};
    }
  }
  const std::vector<FlatPair> pairs =
      track_pairs(emas, src, weights, tracks, drop_zero && !weight_tensor.has_value());
  const LerpCall call{n,           tracks,        call_weights(weights, weight_tensor),
                      stochastic,  step_arg,      seeds.data(),
                      keys.data(), offsets.data()};
  LaunchCounts counts;
  return counts_of(
      launch_lerp_call(pairs.data(), pairs.size(), call, EmulatedLaunch{large, counts}), counts);
}

Counts lerp_op(at::TensorList ema, at::TensorList src, double weight,
               const std::optional<at::Tensor>& weight_tensor, bool large) {
  return run_lerp(ema, src, {weight}, weight_tensor, false, false, {}, 0, std::nullopt, {}, {},
                  large);
}

Counts lerp_stochastic_op(at::TensorList ema, at::TensorList src, double weight,
                          const std::optional<at::Tensor>& weight_tensor, int64_t seed,
                          int64_t step, const std::optional<at::Tensor>& step_tensor,
                          at::IntArrayRef keys, at::IntArrayRef offsets, bool large) {
  return run_lerp(ema, src, {weight}, weight_tensor, false, true, {seed}, step, step_tensor, keys,
                  offsets, large);
}

Counts lerp_many_op(at::TensorList emas, at::TensorList src, c10::ArrayRef<double> weights,
                    const std::optional<at::Tensor>& weight_tensor, bool large) {
  return run_lerp(emas, src, weights, weight_tensor, true, false, {}, 0, std::nullopt, {}, {},
                  large);
}

Counts lerp_many_stochastic_op(at::TensorList emas, at::TensorList src,
                               c10::ArrayRef<double> weights,
                               const std::optional<at::Tensor>& weight_tensor,
                               at::IntArrayRef seeds, int64_t step,
                               const std::optional<at::Tensor>& step_tensor, at::IntArrayRef keys,
                               at::IntArrayRef offsets, bool large) {
  return run_lerp(emas, src, weights, weight_tensor, true, true, seeds, step, step_tensor, keys,
                  offsets, large);
}

// bema_ through the runner's own launch_bema_call (theta0 and out as per-tensor data, weights as
// host values or a device pointer).
Counts bema_op(at::TensorList ema, at::TensorList theta0, at::TensorList out, at::TensorList src,
               c10::ArrayRef<double> weights, const std::optional<at::Tensor>& weight_tensor,
               bool large) {
  TORCH_CHECK(theta0.size() == ema.size() && out.size() == ema.size() && src.size() == ema.size(),
              "equal lists");
  if (weight_tensor.has_value()) {
    TORCH_CHECK(weight_tensor->dim() == 1 && weight_tensor->numel() == 3,
                "tensor weights: 1-D, 3 float32/float64 elements");
  } else {
    TORCH_CHECK(weights.size() == 3, "3 host weights");
    if (weights[0] == 0.0 && weights[1] == 0.0 && weights[2] == 0.0) {
      return {0, 0};  // fused_op.cpp launches nothing
    }
  }
  std::vector<BemaItem> items;
  for (size_t i = 0; i < ema.size(); ++i) {
    const std::optional<PairKind> kind = pair_kind(ema[i].scalar_type(), src[i].scalar_type());
    TORCH_CHECK(kind.has_value(), "unsupported dtype pair");
    for (const at::Tensor& t : {ema[i], theta0[i], out[i]}) {
      TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.scalar_type() == ema[i].scalar_type() &&
                      t.numel() == src[i].numel() && src[i].is_cpu() && src[i].is_contiguous(),
                  "ema, theta0 and out: contiguous CPU tensors of one dtype, as src");
    }
    if (src[i].numel() > 0) {
      items.push_back({ema[i].data_ptr(), theta0[i].data_ptr(), out[i].data_ptr(),
                       src[i].const_data_ptr(), src[i].numel(), *kind});
    }
  }
  LaunchCounts counts;
  const CallWeights w = call_weights(weights, weight_tensor);
  return counts_of(launch_bema_call(items.data(), items.size(), w, EmulatedLaunch{large, counts}),
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
  using Sr = LerpOp<__nv_bfloat16, float, 1, true>;
  using Plain = LerpOp<float, float>;
  using Many = LerpOp<float, float, kMaxTracks>;
  using ManySr = LerpOp<__nv_bfloat16, float, kMaxTracks, true>;
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
