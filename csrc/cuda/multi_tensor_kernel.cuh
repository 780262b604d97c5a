// The multi-tensor kernel: each block finds its tensor by binary search over the first-block
// table and updates its chunk with the op's functor, 16-byte packs with kIlp loads in flight and
// the scalar head and tail. Under g++ the same body is a function of (block, thread).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../host_device.h"
#include "block_work.cuh"
#include "launch_meta.cuh"

namespace fused_ema::cuda {

constexpr int kBlockThreads = 512;
// Two resident blocks per SM at least: caps registers at 64 a thread (50% occupancy).
constexpr int kMinBlocksPerSM = 2;
// Independent pack loads in flight per thread, to cover memory latency (Op::kIlp: ops whose
// packs take more registers keep fewer in flight, to stay within kMinBlocksPerSM).
constexpr int kILP = 4;

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

// Whether a bound op's result goes back to the EMA: always, unless the op says otherwise in a
// write_ema field (bema_ with beta 0 reads the EMA for its out but leaves it unwritten).
template <typename F, typename = void>
struct HasWriteEma : std::false_type {};
template <typename F>
struct HasWriteEma<F, std::void_t<decltype(F::write_ema)>> : std::true_type {};

template <typename F>
FUSED_EMA_HOST_DEVICE inline bool writes_ema([[maybe_unused]] const F& f) {
  if constexpr (HasWriteEma<F>::value) {
    return f.write_ema;
  } else {
    return true;
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
          const E r = apply_one(f, e[j], s[j], w.begin + i);
          if (writes_ema(f)) {
            ema_chunk[i] = r;
          }
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
        if (writes_ema(f)) {
          ema_chunk[p] = e[j];
        }
      }
    }
  }
  // The unaligned head and the tail shorter than a pack: fewer than 2 * kPack elements.
  if (thread < w.scalars) {
    const auto head = static_cast<unsigned>(w.head);  // >= 0 here
    const int64_t i = thread < head ? thread : w.tail_begin + (thread - head);
    const E r = apply_one(f, ema[i], src[i], i);
    if (writes_ema(f)) {
      ema[i] = r;
    }
  }
}

}  // namespace fused_ema::cuda
