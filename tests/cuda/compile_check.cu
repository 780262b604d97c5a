// Instantiates every CUDA kernel of fused_ema without torch headers, so that tests can check the
// device code compiles for each target architecture with plain nvcc (see test_cuda_compile.py).
#include "cuda/lerp_functor.cuh"

namespace fc = fused_ema::cuda;

template cudaError_t fc::launch_lerp<float, float>(const fc::TensorRef*, int64_t, fc::WeightArg,
                                                   cudaStream_t);
template cudaError_t fc::launch_lerp<float, __nv_bfloat16>(const fc::TensorRef*, int64_t,
                                                           fc::WeightArg, cudaStream_t);
template cudaError_t fc::launch_lerp<float, __half>(const fc::TensorRef*, int64_t, fc::WeightArg,
                                                    cudaStream_t);
template cudaError_t fc::launch_lerp<__nv_bfloat16, __nv_bfloat16>(const fc::TensorRef*, int64_t,
                                                                   fc::WeightArg, cudaStream_t);
template cudaError_t fc::launch_lerp<__half, __half>(const fc::TensorRef*, int64_t, fc::WeightArg,
                                                     cudaStream_t);
template cudaError_t fc::launch_lerp<double, double>(const fc::TensorRef*, int64_t, fc::WeightArg,
                                                     cudaStream_t);

// The schedule formula is shared by host and device (schedule_formula.h); the device reads its
// config from memory, as csrc/cuda/schedule_cuda.cu does.
#include "schedule_formula.h"

__global__ void schedule_check(int64_t* step, const double* config, double* out) {
  *step = fused_ema::next_step(*step);
  if (fused_ema::first_bad_field(config) != fused_ema::kNumConfigFields) {
    out[0] = 0.0;
    return;
  }
  const fused_ema::ScheduledWeight w =
      fused_ema::scheduled_weight(fused_ema::schedule_from_config(config), *step);
  out[0] = w.weight;
  out[1] = w.decay;
}
