// Code that nvcc compiles for the device and a plain C++ compiler for the host: the function
// qualifiers, and the few device intrinsics the kernels use, with a host twin that gives the same
// bits. The CPU kernel and the CUDA emulation tests compile the kernels' code through these.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FUSED_EMA_HOST_DEVICE __host__ __device__
#else
#define FUSED_EMA_HOST_DEVICE
#endif

namespace fused_ema {

FUSED_EMA_HOST_DEVICE inline float uint_as_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

FUSED_EMA_HOST_DEVICE inline uint32_t float_as_uint(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

// Fused multiply-add, rounded once (correctly rounded on both sides, so bit-equal).
FUSED_EMA_HOST_DEVICE inline float fma_once(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

FUSED_EMA_HOST_DEVICE inline double fma_once(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return ::fma(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

}  // namespace fused_ema
