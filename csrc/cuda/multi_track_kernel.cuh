// The kernel of lerp_many_: multi_tensor_kernel's walk over each source (block_work, 16-byte packs
// with kIlp loads in flight, the scalar head and tail), every track of the launch then updating
// its own EMA from the source values held in registers, so a source is read once for all tracks.
// Under g++ the same body is a function of (block, thread).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "../host_device.h"
#include "block_work.cuh"
#include "launch_meta.cuh"
#include "multi_tensor_kernel.cuh"

namespace fused_ema::cuda {

// Ops with several EMAs per source (Op::kTracks of them: Op::ema(extra, k), null where track k
// has none, and Op::bind(extra, k)) take multi_track_kernel; the others multi_tensor_kernel.
template <typename Op, typename = void>
struct IsTrackOp : std::false_type {};
template <typename Op>
struct IsTrackOp<Op, std::void_t<decltype(Op::kTracks)>> : std::true_type {};

// A 16-byte access off its alignment faults on the GPU but not on the host: the emulation checks
// the base of every block's packs, if any (all the tracks' EMAs must share the head that aligns
// the first).
template <typename T>
FUSED_EMA_HOST_DEVICE inline void check_aligned([[maybe_unused]] const T* packs,
                                                [[maybe_unused]] int count) {
#if !defined(__CUDACC__)
  if (count > 0 && reinterpret_cast<uintptr_t>(packs) % 16 != 0) {
    throw std::logic_error("multi_track_kernel: a pack is not 16-byte aligned");
  }
#endif
}

// Each track binds the op anew where it uses it (a few instructions; a device weight is an L1
// hit): bound ops kept for every track would hold their registers across the whole loop. The
// track loops unroll, so that the op's per-track fields are indexed at compile time (a run-time
// index would copy the op to local memory); each track's EMA values are stored before the next
// track loads its own (the tracks' pointers may alias as far as the compiler knows), so one
// track's registers are live at a time, next to the source's.
#if defined(__CUDACC__)
template <typename Op, int kCapacity>
__global__ void __launch_bounds__(kBlockThreads, MinBlocksPerSM<Op>::value)
    multi_track_kernel(const FUSED_EMA_GRID_CONSTANT MetaOf<Op, kCapacity> meta,
                       const FUSED_EMA_GRID_CONSTANT Op op) {
  const auto block = static_cast<int32_t>(blockIdx.x);
  const unsigned thread = threadIdx.x;
#else
template <typename Op, int kCapacity>
void multi_track_kernel(const MetaOf<Op, kCapacity>& meta, const Op& op, int32_t block,
                        unsigned thread) {
#endif
  using E = typename Op::ema_t;
  using S = typename Op::src_t;
  constexpr int kPack = Op::kPack;
  constexpr int kIlp = Op::kIlp;
  const BlockWork w = block_work<kPack>(meta, block);
  const auto& tracks = meta.extra[w.tensor];
  const S* src = static_cast<const S*>(meta.src[w.tensor]);

  const int count = static_cast<int>(w.end - w.begin);
  if (w.head < 0) {
    const S* src_chunk = src + w.begin;
    for (int base = static_cast<int>(thread); base < count; base += kBlockThreads * kIlp) {
      S s[kIlp];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int i = base + j * kBlockThreads;
        if (i < count) {
          s[j] = src_chunk[i];
        }
      }
#pragma unroll 1
      for (int k = 0; k < Op::kTracks; ++k) {
        E* ema = static_cast<E*>(Op::ema(tracks, k));
        const auto f = op.bind(tracks, k);
        if (ema == nullptr || f.skip) {
          continue;
        }
        E* ema_chunk = ema + w.begin;
        E e[kIlp];
#pragma unroll
        for (int j = 0; j < kIlp; ++j) {
          const int i = base + j * kBlockThreads;
          if (i < count) {
            e[j] = ema_chunk[i];
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
    }
    return;
  }

  const auto* src_chunk = reinterpret_cast<const Pack<S, kPack>*>(src + w.head) + w.begin;
  check_aligned(src_chunk, count);
  for (int base = static_cast<int>(thread); base < count; base += kBlockThreads * kIlp) {
    Pack<S, kPack> s[kIlp];
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int p = base + j * kBlockThreads;
      if (p < count) {
        s[j] = src_chunk[p];
      }
    }
#pragma unroll 1
    for (int k = 0; k < Op::kTracks; ++k) {
      E* ema = static_cast<E*>(Op::ema(tracks, k));
      const auto f = op.bind(tracks, k);
      if (ema == nullptr || f.skip) {
        continue;
      }
      auto* ema_chunk = reinterpret_cast<Pack<E, kPack>*>(ema + w.head) + w.begin;
      check_aligned(ema_chunk, count);
      Pack<E, kPack> e[kIlp];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int p = base + j * kBlockThreads;
        if (p < count) {
          e[j] = ema_chunk[p];
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
            for (int v = 0; v < kPack; ++v) {
              e[j].v[v] = f(e[j].v[v], s[j].v[v]);
            }
          }
          ema_chunk[p] = e[j];
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
      E* ema = static_cast<E*>(Op::ema(tracks, k));
      const auto f = op.bind(tracks, k);
      if (ema != nullptr && !f.skip) {
        ema[i] = apply_one(f, ema[i], s, i);
      }
    }
  }
}

}  // namespace fused_ema::cuda
