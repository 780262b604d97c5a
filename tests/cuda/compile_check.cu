// Instantiates every CUDA kernel of fused_ema without torch headers, so that tests can check the
// device code compiles for each target architecture with plain nvcc (see test_cuda_compile.py).
#include "cuda/bema_functor.cuh"
#include "cuda/lerp_functor.cuh"
#include "cuda/lerp_many_functor.cuh"
#include "cuda/pair_types.cuh"
#include "cuda/stochastic_functor.cuh"

namespace fc = fused_ema::cuda;

// One launcher per dtype pair, from the list every backend derives its tables from.
#define FUSED_EMA_INSTANTIATE(kind, ema, src, ema_tag, src_tag)                              \
  template cudaError_t                                                                       \
  fc::launch_lerp<fc::cuda_t<fused_ema::tag::ema_tag>, fc::cuda_t<fused_ema::tag::src_tag>>( \
      const fc::TensorRef*, int64_t, fc::WeightArg, cudaStream_t);
FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_INSTANTIATE)
#undef FUSED_EMA_INSTANTIATE

// lerp_stochastic_'s launchers (stochastic rounding for 16-bit EMAs, the plain lerp otherwise).
#define FUSED_EMA_INSTANTIATE_SR(kind, ema, src, ema_tag, src_tag)                              \
  template cudaError_t fc::launch_lerp_stochastic<fc::cuda_t<fused_ema::tag::ema_tag>,          \
                                                  fc::cuda_t<fused_ema::tag::src_tag>>(         \
      const fc::TensorRef*, const fc::SrTensor*, int64_t, fc::WeightArg, fc::StepArg, uint64_t, \
      cudaStream_t);
FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_INSTANTIATE_SR)
#undef FUSED_EMA_INSTANTIATE_SR

// lerp_many_'s launchers, plain and stochastic (multi_track_kernel).
#define FUSED_EMA_INSTANTIATE_MANY(kind, ema, src, ema_tag, src_tag)                              \
  template cudaError_t                                                                            \
  fc::launch_lerp_many<fc::cuda_t<fused_ema::tag::ema_tag>, fc::cuda_t<fused_ema::tag::src_tag>>( \
      const fc::TensorRef*, const fc::TrackEmas*, int64_t, const fc::TrackWeightArgs&,            \
      cudaStream_t);                                                                              \
  template cudaError_t fc::launch_lerp_many_stochastic<fc::cuda_t<fused_ema::tag::ema_tag>,       \
                                                       fc::cuda_t<fused_ema::tag::src_tag>>(      \
      const fc::TensorRef*, const fc::SrTrackEmas*, int64_t, const fc::TrackWeightArgs&,          \
      fc::StepArg, const uint64_t*, cudaStream_t);
FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_INSTANTIATE_MANY)
#undef FUSED_EMA_INSTANTIATE_MANY

// bema_'s launchers (multi_tensor_kernel with theta0 and out as per-tensor data).
#define FUSED_EMA_INSTANTIATE_BEMA(kind, ema, src, ema_tag, src_tag)                         \
  template cudaError_t                                                                       \
  fc::launch_bema<fc::cuda_t<fused_ema::tag::ema_tag>, fc::cuda_t<fused_ema::tag::src_tag>>( \
      const fc::TensorRef*, const fc::BemaTensors*, int64_t, const fc::BemaWeightArgs&,      \
      cudaStream_t);
FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_INSTANTIATE_BEMA)
#undef FUSED_EMA_INSTANTIATE_BEMA

// The schedule kernel's body is shared by host and device (cuda/schedule_step.cuh); the device
// reads its config from memory, as csrc/cuda/schedule_cuda.cu does.
#include "cuda/schedule_step.cuh"

__global__ void schedule_check(int64_t* step, double* out, const double* config, bool advance) {
  fc::schedule_step(step, out, config, advance);
}
