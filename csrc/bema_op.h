// The device-independent driver of fused_ema::bema_ (bias-corrected EMA, Block & Zhang 2025): per
// source tensor an EMA, a snapshot theta0 and the corrected weights out, all three from one read
// of the source. The 3 * N (target, src) pairs go through lerp_'s planner and its checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <cstdint>
#include <vector>

#include "lerp_plan.h"

namespace fused_ema {

// One source tensor's work, as a runner receives it: four dense views of numel elements in the
// same (row-major) order, ema, theta0 and out of one dtype; `kind` is the (ema, src) dtype pair.
struct BemaItem {
  void* ema;
  void* theta0;
  void* out;
  const void* src;
  int64_t numel;
  PairKind kind;
};

// The weights (beta, w0, alpha): known on the host, or 3 float32/float64 elements on the plan's
// device, `stride` apart, that the kernel reads (no host sync; capturable in a CUDA graph).
struct BemaWeights {
  double values[3] = {0.0, 0.0, 0.0};
  const at::Tensor* device_tensor = nullptr;

  bool any_work() const {
    return device_tensor != nullptr || values[0] != 0.0 || values[1] != 0.0 || values[2] != 0.0;
  }
};

// A runner gets one device's items (tensors of 0 elements left out) and calls plan.write_back()
// once its kernels are issued.
using BemaRunner = void (*)(const DevicePlan& plan, const std::vector<BemaItem>& items,
                            const BemaWeights& weights);

// Called from static initialisers of cpu/ and cuda/; returns true so it can initialise a flag.
bool register_bema_runner(c10::DeviceType type, BemaRunner runner);

// The checks of the weights: a 1-D tensor of 3 float32/float64 elements on the EMAs' device or
// the CPU (read here from the CPU), or 3 host values; host values must be finite.
BemaWeights checked_bema_weights(const at::Tensor& weights);
BemaWeights checked_bema_weights(const double (&values)[3]);

// `weights` as checked_bema_weights takes it.
void bema(TensorRefs ema, TensorRefs theta0, TensorRefs out, TensorRefs src,
          const at::Tensor& weights);

// bema_ in two halves: every check and the plans, then the runs. A prepared update
// (prepared_update.h) keeps the plans and runs them again.
std::vector<DevicePlan> plan_bema_call(TensorRefs ema, TensorRefs theta0, TensorRefs out,
                                       TensorRefs src, const BemaWeights& weights);
void run_bema_call(const std::vector<DevicePlan>& plans, size_t tensors,
                   const BemaWeights& weights);

// The signature the dispatcher calls (schema in fused_ema.cpp).
void bema_op(at::TensorList ema, at::TensorList theta0, at::TensorList out, at::TensorList src,
             const at::Tensor& weights);

}  // namespace fused_ema
