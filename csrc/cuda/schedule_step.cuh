// The body of fused_ema::ema_schedule_'s CUDA kernel (schedule_cuda.cu), one thread's work: advance
// the step counter, read the config and write the weight and decay of that step. Host and device,
// so that tests run it on the CPU too. No torch headers.
#pragma once

#include <cmath>
#include <cstdint>

#include "../host_device.h"
#include "../schedule_formula.h"

namespace fused_ema::cuda {

// The device cannot raise: an invalid config writes weight 0 and decay NaN.
FUSED_EMA_HOST_DEVICE inline void schedule_step(int64_t* step, double* out, const double* config,
                                                bool advance) {
  if (advance) {
    *step = next_step(*step);
  }
  if (first_bad_field(config) != kNumConfigFields) {
    out[0] = 0.0;
    out[1] = NAN;
    return;
  }
  const ScheduledWeight w = scheduled_weight(schedule_from_config(config), *step);
  out[0] = w.weight;
  out[1] = w.decay;
}

}  // namespace fused_ema::cuda
