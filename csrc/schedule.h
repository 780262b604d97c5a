// Argument checks of fused_ema::ema_schedule_, shared by its CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/headeronly/core/DeviceType.h>

#include "schedule_formula.h"

namespace fused_ema {

// Dtypes, shapes, contiguity and devices of step, out and config; values are not read.
void check_schedule_tensors(const at::Tensor& step, const at::Tensor& out,
                            const at::Tensor& config);

// The kernel of one device type, registered by its file (cuda/schedule_cuda.cu for CUDA) so that
// a prepared update runs it without the dispatcher. Returns true.
using ScheduleKernel = void (*)(const at::Tensor& step, const at::Tensor& out,
                                const at::Tensor& config, bool advance);
bool register_schedule_kernel(c10::DeviceType type, ScheduleKernel kernel);

// ema_schedule_ by the kernel of step's device.
void run_schedule(const at::Tensor& step, const at::Tensor& out, const at::Tensor& config,
                  bool advance);

}  // namespace fused_ema
