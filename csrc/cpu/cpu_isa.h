// Run-time choice of the CPU instruction set for the span kernels: the best one that both this
// CPU and this build have, unless FUSED_EMA_CPU_ISA (default|avx2|avx512) or set_cpu_isa asks
// for another (the tests run every path and check that they agree bit for bit).
#pragma once

#include <string>
#include <vector>

#include "span_kernels.h"

namespace fused_ema::cpu {

// Instruction sets this build compiled kernels for, baseline first.
std::vector<std::string> compiled_isas();

// Compiled and supported by this CPU.
std::vector<std::string> available_isas();

std::string active_isa();

// Selects `isa` for later calls; throws a ValueError naming the available ones if it is not.
void set_active_isa(const std::string& isa);

const SpanKernels& active_span_kernels();

}  // namespace fused_ema::cpu
