// Checks the arguments of fused_ema::lerp_ against the op contract and flattens them, per device,
// into dense spans for the kernels. Every check runs before anything is written, so a rejected
// call leaves the EMA tensors as they were.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "dtype_pairs.h"

namespace fused_ema {

// Borrowed tensors: the Python fast path unpacks without touching reference counts.
using TensorRefs = c10::ArrayRef<const at::Tensor*>;

// One (ema, src) pair as a kernel sees it: dense memory with the same layout on both sides.
struct FlatPair {
  void* ema;
  const void* src;
  int64_t numel;
  PairKind kind;
  uint32_t index;  // in the caller's lists (lerp_stochastic_'s keys and offsets)
};
static_assert(sizeof(FlatPair) == 32, "the index fits in the padding");

// The pairs that live on one device. Stand-ins replace non-contiguous tensors and live as long
// as the plan; write_backs copy results computed in a stand-in into the caller's ema tensor.
struct DevicePlan {
  explicit DevicePlan(c10::Device d) : device(d) {}
  DevicePlan(DevicePlan&&) = default;
  DevicePlan& operator=(DevicePlan&&) = default;
  ~DevicePlan();  // hands `pairs` back to plan_lerp's per-thread pool

  c10::Device device;
  std::vector<FlatPair> pairs;
  std::vector<at::Tensor> stand_ins;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_backs;

  // Call after the kernels of this plan have been issued (stream order covers CUDA).
  void finish() const;
};

// Prefetches every cache line that [p, p + bytes) touches. Heap objects are only 16-byte aligned,
// so an object usually straddles one line more than its size suggests: stepping from p alone
// missed the last one (where TensorImpl keeps its device and size policies). The prefetch
// helpers are always inlined: GCC found an out-of-line one free of side effects and dropped the
// calls (plan_lerp's main loop issued no prefetch at all).
[[gnu::always_inline]] inline void prefetch_bytes(const void* p, size_t bytes, int write = 0) {
  const auto first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto last = reinterpret_cast<uintptr_t>(p) + bytes - 1;
  for (uintptr_t line = first; line <= last; line += 64) {
    if (write != 0) {
      __builtin_prefetch(reinterpret_cast<const void*>(line), 1);
    } else {
      __builtin_prefetch(reinterpret_cast<const void*>(line));
    }
  }
}

// Prefetches a TensorImpl: the metadata of a long list has left the cache.
[[gnu::always_inline]] inline void prefetch_tensor_impl(const c10::TensorImpl* impl) {
  prefetch_bytes(impl, sizeof(c10::TensorImpl));
}

// Lists shorter than this are still in the L2 cache from their last update, where prefetching
// by hand only adds instructions (1,000 tensors cost 20% more with it).
constexpr size_t kPrefetchFrom = 2048;

// A vector lent by a per-thread pool, given back emptied (capacity kept) when this goes, so that
// the buffers of a long list are neither allocated nor faulted in at every call. kPool tells
// pools of one element type apart; a nested call finds its pool lent out and allocates.
template <typename T, int kPool>
class Scratch {
 public:
  Scratch() {
    vec.swap(pool());
    vec.clear();
  }
  ~Scratch() {
    vec.clear();
    if (vec.capacity() > pool().capacity()) {
      pool().swap(vec);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  std::vector<T> vec;

 private:
  static std::vector<T>& pool() {
    thread_local std::vector<T> lent;
    return lent;
  }
};

// Validates lengths, devices, layouts, dtype pairs, shapes, autograd state and memory overlap,
// naming the index of the first bad pair. Returns one plan per device, in order of appearance.
// row_major: every span lists its ema's elements in row-major order (lerp_stochastic_ numbers
// them), so a non-contiguous ema is computed in a contiguous stand-in and written back.
std::vector<DevicePlan> plan_lerp(TensorRefs ema, TensorRefs src, bool row_major = false);

}  // namespace fused_ema
