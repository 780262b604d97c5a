// The CUDA runner of the fused-op family (fused_op.h): the torch glue around fused_launch.cuh,
// which groups a device's pairs by dtype pair and launches each group in as few launches as the
// kernel-parameter metadata allows, on the current stream of that device.
#include <torch/library.h>

#include <vector>

#include "../fused_op.h"
#include "fused_launch.cuh"
#include "torch_cuda.h"

namespace fused_ema::cuda {
namespace {

// Host values, or the device tensor the kernels read (then its values are left empty).
CallWeights call_weights(const FusedWeights& w) {
  const at::Tensor* t = w.device_tensor;
  const bool f32 = t != nullptr && t->scalar_type() == at::kFloat;
  const bool f64 = t != nullptr && !f32;
  return {w.values.data(), w.values.size(), f32 ? t->const_data_ptr<float>() : nullptr,
          f64 ? t->const_data_ptr<double>() : nullptr, w.stride};
}

void run_fused(const DevicePlan& plan, const FusedCall& call) {
  const DeviceGuard guard(plan.device.index());
  const StreamLaunch launch{current_stream(plan.device.index())};
  const CallWeights weights = call_weights(call.weights);
  if (call.bema()) {
    const std::vector<BemaItem> items = bema_items(plan, call.tensors);
    FUSED_EMA_CUDA_CHECK(launch_bema_call(items.data(), items.size(), weights, launch));
  } else {
    const FusedRounding& r = call.rounding;
    const StepArg step{
        r.step, r.step_tensor != nullptr ? r.step_tensor->const_data_ptr<int64_t>() : nullptr};
    const LerpCall lerp{call.tensors, call.weights.tracks, weights,       call.stochastic(),
                        step,         r.seeds.data(),      r.keys.data(), r.offsets.data()};
    FUSED_EMA_CUDA_CHECK(launch_lerp_call(plan.pairs.data(), plan.pairs.size(), lerp, launch));
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
