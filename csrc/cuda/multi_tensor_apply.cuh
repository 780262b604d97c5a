// Multi-tensor apply: one launch updates many tensors in place, in as few launches as the
// device's kernel parameters allow. Parts: launch_meta.cuh (parameter layouts), block_work.cuh,
// pack_launches.cuh (host), multi_tensor_kernel.cuh (multi_track_kernel.cuh for ops with several
// EMAs a source), launch_layout.cuh (4 or 32 KB, nvcc only).
#pragma once

#include <cuda_runtime.h>

#include "block_work.cuh"
#include "launch_meta.cuh"
#include "multi_tensor_kernel.cuh"
#include "multi_track_kernel.cuh"
#include "pack_launches.cuh"
#if defined(__CUDACC__)
#include "launch_layout.cuh"

namespace fused_ema::cuda {

template <typename Op, size_t kParamBytes>
cudaError_t launch_packed(const TensorRef* refs, int64_t count, const Op& op, cudaStream_t stream,
                          const typename Op::extra_t* extras) {
  constexpr int kCapacity = op_capacity<Op, kParamBytes>();
  return pack_op_launches<Op, kParamBytes>(
      refs, count, extras, [&](const MetaOf<Op, kCapacity>& packed, int64_t blocks) {
        const auto grid = static_cast<unsigned>(blocks);
        if constexpr (IsTrackOp<Op>::value) {
          multi_track_kernel<Op, kCapacity><<<grid, kBlockThreads, 0, stream>>>(packed, op);
        } else {
          multi_tensor_kernel<Op, kCapacity><<<grid, kBlockThreads, 0, stream>>>(packed, op);
        }
        return cudaGetLastError();
      });
}

// Updates every tensor of `refs` in as few launches as the device's parameter space allows.
// `extras` holds each tensor's Op::extra_t, if it has one.
template <typename Op>
cudaError_t multi_tensor_apply(const TensorRef* refs, int64_t count, const Op& op,
                               cudaStream_t stream, const typename Op::extra_t* extras = nullptr) {
  if constexpr (kLargeParamsCompiled) {
    bool large = false;
    if (const cudaError_t err = use_large_params(stream, &large); err != cudaSuccess) {
      return err;
    }
    if (large) {
      return launch_packed<Op, kLargeParamBytes>(refs, count, op, stream, extras);
    }
  }
  return launch_packed<Op, kSmallParamBytes>(refs, count, op, stream, extras);
}

}  // namespace fused_ema::cuda
#endif  // defined(__CUDACC__)
