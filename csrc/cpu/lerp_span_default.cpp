// Baseline build of the span kernels: scalar code for any CPU. Without hardware FMA, std::fma is
// libm's exact fma, so this path still matches the vector paths bit for bit (only slower).
#define CPU_CAPABILITY DEFAULT
#include "lerp_span.h"

namespace fused_ema::cpu {

constexpr SpanKernels kTable = make_span_kernels("default");
const SpanKernels* const kDefaultSpanKernels = &kTable;

}  // namespace fused_ema::cpu
