// How a tensor splits into blocks: an unaligned head, a body of 16-byte packs in chunks of
// kChunkElems elements, a scalar tail; which block updates what (block_work, host and device); and
// how a list of tensors packs into launches that fit the kernel's parameters (host only).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../host_device.h"
#include "launch_meta.cuh"

namespace fused_ema::cuda {

// Elements per block: a multiple of every pack width times kBlockThreads * kILP.
constexpr int64_t kChunkElems = 65536;

// A group of N elements loaded or stored with 16-byte accesses (N * sizeof(T) is 16 or 32).
template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

FUSED_EMA_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

FUSED_EMA_HOST_DEVICE inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Elements of head such that both sides are 16-byte aligned after it, or -1 if no such count
// below one pack exists (then the tensor takes the plain element-wise path).
template <typename E, typename S, int kPack>
int aligned_head(const TensorRef& ref) {
  const auto e = reinterpret_cast<uintptr_t>(ref.ema);
  const auto s = reinterpret_cast<uintptr_t>(ref.src);
  for (int k = 0; k < kPack; ++k) {
    if ((e + k * sizeof(E)) % 16 == 0 && (s + k * sizeof(S)) % 16 == 0) {
      return static_cast<int>(min64(k, ref.numel));
    }
  }
  return -1;
}

template <int kPack>
int64_t blocks_for(int64_t numel, int head) {
  if (head < 0) {
    return ceil_div(numel, kChunkElems);
  }
  const int64_t chunks = ceil_div((numel - head) / kPack, kChunkElems / kPack);
  return chunks > 0 ? chunks : 1;
}

// What one block updates: [begin, end) in packs of the aligned body (head >= 0) or in elements
// (head < 0), and, in a tensor's first block, `scalars` single elements: the head, then the
// tail from tail_begin.
struct BlockWork {
  int tensor;
  int head;
  int64_t begin;
  int64_t end;
  int64_t scalars;
  int64_t tail_begin;
};

template <int kPack, typename Meta>
FUSED_EMA_HOST_DEVICE inline BlockWork block_work(const Meta& meta, int32_t block) {
  int lo = 0;
  int hi = meta.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (meta.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  BlockWork w{lo, meta.head[lo], 0, 0, 0, 0};
  const int64_t chunk = block - meta.first_block[lo];
  const int64_t n = meta.numel[lo];
  if (w.head < 0) {
    w.begin = chunk * kChunkElems;
    w.end = min64(n, w.begin + kChunkElems);
    return w;
  }
  const int64_t packs = (n - w.head) / kPack;
  constexpr int64_t kChunkPacks = kChunkElems / kPack;
  w.begin = chunk * kChunkPacks;
  w.end = min64(packs, w.begin + kChunkPacks);
  if (chunk == 0) {
    w.tail_begin = w.head + packs * kPack;
    w.scalars = w.head + (n - w.tail_begin);
  }
  return w;
}

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
    // The other pointers of the tensor's per-tensor data must share the EMA's alignment for
    // the head to align them too (Extra::aligned_like).
    if constexpr (!std::is_empty_v<Extra>) {
      if (head >= 0 && !extras[i].aligned_like(ref.ema)) {
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
    if constexpr (!std::is_empty_v<Extra>) {
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
