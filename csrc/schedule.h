// Argument checks of fused_ema::ema_schedule_, shared by its CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include "schedule_formula.h"

namespace fused_ema {

Schedule check_schedule(const at::Tensor& step, const at::Tensor& out, double decay,
                        double min_decay, double warmup_gamma, double warmup_power,
                        int64_t update_after_step, int64_t update_every);

}  // namespace fused_ema
