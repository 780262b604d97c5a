// bema_ as an epilogue of lerp_'s one track: ema and theta0 each as LerpTrack's lerp (bit for bit
// lerp_), then out = fma(alpha, src - theta0, ema) from their new values as stored, one read of
// the source. theta0 and out ride along as per-tensor data. No torch headers (nvcc-only tests).
#pragma once

#include <cstdint>

#include "../host_device.h"
#include "lerp_op.cuh"

namespace fused_ema::cuda {

// A tensor's other two targets; the EMA and the source are the TensorRef's.
struct BemaTensors {
  void* theta0;
  void* out;

  // theta0 and out must share the EMA's 16-byte alignment for the tensor to take the packed body
  // (pack_launches finds the head from the EMA and the source); else it goes element by element.
  bool aligned_like(const void* first) const {
    const auto residue = reinterpret_cast<uintptr_t>(first) % 16;
    return reinterpret_cast<uintptr_t>(theta0) % 16 == residue &&
           reinterpret_cast<uintptr_t>(out) % 16 == residue;
  }
};

template <typename E, typename S>
struct BemaOp {
  using ema_t = E;
  using src_t = S;
  using extra_t = BemaTensors;
  using Lerp = LerpTrack<E, S, false>;
  using opmath_t = typename Lerp::opmath_t;
  static constexpr int kTracks = 1;
  static constexpr int kPack = LerpOp<E, S>::kPack;
  // Three targets a pack (theta0 loaded and out stored inside pack()): two packs in flight.
  static constexpr int kIlp = 2;
  static constexpr int kMinBlocksPerSM = cuda::kMinBlocksPerSM;

  TrackWeights<3> weights;  // beta, w0, alpha

  // A weight that rounds to 0 in opmath leaves its list untouched: its lerp says skip, and the
  // kernel neither writes the EMA (stores_ema) nor theta0; alpha 0 writes no out.
  struct Bound {
    Lerp ema_lerp;
    Lerp theta0_lerp;
    opmath_t alpha;
    E* theta0;
    E* out;
    bool write_ema;
    bool read_theta0;
    bool write_out;
    bool skip;  // all three weights 0

    FUSED_EMA_HOST_DEVICE bool stores_ema() const { return write_ema; }

    // out from the new values as stored: d = x - t rounded once, then fma(alpha, d, e) rounded
    // once, then to E. The same order as the CPU kernels (cpu/bema_span.h).
    FUSED_EMA_HOST_DEVICE E corrected(E e, E t, S x) const {
      return from_opmath<E>(fma_once(alpha, to_opmath(x) - to_opmath(t), to_opmath(e)));
    }

    // Element i of its tensor: returns the new EMA value (written back only if write_ema).
    FUSED_EMA_HOST_DEVICE E operator()(E e_in, S s, int64_t i) const {
      const E e = write_ema ? ema_lerp(e_in, s, i) : e_in;
      if (read_theta0) {
        E t = theta0[i];
        if (!theta0_lerp.skip) {
          t = theta0_lerp(t, s, i);
          theta0[i] = t;
        }
        if (write_out) {
          out[i] = corrected(e, t, s);
        }
      }
      return e;
    }

    // The pack of N elements from element `first`: theta0's and out's packs are aligned as the
    // EMA's (BemaTensors::aligned_like).
    template <int N>
    FUSED_EMA_HOST_DEVICE void pack(Pack<E, N>& e, const Pack<S, N>& s, int64_t first) const {
      if (write_ema) {
        ema_lerp.pack(e, s, first);
      }
      if (!read_theta0) {
        return;
      }
      auto* theta0_pack = reinterpret_cast<Pack<E, N>*>(theta0 + first);
      check_aligned(theta0_pack, 1);
      Pack<E, N> t = *theta0_pack;
      if (!theta0_lerp.skip) {
        theta0_lerp.pack(t, s, first);
        *theta0_pack = t;
      }
      if (write_out) {
        auto* out_pack = reinterpret_cast<Pack<E, N>*>(out + first);
        check_aligned(out_pack, 1);
        Pack<E, N> o;
#pragma unroll
        for (int v = 0; v < N; ++v) {
          o.v[v] = corrected(e.v[v], t.v[v], s.v[v]);
        }
        *out_pack = o;
      }
    }
  };

  template <typename Meta>
  FUSED_EMA_HOST_DEVICE static E* ema(const Meta& meta, int tensor, int /*k*/) {
    return static_cast<E*>(meta.ema[tensor]);
  }

  template <typename Meta>
  FUSED_EMA_HOST_DEVICE Bound bind(const Meta& meta, int tensor, int /*k*/) const {
    const Lerp ema_lerp = Lerp::bind(static_cast<opmath_t>(weights.read(0)), {});
    const Lerp theta0_lerp = Lerp::bind(static_cast<opmath_t>(weights.read(1)), {});
    const auto alpha = static_cast<opmath_t>(weights.read(2));
    const bool write_out = alpha != opmath_t(0);
    const BemaTensors& t = meta.extra[tensor];
    return {ema_lerp,
            theta0_lerp,
            alpha,
            static_cast<E*>(t.theta0),
            static_cast<E*>(t.out),
            !ema_lerp.skip,
            !theta0_lerp.skip || write_out,
            write_out,
            ema_lerp.skip && theta0_lerp.skip && !write_out};
  }
};

}  // namespace fused_ema::cuda
