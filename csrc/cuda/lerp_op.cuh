// The lerp of the fused-op family for multi_tensor_apply, written once: PyTorch's formula in float
// (double for float64) for each (ema, src) dtype pair, rounded to nearest or stochastically (bit
// for bit as on the CPU), over K tracks a source (lerp_: K = 1; lerp_many_: rounds of kMaxTracks).
// No torch headers (nvcc-only tests); the host compiles it too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../host_device.h"
#include "../opmath.h"
#include "../stochastic_round.h"
#include "multi_tensor_apply.cuh"

namespace fused_ema::cuda {

// Tracks one launch updates from each read of a source. Each costs 8 bytes of kernel parameters
// per tensor (41 tensors a 4 KB launch, 349 in 32 KB; 28 and 244 with stochastic rounding). More
// tracks go out in rounds of up to kMaxTracks (tracks 0-7, 8-15, ...), each reading the sources
// once.
constexpr int kMaxTracks = 8;

// values[k] for a run-time k without indexing the array, so that an op holding it stays in
// parameter space (the kernel copies an indexed kernel parameter to local memory first).
template <typename T, int K>
FUSED_EMA_HOST_DEVICE T pick(const T (&values)[K], int k) {
  T v = values[0];
#pragma unroll
  for (int j = 1; j < K; ++j) {
    v = j == k ? values[j] : v;
  }
  return v;
}

// The weights of K tracks: host values, or a device array of K float32/float64 elements, `stride`
// apart, that the kernel reads (no sync, CUDA-graph capturable).
template <int K>
struct TrackWeights {
  double value[K];
  const float* f32;
  const double* f64;
  int64_t stride;

  FUSED_EMA_HOST_DEVICE double read(int k) const {
    return f64 != nullptr ? f64[k * stride] : f32 != nullptr ? f32[k * stride] : pick(value, k);
  }
};

// A host-known step, or a device pointer the kernel reads.
struct StepArg {
  uint64_t value;
  const int64_t* device;

  FUSED_EMA_HOST_DEVICE uint64_t read() const {
    return device != nullptr ? static_cast<uint64_t>(*device) : value;
  }
};

// Stochastic rounding's arguments of a launch: the step and each track's seed.
template <int K>
struct SrArgs {
  StepArg step;
  uint64_t seed[K];
};

// Per tensor: each track's EMA, null where a track has none in this launch (a weight of 0 known on
// the host, or an EMA of another dtype pair, or of a stand-in source, which goes out in another
// launch). lerp_'s one EMA is the TensorRef's.
template <int K>
struct TrackEmas {
  void* ema[K];

  // Every EMA must share the first one's alignment for the tensor to take the aligned body
  // (pack_launches finds the head from the first); else it takes the element-wise path.
  bool aligned_like(const void* first) const {
    const auto residue = reinterpret_cast<uintptr_t>(first) % 16;
    for (void* e : ema) {
      if (e != nullptr && reinterpret_cast<uintptr_t>(e) % 16 != residue) {
        return false;
      }
    }
    return true;
  }
};
template <>
struct TrackEmas<1> {
  bool aligned_like(const void* /*first*/) const { return true; }
};

// Stochastic rounding's per-tensor data: also each track's stream key and the tensor's offset (the
// index of its first element in the full tensor).
template <int K>
struct SrTracks : TrackEmas<K> {
  uint32_t key[K];
  uint64_t offset;
};

FUSED_EMA_HOST_DEVICE inline float to_opmath(float x) { return x; }
FUSED_EMA_HOST_DEVICE inline double to_opmath(double x) { return x; }
// A bfloat16 is the high half of a float: widening is a shift, exact on every target. (sm_90's
// conversion intrinsic costs registers enough to spill at two blocks per SM.)
FUSED_EMA_HOST_DEVICE inline float to_opmath(__nv_bfloat16 x) {
  return uint_as_float(static_cast<unsigned>(__bfloat16_as_ushort(x)) << 16);
}
FUSED_EMA_HOST_DEVICE inline float to_opmath(__half x) { return __half2float(x); }

template <typename T>
FUSED_EMA_HOST_DEVICE T from_opmath(typename OpMath<T>::type x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return x;
  }
}

// The EMA types that round stochastically; float32/float64 EMAs get the plain lerp.
template <typename E>
constexpr bool kRoundsStochastically =
    std::is_same_v<E, __nv_bfloat16> || std::is_same_v<E, __half>;

// A tensor's stochastic rounding in one track: its stream, keyed for the tensor's first element's
// block of 2**32 pairs.
struct SrStream {
  uint64_t offset;
  sr::TensorStream stream;
};

// One track's lerp bound to its weight: coeff = w and base = ema for |w| < 0.5, else coeff = w - 1
// and base = src: PyTorch's choice, exact at both ends of [0, 1].
template <typename E, typename S, bool kStochastic>
struct LerpTrack {
  using opmath_t = typename OpMath<E>::type;
  using Rounding = std::conditional_t<kStochastic, SrStream, NoExtra>;
  opmath_t coeff;
  bool small;
  bool skip;  // weight 0 leaves every value as it is: ModelEma's skipped steps touch no memory
  Rounding rounding;

  FUSED_EMA_HOST_DEVICE static LerpTrack bind(opmath_t w, const Rounding& r) {
    const bool small = fabs(w) < opmath_t(0.5);
    return {small ? w : w - opmath_t(1), small, w == opmath_t(0), r};
  }

