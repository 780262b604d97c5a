// prefetch_object: software prefetch of a fixed-size range, shared by the host's list walks
// (lerp_plan, prepared_update) and the CPU span kernels (cpu/simd.h). No torch headers.
#pragma once

#include <cstddef>

namespace fused_ema {

// Prefetches every cache line that [p, p + kBytes) touches: the lines at p, p + 64, ... and the
// one holding the last byte (heap objects are only 16-byte aligned, so an object usually
// straddles one line more than its size suggests). The size is a constant so that this unrolls
// into a few instructions: a loop over computed line addresses was most of the instructions a
// tensor cost once its list outgrew the cache. Always inlined: GCC found an out-of-line prefetch
// free of side effects and dropped the calls.
template <size_t kBytes, int kWrite = 0>
[[gnu::always_inline]] inline void prefetch_object(const void* p) {
  static_assert(kBytes > 0);
  const char* bytes = static_cast<const char*>(p);
  for (size_t offset = 0; offset < kBytes; offset += 64) {
    __builtin_prefetch(bytes + offset, kWrite);
  }
  __builtin_prefetch(bytes + kBytes - 1, kWrite);
}

}  // namespace fused_ema
