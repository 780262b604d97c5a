// How a tensor splits into blocks: an unaligned head, a body of 16-byte packs in chunks of
// kChunkElems elements, a scalar tail; and which block updates what (block_work, host and device:
// the packing, the kernel and the tests' emulation share it).
#pragma once

#include <cstdint>

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

// Whether the other pointers an op's per-tensor data names share `first`'s 16-byte alignment
// (lerp_many_'s other tracks overload this), so that aligned_head's head aligns them too; data
// that names none always does.
template <typename Extra>
bool aligned_like(const Extra&, const void* /*first*/) {
  return true;
}

template <int kPack>
FUSED_EMA_HOST_DEVICE inline int64_t packs_in_body(int64_t numel, int head) {
  return (numel - head) / kPack;
}

template <int kPack>
int64_t blocks_for(int64_t numel, int head) {
  if (head < 0) {
    return ceil_div(numel, kChunkElems);
  }
  const int64_t chunks = ceil_div(packs_in_body<kPack>(numel, head), kChunkElems / kPack);
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
  const int64_t packs = packs_in_body<kPack>(n, w.head);
  constexpr int64_t kChunkPacks = kChunkElems / kPack;
  w.begin = chunk * kChunkPacks;
  w.end = min64(packs, w.begin + kChunkPacks);
  if (chunk == 0) {
    w.tail_begin = w.head + packs * kPack;
    w.scalars = w.head + (n - w.tail_begin);
  }
  return w;
}

}  // namespace fused_ema::cuda
