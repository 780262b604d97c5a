// What the CUDA glue needs of torch, through torch's stable ABI: the device guard, the current
// stream of a device, and CUDA errors reported with torch's own message (device-side assertions
// included). Needs USE_CUDA defined (setup.py passes it), as the shim declares these only then.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

#include <cstdint>
#include <string>

namespace fused_ema::cuda {

// The device made current while this lives (the previous one restored after).
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// torch's current stream of the device: kernels issued there are ordered with torch's own work.
inline cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

// Throws with torch's message for `err` (as C10_CUDA_CHECK would) unless it is cudaSuccess.
inline void check_cuda(cudaError_t err, const char* file, const char* function, uint32_t line) {
  if (err == cudaSuccess) {
    return;
  }
  char* message = nullptr;
  TORCH_ERROR_CODE_CHECK(torch_c10_cuda_check_msg(static_cast<int32_t>(err), file, function, line,
                                                  /*include_device_assertions=*/true, &message));
  std::string text = message != nullptr ? message : cudaGetErrorString(err);
  torch_c10_cuda_free_error_msg(message);
  STD_TORCH_CHECK(false, text);
}

}  // namespace fused_ema::cuda

#define FUSED_EMA_CUDA_CHECK(expr) \
  ::fused_ema::cuda::check_cuda((expr), __FILE__, __func__, static_cast<uint32_t>(__LINE__))
