// fused_ema::ema_schedule_: advances (or keeps) an EMA's step counter and writes the weight and
// decay of that step into a tensor, on the counter's device. ModelEma feeds the weight to
// lerp_.Tensor, so a same-device update needs no host sync. CPU kernel here, CUDA in cuda/.
#include "schedule.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

namespace fused_ema {

Schedule check_schedule(const at::Tensor& step, const at::Tensor& out, double decay,
                        double min_decay, double warmup_gamma, double warmup_power,
                        int64_t update_after_step, int64_t update_every) {
  constexpr const char* kOp = "fused_ema.ema_schedule_: ";
  TORCH_CHECK_VALUE(step.scalar_type() == at::kLong && step.numel() == 1, kOp,
                    "step must be one int64 element, got ", step.scalar_type(), " of shape ",
                    step.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kDouble && out.numel() == 2 && out.is_contiguous(),
                    kOp, "out must be 2 contiguous float64 elements (weight, decay)");
  TORCH_CHECK(step.device() == out.device(), kOp, "step is on ", step.device(), " but out is on ",
              out.device());
  TORCH_CHECK_VALUE(decay >= 0.0 && decay <= 1.0, kOp, "decay must be in [0, 1], got ", decay);
  TORCH_CHECK_VALUE(min_decay >= 0.0 && min_decay <= decay, kOp,
                    "min_decay must be in [0, decay], got ", min_decay);
  TORCH_CHECK_VALUE(warmup_gamma <= 0.0 || warmup_power > 0.0, kOp,
                    "warmup power must be positive, got ", warmup_power);
  TORCH_CHECK_VALUE(update_after_step >= 0, kOp, "update_after_step must be >= 0");
  TORCH_CHECK_VALUE(update_every >= 1, kOp, "update_every must be >= 1, got ", update_every);
  return {decay, min_decay, warmup_gamma, warmup_power, update_after_step, update_every};
}

namespace {

void ema_schedule_cpu(const at::Tensor& step, const at::Tensor& out, bool advance, double decay,
                      double min_decay, double warmup_gamma, double warmup_power,
                      int64_t update_after_step, int64_t update_every) {
  const Schedule sc = check_schedule(step, out, decay, min_decay, warmup_gamma, warmup_power,
                                     update_after_step, update_every);
  int64_t* t = step.mutable_data_ptr<int64_t>();
  if (advance) {
    *t += 1;
  }
  const ScheduledWeight w = scheduled_weight(sc, *t);
  double* o = out.mutable_data_ptr<double>();
  o[0] = w.weight;
  o[1] = w.decay;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CPU, m) { m.impl("ema_schedule_", &ema_schedule_cpu); }

}  // namespace fused_ema
