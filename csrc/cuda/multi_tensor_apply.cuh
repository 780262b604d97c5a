// Multi-tensor apply: one kernel updates many tensors in place, each block finding its tensor by
// binary search over the first-block table, and one launcher packs a list into as few launches as
// the kernel parameters allow (4 or 32 KB). Every op of the family runs through it: an op of K
// tracks updates K EMAs from one read of each source. Under g++ the kernel is a function of
// (block, thread).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "../host_device.h"
#include "launch_meta.cuh"
#include "packing.cuh"

namespace fused_ema::cuda {

constexpr int kBlockThreads = 512;
// Two resident blocks per SM at least: caps registers at 64 a thread (50% occupancy).
constexpr int kMinBlocksPerSM = 2;
// Independent pack loads in flight per thread, to cover memory latency (Op::kIlp: ops whose
// packs take more registers keep fewer in flight, to stay within Op::kMinBlocksPerSM).
constexpr int kILP = 4;

// A 16-byte access off its alignment faults on the GPU but not on the host: the emulation checks
// the base of every block's packs, if any (all the tracks' EMAs must share the source's head).
template <typename T>
FUSED_EMA_HOST_DEVICE inline void check_aligned([[maybe_unused]] const T* packs,
                                                [[maybe_unused]] int count) {
#if !defined(__CUDACC__)
  if (count > 0 && reinterpret_cast<uintptr_t>(packs) % 16 != 0) {
    throw std::logic_error("multi_tensor_kernel: a pack is not 16-byte aligned");
  }
#endif
}

// The tracks of a block's tensor: track k's EMA (Op::ema, null where the track has none in this
// launch) and its bound op (Op::bind). Several tracks bind anew where they are used (a few
// instructions; a device weight is an L1 hit): bound ops kept for every track would hold their
// registers across the whole walk. The metadata is __grid_constant__, so the run-time track index
// reads it in place; the op reads its per-track values with pick().
template <typename Op, typename Meta, bool kOneTrack = Op::kTracks == 1>
struct Tracks {
  const Op& op;
  const Meta& meta;
  int tensor;

  FUSED_EMA_HOST_DEVICE Tracks(const Op& o, const Meta& m, int t) : op(o), meta(m), tensor(t) {}
  FUSED_EMA_HOST_DEVICE bool skip() const { return false; }
  FUSED_EMA_HOST_DEVICE auto* ema(int k) const { return Op::ema(meta, tensor, k); }
  FUSED_EMA_HOST_DEVICE auto bind(int k) const { return op.bind(meta, tensor, k); }
  // Whether track k takes part: an EMA in this launch and a weight that is not 0 (f: its bound op).
  template <typename F>
  FUSED_EMA_HOST_DEVICE bool live(int k, const F& f) const {
    return !f.skip && ema(k) != nullptr;
  }
};

// One track binds once per block, and a block whose weight is 0 returns before any access.
template <typename Op, typename Meta>
struct Tracks<Op, Meta, true> {
  typename Op::ema_t* ema_;
  typename Op::Bound f;

  FUSED_EMA_HOST_DEVICE Tracks(const Op& op, const Meta& meta, int tensor)
      : ema_(Op::ema(meta, tensor, 0)), f(op.bind(meta, tensor, 0)) {}
  FUSED_EMA_HOST_DEVICE bool skip() const { return f.skip; }
  FUSED_EMA_HOST_DEVICE auto* ema(int /*k*/) const { return ema_; }
  FUSED_EMA_HOST_DEVICE const auto& bind(int /*k*/) const { return f; }
  // lerp_'s one EMA is never null (a check for it cost a 16-bit pair's kernel spills on sm_75).
  FUSED_EMA_HOST_DEVICE bool live(int /*k*/, const typename Op::Bound& g) const { return !g.skip; }
};

// Loads the items base + j * kBlockThreads (j < kIlp) of `chunk` that lie below `count`.
template <int kIlp, typename T>
FUSED_EMA_HOST_DEVICE inline void load_items(T (&out)[kIlp], const T* chunk, int base, int count) {
#pragma unroll
  for (int j = 0; j < kIlp; ++j) {
    const int i = base + j * kBlockThreads;
    if (i < count) {
      out[j] = chunk[i];
    }
  }
}

// The kernel. Op supplies ema_t, src_t, extra_t (per-tensor data), kTracks, kPack, kIlp,
// kMinBlocksPerSM, ema() and bind(), whose result f maps (ema, src, index) to the new EMA value,
// updates a pack at once (f.pack), says whether this launch may skip the track (f.skip, read on
// the device for a device-side weight) and whether the EMA is stored (f.stores_ema(); bema_ with
// beta 0 reads it for its out only). The source is read once for all tracks: the track loop stays
// rolled, one track's registers live at a time next to the source's. Offsets within a chunk fit
// in 32 bits, so the kIlp accesses share one base address. The walk stays in the kernel, without
// lambdas: moved into a function or a track visitor it spilled (ptxas, sm_80), as did a
// __grid_constant__ op. The threads of a block share nothing: the emulation runs them one by one.
#if defined(__CUDACC__)
template <typename Op, int kCapacity>
__global__ void __launch_bounds__(kBlockThreads, Op::kMinBlocksPerSM)
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
  const Tracks<Op, MetaOf<Op, kCapacity>> tracks(op, meta, w.tensor);
  if (tracks.skip()) {
    return;
  }
  const S* src = static_cast<const S*>(meta.src[w.tensor]);
  const int count = static_cast<int>(w.end - w.begin);

