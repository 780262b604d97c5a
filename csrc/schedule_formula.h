// The EMA decay schedule, one formula for the host and the device so that a step counter and its
// weight can live in device tensors (no host sync; capturable in a CUDA graph).
//   s = step - update_after_step - 1 (averaging steps so far); s <= 0: copy the model (decay 0)
//   decay_s = warmup ? clamp(1 - (1 + s / gamma)^-power, min_decay, decay) : decay
//   an update happens when (step - 1) % every == 0, with weight 1 - decay_s^every; else weight 0
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FUSED_EMA_HOST_DEVICE __host__ __device__
#else
#define FUSED_EMA_HOST_DEVICE
#endif

namespace fused_ema {

struct Schedule {
  double decay;
  double min_decay;
  double warmup_gamma;  // <= 0: no warmup
  double warmup_power;
  int64_t update_after_step;
  int64_t update_every;
};

struct ScheduledWeight {
  double weight;  // the lerp weight of this step; 0 skips it
  double decay;   // the per-step decay it stands for
};

FUSED_EMA_HOST_DEVICE inline ScheduledWeight scheduled_weight(const Schedule& sc, int64_t step) {
  const int64_t s = step - sc.update_after_step - 1;
  double decay = sc.decay;
  if (s <= 0) {
    decay = 0.0;
  } else if (sc.warmup_gamma > 0) {
    const double ramp = 1.0 - pow(1.0 + static_cast<double>(s) / sc.warmup_gamma, -sc.warmup_power);
    decay = fmax(fmin(ramp, sc.decay), sc.min_decay);
  }
  const int64_t phase = ((step - 1) % sc.update_every + sc.update_every) % sc.update_every;
  if (phase != 0) {
    return {0.0, decay};
  }
  const double kept =
      sc.update_every == 1 ? decay : pow(decay, static_cast<double>(sc.update_every));
  return {1.0 - kept, decay};
}

}  // namespace fused_ema
