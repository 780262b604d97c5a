// Instantiates every CUDA kernel of fused_ema without torch headers, so that tests can check the
// device code compiles for each target architecture with plain nvcc (see test_cuda_compile.py).
#include "cuda/fused_launch.cuh"

namespace fc = fused_ema::cuda;

// A plan's pair and a bema_ item as fused_cuda.cu hands them over (lerp_plan.h, fused_op.h).
struct Pair {
  void* ema;
  const void* src;
  int64_t numel;
  fused_ema::PairKind kind;
  uint32_t index;
};
struct Item {
  void* ema;
  void* theta0;
  void* out;
  const void* src;
  int64_t numel;
  fused_ema::PairKind kind;
};

// The runner's two entry points launch every op of every dtype pair: lerp_ and lerp_many_, each
// rounding to nearest or stochastically, and bema_.
template cudaError_t fc::launch_lerp_call<Pair, fc::StreamLaunch>(const Pair*, size_t,
                                                                  const fc::LerpCall&,
                                                                  const fc::StreamLaunch&);
template cudaError_t fc::launch_bema_call<Item, fc::StreamLaunch>(const Item*, size_t,
                                                                  const fc::CallWeights&,
                                                                  const fc::StreamLaunch&);

// The schedule kernel's body is shared by host and device (schedule_formula.h); the device
// reads its config from memory, as csrc/cuda/schedule_cuda.cu does.
#include "schedule_formula.h"

__global__ void schedule_check(int64_t* step, double* out, const double* config, bool advance) {
  fused_ema::schedule_step(step, out, config, advance);
}
