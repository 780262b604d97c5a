// The driver behind every entry to fused_ema::lerp_ (see lerp_op.h): weight checks, planning, and
// one runner call per device.
#include "lerp_op.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "opmath.h"

namespace fused_ema {
namespace {

constexpr const char* kOp = "fused_ema.lerp_: ";
constexpr auto kNumDeviceTypes =
    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

constexpr const char* kStochasticOp = "fused_ema.lerp_stochastic_: ";

std::array<DeviceRunner, kNumDeviceTypes>& runners() {
  static std::array<DeviceRunner, kNumDeviceTypes> table{};
  return table;
}

std::array<StochasticRunner, kNumDeviceTypes>& stochastic_runners() {
  static std::array<StochasticRunner, kNumDeviceTypes> table{};
  return table;
}

std::string join(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) {
    text += (text.empty() ? "" : ", ") + name;
  }
  return text;
}

template <typename Runner>
void check_runner(Runner runner, const DevicePlan& plan, const LerpWeight& weight, const char* op) {
  check_has_kernel(runner != nullptr, plan.device, op);
  TORCH_CHECK(weight.device_tensor == nullptr || weight.device_tensor->device() == plan.device, op,
              "weight is on ", weight.device_tensor->device(), " but ema tensors are on ",
              plan.device, "; pass the weight on the EMA's device, on the CPU, or as a float");
}

}  // namespace

std::vector<const at::Tensor*> tensor_refs(at::TensorList tensors) {
  std::vector<const at::Tensor*> out(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    out[i] = &tensors[i];
  }
  return out;
}

bool register_device_runner(c10::DeviceType type, DeviceRunner runner) {
  runners()[static_cast<size_t>(type)] = runner;
  return true;
}

void check_has_kernel(bool has_kernel, c10::Device device, const char* op) {
  TORCH_CHECK(has_kernel, op, "no kernel for tensors on ", device,
              " in this build of fused_ema (kernels for: ", join(devices_with_kernels()), ")");
}

std::vector<std::string> devices_with_kernels() {
  std::vector<std::string> names;
  for (size_t t = 0; t < kNumDeviceTypes; ++t) {
    if (runners()[t] != nullptr) {
      names.push_back(c10::DeviceTypeName(static_cast<c10::DeviceType>(t), /*lower_case=*/true));
    }
  }
  return names;
}

LerpWeight checked_weight(const c10::Scalar& weight) {
  // The schema's Scalar keeps the Python type, so that True is refused here as it is by
  // fused_ema.lerp_ (a `float` argument would have turned it into 1.0).
  TORCH_CHECK_TYPE(weight.isFloatingPoint() || weight.isIntegral(/*includeBool=*/false), kOp,
                   "weight must be a float or a 0-dim tensor, got ",
                   weight.isBoolean() ? "bool" : "complex");
  // A NaN or infinite weight would poison every EMA entry; a device weight cannot be checked
  // without a sync, so only host-known weights are.
  const double value = weight.toDouble();
  TORCH_CHECK_VALUE(std::isfinite(value), kOp, "weight must be finite, got ", value);
  TORCH_CHECK_VALUE(fits_float(value), kOp, "weight must fit a float32, got ", value);
  return {value, nullptr};
}

void check_runnable(const DevicePlan& plan, const LerpWeight& weight) {
  check_runner(runners()[static_cast<size_t>(plan.device.type())], plan, weight, kOp);
}

void run_plans(const std::vector<DevicePlan>& plans, const LerpWeight& weight) {
  RECORD_FUNCTION("fused_ema::lerp_", std::vector<c10::IValue>());
  for (const DevicePlan& plan : plans) {
    runners()[static_cast<size_t>(plan.device.type())](plan, weight);
  }
}

void lerp(TensorRefs ema, TensorRefs src, const c10::Scalar& weight) {
  const LerpWeight checked = checked_weight(weight);
  run_plans(plan_lerp(ema, src, /*row_major=*/false,
                      [&](const DevicePlan& plan) { check_runnable(plan, checked); }),
            checked);
}

void lerp(TensorRefs ema, TensorRefs src, const at::Tensor& weight) {
  const LerpWeight checked = checked_weight(weight);
  run_plans(plan_lerp(ema, src, /*row_major=*/false,
                      [&](const DevicePlan& plan) { check_runnable(plan, checked); }),
            checked);
}

// The checks of a tensor weight; a CPU one is read here (one number needs no trip through the
// dispatcher).
LerpWeight checked_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.defined(), kOp, "weight is an undefined tensor");
  TORCH_CHECK_VALUE(weight.numel() == 1 && weight.dim() <= 1, kOp,
                    "a tensor weight must hold one element (a 0-dim tensor), got shape ",
                    weight.sizes());
  const auto type = weight.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kDouble, kOp,
                    "a tensor weight must be float32 or float64, got ", dtype_name(type));
  TORCH_CHECK(!(weight.requires_grad() && c10::GradMode::is_enabled()), kOp,
              "weight requires grad; the EMA update is not differentiable");
  if (!weight.is_cpu()) {
    return {0.0, &weight};
  }
  const double value = type == at::kFloat ? static_cast<double>(*weight.const_data_ptr<float>())
                                          : *weight.const_data_ptr<double>();
  TORCH_CHECK_VALUE(std::isfinite(value), kOp, "weight must be finite, got ", value);
  TORCH_CHECK_VALUE(fits_float(value), kOp, "weight must fit a float32, got ", value);
  return {value, nullptr};
}

