// CUDA kernel of fused_ema::ema_schedule_: one thread advances the step counter, reads the config
// and writes the weight of that step, in stream order, so that lerp_.Tensor can read it without a
// host sync. Reading config values on the host would sync, so the caller validates them before
// writing config (ModelEma does); an invalid config writes weight 0 and decay NaN here.
#include <torch/library.h>

#include "../schedule.h"
#include "torch_cuda.h"

namespace fused_ema::cuda {
namespace {

__global__ void ema_schedule_kernel(int64_t* step, double* out, const double* config,
                                    bool advance) {
  schedule_step(step, out, config, advance);
}

void ema_schedule_cuda(const at::Tensor& step, const at::Tensor& out, const at::Tensor& config,
                       bool advance) {
  check_schedule_tensors(step, out, config);
  const DeviceGuard guard(step.device().index());
  const cudaStream_t stream = current_stream(step.device().index());
  ema_schedule_kernel<<<1, 1, 0, stream>>>(step.mutable_data_ptr<int64_t>(),
                                           out.mutable_data_ptr<double>(),
                                           config.const_data_ptr<double>(), advance);
  FUSED_EMA_CUDA_CHECK(cudaGetLastError());
}

[[maybe_unused]] const bool kRegistered =
    register_schedule_kernel(c10::DeviceType::CUDA, &ema_schedule_cuda);

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CUDA, m) { m.impl("ema_schedule_", &ema_schedule_cuda); }

}  // namespace fused_ema::cuda
