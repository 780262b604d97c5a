// The bema_ functor for multi_tensor_apply: ema and theta0 each as LerpOp's bound lerp (bit for
// bit lerp_), out = fma(alpha, src - theta0, ema) from their new values as stored, one read of the
// source. theta0 and out ride along as per-tensor data. No torch headers (nvcc-only tests).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "../host_device.h"
#include "../opmath.h"
#include "lerp_functor.cuh"
#include "multi_tensor_apply.cuh"

namespace fused_ema::cuda {

// A tensor's other two targets; the EMA and the source are the TensorRef's.
struct BemaTensors {
  void* theta0;
  void* out;
};

// theta0 and out must share the EMA's 16-byte alignment for the tensor to take the packed body
// (pack_launches finds the head from the EMA and the source); else it goes element by element.
inline bool aligned_like(const BemaTensors& tensors, const void* first) {
  const auto residue = reinterpret_cast<uintptr_t>(first) % 16;
  return reinterpret_cast<uintptr_t>(tensors.theta0) % 16 == residue &&
         reinterpret_cast<uintptr_t>(tensors.out) % 16 == residue;
}

// (beta, w0, alpha): host values, or a device pointer to the first of 3 float32/float64 elements,
// `stride` apart, that the kernel reads.
struct BemaWeightArgs {
  double value[3];
  const float* f32;
  const double* f64;
  int64_t stride;

  FUSED_EMA_HOST_DEVICE WeightArg operator[](int k) const {
    return {value[k], f32 != nullptr ? f32 + k * stride : nullptr,
            f64 != nullptr ? f64 + k * stride : nullptr};
  }
};

template <typename E, typename S>
struct BemaOp {
  using ema_t = E;
  using src_t = S;
  using opmath_t = typename OpMath<E>::type;
  using Lerp = LerpOp<E, S>;
  using extra_t = BemaTensors;
  static constexpr int kPack = Lerp::kPack;
  // Three targets a pack (theta0 loaded and out stored inside pack()): two packs in flight.
  static constexpr int kIlp = 2;

  BemaWeightArgs weights;

  // A weight that rounds to 0 in opmath leaves its list untouched: its bound lerp says skip, and
  // the kernel neither writes the EMA (write_ema) nor theta0; alpha 0 writes no out.
  struct Bound {
    static constexpr bool kIndexed = true;
    typename Lerp::Bound ema_lerp;
    typename Lerp::Bound theta0_lerp;
    opmath_t alpha;
    E* theta0;
    E* out;
    bool write_ema;
    bool read_theta0;
    bool write_out;
    bool skip;  // all three weights 0

    // out from the new values as stored: d = x - t rounded once, then fma(alpha, d, e) rounded
    // once, then to E. The same order as the CPU kernels (cpu/bema_span.h).
    FUSED_EMA_HOST_DEVICE E corrected(E e, E t, S x) const {
      return from_opmath<E>(fma_once(alpha, to_opmath(x) - to_opmath(t), to_opmath(e)));
    }

    // Element i of its tensor: returns the new EMA value (written back only if write_ema).
    FUSED_EMA_HOST_DEVICE E operator()(E e_in, S s, int64_t i) const {
      const E e = write_ema ? ema_lerp(e_in, s) : e_in;
      if (read_theta0) {
        E t = theta0[i];
        if (!theta0_lerp.skip) {
          t = theta0_lerp(t, s);
          theta0[i] = t;
        }
        if (write_out) {
          out[i] = corrected(e, t, s);
        }
      }
      return e;
    }

    // The pack of N elements from element `first`: theta0's and out's packs are aligned as the
    // EMA's (aligned_like).
    template <int N>
    FUSED_EMA_HOST_DEVICE void pack(Pack<E, N>& e, const Pack<S, N>& s, int64_t first) const {
      if (write_ema) {
#pragma unroll
        for (int v = 0; v < N; ++v) {
          e.v[v] = ema_lerp(e.v[v], s.v[v]);
        }
      }
      if (!read_theta0) {
        return;
      }
      auto* theta0_pack = reinterpret_cast<Pack<E, N>*>(theta0 + first);
      check_aligned(theta0_pack, 1);
      Pack<E, N> t = *theta0_pack;
      if (!theta0_lerp.skip) {
#pragma unroll
        for (int v = 0; v < N; ++v) {
          t.v[v] = theta0_lerp(t.v[v], s.v[v]);
        }
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

  FUSED_EMA_HOST_DEVICE Bound bind(const BemaTensors& tensors) const {
    const typename Lerp::Bound ema_lerp = Lerp{weights[0]}.bind();
    const typename Lerp::Bound theta0_lerp = Lerp{weights[1]}.bind();
    const auto alpha = static_cast<opmath_t>(weights[2].read());
    const bool write_out = alpha != opmath_t(0);
    return {ema_lerp,
            theta0_lerp,
            alpha,
            static_cast<E*>(tensors.theta0),
            static_cast<E*>(tensors.out),
            !ema_lerp.skip,
            !theta0_lerp.skip || write_out,
            write_out,
            ema_lerp.skip && theta0_lerp.skip && !write_out};
  }
};

// How a tensor goes to BemaOp: host weights that leave only theta0 to update (beta = alpha = 0)
// put theta0 in the EMA's place with w0 as its weight (the same bound lerp, so the same bits), and
// no EMA is read; otherwise (ema, src) as the TensorRef and (theta0, out) as its data. Host only:
// fused_cuda.cu and the tests' emulation both pass their tensors through it.
struct BemaLaunch {
  bool theta0_only;
  BemaWeightArgs weights;

  explicit BemaLaunch(const BemaWeightArgs& w)
      : theta0_only(w.f32 == nullptr && w.f64 == nullptr && w.value[0] == 0.0 && w.value[2] == 0.0),
        weights(theta0_only ? BemaWeightArgs{{w.value[1], 0.0, 0.0}, nullptr, nullptr, 0} : w) {}

  void add(void* ema, void* theta0, void* out, const void* src, int64_t numel,
           std::vector<TensorRef>& refs, std::vector<BemaTensors>& extras) const {
    if (theta0_only) {
      refs.push_back({theta0, src, numel});
      extras.push_back({theta0, theta0});  // never touched: w0 and alpha are 0 here
    } else {
      refs.push_back({ema, src, numel});
      extras.push_back({theta0, out});
    }
  }
};

#if defined(__CUDACC__)
template <typename E, typename S>
cudaError_t launch_bema(const TensorRef* refs, const BemaTensors* extras, int64_t count,
                        const BemaWeightArgs& weights, cudaStream_t stream) {
  return multi_tensor_apply(refs, count, BemaOp<E, S>{weights}, stream, extras);
}
#endif

}  // namespace fused_ema::cuda
