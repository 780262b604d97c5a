// Multi-tensor apply: one launch updates many tensors in place. Pointers, sizes and each tensor's
// first block travel in the kernel's parameter space (4 KB, or 32 KB where driver and GPU allow,
// chosen at run time per device); a block finds its tensor by binary search over the first-block
// table, so a tensor never straddles two launches. Needs no torch headers (nvcc-only tests); a
// plain C++ compiler takes all but the launch itself, so tests run the device code on the host.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../host_device.h"

namespace fused_ema::cuda {

constexpr int kBlockThreads = 512;
// Two resident blocks per SM at least: caps registers at 64 a thread (50% occupancy).
constexpr int kMinBlocksPerSM = 2;
// Independent pack loads in flight per thread, to cover memory latency (Op::kIlp: ops whose
// packs take more registers keep fewer in flight, to stay within kMinBlocksPerSM).
constexpr int kILP = 4;
// Elements per block: a multiple of every pack width times kBlockThreads * kILP.
constexpr int64_t kChunkElems = 65536;

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

// Per-tensor data some ops need besides pointers and sizes (Op::extra_t; void: none). It costs
// launch capacity, so only such ops' metadata carries it.
template <typename Extra, int kCapacity>
struct PerTensorExtra {
  Extra extra[kCapacity];
};
template <int kCapacity>
struct PerTensorExtra<void, kCapacity> {};

// Tensors a launch of `kParamBytes` of parameters carries: the fixed capacities for ops without
// per-tensor data, fewer for ops with some.
template <typename Extra, size_t kParamBytes>
constexpr int capacity_for() {
  if constexpr (std::is_void_v<Extra>) {
    return kParamBytes == kSmallParamBytes ? kSmallCapacity : kLargeCapacity;
  } else {
    constexpr size_t kPerTensor =
        2 * sizeof(void*) + sizeof(int64_t) + sizeof(int32_t) + sizeof(int8_t) + sizeof(Extra);
    return static_cast<int>((kParamBytes - kOpParamRoom - 2 * sizeof(int64_t)) / kPerTensor);
  }
}

// Struct of arrays: the binary search walks first_block alone.
template <int kCapacity, typename Extra = void>
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

template <typename Op, int kCapacity>
using MetaOf = LaunchMeta<kCapacity, typename Op::extra_t>;

// Resident blocks per SM an op's kernel is compiled for: Op::kMinBlocksPerSM where the op sets
// it (benchmarks/cuda/sr_variants.cu tries others), else kMinBlocksPerSM.
template <typename Op, typename = void>
struct MinBlocksPerSM {
  static constexpr int value = kMinBlocksPerSM;
};
template <typename Op>
struct MinBlocksPerSM<Op, std::void_t<decltype(Op::kMinBlocksPerSM)>> {
  static constexpr int value = Op::kMinBlocksPerSM;
};

// Ops without per-tensor data bind from their own fields; others also from the block's tensor.
template <typename Op, typename Meta>
FUSED_EMA_HOST_DEVICE auto bind_op(const Op& op, const Meta& meta, int t) {
  if constexpr (std::is_void_v<typename Op::extra_t>) {
    return op.bind();
  } else {
    return op.bind(meta.extra[t]);
  }
}

// A bound op maps (ema, src) to the new ema value; an indexed one (kIndexed) also takes the
// element's index in its tensor, and updates a whole pack at once (pack()).
template <typename F, typename E, typename S>
FUSED_EMA_HOST_DEVICE E apply_one(const F& f, E e, S s, int64_t i) {
  if constexpr (F::kIndexed) {
    return f(e, s, i);
  } else {
    return f(e, s);
  }
}

// The kernel: Op supplies ema_t, src_t, extra_t, kPack and bind(), whose result maps (ema, src)
// to the new ema value and says whether this launch may skip its work (read on the device: a
// device-side weight). A plain C++ compiler gets the same body as a function of the block and
// thread indices: the threads of a block share nothing, so running them one after another on the
// host is faithful. (The body stays in the kernel: moved into a function that the kernel calls,
// inlined or not, it took ptxas from 38 to 61 registers for a stochastic kernel on sm_80.)
#if defined(__CUDACC__)
template <typename Op, int kCapacity>
__global__ void __launch_bounds__(kBlockThreads, MinBlocksPerSM<Op>::value)
    multi_tensor_kernel(const FUSED_EMA_GRID_CONSTANT MetaOf<Op, kCapacity> meta, const Op op) {
  const auto block = static_cast<int32_t>(blockIdx.x);
  const unsigned thread = threadIdx.x;
#else
template <typename Op, int kCapacity>
void multi_tensor_kernel(const MetaOf<Op, kCapacity>& meta, const Op& op, int32_t block,
                         unsigned thread) {
#endif
  using E = typename Op::ema_t;
  using S = typename Op::src_t;
  constexpr int kPack = Op::kPack;
  constexpr int kIlp = Op::kIlp;
  const BlockWork w = block_work<kPack>(meta, block);
  const auto f = bind_op(op, meta, w.tensor);
  if (f.skip) {
    return;
  }
  E* ema = static_cast<E*>(meta.ema[w.tensor]);
  const S* src = static_cast<const S*>(meta.src[w.tensor]);

  // Offsets within a chunk fit in 32 bits, so the kIlp accesses share one base address.
  const int count = static_cast<int>(w.end - w.begin);
  if (w.head < 0) {
    E* ema_chunk = ema + w.begin;
    const S* src_chunk = src + w.begin;
    for (int base = static_cast<int>(thread); base < count; base += kBlockThreads * kIlp) {
      E e[kIlp];
      S s[kIlp];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int i = base + j * kBlockThreads;
        if (i < count) {
          e[j] = ema_chunk[i];
          s[j] = src_chunk[i];
        }
      }
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int i = base + j * kBlockThreads;
        if (i < count) {
          ema_chunk[i] = apply_one(f, e[j], s[j], w.begin + i);
        }
      }
    }
    return;
  }

