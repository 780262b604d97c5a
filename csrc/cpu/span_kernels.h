// The table of per-dtype-pair CPU span kernels. lerp_span.h fills one table per instruction set
// (lerp_span_{default,avx2,avx512}.cpp); cpu_isa.cpp picks the table at run time.
#pragma once

#include <cstdint>

#include "../dtype_pair_list.h"

namespace fused_ema::cpu {

// Updates ema[begin:end] of one dense pair of `numel` elements in place; `weight` is rounded once
// to the opmath type. The loop prefetches ahead up to numel, past `end`: lerp_many_ hands a tensor
// over in 4 KB blocks, a call each, whose next block is then on its way.
using SpanFn = void (*)(void* ema, const void* src, int64_t begin, int64_t end, int64_t numel,
                        double weight);

// The random stream of one tensor of lerp_stochastic_ (../stochastic_round.h): the span's
// elements are numbered from `offset` on.
struct SrStream {
  uint64_t seed;
  uint64_t step;
  uint64_t offset;
  uint32_t key;
};

// lerp_stochastic_ on ema[begin:end]: 16-bit EMAs are rounded stochastically, others as SpanFn.
using SrSpanFn = void (*)(void* ema, const void* src, int64_t begin, int64_t end, int64_t numel,
                          double weight, const SrStream& stream);

// bema_ on elements [begin, end) of one tensor's four dense views (bema_span.h); `weights` holds
// (beta, w0, alpha), each rounded once to the opmath type.
using BemaSpanFn = void (*)(void* ema, void* theta0, void* out, const void* src, int64_t begin,
                            int64_t end, const double* weights);

// The kernels of one dtype pair.
struct PairKernels {
  SpanFn fn;
  SrSpanFn sr;
  BemaSpanFn bema;
};

struct SpanKernels {
  PairKernels pair[kNumPairKinds];  // indexed by PairKind
};

// Constant-initialised, so reading them runs no code compiled for another instruction set.
// The AVX tables are null where the compiler could not build them.
extern const SpanKernels* const kDefaultSpanKernels;
extern const SpanKernels* const kAvx2SpanKernels;
extern const SpanKernels* const kAvx512SpanKernels;

}  // namespace fused_ema::cpu
