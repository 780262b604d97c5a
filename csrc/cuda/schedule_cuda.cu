// CUDA kernel of fused_ema::ema_schedule_: one thread advances the step counter and writes the
// weight of that step, in stream order, so that lerp_.Tensor can read it without a host sync.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../schedule.h"

namespace fused_ema::cuda {
namespace {

__global__ void ema_schedule_kernel(int64_t* step, double* out, bool advance, Schedule sc) {
  if (advance) {
    *step += 1;
  }
  const ScheduledWeight w = scheduled_weight(sc, *step);
  out[0] = w.weight;
  out[1] = w.decay;
}

void ema_schedule_cuda(const at::Tensor& step, const at::Tensor& out, bool advance, double decay,
                       double min_decay, double warmup_gamma, double warmup_power,
                       int64_t update_after_step, int64_t update_every) {
  const Schedule sc = check_schedule(step, out, decay, min_decay, warmup_gamma, warmup_power,
                                     update_after_step, update_every);
  const c10::cuda::CUDAGuard guard(step.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(step.device().index()).stream();
  ema_schedule_kernel<<<1, 1, 0, stream>>>(step.mutable_data_ptr<int64_t>(),
                                           out.mutable_data_ptr<double>(), advance, sc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CUDA, m) { m.impl("ema_schedule_", &ema_schedule_cuda); }

}  // namespace fused_ema::cuda
