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

  c10::Device device;
  std::vector<FlatPair> pairs;
  std::vector<at::Tensor> stand_ins;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_backs;

  // Call after the kernels of this plan have been issued (stream order covers CUDA).
  void finish() const;
};

// Validates lengths, devices, layouts, dtype pairs, shapes, autograd state and memory overlap,
// naming the index of the first bad pair. Returns one plan per device, in order of appearance.
// row_major: every span lists its ema's elements in row-major order (lerp_stochastic_ numbers
// them), so a non-contiguous ema is computed in a contiguous stand-in and written back.
std::vector<DevicePlan> plan_lerp(TensorRefs ema, TensorRefs src, bool row_major = false);

}  // namespace fused_ema