  auto* ema_chunk = reinterpret_cast<Pack<E, kPack>*>(ema + w.head) + w.begin;
  const auto* src_chunk = reinterpret_cast<const Pack<S, kPack>*>(src + w.head) + w.begin;
  for (int base = static_cast<int>(thread); base < count; base += kBlockThreads * kIlp) {
    Pack<E, kPack> e[kIlp];
    Pack<S, kPack> s[kIlp];
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int p = base + j * kBlockThreads;
      if (p < count) {
        e[j] = ema_chunk[p];
        s[j] = src_chunk[p];
      }
    }
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int p = base + j * kBlockThreads;
      if (p < count) {
        if constexpr (std::decay_t<decltype(f)>::kIndexed) {
          f.pack(e[j], s[j], w.head + (w.begin + p) * kPack);
        } else {
#pragma unroll
          for (int k = 0; k < kPack; ++k) {
            e[j].v[k] = f(e[j].v[k], s[j].v[k]);
          }
        }
        ema_chunk[p] = e[j];
      }
    }
  }
  // The unaligned head and the tail shorter than a pack: fewer than 2 * kPack elements.
  if (thread < w.scalars) {
    const auto head = static_cast<unsigned>(w.head);  // >= 0 here
    const int64_t i = thread < head ? thread : w.tail_begin + (thread - head);
    ema[i] = apply_one(f, ema[i], src[i], i);
  }
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
    const int head = aligned_head<E, S, kPack>(ref);
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
// `launch(meta, blocks)`: the kernel launch below, or the host emulation of the tests.
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

#if defined(__CUDACC__)
// FUSED_EMA_CUDA_SMALL_PARAMS=1 (or set_force_small_params) keeps every launch at 4 KB.
inline std::atomic<bool>& force_small_params() {
  static std::atomic<bool> flag([] {
    const char* env = std::getenv("FUSED_EMA_CUDA_SMALL_PARAMS");
    return env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
  }());
  return flag;
}

// Whether `device` takes 32 KB of kernel parameters: a driver >= 12.1 (an older one runs CUDA
// 12.1+ builds under minor-version compatibility but rejects the launch) and compute capability
// >= 7.0. Asked once per device.
inline cudaError_t large_params_supported(int device, bool* supported) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> cache[kMaxDevices] = {};  // 0: not asked yet, 1: no, 2: yes
  if (device >= 0 && device < kMaxDevices) {
    if (const int8_t known = cache[device].load(std::memory_order_relaxed); known != 0) {
      *supported = known == 2;
      return cudaSuccess;
    }
  }
  int driver = 0;
  int major = 0;
  if (cudaError_t err = cudaDriverGetVersion(&driver); err != cudaSuccess) {
    return err;
  }
  if (cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      err != cudaSuccess) {
    return err;
  }
  *supported = driver >= 12010 && major >= 7;
  if (device >= 0 && device < kMaxDevices) {
    cache[device].store(*supported ? 2 : 1, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Which layout launches on `stream` (on the current device) use. Like ATen's run-time choice,
// builds before CUDA 13 keep 4 KB while the stream captures a graph; ATen's CUDA 13 builds (which
// need a driver >= 13.0) take 32 KB in graphs too.
inline cudaError_t use_large_params(cudaStream_t stream, bool* large) {
  *large = false;
  if (!kLargeParamsCompiled || force_small_params().load(std::memory_order_relaxed)) {
    return cudaSuccess;
  }
#if CUDART_VERSION < 13000
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t err = cudaStreamIsCapturing(stream, &capture); err != cudaSuccess) {
    return err;
  }
  if (capture != cudaStreamCaptureStatusNone) {
    return cudaSuccess;
  }
#else
  (void)stream;
#endif
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return err;
  }
  return large_params_supported(device, large);
}

template <typename Op, size_t kParamBytes>
cudaError_t launch_packed(const TensorRef* refs, int64_t count, const Op& op, cudaStream_t stream,
                          const typename Op::extra_t* extras) {
  constexpr int kCapacity = op_capacity<Op, kParamBytes>();
  return pack_op_launches<Op, kParamBytes>(
      refs, count, extras, [&](const MetaOf<Op, kCapacity>& packed, int64_t blocks) {
        multi_tensor_kernel<Op, kCapacity>
            <<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(packed, op);
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
#endif  // defined(__CUDACC__)

}  // namespace fused_ema::cuda
