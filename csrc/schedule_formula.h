// The EMA decay schedule, one formula for the host and the device so that a step counter, its
// configuration and its weight can live in device tensors (no host sync; capturable in a CUDA
// graph).
//   s = step - update_after_step - 1 (averaging steps so far; torch_ema warmup: without the - 1,
//   as torch_ema averages from its first update); s <= 0: copy the model (decay 0)
//   decay_s = clamp(ramp(s), min_decay, decay), ramp by warmup kind: none: decay; power:
//   1 - (1 + s / gamma)^-power; diffusers and torch_ema: (1 + s) / (10 + s); power function
//   (EDM2's profile, t = s + 1 updates so far): (1 - 1 / t)^(gamma + 1)
//   an update happens when (step - 1) % every == 0, with weight 1 - decay_s^every (or
//   1 - decay_s with plain update_every decay); else weight 0
// BEMA (fused_ema.Bema, TRL's BEMACallback), with u = step - update_after_step, base = lag +
// multiplier * step (TRL counts t from the trainer's step 0, not from update_after): the EMA's
// weight is 1 at u = 0 (the reset), beta = max(base^-ema_power, min_decay) when u > 0 and
// u % every == 0, else 0; theta0's is 1 at u = 0, else 0; the correction's is alpha =
// base^-bias_power when the EMA's beta is, else 0 (kept above 0: 0 means "not written").
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace fused_ema {

// Steps outside [0, kMaxStep] get weight 0 and decay 0: the update does nothing (a step counter
// on a device cannot raise without a host sync). 2**53: every step is exact in a double.
constexpr int64_t kMaxStep = int64_t{1} << 53;

// The float64 config tensor of ema_schedule_, element by element.
enum ConfigField : int {
  kDecay,
  kMinDecay,
  kWarmupGamma,  // used by the power warmup and the power function only
  kWarmupPower,
  kUpdateAfterStep,
  kUpdateEvery,
  kWarmupKind,        // a WarmupKind
  kUpdateEveryDecay,  // 0: decay^every per update (compensated), 1: decay (plain)
  kBemaLag,           // BEMA's rho; the four BEMA fields are 0 for the other kinds
  kBemaMultiplier,    // BEMA's gamma
  kBemaEmaPower,      // BEMA's kappa
  kBemaBiasPower,     // BEMA's eta
  kNumConfigFields,
};

enum WarmupKind : int {
  kNoWarmup,
  kPowerWarmup,      // timm, ema-pytorch, diffusers use_ema_warmup=True
  kDiffusersWarmup,  // diffusers use_ema_warmup=False
  kTorchEmaWarmup,   // torch_ema use_num_updates=True
  kPowerFunction,    // EDM2's power-function EMA (fused_ema.PostHocEma, ema-pytorch KarrasEMA)
  kBemaEma,          // fused_ema.Bema's three tracks: its EMA, theta0 and the correction alpha
  kBemaTheta0,
  kBemaAlpha,
  kNumWarmupKinds,
};

struct Schedule {
  double decay;
  double min_decay;
  double warmup_gamma;
  double warmup_power;
  int64_t update_after_step;
  int64_t update_every;
  int warmup_kind;
  bool plain_every;
  double lag;
  double multiplier;
  double ema_power;
  double bias_power;
};

struct ScheduledWeight {
  double weight;  // the lerp weight of this step; 0 skips it
  double decay;   // the per-step decay it stands for
};

FUSED_EMA_HOST_DEVICE inline bool finite(double x) { return fabs(x) <= 1.7976931348623157e308; }

FUSED_EMA_HOST_DEVICE inline bool whole_in(double x, double lo, double hi) {
  return x >= lo && x <= hi && floor(x) == x;
}

// The first field of `config` that breaks the contract, or kNumConfigFields if none does.
FUSED_EMA_HOST_DEVICE inline int first_bad_field(const double* config) {
  const double decay = config[kDecay];
  const double gamma = config[kWarmupGamma];
  const double power = config[kWarmupPower];
  const auto max_step = static_cast<double>(kMaxStep);
  if (!(decay >= 0.0 && decay <= 1.0)) {
    return kDecay;
  }
  if (!(config[kMinDecay] >= 0.0 && config[kMinDecay] <= decay)) {
    return kMinDecay;
  }
  const bool power_warmup = config[kWarmupKind] == static_cast<double>(kPowerWarmup);
  // A power-function profile t^gamma is integrable (a finite average) for gamma > -1.
  const bool power_function = config[kWarmupKind] == static_cast<double>(kPowerFunction);
  if (!finite(gamma) || (power_warmup && !(gamma > 0.0)) || (power_function && !(gamma > -1.0))) {
    return kWarmupGamma;
  }
  if (!finite(power) || (power_warmup && !(power > 0.0))) {
    return kWarmupPower;
  }
  if (!whole_in(config[kUpdateAfterStep], 0.0, max_step)) {
    return kUpdateAfterStep;
  }
  if (!whole_in(config[kUpdateEvery], 1.0, max_step)) {
    return kUpdateEvery;
  }
  if (!whole_in(config[kWarmupKind], 0.0, static_cast<double>(kNumWarmupKinds) - 1.0)) {
    return kWarmupKind;
  }
  if (!whole_in(config[kUpdateEveryDecay], 0.0, 1.0)) {
    return kUpdateEveryDecay;
  }
  // BEMA's four fields: finite, and >= 0 with BEMA (its base lag + multiplier * step stays > 0
  // for every step >= 1), 0 for the other kinds.
  const bool bema = config[kWarmupKind] >= static_cast<double>(kBemaEma);
  for (int field = kBemaLag; field <= kBemaBiasPower; ++field) {
    const double x = config[field];
    const bool base_positive = field != kBemaMultiplier || config[kBemaLag] + x > 0.0;
    if (!finite(x) || (bema ? !(x >= 0.0 && base_positive) : x != 0.0)) {
      return field;
    }
  }
  return kNumConfigFields;
}

// `config` must have passed first_bad_field.
FUSED_EMA_HOST_DEVICE inline Schedule schedule_from_config(const double* config) {
  return {config[kDecay],
          config[kMinDecay],
          config[kWarmupGamma],
          config[kWarmupPower],
          static_cast<int64_t>(config[kUpdateAfterStep]),
          static_cast<int64_t>(config[kUpdateEvery]),
          static_cast<int>(config[kWarmupKind]),
          config[kUpdateEveryDecay] != 0.0,
          config[kBemaLag],
          config[kBemaMultiplier],
          config[kBemaEmaPower],
          config[kBemaBiasPower]};
}

// step + 1, wrapping instead of overflowing (a wrapped step is out of range: weight 0).
FUSED_EMA_HOST_DEVICE inline int64_t next_step(int64_t step) {
  return static_cast<int64_t>(static_cast<uint64_t>(step) + 1u);
}

// The weight of one of BEMA's tracks at `step` (in [0, kMaxStep]); decay is 1 - the EMA's beta.
FUSED_EMA_HOST_DEVICE inline ScheduledWeight bema_weight(const Schedule& sc, int64_t step) {
  const int64_t u = step - sc.update_after_step;
  if (u < 0) {
    return {0.0, 1.0};
  }
  if (u == 0) {
    return {sc.warmup_kind == kBemaAlpha ? 0.0 : 1.0, 0.0};
  }
  const double base = sc.lag + sc.multiplier * static_cast<double>(step);
  const double beta = fmax(pow(base, -sc.ema_power), sc.min_decay);
  if (u % sc.update_every != 0 || sc.warmup_kind == kBemaTheta0) {
    return {0.0, 1.0 - beta};
  }
  if (sc.warmup_kind == kBemaEma) {
    return {beta, 1.0 - beta};
  }
  // The smallest double instead of an alpha that underflowed: still "write the correction".
  return {fmax(pow(base, -sc.bias_power), 4.9406564584124654e-324), 1.0 - beta};
}

FUSED_EMA_HOST_DEVICE inline ScheduledWeight scheduled_weight(const Schedule& sc, int64_t step) {
  if (step < 0 || step > kMaxStep) {
    return {0.0, 0.0};
  }
  if (sc.warmup_kind >= kBemaEma) {
    return bema_weight(sc, step);
  }
  // torch_ema counts its ramp from its first update, diffusers from its first averaging one.
  const int64_t s = step - sc.update_after_step - (sc.warmup_kind == kTorchEmaWarmup ? 0 : 1);
  const auto x = static_cast<double>(s);
  double decay = sc.decay;
  if (s <= 0) {
    decay = 0.0;
  } else if (sc.warmup_kind != kNoWarmup) {
    double ramp = 0.0;
    if (sc.warmup_kind == kPowerWarmup) {
      ramp = 1.0 - pow(1.0 + x / sc.warmup_gamma, -sc.warmup_power);
    } else if (sc.warmup_kind == kPowerFunction) {
      // EDM2's and ema-pytorch's own expression, so that the weights agree to the last bit.
      ramp = pow(1.0 - 1.0 / (x + 1.0), sc.warmup_gamma + 1.0);
    } else {
      ramp = (1.0 + x) / (10.0 + x);
    }
    decay = fmax(fmin(ramp, sc.decay), sc.min_decay);
  }
  const int64_t phase = ((step - 1) % sc.update_every + sc.update_every) % sc.update_every;
  if (phase != 0) {
    return {0.0, decay};
  }
  const double kept = sc.update_every == 1 || sc.plain_every
                          ? decay
                          : pow(decay, static_cast<double>(sc.update_every));
  return {1.0 - kept, decay};
}

// ema_schedule_'s work, on the host (schedule.cpp) and in the CUDA kernel's one thread
// (cuda/schedule_cuda.cu): advance the counter, then write the weight and decay of its step. The
// device cannot raise: an invalid config writes weight 0 and decay NaN (the CPU kernel refuses it
// first).
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

}  // namespace fused_ema
