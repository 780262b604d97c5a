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

// Calls visit(ema, f) for every track of the tensor that has an EMA in this launch and a weight
// that is not 0, f its bound op. Each track binds the op anew where it is used (a few
// instructions; a device weight is an L1 hit): bound ops kept for every track would hold their
// registers across the whole walk. The loop stays rolled, one track's registers live at a time
// next to the source's; the op and the metadata are __grid_constant__, so the run-time track
// index reads them in place.
template <typename Op, typename Visit>
FUSED_EMA_HOST_DEVICE inline void for_each_track(const Op& op, const typename Op::extra_t& tracks,
                                                 const Visit& visit) {
#pragma unroll 1
  for (int k = 0; k < Op::kTracks; ++k) {
    auto* ema = static_cast<typename Op::ema_t*>(Op::ema(tracks, k));
    const auto f = op.bind(tracks, k);
    if (ema != nullptr && !f.skip) {
      visit(ema, f);
    }
  }
}

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

// One track's step of the walk: its EMA items of base (see load_items) loaded, each updated from
// the source's by update(f, e, s, index in the chunk), stored.
template <int kIlp, typename T, typename U, typename F, typename Update>
FUSED_EMA_HOST_DEVICE inline void update_items(T* chunk, const U (&s)[kIlp], int base, int count,
                                               const F& f, const Update& update) {
  T e[kIlp];
  load_items(e, chunk, base, count);
#pragma unroll
  for (int j = 0; j < kIlp; ++j) {
    const int i = base + j * kBlockThreads;
    if (i < count) {
      update(f, e[j], s[j], i);
      chunk[i] = e[j];
    }
  }
}

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
      load_items(s, src_chunk, base, count);
      for_each_track(op, tracks, [&](E* ema, const auto& f) {
        update_items(ema + w.begin, s, base, count, f,
                     [&](const auto& g, E& e, S x, int i) { e = apply_one(g, e, x, w.begin + i); });
      });
    }
    return;
  }

  const auto* src_chunk = reinterpret_cast<const Pack<S, kPack>*>(src + w.head) + w.begin;
  check_aligned(src_chunk, count);
  for (int base = static_cast<int>(thread); base < count; base += kBlockThreads * kIlp) {
    Pack<S, kPack> s[kIlp];
    load_items(s, src_chunk, base, count);
    for_each_track(op, tracks, [&](E* ema, const auto& f) {
      auto* ema_chunk = reinterpret_cast<Pack<E, kPack>*>(ema + w.head) + w.begin;
      check_aligned(ema_chunk, count);
      update_items(ema_chunk, s, base, count, f,
                   [&](const auto& g, Pack<E, kPack>& e, const Pack<S, kPack>& x, int p) {
                     if constexpr (std::decay_t<decltype(g)>::kIndexed) {
                       g.pack(e, x, w.head + (w.begin + p) * kPack);
                     } else {
#pragma unroll
                       for (int v = 0; v < kPack; ++v) {
                         e.v[v] = g(e.v[v], x.v[v]);
                       }
                     }
                   });
    });
  }
  // The unaligned head and the tail shorter than a pack: fewer than 2 * kPack elements.
  if (thread < w.scalars) {
    const auto head = static_cast<unsigned>(w.head);  // >= 0 here
    const int64_t i = thread < head ? thread : w.tail_begin + (thread - head);
    const S s = src[i];
    for_each_track(op, tracks, [&](E* ema, const auto& f) { ema[i] = apply_one(f, ema[i], s, i); });
  }
}

}  // namespace fused_ema::cuda
