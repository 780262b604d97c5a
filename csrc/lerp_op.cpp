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

namespace fused_ema {
namespace {

constexpr const char* kOp = "fused_ema.lerp_: ";
constexpr auto kNumDeviceTypes =
    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

std::array<DeviceRunner, kNumDeviceTypes>& runners() {
  static std::array<DeviceRunner, kNumDeviceTypes> table{};
  return table;
}

std::string join(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) {
    text += (text.empty() ? "" : ", ") + name;
  }
  return text;
}

void run(TensorRefs ema, TensorRefs src, const LerpWeight& weight) {
  RECORD_FUNCTION("fused_ema::lerp_", std::vector<c10::IValue>());
  for (const DevicePlan& plan : plan_lerp(ema, src)) {
    const DeviceRunner runner = runners()[static_cast<size_t>(plan.device.type())];
    TORCH_CHECK(runner != nullptr, kOp, "no kernel for tensors on ", plan.device,
                " in this build of fused_ema (kernels for: ", join(devices_with_kernels()), ")");
    TORCH_CHECK(weight.device_tensor == nullptr || weight.device_tensor->device() == plan.device,
                kOp, "weight is on ", weight.device_tensor->device(), " but ema tensors are on ",
                plan.device, "; pass the weight on the EMA's device, on the CPU, or as a float");
    runner(plan, weight);
  }
}

std::vector<const at::Tensor*> refs(at::TensorList tensors) {
  std::vector<const at::Tensor*> out(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    out[i] = &tensors[i];
  }
  return out;
}

void lerp_value(TensorRefs ema, TensorRefs src, double weight) {
  // A NaN or infinite weight would poison every EMA entry; a device weight cannot be checked
  // without a sync, so only host-known weights are.
  TORCH_CHECK_VALUE(std::isfinite(weight), kOp, "weight must be finite, got ", weight);
  run(ema, src, {weight, nullptr});
}

}  // namespace

bool register_device_runner(c10::DeviceType type, DeviceRunner runner) {
  runners()[static_cast<size_t>(type)] = runner;
  return true;
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

void lerp(TensorRefs ema, TensorRefs src, const c10::Scalar& weight) {
  // The schema's Scalar keeps the Python type, so that True is refused here as it is by
  // fused_ema.lerp_ (a `float` argument would have turned it into 1.0).
  TORCH_CHECK_TYPE(weight.isFloatingPoint() || weight.isIntegral(/*includeBool=*/false), kOp,
                   "weight must be a float or a 0-dim tensor, got ",
                   weight.isBoolean() ? "bool" : "complex");
  lerp_value(ema, src, weight.toDouble());
}

void lerp(TensorRefs ema, TensorRefs src, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.defined(), kOp, "weight is an undefined tensor");
  TORCH_CHECK_VALUE(weight.numel() == 1 && weight.dim() <= 1, kOp,
                    "a tensor weight must hold one element (a 0-dim tensor), got shape ",
                    weight.sizes());
  const auto type = weight.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kDouble, kOp,
                    "a tensor weight must be float32 or float64, got ", dtype_name(type));
  TORCH_CHECK(!(weight.requires_grad() && c10::GradMode::is_enabled()), kOp,
              "weight requires grad; the EMA update is not differentiable");
  if (weight.is_cpu()) {
    // A CPU scalar is read where it lies: one number needs no trip through the dispatcher.
    const double value = type == at::kFloat ? static_cast<double>(*weight.const_data_ptr<float>())
                                            : *weight.const_data_ptr<double>();
    lerp_value(ema, src, value);
  } else {
    run(ema, src, {0.0, &weight});
  }
}

void lerp_op(at::TensorList ema, at::TensorList src, const c10::Scalar& weight) {
  lerp(refs(ema), refs(src), weight);
}

void lerp_op_tensor_weight(at::TensorList ema, at::TensorList src, const at::Tensor& weight) {
  lerp(refs(ema), refs(src), weight);
}

}  // namespace fused_ema

// CPU and CUDA register their own kernels (cpu/, cuda/). This one serves the calls the dispatcher
// cannot route to a backend: empty lists (a no-op) and devices without a fused_ema kernel, which
// get an error naming the device instead of the dispatcher's generic message.
TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) {
  m.impl("lerp_", &fused_ema::lerp_op);
  m.impl("lerp_.Tensor", &fused_ema::lerp_op_tensor_weight);
}
