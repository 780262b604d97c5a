// AVX-512 build of the span kernels (F, BW, VL, DQ), compiled
// by setup.py with those -m flags into a library of its own. cpu_isa.cpp calls in only after
// checking the CPU; built without the flags, this file yields no table.
#include "span_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__FMA__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "lerp_span.h"

namespace fused_ema::cpu {
const SpanKernels* const kAvx512SpanKernels = &kSpanKernels;
}  // namespace fused_ema::cpu
#else
namespace fused_ema::cpu {
const SpanKernels* const kAvx512SpanKernels = nullptr;
}  // namespace fused_ema::cpu
#endif
