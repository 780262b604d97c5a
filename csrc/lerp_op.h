// The device-independent driver of fused_ema::lerp_: plan the pairs (lerp_plan.h), then hand each
// device's pairs to the runner that device's kernel registered. The dispatcher kernels and a
// prepared update (prepared_update.h) enter here, so their behaviour cannot drift apart.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Scalar.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lerp_plan.h"

namespace fused_ema {

// The weight as a runner receives it: a value known on the host, or a tensor on a device that
// the kernel reads itself (no host sync; capturable in a CUDA graph).
struct LerpWeight {
  double value = 0.0;
  const at::Tensor* device_tensor = nullptr;
};

using DeviceRunner = void (*)(const DevicePlan& plan, const LerpWeight& weight);

// Called from static initialisers of cpu/ and cuda/; returns true so it can initialise a flag.
bool register_device_runner(c10::DeviceType type, DeviceRunner runner);

// "cpu", "cuda": the device types this build has kernels for.
std::vector<std::string> devices_with_kernels();

// Refuses tensors on `device` when this build has no kernel for them (`op` starts the message).
void check_has_kernel(bool has_kernel, c10::Device device, const char* op);

// A Python number as weight: a float or an int (not a bool), finite.
void lerp(TensorRefs ema, TensorRefs src, const c10::Scalar& weight);
void lerp(TensorRefs ema, TensorRefs src, const at::Tensor& weight);

// The parts of lerp: the checks of a weight, the check of each device's plan against it (for
// LerpPlanner::finish), then the runs of the finished plans on their devices.
LerpWeight checked_weight(const c10::Scalar& weight);
LerpWeight checked_weight(const at::Tensor& weight);
void check_runnable(const DevicePlan& plan, const LerpWeight& weight);
void run_plans(const std::vector<DevicePlan>& plans, const LerpWeight& weight);

// A step of lerp_stochastic_ (one int64 element), checked: read here from the CPU, else left on
// its device for the kernel to read.
struct CheckedStep {
  uint64_t value = 0;
  const at::Tensor* tensor = nullptr;
};
CheckedStep checked_step(const at::Tensor& step, const char* op);

// Keys are 32 bits of a stream's key (../stochastic_round.h).
constexpr int64_t kMaxKey = UINT32_MAX;

// lerp_stochastic_'s rounding arguments as a runner receives them (../stochastic_round.h).
struct StochasticRounding {
  uint64_t seed = 0;
  uint64_t step = 0;                        // when the step is known on the host
  const at::Tensor* step_tensor = nullptr;  // else an int64 tensor on the plan's device
  c10::ArrayRef<int64_t> keys;              // indexed by FlatPair::index
  c10::ArrayRef<int64_t> offsets;
};

using StochasticRunner = void (*)(const DevicePlan& plan, const LerpWeight& weight,
                                  const StochasticRounding& rounding);

bool register_stochastic_runner(c10::DeviceType type, StochasticRunner runner);

// lerp_stochastic_'s step, seed, keys and offsets checked for `count` tensors (a CPU step read).
StochasticRounding checked_rounding(size_t count, const at::Tensor& step, int64_t seed,
                                    c10::ArrayRef<int64_t> keys, c10::ArrayRef<int64_t> offsets);

// lerp_ (rounding null) or lerp_stochastic_ in its two halves: every check and the plans, then the
// runs. A prepared update (prepared_update.h) keeps the plans and runs them again.
std::vector<DevicePlan> plan_lerp_call(TensorRefs ema, TensorRefs src, const LerpWeight& weight,
                                       const StochasticRounding* rounding);
void run_lerp_call(const std::vector<DevicePlan>& plans, const LerpWeight& weight,
                   const StochasticRounding* rounding);

// lerp_ with bfloat16/float16 EMAs rounded stochastically: keys and offsets hold one entry per
// tensor (its key, and the index of its first element in the full tensor).
void lerp_stochastic(TensorRefs ema, TensorRefs src, const at::Tensor& weight,
                     const at::Tensor& step, int64_t seed, c10::ArrayRef<int64_t> keys,
                     c10::ArrayRef<int64_t> offsets);

// A dispatcher list as the planner's borrowed tensors.
std::vector<const at::Tensor*> tensor_refs(at::TensorList tensors);

// The signatures the dispatcher calls (schema in fused_ema.cpp).
void lerp_op(at::TensorList ema, at::TensorList src, const c10::Scalar& weight);
void lerp_op_tensor_weight(at::TensorList ema, at::TensorList src, const at::Tensor& weight);
void lerp_stochastic_op(at::TensorList ema, at::TensorList src, const at::Tensor& weight,
                        const at::Tensor& step, int64_t seed, at::IntArrayRef keys,
                        at::IntArrayRef offsets);

}  // namespace fused_ema
