// CPU feature detection and the process-wide choice of span-kernel table (see cpu_isa.h).
#include "cpu_isa.h"

#include <atomic>

#include "../join.h"
#include "../refuse.h"

namespace fused_ema::cpu {
namespace {

// `table` points at the table pointer so that kIsas is constant-initialised, whatever the order in
// which the translation units start up.
struct IsaEntry {
  const char* name;
  const SpanKernels* const* table;
  bool (*cpu_has)();
};

bool always() { return true; }

#if defined(__x86_64__) && defined(__GNUC__)
// __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 register state.
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
#endif

const IsaEntry kIsas[] = {
    {"default", &kDefaultSpanKernels, &always},
    {"avx2", &kAvx2SpanKernels, &has_avx2},
    {"avx512", &kAvx512SpanKernels, &has_avx512},
};
constexpr int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

bool available(int k) { return *kIsas[k].table != nullptr && kIsas[k].cpu_has(); }

int find(const std::string& name) {
  for (int k = 0; k < kNumIsas; ++k) {
    if (name == kIsas[k].name) {
      return k;
    }
  }
  return -1;
}

int best_available() {
  for (int k = kNumIsas - 1; k > 0; --k) {
    if (available(k)) {
      return k;
    }
  }
  return 0;
}

std::atomic<int>& choice() {
  static std::atomic<int> value{best_available()};  // FUSED_EMA_CPU_ISA: _ext/loader.py
  return value;
}

// The instruction sets compiled in (and, with `here`, supported by this CPU), baseline first.
std::vector<std::string> isa_names(bool here) {
  std::vector<std::string> names;
  for (int k = 0; k < kNumIsas; ++k) {
    if (here ? available(k) : *kIsas[k].table != nullptr) {
      names.emplace_back(kIsas[k].name);
    }
  }
  return names;
}

}  // namespace

std::vector<std::string> compiled_isas() { return isa_names(false); }

std::vector<std::string> available_isas() { return isa_names(true); }

std::string active_isa() { return kIsas[choice().load()].name; }

void set_active_isa(const std::string& isa) {
  const int k = find(isa);
  if (k < 0 || !available(k)) {
    refuse("fused_ema: CPU instruction set '", isa,
           "' is not available here; available: ", join(available_isas()));
  }
  choice().store(k);
}

const SpanKernels& active_span_kernels() { return **kIsas[choice().load()].table; }

}  // namespace fused_ema::cpu
