// Which parameter layout a launch takes, decided at run time: 32 KB where the build, the driver
// and the GPU allow it (asked once per device, kept here), else 4 KB; FUSED_EMA_CUDA_SMALL_PARAMS
// forces 4 KB. nvcc only (it queries the driver).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "launch_meta.cuh"

namespace fused_ema::cuda {

// FUSED_EMA_CUDA_SMALL_PARAMS=1 (or set_force_small_params) keeps every launch at 4 KB.
inline std::atomic<bool>& force_small_params() {
  static std::atomic<bool> flag([] {
    const char* env = std::getenv("FUSED_EMA_CUDA_SMALL_PARAMS");
    return env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
  }());
  return flag;
}

// Whether `device` takes 32 KB of kernel parameters: a driver >= 12.1 (an older one runs CUDA
// 12.1+ builds under minor-version compatibility but rejects the launch) and compute capability
// >= 7.0. Asked once per device.
inline cudaError_t large_params_supported(int device, bool* supported) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> cache[kMaxDevices] = {};  // 0: not asked yet, 1: no, 2: yes
  if (device >= 0 && device < kMaxDevices) {
    if (const int8_t known = cache[device].load(std::memory_order_relaxed); known != 0) {
      *supported = known == 2;
      return cudaSuccess;
    }
  }
  int driver = 0;
  int major = 0;
  if (cudaError_t err = cudaDriverGetVersion(&driver); err != cudaSuccess) {
    return err;
  }
  if (cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      err != cudaSuccess) {
    return err;
  }
  *supported = driver >= 12010 && major >= 7;
  if (device >= 0 && device < kMaxDevices) {
    cache[device].store(*supported ? 2 : 1, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Which layout launches on `stream` (on the current device) use. Like ATen's run-time choice,
// builds before CUDA 13 keep 4 KB while the stream captures a graph; ATen's CUDA 13 builds (which
// need a driver >= 13.0) take 32 KB in graphs too.
inline cudaError_t use_large_params(cudaStream_t stream, bool* large) {
  *large = false;
  if (!kLargeParamsCompiled || force_small_params().load(std::memory_order_relaxed)) {
    return cudaSuccess;
  }
#if CUDART_VERSION < 13000
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t err = cudaStreamIsCapturing(stream, &capture); err != cudaSuccess) {
    return err;
  }
  if (capture != cudaStreamCaptureStatusNone) {
    return cudaSuccess;
  }
#else
  (void)stream;
#endif
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return err;
  }
  return large_params_supported(device, large);
}

}  // namespace fused_ema::cuda
