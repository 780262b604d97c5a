// The dispatcher's kernels of lerp_, lerp_stochastic_, lerp_many_, lerp_many_stochastic_ and bema_
// (schemas in fused_ema.cpp): each turns its arguments into one FusedCall and its lists into the
// planner's borrowed tensors, then plans and runs it (fused_op.h), or, as the twin op of
// fused_ema_checks that the fake kernels call, only checks it.
#include <torch/library.h>

#include <vector>

#include "fused_op.h"

namespace fused_ema {
namespace {

// kRun: plan and run the call; else only its checks (a fake kernel's twin, fused_op.h).
template <bool kRun>
void fused_call(const FusedCall& call, TensorRefs emas, TensorRefs src) {
  if constexpr (kRun) {
    run_fused_call(call, plan_fused_call(call, emas, src));
  } else {
    check_fused_call(call, emas, src);
  }
}

template <bool kRun>
void fused_call(const FusedCall& call, at::TensorList emas, at::TensorList src) {
  fused_call<kRun>(call, refs_of(emas), refs_of(src));
}

// The dispatcher's kernels (schemas in fused_ema.cpp). Only a run reads the weights and the step.

template <bool kRun>
void lerp_op(at::TensorList ema, at::TensorList src, const c10::Scalar& weight) {
  fused_call<kRun>({FusedKind::kLerp, src.size(), checked_scalar_weight(weight)}, ema, src);
}

template <bool kRun>
void lerp_tensor_weight_op(at::TensorList ema, at::TensorList src, const at::Tensor& weight) {
  fused_call<kRun>({FusedKind::kLerp, src.size(), checked_weights(FusedKind::kLerp, weight, kRun)},
                   ema, src);
}

template <bool kRun>
void lerp_stochastic_op(at::TensorList ema, at::TensorList src, const at::Tensor& weight,
                        const at::Tensor& step, int64_t seed, at::IntArrayRef keys,
                        at::IntArrayRef offsets) {
  fused_call<kRun>(stochastic_call(FusedKind::kLerpStochastic, src.size(), weight, step, seed, keys,
                                   offsets, kRun),
                   ema, src);
}

template <bool kRun>
void lerp_many_op(at::TensorList emas, at::TensorList src, const at::Tensor& weights) {
  fused_call<kRun>(
      {FusedKind::kLerpMany, src.size(), checked_weights(FusedKind::kLerpMany, weights, kRun)},
      emas, src);
}

template <bool kRun>
void lerp_many_stochastic_op(at::TensorList emas, at::TensorList src, const at::Tensor& weights,
                             const at::Tensor& step, at::IntArrayRef seeds, at::IntArrayRef keys,
                             at::IntArrayRef offsets) {
  fused_call<kRun>(stochastic_call(FusedKind::kLerpManyStochastic, src.size(), weights, step, seeds,
                                   keys, offsets, kRun),
                   emas, src);
}

// bema_'s three lists become its tracks 0, 1, 2.
template <bool kRun>
void bema_op(at::TensorList ema, at::TensorList theta0, at::TensorList out, at::TensorList src,
             const at::Tensor& weights) {
  const FusedCall call{FusedKind::kBema, src.size(),
                       checked_weights(FusedKind::kBema, weights, kRun)};
  std::vector<const at::Tensor*> targets;
  targets.reserve(3 * src.size());
  const at::TensorList lists[] = {ema, theta0, out};
  for (size_t k = 0; k < 3; ++k) {
    TORCH_CHECK_VALUE(lists[k].size() == src.size(), "fused_ema.bema_: ", kBemaLists[k], " has ",
                      lists[k].size(), " tensors but src has ", src.size());
    for (const at::Tensor& t : lists[k]) {
      targets.push_back(&t);
    }
  }
  fused_call<kRun>(call, targets, refs_of(src));
}

template <bool kRun>
void register_kernels(torch::Library& m) {
  m.impl("lerp_", &lerp_op<kRun>);
  m.impl("lerp_.Tensor", &lerp_tensor_weight_op<kRun>);
  m.impl("lerp_stochastic_", &lerp_stochastic_op<kRun>);
  m.impl("lerp_many_", &lerp_many_op<kRun>);
  m.impl("lerp_many_stochastic_", &lerp_many_stochastic_op<kRun>);
  m.impl("bema_", &bema_op<kRun>);
}

}  // namespace

void register_fused_ops(torch::Library& m) { register_kernels<true>(m); }

void register_fused_checks(torch::Library& m) { register_kernels<false>(m); }

}  // namespace fused_ema

// CPU and CUDA register the same kernels (cpu/, cuda/). These serve the calls the dispatcher
// cannot route to a backend: empty lists (a no-op) and devices without a fused_ema kernel, which
// get an error naming the device instead of the dispatcher's generic message.
TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) { fused_ema::register_fused_ops(m); }

// The checks run on whatever tensors they get, FakeTensors included (metadata only).
TORCH_LIBRARY_IMPL(fused_ema_checks, CompositeImplicitAutograd, m) {
  fused_ema::register_fused_checks(m);
}
