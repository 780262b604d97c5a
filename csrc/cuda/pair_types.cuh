// The CUDA types of the dtype-pair type tags (dtype_pair_list.h). No torch headers, so that
// tests can compile it with plain nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../dtype_pair_list.h"

namespace fused_ema::cuda {

template <typename Tag>
struct CudaType;
template <>
struct CudaType<tag::f32> {
  using type = float;
};
template <>
struct CudaType<tag::f64> {
  using type = double;
};
template <>
struct CudaType<tag::bf16> {
  using type = __nv_bfloat16;
};
template <>
struct CudaType<tag::f16> {
  using type = __half;
};
template <typename Tag>
using cuda_t = typename CudaType<Tag>::type;

}  // namespace fused_ema::cuda
