// AVX2 build of the span kernels, compiled by setup.py with -mavx2 -mfma -mf16c into a library
// of its own (flags cannot differ per file inside one extension). cpu_isa.cpp calls in only
// after checking the CPU; built without those flags, this file yields no table.
#include "span_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "lerp_span.h"

namespace fused_ema::cpu {
const SpanKernels* const kAvx2SpanKernels = &kSpanKernels;
}  // namespace fused_ema::cpu
#else
namespace fused_ema::cpu {
const SpanKernels* const kAvx2SpanKernels = nullptr;
}  // namespace fused_ema::cpu
#endif
