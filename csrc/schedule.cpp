// fused_ema::ema_schedule_: advances (or keeps) an EMA's step counter and writes the weight and
// decay of that step into a tensor, on the counter's device. ModelEma feeds the weight to
// lerp_.Tensor, so a same-device update needs no host sync. CPU kernel here, CUDA in cuda/.
#include "schedule.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "dtype_pairs.h"

namespace fused_ema {
namespace {

constexpr const char* kOp = "fused_ema.ema_schedule_: ";

// What each config field must be, in ConfigField order.
constexpr const char* kFieldRules[kNumConfigFields] = {
    "decay must be in [0, 1]",
    "min_decay must be in [0, decay]",
    "warmup_gamma must be finite, > 0 with the power warmup, > -1 with the power function",
    "warmup_power must be finite, and > 0 with the power warmup",
    "update_after_step must be an integer in [0, 2**53]",
    "update_every must be an integer in [1, 2**53]",
    "warmup_kind must be 0 (none), 1 (power), 2 (diffusers), 3 (torch_ema), 4 (power function) "
    "or 5-7 (BEMA's EMA, theta0, alpha)",
    "update_every_decay must be 0 (compensated) or 1 (plain)",
    "lag must be finite and >= 0 with BEMA, 0 otherwise",
    "multiplier must be finite, >= 0 and lag + multiplier > 0 with BEMA, 0 otherwise",
    "ema_power must be finite and >= 0 with BEMA, 0 otherwise",
    "bias_power must be finite and >= 0 with BEMA, 0 otherwise",
};

// By device type.
ScheduleKernel* kernels() {
  static ScheduleKernel table[static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)];
  return table;
}

}  // namespace

bool register_schedule_kernel(c10::DeviceType type, ScheduleKernel kernel) {
  kernels()[static_cast<size_t>(type)] = kernel;
  return true;
}

void run_schedule(const at::Tensor& step, const at::Tensor& out, const at::Tensor& config,
                  bool advance) {
  const ScheduleKernel kernel = kernels()[static_cast<size_t>(step.device().type())];
  TORCH_CHECK(kernel != nullptr, kOp, "no kernel for tensors on ", step.device());
  kernel(step, out, config, advance);
}

void check_schedule_tensors(const at::Tensor& step, const at::Tensor& out,
                            const at::Tensor& config) {
  TORCH_CHECK_VALUE(step.scalar_type() == at::kLong && step.numel() == 1, kOp,
                    "step must be one int64 element, got ", dtype_name(step.scalar_type()),
                    " of shape ", step.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kDouble && out.numel() == 2 && out.is_contiguous(),
                    kOp, "out must be 2 contiguous float64 elements (weight, decay), got ",
                    dtype_name(out.scalar_type()), " of shape ", out.sizes());
  TORCH_CHECK_VALUE(config.scalar_type() == at::kDouble && config.numel() == kNumConfigFields &&
                        config.is_contiguous(),
                    kOp,
                    "config must be 12 contiguous float64 elements (decay, min_decay, "
                    "warmup_gamma, warmup_power, update_after_step, update_every, warmup_kind, "
                    "update_every_decay, lag, multiplier, ema_power, bias_power), got ",
                    dtype_name(config.scalar_type()), " of shape ", config.sizes());
  TORCH_CHECK(out.device() == step.device(), kOp, "out is on ", out.device(), " but step is on ",
              step.device());
  TORCH_CHECK(config.device() == step.device(), kOp, "config is on ", config.device(),
              " but step is on ", step.device());
}

namespace {

void ema_schedule_cpu(const at::Tensor& step, const at::Tensor& out, const at::Tensor& config,
                      bool advance) {
  check_schedule_tensors(step, out, config);
  const double* fields = config.const_data_ptr<double>();
  const int bad = first_bad_field(fields);  // a ValueError names the first bad field
  TORCH_CHECK_VALUE(bad == kNumConfigFields, kOp, "config: ", kFieldRules[bad], ", got ",
                    fields[bad]);
  schedule_step(step.mutable_data_ptr<int64_t>(), out.mutable_data_ptr<double>(), fields, advance);
}

[[maybe_unused]] const bool kRegistered =
    register_schedule_kernel(c10::DeviceType::CPU, &ema_schedule_cpu);

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CPU, m) { m.impl("ema_schedule_", &ema_schedule_cpu); }

// The checks alone, for the fake kernel (fused_ema_checks, fused_ema.cpp).
TORCH_LIBRARY_IMPL(fused_ema_checks, CompositeImplicitAutograd, m) {
  m.impl("ema_schedule_",
         [](const at::Tensor& step, const at::Tensor& out, const at::Tensor& config, bool) {
           check_schedule_tensors(step, out, config);
         });
}

}  // namespace fused_ema
