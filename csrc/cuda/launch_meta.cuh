// The launch metadata of multi_tensor_apply: tensor pointers, sizes and each tensor's first block
// in the kernel's parameter space, 4 KB or (CUDA >= 12.1, Volta and newer) 32 KB, and how many
// tensors each layout carries. No torch headers (nvcc-only tests; g++ compiles it too).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fused_ema::cuda {

// Kernel parameters may take 4,096 bytes, or 32,764 since CUDA 12.1 with a driver >= 12.1 on
// Volta and newer. ATen's foreach launcher packs 110 tensors for 4 KB.
constexpr int kSmallCapacity = 120;
constexpr int kLargeCapacity = 1024;
constexpr size_t kSmallParamBytes = 4096;
constexpr size_t kLargeParamBytes = 32764;
// The op rides along as a kernel parameter too; keep room for it.
constexpr size_t kOpParamRoom = 256;

// A target below sm_70 in the arch list (__CUDA_ARCH_LIST__ is sorted: its head is the oldest)
// takes neither 32 KB of parameters nor __grid_constant__. One host launcher serves every target,
// so the whole build then packs for 4 KB.
#define FUSED_EMA_ARCH_LIST_HEAD_(a, ...) a
#define FUSED_EMA_ARCH_LIST_HEAD(...) FUSED_EMA_ARCH_LIST_HEAD_(__VA_ARGS__)
#if !defined(FUSED_EMA_PRE_VOLTA_BUILD) && defined(__CUDA_ARCH_LIST__)
#if FUSED_EMA_ARCH_LIST_HEAD(__CUDA_ARCH_LIST__) < 700
#define FUSED_EMA_PRE_VOLTA_BUILD 1
#endif
#endif
#if defined(FUSED_EMA_PRE_VOLTA_BUILD) || !defined(CUDART_VERSION) || CUDART_VERSION < 12010
constexpr bool kLargeParamsCompiled = false;
#else
constexpr bool kLargeParamsCompiled = true;
#endif
// Keeps the metadata in parameter space even where its address is taken.
#if defined(FUSED_EMA_PRE_VOLTA_BUILD)
#define FUSED_EMA_GRID_CONSTANT
#else
#define FUSED_EMA_GRID_CONSTANT __grid_constant__
#endif

// One dense (ema, src) pair, as the host hands it over.
struct TensorRef {
  void* ema;
  const void* src;
  int64_t numel;
};

// Per-tensor data some ops need besides pointers and sizes (Op::extra_t; an empty struct: none).
// It costs launch capacity, so only such ops' metadata carries it.
struct NoExtra {};
template <typename Extra, int kCapacity, bool = std::is_empty_v<Extra>>
struct PerTensorExtra {
  Extra extra[kCapacity];
};
template <typename Extra, int kCapacity>
struct PerTensorExtra<Extra, kCapacity, true> {};

// Tensors a launch of `kParamBytes` of parameters carries: the fixed capacities for ops without
// per-tensor data, fewer for ops with some.
template <typename Extra, size_t kParamBytes>
constexpr int capacity_for() {
  if constexpr (std::is_empty_v<Extra>) {
    return kParamBytes == kSmallParamBytes ? kSmallCapacity : kLargeCapacity;
  } else {
    constexpr size_t kPerTensor =
        2 * sizeof(void*) + sizeof(int64_t) + sizeof(int32_t) + sizeof(int8_t) + sizeof(Extra);
    return static_cast<int>((kParamBytes - kOpParamRoom - 2 * sizeof(int64_t)) / kPerTensor);
  }
}

// Struct of arrays: the binary search walks first_block alone.
template <int kCapacity, typename Extra = NoExtra>
struct LaunchMeta : PerTensorExtra<Extra, kCapacity> {
  static constexpr int kMaxTensors = kCapacity;
  void* ema[kCapacity];
  const void* src[kCapacity];
  int64_t numel[kCapacity];
  int32_t first_block[kCapacity + 1];  // [num_tensors] holds the launch's block count
  int8_t head[kCapacity];              // scalar elements before the 16-byte aligned body; -1: none
  int32_t num_tensors;
};

static_assert(sizeof(LaunchMeta<kSmallCapacity>) + kOpParamRoom <= kSmallParamBytes,
              "small launch metadata exceeds 4 KB of kernel parameters");
static_assert(sizeof(LaunchMeta<kLargeCapacity>) + kOpParamRoom <= kLargeParamBytes,
              "large launch metadata exceeds 32 KB of kernel parameters");

template <typename Op, int kCapacity>
using MetaOf = LaunchMeta<kCapacity, typename Op::extra_t>;

}  // namespace fused_ema::cuda
