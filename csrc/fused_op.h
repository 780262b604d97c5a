// The one device-independent driver of the fused-op family: lerp_ is one track, lerp_many_ K tracks
// of one list of sources, stochastic rounding a flag, bema_ a write epilogue (its ema, theta0 and
// out are 3 tracks). Every check and the plans (lerp_plan.h), then one runner call per device. The
// dispatcher's ops and a prepared update (prepared_update.h) enter here, so they cannot drift
// apart.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lerp_plan.h"
#include "track_index.h"

namespace fused_ema {

// Which op of the family a call is: it decides the messages, the rounding and the epilogue.
enum class FusedKind : int64_t {
  kLerp = 0,
  kLerpStochastic = 1,
  kLerpMany = 2,
  kLerpManyStochastic = 3,
  kBema = 4,
};

// The tracks' weights: K values known on the host (then the pairs of a track whose weight is 0 are
// left out of a plain call), or K float32/float64 elements of a tensor on the plan's device,
// `stride` apart, that the kernel reads (no host sync; capturable in a CUDA graph).
struct FusedWeights {
  size_t tracks = 0;
  std::vector<double> values;
  const at::Tensor* device_tensor = nullptr;
  int64_t stride = 0;
};

// lerp_stochastic_ and lerp_many_stochastic_.
inline bool is_stochastic(FusedKind kind) {
  return kind == FusedKind::kLerpStochastic || kind == FusedKind::kLerpManyStochastic;
}

// Stochastic rounding (stochastic_round.h): track k's tensor i rounds with seed seeds[k], key
// keys[k * tensors + i] and offset offsets[i].
struct FusedRounding {
  c10::HeaderOnlyArrayRef<int64_t> seeds;
  uint64_t step = 0;                        // when the step is known on the host
  const at::Tensor* step_tensor = nullptr;  // else an int64 tensor on the plan's device
  c10::HeaderOnlyArrayRef<int64_t> keys;
  c10::HeaderOnlyArrayRef<int64_t> offsets;
};

// One call as the driver and the runners see it. A plan's pair FlatPair::index is track k's tensor
// i, k * tensors + i; a plain call's plan lists the pairs of a tensor one after another.
struct FusedCall {
  FusedKind kind = FusedKind::kLerp;
  size_t tensors = 0;
  FusedWeights weights;
  FusedRounding rounding;  // the stochastic kinds'

  bool stochastic() const { return is_stochastic(kind); }
  // bema_'s epilogue: per source, ema and theta0 lerp with weights[0] and weights[1], then
  // out = ema + weights[2] * (src - theta0) from their new values.
  bool bema() const { return kind == FusedKind::kBema; }
};

// The runner of one device type: it runs `plan` as `call` says and calls plan.write_back() once
// its kernels are issued. Called from a static initialiser of cpu/ and cuda/; returns true.
using FusedRunner = void (*)(const DevicePlan& plan, const FusedCall& call);
bool register_fused_runner(c10::DeviceType type, FusedRunner runner);

// "cpu", "cuda": the device types this build has kernels for.
std::vector<std::string> devices_with_kernels();

// The checks of a call's weights: a tensor of K float32/float64 elements (lerp_'s one), read here
// from the CPU when `read`; host values must be finite and fit a float32.
FusedWeights checked_weights(FusedKind kind, const at::Tensor& weights, bool read = true);

// lerp_'s Python number as its weight: a float or an int (not a bool), finite.
FusedWeights checked_scalar_weight(const c10::Scalar& weight);

// A stochastic call of `kind` over `tensors` sources: its weights, step (one int64 element, read
// here from the CPU when `read`, else left to the kernel), seeds, keys and offsets.
FusedCall stochastic_call(FusedKind kind, size_t tensors, const at::Tensor& weights,
                          const at::Tensor& step, c10::HeaderOnlyArrayRef<int64_t> seeds,
                          c10::HeaderOnlyArrayRef<int64_t> keys,
                          c10::HeaderOnlyArrayRef<int64_t> offsets, bool read = true);

// bema_'s lists, tracks 0, 1 and 2 of its call.
inline constexpr const char* kBemaLists[] = {"ema", "theta0", "out"};

// A call in two halves: every check (counts, rounding, pairs, devices) and the plans, then the
// runs. A prepared update keeps the plans and runs them again. `emas` holds the tracks one after
// another (bema_: ema, theta0, out).
std::vector<DevicePlan> plan_fused_call(const FusedCall& call, TensorRefs emas, TensorRefs src);
void run_fused_call(const FusedCall& call, const std::vector<DevicePlan>& plans);

// plan_fused_call's checks that need no memory (no overlap, no kernel for the device), for the
// fake kernels: the call's values (weights, step) need not have been read.
void check_fused_call(const FusedCall& call, TensorRefs emas, TensorRefs src);

// One source tensor of bema_ as a runner receives it: four dense views of numel elements in the
// same (row-major) order, ema, theta0 and out of one dtype; `kind` is the (ema, src) dtype pair.
struct BemaItem {
  void* ema;
  void* theta0;
  void* out;
  const void* src;
  int64_t numel;
  PairKind kind;
};

// bema_'s pairs of a plan as one item per source tensor (tensors of 0 elements left out).
std::vector<BemaItem> bema_items(const DevicePlan& plan, size_t tensors);

// The dispatcher's kernels (fused_op_kernels.cpp; schemas in fused_ema.cpp), registered for the
// CPU, CUDA and, for empty lists and devices without a kernel, CompositeExplicitAutograd.
void register_fused_ops(torch::Library& m);

// The same kernels checking only (check_fused_call), for fused_ema_checks's twin ops: the fake
// kernels run them on FakeTensors, so traced calls fail with the messages of eager ones.
void register_fused_checks(torch::Library& m);

}  // namespace fused_ema
