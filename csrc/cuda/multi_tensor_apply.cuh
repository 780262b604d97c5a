// Multi-tensor apply: one launch updates up to kMaxTensorsPerLaunch tensors in place. Pointers,
// sizes and each tensor's first block travel in the kernel's parameter space; a block finds its
// tensor by binary search over the first-block table, so a tensor never straddles two launches
// and metadata does not grow with the block count. Needs no torch headers (nvcc-only tests).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

namespace fused_ema::cuda {

constexpr int kBlockThreads = 512;
// Independent pack loads in flight per thread, to cover memory latency.
constexpr int kILP = 4;
// Elements per block: a multiple of every pack width times kBlockThreads * kILP.
constexpr int64_t kChunkElems = 65536;

// Kernel parameters may take 32,764 bytes since CUDA 12.1 (Volta and newer), 4 KB before. ATen's
// foreach launcher still packs for 4 KB (64 tensors a launch); 1,024 tensors fit here.
#if CUDART_VERSION >= 12010
constexpr int kMaxTensorsPerLaunch = 1024;
constexpr size_t kParamBytes = 32764;
#else
constexpr int kMaxTensorsPerLaunch = 120;
constexpr size_t kParamBytes = 4096;
#endif

// One dense (ema, src) pair, as the host hands it over.
struct TensorRef {
  void* ema;
  const void* src;
  int64_t numel;
};

// Bytes of kernel parameters the op itself may take.
constexpr size_t kOpParamBytes = 256;

// Per-tensor data some ops need besides pointers and sizes (Op::extra_t; void: none). It costs
// launch capacity, so only such ops' metadata carries it.
template <typename Extra, int kMax>
struct PerTensorExtra {
  Extra extra[kMax];
};
template <int kMax>
struct PerTensorExtra<void, kMax> {};

template <typename Extra>
constexpr int max_tensors_per_launch() {
  if constexpr (std::is_void_v<Extra>) {
    return kMaxTensorsPerLaunch;
  } else {
    constexpr size_t kPerTensor =
        2 * sizeof(void*) + sizeof(int64_t) + sizeof(int32_t) + sizeof(int8_t) + sizeof(Extra);
    return static_cast<int>((kParamBytes - kOpParamBytes - 2 * sizeof(int64_t)) / kPerTensor);
  }
}

// Struct of arrays: the binary search walks first_block alone.
template <typename Extra = void, int kMax = max_tensors_per_launch<Extra>()>
struct LaunchMeta : PerTensorExtra<Extra, kMax> {
  static constexpr int kMaxTensors = kMax;
  void* ema[kMax];
  const void* src[kMax];
  int64_t numel[kMax];
  int32_t first_block[kMax + 1];  // [num_tensors] holds the launch's block count
  int8_t head[kMax];              // scalar elements before the 16-byte aligned body; -1: none
  int32_t num_tensors;
};

// The op rides along as a kernel parameter too; keep room for it.
static_assert(sizeof(LaunchMeta<>) + kOpParamBytes <= kParamBytes,
              "launch metadata exceeds kernel params");

template <typename Op>
using MetaOf = LaunchMeta<typename Op::extra_t>;

// Ops without per-tensor data bind once per block from their own fields; others also from the
// block's tensor entry.
template <typename Op>
__device__ auto bind_op(const Op& op, const MetaOf<Op>& meta, int t) {
  if constexpr (std::is_void_v<typename Op::extra_t>) {
    return op.bind();
  } else {
    return op.bind(meta.extra[t]);
  }
}

// A bound op maps (ema, src) to the new ema value; an indexed one (kIndexed) also takes the
// element's index in its tensor, and updates a whole pack at once (pack()).
template <typename F, typename E, typename S>
__device__ E apply_one(const F& f, E e, S s, int64_t i) {
  if constexpr (F::kIndexed) {
    return f(e, s, i);
  } else {
    return f(e, s);
  }
}

// A group of N elements loaded or stored with 16-byte accesses (N * sizeof(T) is 16 or 32).
template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

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
__host__ __device__ inline int64_t packs_in_body(int64_t numel, int head) {
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

template <typename Meta>
__device__ int find_tensor(const Meta& meta, int32_t block) {
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
  return lo;
}

// Op supplies ema_t, src_t, kPack and bind(), whose result maps (ema, src) to the new ema value
// and says whether this launch may skip its work (read on the device: a device-side weight).
template <typename Op>
__global__ void __launch_bounds__(kBlockThreads)
    multi_tensor_kernel(const __grid_constant__ MetaOf<Op> meta, const Op op) {
  using E = typename Op::ema_t;
  using S = typename Op::src_t;
  constexpr int kPack = Op::kPack;
  const auto block = static_cast<int32_t>(blockIdx.x);
  const int t = find_tensor(meta, block);
  const int64_t chunk = block - meta.first_block[t];
  E* ema = static_cast<E*>(meta.ema[t]);
  const S* src = static_cast<const S*>(meta.src[t]);
  const int64_t n = meta.numel[t];
  const int head = meta.head[t];
  const auto f = bind_op(op, meta, t);
  if (f.skip) {
    return;
  }

  if (head < 0) {
    const int64_t end = min64(n, (chunk + 1) * kChunkElems);
    for (int64_t base = chunk * kChunkElems + threadIdx.x; base < end;
         base += kBlockThreads * kILP) {
      E e[kILP];
      S s[kILP];
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const int64_t i = base + j * kBlockThreads;
        if (i < end) {
          e[j] = ema[i];
          s[j] = src[i];
        }
      }
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const int64_t i = base + j * kBlockThreads;
        if (i < end) {
          ema[i] = apply_one(f, e[j], s[j], i);
        }
      }
    }
    return;
  }