  if (w.head < 0) {  // the plain path: element by element
    const S* src_chunk = src + w.begin;
    for (int base = static_cast<int>(thread); base < count; base += kBlockThreads * kIlp) {
      S s[kIlp];
      load_items(s, src_chunk, base, count);
#pragma unroll 1
      for (int k = 0; k < Op::kTracks; ++k) {
        const auto f = tracks.bind(k);
        if (!tracks.live(k, f)) {
          continue;
        }
        E* ema_chunk = tracks.ema(k) + w.begin;
        E e[kIlp];
        load_items(e, ema_chunk, base, count);
#pragma unroll
        for (int j = 0; j < kIlp; ++j) {
          const int i = base + j * kBlockThreads;
          if (i < count) {
            e[j] = f(e[j], s[j], w.begin + i);
            if (f.stores_ema()) {
              ema_chunk[i] = e[j];
            }
          }
        }
      }
    }
    return;
  }

  // The aligned fast path: 16-byte packs, kIlp of them in flight.
  const auto* src_chunk = reinterpret_cast<const Pack<S, kPack>*>(src + w.head) + w.begin;
  check_aligned(src_chunk, count);
  for (int base = static_cast<int>(thread); base < count; base += kBlockThreads * kIlp) {
    Pack<S, kPack> s[kIlp];
    load_items(s, src_chunk, base, count);
#pragma unroll 1
    for (int k = 0; k < Op::kTracks; ++k) {
      const auto f = tracks.bind(k);
      if (!tracks.live(k, f)) {
        continue;
      }
      auto* ema_chunk = reinterpret_cast<Pack<E, kPack>*>(tracks.ema(k) + w.head) + w.begin;
      check_aligned(ema_chunk, count);
      Pack<E, kPack> e[kIlp];
      load_items(e, ema_chunk, base, count);
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int p = base + j * kBlockThreads;
        if (p < count) {
          f.pack(e[j], s[j], w.head + (w.begin + p) * kPack);
          if (f.stores_ema()) {
            ema_chunk[p] = e[j];
          }
        }
      }
    }
  }
  // The unaligned head and the tail shorter than a pack: fewer than 2 * kPack elements.
  if (thread < w.scalars) {
    const auto head = static_cast<unsigned>(w.head);  // >= 0 here
    const int64_t i = thread < head ? thread : w.tail_begin + (thread - head);
    const S s = src[i];
#pragma unroll 1
    for (int k = 0; k < Op::kTracks; ++k) {
      const auto f = tracks.bind(k);
      if (!tracks.live(k, f)) {
        continue;
      }
      E* ema = tracks.ema(k);
      const E r = f(ema[i], s, i);
      if (f.stores_ema()) {
        ema[i] = r;
      }
    }
  }
}

#if defined(__CUDACC__)
// The launcher. Which parameter layout a launch takes is decided at run time: 32 KB where the
// build, the driver and the GPU allow it (asked once per device, kept here), else 4 KB.

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
        const auto grid = static_cast<unsigned>(blocks);
        multi_tensor_kernel<Op, kCapacity><<<grid, kBlockThreads, 0, stream>>>(packed, op);
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

// The launch the host side of the family (fused_launch.cuh) hands its ops to on a GPU; the tests'
// emulation has its own.
struct StreamLaunch {
  cudaStream_t stream;

  template <typename Op>
  cudaError_t operator()(const Op& op, const TensorRef* refs, int64_t count,
                         const typename Op::extra_t* extras) const {
    return multi_tensor_apply(refs, count, op, stream, extras);
  }
};
#endif  // defined(__CUDACC__)

}  // namespace fused_ema::cuda