  FUSED_EMA_HOST_DEVICE static constexpr bool stores_ema() { return true; }

  FUSED_EMA_HOST_DEVICE opmath_t lerp(E e_in, S s_in) const {
    const opmath_t e = to_opmath(e_in);
    const opmath_t s = to_opmath(s_in);
    return fma_once(coeff, s - e, small ? e : s);
  }

  // r rounded stochastically with an element's 16 random bits (../stochastic_round.h).
  FUSED_EMA_HOST_DEVICE static E rounded(float r, uint32_t word) {
    if constexpr (std::is_same_v<E, __half>) {
      return __ushort_as_half(sr::round_f16(float_as_uint(r), word));
    } else {
      return __ushort_as_bfloat16(sr::round_bf16(float_as_uint(r), word));
    }
  }

  // Element i of its tensor.
  FUSED_EMA_HOST_DEVICE E operator()(E e, S s, int64_t i) const {
    if constexpr (kStochastic) {
      return rounded(lerp(e, s), rounding.stream.word(rounding.offset + static_cast<uint64_t>(i)));
    } else {
      return from_opmath<E>(lerp(e, s));
    }
  }

  // The pack of N elements from element `first`. Stochastically rounded, a pack whose first
  // element starts a pair, within the stream's block of pairs, takes one hash per pair.
  template <int N>
  FUSED_EMA_HOST_DEVICE void pack(Pack<E, N>& e, const Pack<S, N>& s, int64_t first) const {
    if constexpr (kStochastic) {
      static_assert(N % 2 == 0, "a pack holds whole element pairs");
      const uint64_t element = rounding.offset + static_cast<uint64_t>(first);
      const uint64_t pair = element >> 1;
      const sr::TensorStream& stream = rounding.stream;
      if ((element & 1) == 0 && sr::hi32(pair) == stream.hi &&
          sr::hi32(pair + N / 2 - 1) == stream.hi) {
#pragma unroll
        for (int q = 0; q < N / 2; ++q) {
          const uint32_t bits = sr::pair_bits(sr::lo32(pair) + q, stream.k);
          e.v[2 * q] = rounded(lerp(e.v[2 * q], s.v[2 * q]), bits & 0xFFFFu);
          e.v[2 * q + 1] = rounded(lerp(e.v[2 * q + 1], s.v[2 * q + 1]), bits >> 16);
        }
        return;
      }
    }
    // Element by element: round to nearest, and stochastic rounding's rare packs (a shard whose
    // offset is odd, a pack past the first block of 2**32 pairs) with a hash each. Unrolled: a
    // run-time index into the packs would move them to local memory, on the common path too.
#pragma unroll
    for (int v = 0; v < N; ++v) {
      e.v[v] = (*this)(e.v[v], s.v[v], first + v);
    }
  }
};

// The op of K tracks a source, each with its own weight (and seed and key), so that every track's
// bits are lerp_'s (lerp_stochastic_'s) of that track alone. Stochastic rounding is for 16-bit
// EMAs only.
template <typename E, typename S, int K = 1, bool kStochastic = false>
struct LerpOp {
  static_assert(!kStochastic || kRoundsStochastically<E>, "stochastic rounding: 16-bit EMAs");
  using ema_t = E;
  using src_t = S;
  using extra_t = std::conditional_t<kStochastic, SrTracks<K>, TrackEmas<K>>;
  using Bound = LerpTrack<E, S, kStochastic>;
  static constexpr int kTracks = K;
  static constexpr int kPack = 16 / (sizeof(E) < sizeof(S) ? sizeof(E) : sizeof(S));
  // Packs in flight: one under stochastic rounding (more is unmeasured); two for a 16-bit EMA of a
  // float32 model (32-byte source packs), and for 16-bit pairs over several tracks (the source
  // packs stay live through every track's: four spill within 64 registers on sm_80).
  static constexpr bool kTwoPacks = sizeof(S) > sizeof(E) ||
                                    (K > 1 && sizeof(E) == 2 && sizeof(S) == 2);
  static constexpr int kIlp = kStochastic ? 1 : kTwoPacks ? 2 : kILP;
  static constexpr int kMinBlocksPerSM = cuda::kMinBlocksPerSM;

  TrackWeights<K> weights;
  std::conditional_t<kStochastic, SrArgs<K>, NoExtra> sr;

  template <typename Meta>
  FUSED_EMA_HOST_DEVICE static E* ema(const Meta& meta, int tensor, int k) {
    if constexpr (K == 1) {
      return static_cast<E*>(meta.ema[tensor]);
    } else {
      return static_cast<E*>(meta.extra[tensor].ema[k]);
    }
  }

  template <typename Meta>
  FUSED_EMA_HOST_DEVICE Bound bind(const Meta& meta, int tensor, int k) const {
    const auto w = static_cast<typename Bound::opmath_t>(weights.read(k));
    if constexpr (kStochastic) {
      const SrTracks<K>& t = meta.extra[tensor];
      const uint64_t step_key = sr::step_key(pick(sr.seed, k), sr.step.read());
      return Bound::bind(w, {t.offset, sr::TensorStream(step_key, t.key[k], t.offset)});
    } else {
      return Bound::bind(w, {});
    }
  }
};

}  // namespace fused_ema::cuda
