// Baseline build of the span kernels: scalar code for any CPU. Without hardware FMA, std::fma is
// libm's exact fma, so this path still matches the vector paths bit for bit (only slower).
#define CPU_CAPABILITY DEFAULT
#include "lerp_span.h"

namespace fused_ema::cpu {

const SpanKernels* const kDefaultSpanKernels = &kSpanKernels;

}  // namespace fused_ema::cpu