  const int64_t packs = packs_in_body<kPack>(n, head);
  constexpr int64_t kChunkPacks = kChunkElems / kPack;
  auto* ema_body = reinterpret_cast<Pack<E, kPack>*>(ema + head);
  const auto* src_body = reinterpret_cast<const Pack<S, kPack>*>(src + head);
  const int64_t end = min64(packs, (chunk + 1) * kChunkPacks);
  for (int64_t base = chunk * kChunkPacks + threadIdx.x; base < end; base += kBlockThreads * kILP) {
    Pack<E, kPack> e[kILP];
    Pack<S, kPack> s[kILP];
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      const int64_t p = base + j * kBlockThreads;
      if (p < end) {
        e[j] = ema_body[p];
        s[j] = src_body[p];
      }
    }
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      const int64_t p = base + j * kBlockThreads;
      if (p < end) {
        if constexpr (std::decay_t<decltype(f)>::kIndexed) {
          f.pack(e[j], s[j], head + p * kPack);
        } else {
#pragma unroll
          for (int k = 0; k < kPack; ++k) {
            e[j].v[k] = f(e[j].v[k], s[j].v[k]);
          }
        }
        ema_body[p] = e[j];
      }
    }
  }
  // The unaligned head and the tail shorter than a pack: fewer than 2 * kPack elements.
  if (chunk == 0) {
    const int64_t tail_begin = head + packs * kPack;
    const int64_t scalars = head + (n - tail_begin);
    if (threadIdx.x < scalars) {
      const int64_t i = threadIdx.x < head ? threadIdx.x : tail_begin + (threadIdx.x - head);
      ema[i] = apply_one(f, ema[i], src[i], i);
    }
  }
}

// Packs `refs` into as few launches as the metadata allows and launches them on `stream`.
// `extras` holds each tensor's Op::extra_t, if it has one.
template <typename Op, typename Extra = typename Op::extra_t>
cudaError_t multi_tensor_apply(const TensorRef* refs, int64_t count, const Op& op,
                               cudaStream_t stream, const Extra* extras = nullptr) {
  using E = typename Op::ema_t;
  using S = typename Op::src_t;
  MetaOf<Op> meta;
  meta.num_tensors = 0;
  int64_t blocks = 0;
  const auto flush = [&]() -> cudaError_t {
    if (meta.num_tensors == 0) {
      return cudaSuccess;
    }
    meta.first_block[meta.num_tensors] = static_cast<int32_t>(blocks);
    multi_tensor_kernel<Op><<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(meta, op);
    meta.num_tensors = 0;
    blocks = 0;
    return cudaGetLastError();
  };
  for (int64_t i = 0; i < count; ++i) {
    const TensorRef& ref = refs[i];
    if (ref.numel == 0) {
      continue;
    }
    const int head = aligned_head<E, S, Op::kPack>(ref);
    const int64_t needed = blocks_for<Op::kPack>(ref.numel, head);
    if (meta.num_tensors == MetaOf<Op>::kMaxTensors || blocks + needed > INT32_MAX) {
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

}  // namespace fused_ema::cuda
