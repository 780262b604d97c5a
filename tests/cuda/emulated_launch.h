// The host emulation of multi_tensor_apply, for tests without a GPU: the real packing
// (pack_op_launches) for the 4 KB or the 32 KB layout, then every thread of every block of each
// packed launch, one after another, running the kernel's own body (multi_tensor_kernel as a plain
// C++ compiler sees it) over host memory. EmulatedLaunch stands in for StreamLaunch.
#pragma once

#include <cstdint>

#include "cuda/multi_tensor_apply.cuh"

namespace fused_ema::cuda::emulation {

struct LaunchCounts {
  int64_t launches = 0;
  int64_t blocks = 0;
};

template <typename Op, size_t kParamBytes>
cudaError_t run_layout(const TensorRef* refs, int64_t count, const Op& op,
                       const typename Op::extra_t* extras, LaunchCounts& counts) {
  constexpr int kCapacity = op_capacity<Op, kParamBytes>();
  return pack_op_launches<Op, kParamBytes>(
      refs, count, extras, [&](const MetaOf<Op, kCapacity>& meta, int64_t blocks) {
        ++counts.launches;
        counts.blocks += blocks;
        for (int64_t block = 0; block < blocks; ++block) {
          for (unsigned thread = 0; thread < kBlockThreads; ++thread) {
            multi_tensor_kernel<Op, kCapacity>(meta, op, static_cast<int32_t>(block), thread);
          }
        }
        return cudaSuccess;
      });
}

// The launch of fused_launch.cuh's ops with the layout chosen by the caller instead of the device.
struct EmulatedLaunch {
  bool large;
  LaunchCounts& counts;

  template <typename Op>
  cudaError_t operator()(const Op& op, const TensorRef* refs, int64_t count,
                         const typename Op::extra_t* extras) const {
    return large ? run_layout<Op, kLargeParamBytes>(refs, count, op, extras, counts)
                 : run_layout<Op, kSmallParamBytes>(refs, count, op, extras, counts);
  }
};

}  // namespace fused_ema::cuda::emulation
