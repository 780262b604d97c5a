// CUDA kernel of fused_ema::bema_: the torch glue around multi_tensor_apply with BemaOp. A
// device's items are grouped by dtype pair and each group goes out in as few launches as the
// kernel-parameter metadata allows, on the current stream of that device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "../bema_op.h"
#include "bema_functor.cuh"
#include "pair_types.cuh"

namespace fused_ema::cuda {
namespace {

using BemaLauncher = cudaError_t (*)(const TensorRef*, const BemaTensors*, int64_t,
                                     const BemaWeightArgs&, cudaStream_t);

struct BemaLauncherEntry {
  PairKind kind;
  BemaLauncher launch;
};

#define FUSED_EMA_BEMA_LAUNCHER(kind, ema, src, ema_tag, src_tag) \
  {PairKind::kind, &launch_bema<cuda_t<tag::ema_tag>, cuda_t<tag::src_tag>>},
constexpr BemaLauncherEntry kBemaLaunchers[] = {
    FUSED_EMA_FOR_EACH_DTYPE_PAIR(FUSED_EMA_BEMA_LAUNCHER)};
#undef FUSED_EMA_BEMA_LAUNCHER
static_assert(in_pair_kind_order(kBemaLaunchers), "kBemaLaunchers must follow PairKind order");

BemaWeightArgs bema_weight_args(const BemaWeights& weights) {
  BemaWeightArgs arg{
      {weights.values[0], weights.values[1], weights.values[2]}, nullptr, nullptr, 0};
  if (const at::Tensor* t = weights.device_tensor) {
    arg.stride = t->stride(0);
    if (t->scalar_type() == at::kFloat) {
      arg.f32 = t->const_data_ptr<float>();
    } else {
      arg.f64 = t->const_data_ptr<double>();
    }
  }
  return arg;
}

void run_bema_plan(const DevicePlan& plan, const std::vector<BemaItem>& items,
                   const BemaWeights& weights) {
  const c10::cuda::CUDAGuard guard(plan.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  std::array<std::vector<TensorRef>, kNumPairKinds> refs;
  std::array<std::vector<BemaTensors>, kNumPairKinds> extras;
  for (const BemaItem& item : items) {
    const auto kind = static_cast<size_t>(item.kind);
    refs[kind].push_back({item.ema, item.src, item.numel});
    extras[kind].push_back({item.theta0, item.out});
  }
  const BemaWeightArgs arg = bema_weight_args(weights);
  for (size_t kind = 0; kind < refs.size(); ++kind) {
    if (!refs[kind].empty()) {
      C10_CUDA_CHECK(kBemaLaunchers[kind].launch(refs[kind].data(), extras[kind].data(),
                                                 static_cast<int64_t>(refs[kind].size()), arg,
                                                 stream));
    }
  }
  plan.write_back();
}

[[maybe_unused]] const bool kRegistered =
    register_bema_runner(c10::DeviceType::CUDA, &run_bema_plan);

}  // namespace

TORCH_LIBRARY_IMPL(fused_ema, CUDA, m) { m.impl("bema_", &bema_op); }

}  // namespace fused_ema::cuda
