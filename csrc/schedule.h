// Argument checks of fused_ema::ema_schedule_, shared by its CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include "schedule_formula.h"

namespace fused_ema {

// Dtypes, shapes, contiguity and devices of step, out and config; values are not read.
void check_schedule_tensors(const at::Tensor& step, const at::Tensor& out,
                            const at::Tensor& config);

// The CPU kernel (a prepared update calls it directly; other devices go through the dispatcher).
void ema_schedule_cpu(const at::Tensor& step, const at::Tensor& out, const at::Tensor& config,
                      bool advance);

// Every field of a host config against the contract; a ValueError names the first bad one.
Schedule check_schedule_config(const double* config);

}  // namespace fused_ema
