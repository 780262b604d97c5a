// The functor of fused_ema::lerp_stochastic_ for multi_tensor_apply: LerpOp's lerp in float, then
// the stochastic rounding of ../stochastic_round.h into a bfloat16/float16 EMA, bit for bit as on
// the CPU. One 32-bit hash serves 2 consecutive elements. No torch headers (nvcc-only tests); the
// host compiles it too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "../stochastic_round.h"
#include "lerp_functor.cuh"

namespace fused_ema::cuda {

// Per tensor: its stream's key and the index of its first element in the full tensor.
struct SrTensor {
  uint64_t offset;
  uint32_t key;
};

// A host-known step, or a device pointer the kernel reads (no sync, CUDA-graph capturable).
struct StepArg {
  uint64_t value;
  const int64_t* device;

  FUSED_EMA_HOST_DEVICE uint64_t read() const {
    return device != nullptr ? static_cast<uint64_t>(*device) : value;
  }
};

FUSED_EMA_HOST_DEVICE inline __nv_bfloat16 from_sr_bits(uint32_t bits, uint32_t word,
                                                        __nv_bfloat16*) {
  return __ushort_as_bfloat16(sr::round_bf16(bits, word));
}
FUSED_EMA_HOST_DEVICE inline __half from_sr_bits(uint32_t bits, uint32_t word, __half*) {
  return __ushort_as_half(sr::round_f16(bits, word));
}

// The EMA types lerp_stochastic_ rounds stochastically; others get the plain lerp.
template <typename E>
constexpr bool kRoundsStochastically =
    std::is_same_v<E, __nv_bfloat16> || std::is_same_v<E, __half>;

template <typename E, typename S>
struct LerpStochasticOp {
  static_assert(kRoundsStochastically<E>, "stochastic rounding is for 16-bit EMAs");
  using ema_t = E;
  using src_t = S;
  using extra_t = SrTensor;
  static constexpr int kPack = LerpOp<E, S>::kPack;
  // One pack in flight, as under the Philox stream this replaced (which needed the registers);
  // more is for a GPU session to measure.
  static constexpr int kIlp = 1;
  static_assert(kPack % 2 == 0, "a pack holds whole element pairs");

  WeightArg weight;
  StepArg step;
  uint64_t seed;

  struct Bound {
    static constexpr bool kIndexed = true;
    float coeff;
    bool small;
    bool skip;  // weight 0: as LerpOp, touch no memory
    uint64_t offset;
    sr::TensorStream stream;  // keyed for the tensor's first element's block of 2**32 pairs

    FUSED_EMA_HOST_DEVICE E round(E e_in, S s_in, uint32_t word) const {
      const float e = to_opmath(e_in);
      const float s = to_opmath(s_in);
      const float r = fma_once(coeff, s - e, small ? e : s);
      return from_sr_bits(float_as_uint(r), word, static_cast<E*>(nullptr));
    }

    FUSED_EMA_HOST_DEVICE E operator()(E e, S s, int64_t i) const {
      return round(e, s, stream.word(offset + static_cast<uint64_t>(i)));
    }

    // A pack whose first element starts a pair, within the stream's block of pairs, takes N / 2
    // hashes.
    template <int N>
    FUSED_EMA_HOST_DEVICE void pack(Pack<E, N>& e, const Pack<S, N>& s, int64_t first) const {
      const uint64_t element = offset + static_cast<uint64_t>(first);
      const uint64_t pair = element >> 1;
      if ((element & 1) == 0 && sr::hi32(pair) == stream.hi &&
          sr::hi32(pair + N / 2 - 1) == stream.hi) {
#pragma unroll
        for (int q = 0; q < N / 2; ++q) {
          const uint32_t bits = sr::pair_bits(sr::lo32(pair) + q, stream.k);
          e.v[2 * q] = round(e.v[2 * q], s.v[2 * q], bits & 0xFFFFu);
          e.v[2 * q + 1] = round(e.v[2 * q + 1], s.v[2 * q + 1], bits >> 16);
        }
        return;
      }
      // Rare (a shard whose offset is odd, a pack past the first block of 2**32 pairs): one hash
      // per element. Unrolled, like the rest: a run-time index into the packs would move them to
      // local memory, on the common path too.
#pragma unroll
      for (int k = 0; k < N; ++k) {
        e.v[k] = (*this)(e.v[k], s.v[k], first + k);
      }
    }
  };

  FUSED_EMA_HOST_DEVICE Bound bind(const SrTensor& tensor) const {
    const auto w = static_cast<float>(weight.read());
    const bool small = fabsf(w) < 0.5f;
    return {small ? w : w - 1.0f, small, w == 0.0f, tensor.offset,
            sr::TensorStream(sr::step_key(seed, step.read()), tensor.key, tensor.offset)};
  }
};

#if defined(__CUDACC__)
// Stochastic rounding for 16-bit EMAs; float32/float64 EMAs get the plain lerp.
template <typename E, typename S>
cudaError_t launch_lerp_stochastic(const TensorRef* refs, const SrTensor* extras, int64_t count,
                                   WeightArg weight, StepArg step, uint64_t seed,
                                   cudaStream_t stream) {
  if constexpr (kRoundsStochastically<E>) {
    return multi_tensor_apply(refs, count, LerpStochasticOp<E, S>{weight, step, seed}, stream,
                              extras);
  } else {
    return launch_lerp<E, S>(refs, count, weight, stream);
  }
}
#endif

}  // namespace fused_ema::cuda
