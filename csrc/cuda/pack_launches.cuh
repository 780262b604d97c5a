// Host side of multi_tensor_apply: packs a list of tensors into launches that fit the kernel's
// parameters (a tensor never straddles two), for the real launch or for the tests' emulation.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "block_work.cuh"
#include "launch_meta.cuh"

namespace fused_ema::cuda {

// Packs `refs` into launches of up to kCapacity tensors and INT32_MAX blocks and hands each to
// `launch(meta, blocks)`, stopping at its first error. `extras` holds each tensor's per-tensor
// data where the metadata has some. Host only; tests drive it directly.
template <typename E, typename S, int kPack, int kCapacity, typename Extra, typename Launch>
cudaError_t pack_launches(const TensorRef* refs, int64_t count, LaunchMeta<kCapacity, Extra>& meta,
                          Launch&& launch, const Extra* extras = nullptr) {
  meta.num_tensors = 0;
  int64_t blocks = 0;
  const auto flush = [&]() -> cudaError_t {
    if (meta.num_tensors == 0) {
      return cudaSuccess;
    }
    meta.first_block[meta.num_tensors] = static_cast<int32_t>(blocks);
    const cudaError_t err = launch(static_cast<const LaunchMeta<kCapacity, Extra>&>(meta), blocks);
    meta.num_tensors = 0;
    blocks = 0;
    return err;
  };
  for (int64_t i = 0; i < count; ++i) {
    const TensorRef& ref = refs[i];
    if (ref.numel == 0) {
      continue;
    }
    int head = aligned_head<E, S, kPack>(ref);
    if constexpr (!std::is_void_v<Extra>) {
      if (head >= 0 && !aligned_like(extras[i], ref.ema)) {
        head = -1;
      }
    }
    const int64_t needed = blocks_for<kPack>(ref.numel, head);
    if (needed > INT32_MAX) {
      return cudaErrorInvalidValue;  // over 2^47 elements: no such tensor fits in memory
    }
    if (meta.num_tensors == kCapacity || blocks + needed > INT32_MAX) {
      if (const cudaError_t err = flush(); err != cudaSuccess) {
        return err;
      }
    }
    const int slot = meta.num_tensors++;
    meta.ema[slot] = ref.ema;
    meta.src[slot] = ref.src;
    meta.numel[slot] = ref.numel;
    meta.head[slot] = static_cast<int8_t>(head);
    if constexpr (!std::is_void_v<Extra>) {
      meta.extra[slot] = extras[i];
    }
    meta.first_block[slot] = static_cast<int32_t>(blocks);
    blocks += needed;
  }
  return flush();
}

// Tensors a launch of `kParamBytes` of parameters carries for `Op`.
template <typename Op, size_t kParamBytes>
constexpr int op_capacity() {
  return capacity_for<typename Op::extra_t, kParamBytes>();
}

// Packs `refs` into launches of `kParamBytes` of parameters for `Op` and hands each to
// `launch(meta, blocks)`: the kernel launch (multi_tensor_apply.cuh) or the tests' emulation.
template <typename Op, size_t kParamBytes, typename Launch>
cudaError_t pack_op_launches(const TensorRef* refs, int64_t count,
                             const typename Op::extra_t* extras, Launch&& launch) {
  constexpr int kCapacity = op_capacity<Op, kParamBytes>();
  static_assert(sizeof(MetaOf<Op, kCapacity>) + kOpParamRoom <= kParamBytes,
                "launch metadata exceeds the kernel parameters");
  MetaOf<Op, kCapacity> meta;
  return pack_launches<typename Op::ema_t, typename Op::src_t, Op::kPack>(refs, count, meta, launch,
                                                                          extras);
}

}  // namespace fused_ema::cuda