StochasticRounding checked_rounding(size_t count, const at::Tensor& step, int64_t seed,
                                    c10::ArrayRef<int64_t> keys, c10::ArrayRef<int64_t> offsets) {
  const CheckedStep checked = checked_step(step, kStochasticOp);
  TORCH_CHECK_VALUE(keys.size() == count, kStochasticOp, "keys has ", keys.size(),
                    " entries but ema has ", count, " tensors");
  TORCH_CHECK_VALUE(offsets.size() == count, kStochasticOp, "offsets has ", offsets.size(),
                    " entries but ema has ", count, " tensors");
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK_VALUE(keys[i] >= 0 && keys[i] <= kMaxKey, kStochasticOp, "keys[", i, "] is ",
                      keys[i], "; keys are 32-bit: 0 <= key <= ", kMaxKey);
    TORCH_CHECK_VALUE(offsets[i] >= 0, kStochasticOp, "offsets[", i, "] is ", offsets[i],
                      "; an offset is the index of the tensor's first element, >= 0");
  }
  StochasticRounding rounding;
  rounding.seed = static_cast<uint64_t>(seed);
  rounding.keys = keys;
  rounding.offsets = offsets;
  rounding.step = checked.value;
  rounding.step_tensor = checked.tensor;
  return rounding;
}

CheckedStep checked_step(const at::Tensor& step, const char* op) {
  TORCH_CHECK_VALUE(step.defined(), op, "step is an undefined tensor");
  TORCH_CHECK_VALUE(step.numel() == 1 && step.dim() <= 1 && step.scalar_type() == at::kLong, op,
                    "step must be one int64 element (a 0-dim tensor), got ",
                    dtype_name(step.scalar_type()), " of shape ", step.sizes());
  if (!step.is_cpu()) {
    return {0, &step};
  }
  return {static_cast<uint64_t>(*step.const_data_ptr<int64_t>()), nullptr};
}

std::vector<DevicePlan> plan_lerp_call(TensorRefs ema, TensorRefs src, const LerpWeight& weight,
                                       const StochasticRounding* rounding) {
  if (rounding == nullptr) {
    return plan_lerp(ema, src, /*row_major=*/false,
                     [&](const DevicePlan& plan) { check_runnable(plan, weight); });
  }
  TORCH_CHECK_VALUE(ema.size() == src.size(), kOp, "ema has ", ema.size(), " tensors but src has ",
                    src.size());
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK_VALUE(ema[i]->defined(), kOp, "ema[", i, "] is an undefined tensor");
    TORCH_CHECK_VALUE(rounding->offsets[i] <= INT64_MAX - ema[i]->numel(), kStochasticOp,
                      "offsets[", i, "] + ema[", i, "].numel() overflows int64");
  }
  // Every device is checked before anything is written (or a version moves).
  return plan_lerp(ema, src, /*row_major=*/true, [&](const DevicePlan& plan) {
    check_runner(stochastic_runners()[static_cast<size_t>(plan.device.type())], plan, weight,
                 kStochasticOp);
    const at::Tensor* step = rounding->step_tensor;
    TORCH_CHECK(step == nullptr || step->device() == plan.device, kStochasticOp, "step is on ",
                step->device(), " but ema tensors are on ", plan.device,
                "; pass the step on the EMA's device, on the CPU, or as an int");
  });
}

void run_lerp_call(const std::vector<DevicePlan>& plans, const LerpWeight& weight,
                   const StochasticRounding* rounding) {
  if (rounding == nullptr) {
    run_plans(plans, weight);
    return;
  }
  RECORD_FUNCTION("fused_ema::lerp_stochastic_", std::vector<c10::IValue>());
  for (const DevicePlan& plan : plans) {
    stochastic_runners()[static_cast<size_t>(plan.device.type())](plan, weight, *rounding);
  }
}

void lerp_stochastic(TensorRefs ema, TensorRefs src, const at::Tensor& weight,
                     const at::Tensor& step, int64_t seed, c10::ArrayRef<int64_t> keys,
                     c10::ArrayRef<int64_t> offsets) {
  TORCH_CHECK_VALUE(ema.size() == src.size(), kOp, "ema has ", ema.size(), " tensors but src has ",
                    src.size());
  const LerpWeight w = checked_weight(weight);
  const StochasticRounding rounding = checked_rounding(ema.size(), step, seed, keys, offsets);
  run_lerp_call(plan_lerp_call(ema, src, w, &rounding), w, &rounding);
}

void lerp_stochastic_op(at::TensorList ema, at::TensorList src, const at::Tensor& weight,
                        const at::Tensor& step, int64_t seed, at::IntArrayRef keys,
                        at::IntArrayRef offsets) {
  lerp_stochastic(tensor_refs(ema), tensor_refs(src), weight, step, seed, keys, offsets);
}

bool register_stochastic_runner(c10::DeviceType type, StochasticRunner runner) {
  stochastic_runners()[static_cast<size_t>(type)] = runner;
  return true;
}

void lerp_op(at::TensorList ema, at::TensorList src, const c10::Scalar& weight) {
  lerp(tensor_refs(ema), tensor_refs(src), weight);
}

void lerp_op_tensor_weight(at::TensorList ema, at::TensorList src, const at::Tensor& weight) {
  lerp(tensor_refs(ema), tensor_refs(src), weight);
}

}  // namespace fused_ema

// CPU and CUDA register their own kernels (cpu/, cuda/). This one serves the calls the dispatcher
// cannot route to a backend: empty lists (a no-op) and devices without a fused_ema kernel, which
// get an error naming the device instead of the dispatcher's generic message.
TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) {
  m.impl("lerp_", &fused_ema::lerp_op);
  m.impl("lerp_.Tensor", &fused_ema::lerp_op_tensor_weight);
  m.impl("lerp_stochastic_", &fused_ema::lerp_stochastic_op);
}
